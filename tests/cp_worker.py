"""Worker of tests/test_context_parallel.py: one rank of a 2-process CPU (gloo) run of the engine's exact-mode
backward with context-parallel prompt passes, in fp32 and under bf16 autocast (TRL's `bf16=True`).

Launched through `tests.helpers.torchrun` (2 processes), one case per model: `main(MODEL_PATH, OUT)`. Every rank first
runs the whole micro-batch alone (no shards: fp32, then bf16 autocast), then its own rows with the prompt state sharded
over both ranks (fp32, bf16, and fp32 with replicated chunks instead of context-parallel rounds, as for an adapter
without them), whose gradients are summed over the ranks; each run counts the calls that compute a token mixer's output
in the last decoder layer and the others (`dist_worker.mixer_outputs_counted`). `attention_last(MODEL_PATH, OUT)`: the
fp32 runs alone, for a qwen3_5 model whose last layer is a gated-attention layer. The micro-batch: one prompt of 61
tokens in chunks of 7 (60 prefix tokens: 4 rounds of 2 chunks of 7, then a round of 2 + 2), 2 + 2 ragged completions;
for glm_moe_dsa a second, left-padded prompt of 38 tokens (37 prefix tokens: 2 rounds of 2 chunks of 7, then a round of
5 + 4), each rank holding one completion of each prompt, the rounds' exchanges in slices of 3 query rows per rank, and
the DSA round check `dsa_round_errors` of every rank. For llama and qwen3_5, then, under gradient checkpointing, the
sharded fp32 run twice: with the reverse pass's attention reuse (each checkpoint recompute takes its attention layer's
kept output instead of exchanging and attending again) and without it, counting fused attention forwards and
all-to-alls, and with the reuse each rank's (query, key) pairs through the fused kernels in the context-parallel
rounds. Rank 0 writes the gradient sets (the DSA errors, the counts) to `OUT`.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


def dsa_round_errors(rank: int) -> dict[str, float]:
    """glm_moe_dsa's DSA selection and latent attention in a context-parallel round against their single-process
    references (`reference_select`, `reference_latent_attention`), in fp64 (the indexer in fp32, as it runs).

    Prefix chunks of 5, 4 and 3 keys on their owners (none for the empty prefix of a first round), then a round in
    which rank 0 runs 3 queries and rank 1 the 2 after them: each rank gathers the round's rows (`round_rows`) and its
    queries see them up to their own token. The selection must equal the reference's key set per query; outputs, the
    query and round-row gradients (every rank's loss, as one process has them) and each prefix chunk's gradient on
    its owner must equal the reference's. Top-k 5 (selection across the shards and the round), 9 (rank 1 sees more
    keys than rank 0: one width for both), 64 (dense) and ties (whole chunks score the same: the earlier key wins,
    across shards and into the round); the queries exchanged at once, or in slices (`EXCHANGE_ROWS`), some of which
    hold no row of rank 1. Block constants are tiny so that tiles and key blocks span chunks. Returns max abs errors,
    and for the selection the number of queries whose set differs.
    """
    import trl_longstraw.glm_moe_dsa as glm
    from trl_longstraw.sharding import PromptShards

    heads, dim, rank_dim, rope, lengths = 3, 4, 5, 2, [3, 2]
    errors: dict[str, float] = {}
    saved = glm.INDEX_KEY_BLOCK, glm.INDEX_TILE, glm.ATTN_SLOTS, glm.EXCHANGE_ROWS
    glm.INDEX_KEY_BLOCK, glm.INDEX_TILE, glm.ATTN_SLOTS = 3, 2 * heads * 3, 2 * 5
    try:
        for chunk_lengths, topk, ties, exchange_rows in [
            ([5, 4, 3], 5, False, 4096),
            ([5, 4, 3], 5, False, 4),  # slices of 2 rows per rank: (2, 2), then (1, 0)
            ([5, 4, 3], 5, True, 2),
            ([5, 4, 3], 9, False, 4096),
            ([5, 4, 3], 64, False, 4096),
            ([], 2, False, 4096),
            ([], 2, True, 4096),
        ]:
            glm.EXCHANGE_ROWS = exchange_rows
            tag = f"round/{len(chunk_lengths)}chunks/top{topk}/slices{exchange_rows}" + ("/ties" if ties else "")
            g = torch.Generator().manual_seed(topk + len(chunk_lengths) + ties)

            def index(*shape, g=g, ties=ties):
                return torch.randint(1, 3, shape, generator=g).float() if ties else torch.randn(*shape, generator=g)

            def rand(*shape, g=g):
                return torch.randn(*shape, generator=g, dtype=torch.float64)

            starts = [0]
            for n in chunk_lengths:
                starts.append(starts[-1] + n)
            prefix_len, total = starts[-1], starts[-1] + sum(lengths)
            index_keys = [index(n, dim) for n in chunk_lengths]
            kv = [rand(n, rank_dim + rope) for n in chunk_lengths]
            # Per rank: indexer queries, head weights, own index keys, absorbed queries, own kv rows, output grad.
            rows = [
                (
                    index(t, heads, dim),
                    torch.ones(t, heads) if ties else torch.rand(t, heads, generator=g) + 0.5,
                    index(t, dim),
                    rand(t, heads, rank_dim + rope),
                    rand(t, rank_dim + rope),
                    rand(t, heads, rank_dim),
                )
                for t in lengths
            ]
            if ties:
                # Chunk 0 (rank 0) scores nothing; chunk 1 (rank 1), chunk 2 (rank 0) and the round all score the
                # same: the earlier keys must win.
                index_keys = [
                    torch.zeros(n, dim) if c == 0 else torch.ones(n, dim) for c, n in enumerate(chunk_lengths)
                ]
                rows = [(r[0], r[1], torch.ones(r[2].shape), *r[3:]) for r in rows]
            shards = PromptShards(None)
            shards.cp_round(lengths)
            own_start = sum(lengths[:rank])
            held = [shards.owner(c) == rank for c in range(len(chunk_lengths))]
            iq, iw, ik, q, own_kv, grad_out = rows[rank]
            round_keys = glm.round_rows(ik, shards)
            sel = glm.sharded_select_topk(
                iq,
                iw,
                [k if h else None for k, h in zip(index_keys, held, strict=True)],
                starts,
                round_keys,
                topk,
                0.5,
                shards,
                own_start=own_start,
            )
            all_keys = torch.cat(index_keys + [r[2] for r in rows])
            expected = glm.reference_select(glm._index_scores(iq, iw, all_keys, 0.5), prefix_len + own_start, topk)
            errors[f"{tag}/selection"] = float(
                sum(set(a[a >= 0].tolist()) != set(b[b >= 0].tolist()) for a, b in zip(sel, expected, strict=True))
            )
            errors[f"{tag}/selection_width"] = float(sel.shape[1] != min(topk, total))

            def leaves(*xs):
                return [x.clone().requires_grad_() for x in xs]

            def grad(x):
                return torch.zeros_like(x) if x.grad is None else x.grad

            mine = [leaves(x)[0] if h else None for x, h in zip(kv, held, strict=True)]
            ours = leaves(q, own_kv)
            round_kv = glm.round_rows(ours[1], shards)
            out = glm.sharded_latent_attention(ours[0], mine, starts, round_kv, sel, 0.4, rank_dim, shards)
            out.backward(grad_out)
            # One process: both ranks' queries over the prefix and the round's rows, with both ranks' losses.
            whole = leaves(*kv)
            ref_rows = [leaves(r[3], r[4]) for r in rows]
            loss, ref_out = 0, None
            for r, (riq, riw, _, _, _, rgrad) in enumerate(rows):
                first = prefix_len + sum(lengths[:r])
                rsel = glm.reference_select(glm._index_scores(riq, riw, all_keys, 0.5), first, topk)
                parts = whole + [x[1] for x in ref_rows]
                o = glm.reference_latent_attention(ref_rows[r][0], parts, rsel, 0.4, rank_dim)
                loss = loss + (o * rgrad).sum()
                ref_out = o if r == rank else ref_out
            loss.backward()
            errors[f"{tag}/out"] = (out - ref_out).abs().max().item()
            errors[f"{tag}/dq"] = (ours[0].grad - ref_rows[rank][0].grad).abs().max().item()
            errors[f"{tag}/dkv_own"] = (grad(ours[1]) - grad(ref_rows[rank][1])).abs().max().item()
            for c, x in enumerate(mine):
                if x is not None:
                    errors[f"{tag}/dprefix{c}"] = (grad(x) - grad(whole[c])).abs().max().item()
    finally:
        glm.INDEX_KEY_BLOCK, glm.INDEX_TILE, glm.ATTN_SLOTS, glm.EXCHANGE_ROWS = saved
    return errors


def attention_last(model_path: str, out_path: str) -> None:
    """`main` on a qwen3_5 model whose last decoder layer is a gated-attention layer (as in Qwen3.6-27B, where every
    fourth layer is): the fp32 runs alone, one process's and the sharded ones, with their mixer-output counts."""
    main(model_path, out_path, fp32_only=True)


