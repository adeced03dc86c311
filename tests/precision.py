"""Mixed precision against stock: three `trainer.train()` runs of one optimizer step on the same generation batch.

- `stock fp32`: stock `GRPOTrainer` with `bf16=False` (the reference); its completions are recorded;
- `stock bf16`: stock with `bf16=True` (autocast over the fp32 weights loaded from the path);
- `ours bf16`: `LongStrawGRPOTrainer` with `bf16=True`.

The last two replay the recorded completions instead of generating, so all three train on the same micro-batch. In
detached mode, "stock" is the plain detached reference (`reference.detached_prompt_logps` under stock's loss and
backward, `tests.helpers.detached_reference`): stock itself computes another gradient.

Each run yields the per-token log-probs of its loss pass, the loss, and every parameter's gradient just before the
optimizer step (unclipped: `max_grad_norm=0`). `errors` measures a run against the fp32 one (see
`tolerances.BF16_ERROR_FACTOR` for the criterion).
"""

from __future__ import annotations

import contextlib
import re
import tempfile
from unittest import mock

import torch
from datasets import Dataset
from transformers import TrainerCallback, set_seed
from transformers.cache_utils import LinearAttentionLayer
from trl import GRPOConfig, GRPOTrainer

from tests.helpers import rebind_recurrent_state, score_detached
from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer

# Prompts of the word-level test tokenizer, 5 to 14 tokens: with `prefill_chunk_size=4` they span 2 to 4 chunks, and
# in one batch they are left-padded to the longest.
PROMPTS = ["a b c d e f g h i j k l m n", "key value is 3 ; what is", "x y z", "the answer of 7 = 7 ; the answer"]


def config(**overrides) -> dict:
    """One optimizer step over one generation batch of every prompt, in one micro-batch of whole groups."""
    kw = dict(
        output_dir=tempfile.mkdtemp(),
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        seed=0,
        max_steps=1,
        num_generations=2,
        per_device_train_batch_size=2 * len(PROMPTS),
        max_completion_length=6,
        # The loss value then depends on the per-token values (at the first iteration the policy ratio is 1), and the
        # reference model runs through an engine too.
        beta=0.1,
        entropy_coef=0.1,
        max_grad_norm=0.0,  # the gradient before clipping
        gradient_checkpointing=True,
    )
    kw.update(overrides)
    return kw


def reward(completions, **kwargs):
    """Separates the completions of a group: their length, plus the row's position."""
    return [float(len(c) + i % 3) for i, c in enumerate(completions)]


class _Capture(TrainerCallback):
    def __init__(self, trainer, out: dict):
        self.trainer, self.out = trainer, out

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.out["grads"] = {
            n: p.grad.detach().float().clone() for n, p in self.trainer.model.named_parameters() if p.grad is not None
        }


