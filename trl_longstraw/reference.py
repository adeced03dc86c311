"""Plain references for the engine, built only from the transformers model's own forward and cache.

They are slow and keep every graph alive; they exist to be compared against.
"""

from __future__ import annotations

import copy

import torch

from .engine import completion_lengths, group_prompts


def plain_token_logps(logits: torch.Tensor, labels: torch.Tensor, temperature: float):
    """Log-probs of `labels` `[B, T]` and entropies under `logits` `[B, T, V] / temperature`, from full logits."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, labels[..., None]).squeeze(-1), entropy


def detached_prompt_logps(
    causal_lm,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of detached mode: `[B, C]` log-probs and entropies of the last `logits_to_keep` tokens.

    Each distinct prompt runs once without autograd through the model with a transformers cache; each completion
    then runs with autograd on a fresh deep copy of that cache. The prompt is a constant for the gradient.
    Gradient checkpointing must be off on `causal_lm` (transformers drops the cache under it).
    """
    k = logits_to_keep
    prompt_ids, prompt_mask = input_ids[:, :-k], attention_mask[:, :-k]
    completion_ids, completion_mask = input_ids[:, -k:], attention_mask[:, -k:]
    lengths = completion_lengths(completion_mask)
    logps = torch.zeros(completion_ids.shape, device=input_ids.device)
    entropies = torch.zeros_like(logps)
    rows_lp, rows_ent = {}, {}
    for group in group_prompts(prompt_ids, prompt_mask):
        prefix = group.tokens[:-1]
        cache = None
        if prefix.numel():
            with torch.no_grad():
                out = causal_lm(
                    input_ids=prefix[None],
                    position_ids=torch.arange(group.pad, group.pad + prefix.numel())[None],
                    use_cache=True,
                )
            cache = out.past_key_values
        start = group.pad + prefix.numel()
        for row in group.rows:
            n = lengths[row]
            if n == 0:
                continue
            ids = torch.cat([group.tokens[-1:], completion_ids[row, : n - 1]])[None]
            out = causal_lm(
                input_ids=ids,
                position_ids=torch.arange(start, start + n)[None],
                past_key_values=copy.deepcopy(cache),
                use_cache=cache is not None,
            )
            rows_lp[row], rows_ent[row] = plain_token_logps(out.logits, completion_ids[row, :n][None], temperature)
    # Assemble without in-place writes into a leaf, so the graph of each row survives.
    logps = torch.stack(
        [
            torch.cat([rows_lp[r][0], logps[r, lengths[r] :]]) if r in rows_lp else logps[r]
            for r in range(logps.shape[0])
        ]
    )
    entropies = torch.stack(
        [
            torch.cat([rows_ent[r][0], entropies[r, lengths[r] :]]) if r in rows_ent else entropies[r]
            for r in range(entropies.shape[0])
        ]
    )
    return logps, entropies