def main(model_path: str, out_path: str, fp32_only: bool = False) -> None:
    from dist_worker import mixer_outputs_counted
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from trl_longstraw import attention, engine, sharding
    from trl_longstraw.adapters import get_adapter
    from trl_longstraw.engine import Engine
    from trl_longstraw.sharding import PromptShards
    from trl_longstraw.testing import random_micro_batch

    if not dist.is_initialized():  # an earlier case of the launch set it up
        dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    assert world == 2, f"the context-parallel test needs 2 processes, got {world}"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
    adapter = get_adapter(model)
    glm = model.config.model_type == "glm_moe_dsa"
    if glm:  # two prompts, left-padded; each rank holds rows of both (rows 0, 2 and 1, 3)
        batch = random_micro_batch([61, 38], [3, 2, 4, 1], [0, 0, 1, 1], model.config.vocab_size, seed=3)
    else:
        batch = random_micro_batch([61], [3, 2, 4, 1], [0, 0, 0, 0], model.config.vocab_size, seed=3)
    g = torch.Generator().manual_seed(4)
    grad_logps = torch.randn(batch["completion_ids"].shape, generator=g) * batch["completion_mask"]
    grad_entropies = torch.randn(batch["completion_ids"].shape, generator=g) * batch["completion_mask"]

    def bf16():
        return torch.autocast("cpu", dtype=torch.bfloat16)

    outputs = {}  # run -> `mixer_outputs_counted`'s counts

    def run(name: str, shards, autocast, replicated: bool = False) -> dict[str, torch.Tensor]:
        rows = list(range(rank, 4, world)) if shards is not None else list(range(4))
        model.zero_grad(set_to_none=True)
        engine = Engine(model, model, adapter, chunk_size=7, shards=shards, autocast=autocast)
        if replicated:  # every rank runs every chunk, as for an adapter without context parallelism
            engine.context_parallel = False
        elif shards is not None:
            assert engine.context_parallel, "the passes are not context-parallel"
        keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
        inputs = [batch[k][rows] for k in keys]
        with mixer_outputs_counted(model) as counts:
            engine.backward(*inputs, grad_logps[rows], grad_entropies[rows], True, torch.autograd.backward)
        outputs[name] = counts
        grads = {}
        for param, p in model.named_parameters():
            grad = torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
            if shards is not None:
                dist.all_reduce(grad)
            grads[param] = grad
        return grads

    import trl_longstraw.glm_moe_dsa as glm_module

    # What the runs below patch, restored for the launch's next case.
    saved = (
        glm_module.EXCHANGE_ROWS,
        attention._kernel_forward,
        sharding._kernel_forward,
        dist.all_to_all_single,
        engine.Pass.attention_reuse,
    )
    if glm:  # the rounds' exchanges in slices of 3 query rows per rank (chunks of 7: 3 slices, checkpointed)
        glm_module.EXCHANGE_ROWS = 6
    try:
        shards = PromptShards(None)
        results = {
            "single fp32": run("single fp32", None, contextlib.nullcontext),
            "sharded fp32": run("sharded fp32", shards, contextlib.nullcontext),
            "sharded fp32 replicated": run("sharded fp32 replicated", shards, contextlib.nullcontext, True),
        }
        if not fp32_only:
            results["single bf16"] = run("single bf16", None, bf16)
            results["sharded bf16"] = run("sharded bf16", shards, bf16)
        if fp32_only:  # `attention_last`
            pass
        elif glm:
            results["dsa round errors"] = [None] * world
            dist.all_gather_object(results["dsa round errors"], dsa_round_errors(rank))
        else:
            counts = {"kernel": 0, "all_to_all": 0, "pairs": 0}
            kernel_forward, all_to_all = attention._kernel_forward, dist.all_to_all_single

            def counted_kernel(kind, q, k, v, causal, scale):
                # Fused attention calls, and the (query, key) pairs they score in the prompt's context-parallel
                # rounds: this rank's attention work in the prefill and the reverse pass.
                counts["kernel"] += 1
                pairs = q.shape[2] * (q.shape[2] + 1) // 2 if causal else q.shape[2] * k.shape[2]
                counts["pairs"] += shards.in_round * q.shape[0] * q.shape[1] * pairs
                return kernel_forward(kind, q, k, v, causal, scale)

            def counted_all_to_all(*args, **kwargs):
                counts["all_to_all"] += 1
                return all_to_all(*args, **kwargs)

            attention._kernel_forward = sharding._kernel_forward = counted_kernel
            dist.all_to_all_single = counted_all_to_all
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()  # transformers checkpoints only in training mode; the tiny models have no dropout
            results["sharded fp32 checkpointed, reuse"] = run("checkpointed, reuse", shards, contextlib.nullcontext)
            results["counts, reuse"] = dict(counts)
            results["pairs per rank"] = [None] * world
            dist.all_gather_object(results["pairs per rank"], counts["pairs"])
            counts.update(kernel=0, all_to_all=0, pairs=0)
            engine.Pass.attention_reuse = lambda self, layer_idx: None
            results["sharded fp32 checkpointed, no reuse"] = run(
                "checkpointed, no reuse", shards, contextlib.nullcontext
            )
            results["counts, no reuse"] = dict(counts)
    finally:
        (
            glm_module.EXCHANGE_ROWS,
            attention._kernel_forward,
            sharding._kernel_forward,
            dist.all_to_all_single,
            engine.Pass.attention_reuse,
        ) = saved
    results["mixer outputs"] = [None] * world
    dist.all_gather_object(results["mixer outputs"], outputs)
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()