def _instrument(trainer, out: dict, completions: list | None) -> None:
    """Records the loss pass's per-token log-probs (keyed by row content), the loss and the gradient; replays
    `completions` instead of generating, or records what the trainer generates when it is None."""
    generate, score, step = (
        trainer._generate_single_turn,
        trainer._get_per_token_logps_and_entropies,
        trainer.training_step,
    )

    def generate_or_replay(*args, **kwargs):
        if completions is None:
            result = generate(*args, **kwargs)
            out["completions"] = [list(c) for c in result[0]]
            return result
        return [list(c) for c in completions], None

    def scored(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        result = score(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        if torch.is_grad_enabled():  # the loss pass (old-policy and reference log-probs are taken without autograd)
            mask = attention_mask[:, -logits_to_keep:].bool()
            logps = {}
            for row in range(input_ids.shape[0]):
                key = tuple(input_ids[row][attention_mask[row].bool()].tolist())
                logps[key] = result[0][row][mask[row]].detach().float().clone()
            out["logps"] = logps
        return result

    def training_step(model, inputs, num_items_in_batch):
        loss = step(model, inputs, num_items_in_batch)
        out["loss"] = float(loss)
        return loss

    trainer._generate_single_turn = generate_or_replay
    trainer._get_per_token_logps_and_entropies = scored
    trainer.training_step = training_step
    trainer.add_callback(_Capture(trainer, out))


def run(path, kind: str, mode: str, completions: list | None, chunk: int = 4, **overrides) -> dict:
    """One `train()` step of `kind` (`stock` or `ours`) in `mode` on the model at `path`; see the module docstring."""
    dataset = Dataset.from_dict({"prompt": PROMPTS})
    kw = config(**overrides)
    patched = contextlib.nullcontext()
    if kind == "ours":
        args = LongStrawGRPOConfig(**kw, prompt_gradient=mode, prefill_chunk_size=chunk, prefill_progress=False)
        trainer = LongStrawGRPOTrainer(str(path), reward, args, train_dataset=dataset)
    elif mode == "exact":
        trainer = GRPOTrainer(str(path), reward, GRPOConfig(**kw), train_dataset=dataset)
    else:
        # The plain reference: transformers drops the cache under gradient checkpointing, so it runs without.
        kw["gradient_checkpointing"] = False
        trainer = score_detached(GRPOTrainer(str(path), reward, GRPOConfig(**kw), train_dataset=dataset))
        patched = mock.patch.object(LinearAttentionLayer, "update_recurrent_state", rebind_recurrent_state)
    out: dict = {}
    _instrument(trainer, out, completions)
    set_seed(0)
    with patched:
        trainer.train()
    out["trainer"] = trainer
    return out


def three_runs(path, mode: str, low: dict | None = None, **overrides) -> dict[str, dict]:
    """`stock fp32`, `stock bf16` and `ours bf16` on the same completions (those stock fp32 generated).

    `low` overrides the settings of the two low-precision runs: by default `bf16=True` (TRL's default: autocast over
    the fp32 weights); `dict(bf16=False, model_init_kwargs={"dtype": "bfloat16"})` loads bf16 weights instead.
    """
    low = dict(bf16=True) if low is None else low
    runs = {"stock fp32": run(path, "stock", mode, None, bf16=False, **overrides)}
    completions = runs["stock fp32"]["completions"]
    runs["stock bf16"] = run(path, "stock", mode, completions, **low, **overrides)
    runs["ours bf16"] = run(path, "ours", mode, completions, **low, **overrides)
    return runs


def parameter_group(name: str) -> str:
    """The group of a parameter: its name without layer numbers, PEFT prefixes and adapter names, e.g.
    `model.layers.1.self_attn.k_proj.weight` -> `self_attn.k_proj.weight`."""
    name = re.sub(r"^(base_model\.model\.)?(model\.)?", "", name)
    name = re.sub(r"^layers\.\d+\.", "", name)
    return re.sub(r"\.experts\.\d+\.", ".experts.", name)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """`||a - b|| / ||b||`."""
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def errors(run: dict, ref: dict) -> dict:
    """The errors of `run` against the fp32 reference `ref`.

    - `logps`: the largest absolute difference over every scored completion token (rows matched by content);
    - `loss`: the absolute difference;
    - `grad`: the relative error in norm of the whole gradient (every parameter concatenated);
    - `groups`: per `parameter_group`, the relative error in norm of the group's gradients concatenated.
    """
    assert run["logps"].keys() == ref["logps"].keys(), "the runs scored different rows"
    assert run["grads"].keys() == ref["grads"].keys(), set(run["grads"]) ^ set(ref["grads"])
    logps = max(float((run["logps"][k] - v).abs().max()) for k, v in ref["logps"].items())
    names = sorted(ref["grads"])
    flat = [torch.cat([g[n].flatten() for n in names]) for g in (run["grads"], ref["grads"])]
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(parameter_group(n), []).append(n)
    per_group = {
        group: rel(*(torch.cat([g[n].flatten() for n in members]) for g in (run["grads"], ref["grads"])))
        for group, members in groups.items()
    }
    return dict(logps=logps, loss=abs(run["loss"] - ref["loss"]), grad=rel(*flat), groups=per_group)
