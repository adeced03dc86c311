"""Worker of tests/test_distributed.py: one rank of a 2-process CPU (gloo) run of LongStraw training steps.

Launched by the test through `tests.helpers.torchrun` (2 processes), one case per model: `main(MODEL_PATH, BATCHES,
OUT)`. `BATCHES` is a `torch.save`d dict of global micro-batches (each row tagged with the rank that runs it); each
rank takes its rows and runs these scenarios on them:

- `ddp_exact`: DDP, exact mode, micro-batch `A` under `no_sync` (gradient accumulation), then `B` synchronized;
- `ddp_detached`: DDP, detached mode, `B`;
- `fsdp2_exact`: `fully_shard` on every decoder layer and the root, exact mode with non-reentrant gradient
  checkpointing, `A` under `set_requires_gradient_sync(False)`, then `B`: the ranks run different work, so the
  engine's data-parallel lockstep pads their passes to equal counts and FSDP2 gathers and frees each layer pass by
  pass;
- `fsdp2_detached`: the same model, detached mode, `B`;
- `sharded_exact` / `sharded_detached`: DDP with the prompt state sharded over both ranks, micro-batch `S` (the
  ranks hold the same prompts, different completions); `sharded_exact` with non-reentrant gradient checkpointing;
- `offload_sharded_exact`: `sharded_exact` with `offload_boundary_states` (the boundaries in host memory);
- `fsdp2_sharded_exact`: the FSDP2 model with the sharded prompt state and non-reentrant gradient checkpointing,
  `S`: the ranks run in lockstep, so FSDP2 gathers and frees each layer pass by pass;
- `fsdp2_grouped_sharded_detached`: the FSDP2 model with the prompt state sharded over groups of one rank each
  (smaller than the world: each group its own passes, padded to the world's agreed pass counts, so FSDP2 still
  gathers and frees each layer pass by pass), detached, `B` (the groups hold different prompts, chunks and
  completions; 4 processes in groups of 2: `tests/group_worker.py`);
- `sharded_held_detached`: `sharded_detached` with the hold budget that the memory guard sets on GPU (its free
  memory faked: 1 TiB), which fits both prompts' states; `sharded_unheld_detached`: two such steps with a budget of
  1 byte, so the state scored first is prefilled again in the backward pass, and the engine says so once. For these
  and `sharded_exact` / `sharded_detached`, how many times the policy's backbone ran each prefix position of each
  prompt of `S`, per step, and the warnings about states that do not fit;
- `sharded_long_exact`: the sharded prompt state, exact mode, micro-batch `L` (a long prompt), counting the tokens
  that each decoder layer's MLP runs on this rank;
- `ddp_idle_rank`, `fsdp2_idle_rank`, `sharded_idle_rank`: exact mode, micro-batch `C` with `beta = 0`, where rank 1
  has no gradient to back-propagate;
- `fsdp2_batched_scoring`: the FSDP2 model scores `A` with branches packed into batches of at most `BATCH_TOKENS`
  tokens, as for old-policy and reference log-probs;
- for every FSDP2 scenario, at each unshard (prefetches included) and each wait for one, how many decoder layers
  are gathered or being gathered, and how many hold unsharded parameters (`gathered`);
- for the sharded scenarios (`sharded_exact`, `sharded_detached`, `sharded_long_exact`, `fsdp2_sharded_exact`,
  `fsdp2_grouped_sharded_detached`), the calls that compute a token mixer's output in the last decoder layer and in
  the others, in prompt passes and in branches (`mixer_outputs_counted`);
- `nonfinite_raise`: the sharded exact step on `S` with a NaN advantage in rank 1's rows only (`on_nonfinite`
  "raise"): every rank must raise FloatingPointError before back-propagating (none left waiting in a collective);
  the messages are kept;

and one case without a model (`kernels`): `sharded_prefix_attention` alone against `prefix_merge_attention`, and the
glm_moe_dsa sharded selection and latent attention against their references, in fp64; `PromptShards.broadcast_boundary`
alone on records of mixed dtypes.

Rank 0 writes the full (gathered) parameter gradients, the logps of the sharded scoring, each rank's sequence of
collective calls, the state sizes and the recurrent records each rank holds after a sharded exact-mode prefill to
`OUT`. The process group is destroyed and the process exits explicitly
(gloo runs of FSDP can abort in interpreter teardown after passing).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist

# Collectives counted at the `torch.distributed` namespace, where the engine, accelerate and FSDP2 call them.
COLLECTIVES = [
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_object_list",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "barrier",
    "reduce",
    "gather",
    "scatter",
]


# The log that the wrapped collectives append to: the latest `count_collectives` call's (a launch runs several cases).
_LOG: list[list] = []


def count_collectives(log: list) -> None:
    """Makes each call of a collective of `torch.distributed` append `(name, tensor shapes)` to `log` (wrapping them
    once per process; a later call redirects the records to its own `log`). A collective over a group smaller than
    the world (a shard group) is named `name@size`: FSDP2's world-level all-gathers and the sharded attention's group
    ones are both `all_gather_single`."""
    if _LOG:
        _LOG[0] = log
        return
    _LOG.append(log)

    def wrap(name, fn):
        def wrapper(*args, **kwargs):
            shapes = tuple(tuple(a.shape) for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor))
            size = dist.get_world_size(kwargs.get("group"))
            _LOG[0].append((name if size == dist.get_world_size() else f"{name}@{size}", shapes))
            return fn(*args, **kwargs)

        return wrapper

    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, wrap(name, getattr(dist, name)))


# Token budget of a batch of branches in the batched scoring (`Engine.score(batch_tokens=...)`).
BATCH_TOKENS = 9


def trainer_config(output_dir: str, **overrides):
    """The `LongStrawGRPOConfig` of the worker and of the single-process reference (global-batch `dapo` loss).

    `num_generations` does not enter the loss of a hand-built micro-batch; the worker raises it to 8 so that a prompt's
    completions cover both ranks, as `shard_prompt_state` requires.
    """
    from trl_longstraw import LongStrawGRPOConfig

    settings = dict(
        per_device_train_batch_size=4,
        max_completion_length=9,
        report_to=[],
        use_cpu=True,
        beta=0.1,
        loss_type="dapo",
        bf16=False,
        prefill_chunk_size=5,
        prefill_progress=False,
    )
    return LongStrawGRPOConfig(output_dir=output_dir, **(settings | overrides))


def make_batches(vocab_size: int) -> dict[str, dict]:
    """Global micro-batches; `rank` says which rank runs each row.

    `A`, `B`: uneven work: the ranks hold different numbers of distinct prompts (of 0 to 3 chunks of 5 tokens) and
    completions of different lengths (1 to 9). Every rank holds 3 rows, as TRL's metric gathers need equal row
    counts. `S`: both ranks hold the same two prompts (3 and 2 chunks), with 2 + 1 and 1 + 2 completions. `C`: like
    `S`, but rank 1's advantages are zero, so that with `beta = 0` it has no gradient to back-propagate at all. `L`:
    one prompt of 202 tokens (201 prefix tokens: 20 context-parallel rounds of 2 chunks, then one token that both
    ranks run) and 2 + 2 short completions, for the MLP token counts of `sharded_long_exact`.
    """
    from trl_longstraw.testing import random_micro_batch

    layouts = {
        # (prompt lengths, completion lengths, prompt of row, rank of row)
        "A": ([13, 7, 1, 9], [9, 1, 5, 3, 4, 1], [0, 1, 0, 2, 3, 3], [0, 0, 0, 1, 1, 1]),
        "B": ([12, 6, 2], [2, 8, 1, 7, 1, 6], [0, 0, 0, 1, 1, 2], [0, 0, 0, 1, 1, 1]),
        "S": ([13, 7], [9, 1, 5, 3, 4, 6], [0, 1, 0, 1, 0, 1], [0, 0, 0, 1, 1, 1]),
        "C": ([11, 8], [4, 2, 7, 3, 5, 1], [0, 1, 1, 0, 1, 0], [0, 0, 0, 1, 1, 1]),
        "L": ([202], [3, 1, 2, 4], [0, 0, 0, 0], [0, 0, 1, 1]),
    }
    batches = {}
    for i, (key, (prompts, completions, prompt_of_row, rank_of_row)) in enumerate(layouts.items()):
        batch = random_micro_batch(prompts, completions, prompt_of_row, vocab_size, seed=10 + i, completion_width=9)
        g = torch.Generator().manual_seed(20 + i)
        batch["ref_per_token_logps"] = -torch.rand(batch["completion_ids"].shape, generator=g) * 5
        batch["rank"] = torch.tensor(rank_of_row)
        if key == "C":  # rank 1 has nothing to back-propagate (with beta = 0)
            batch["advantages"][batch["rank"] == 1] = 0.0
        batches[key] = batch
    return batches


# The model whose gathers the wrapped FSDP2 methods record: `(its decoder layers, their parameter groups, record)`.
_PROBED: list[tuple] = []


def probe_gathers(fsdp) -> tuple[list[tuple[int, int]], Callable[[], tuple[int, int, int]]]:
    """Whenever FSDP2 gathers a parameter group of `fsdp` (an unshard, a prefetch included, or the wait that completes
    one), records how many decoder layers are gathered or being gathered, and how many hold their unsharded (plain
    tensor, not DTensor) parameters: at most the running layer and one prefetched when FSDP2 gathers pass by pass,
    every layer when the whole model is gathered.

    Returns the record `[(gathered, unsharded)]` and a function returning `(probes, most layers gathered or gathering,
    most layers with unsharded parameters)` since its last call (which clears the record).
    """
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.tensor import DTensor

    from trl_longstraw.distributed import _param_groups_of

    gathered: list[tuple[int, int]] = []
    layers = fsdp.model.layers
    first = not _PROBED
    _PROBED[:] = [(layers, [_param_groups_of(layer) for layer in layers], gathered)]
    if first:  # wrapped once per process; a later call probes its own model

        def probed(fn):
            def wrapper(self, *args, **kwargs):
                out = fn(self, *args, **kwargs)
                layers, layer_groups, record = _PROBED[0]
                held = sum(any(g.is_unsharded or g._all_gather_result is not None for g in gs) for gs in layer_groups)
                plain = sum(not isinstance(next(layer.parameters()), DTensor) for layer in layers)
                record.append((held, plain))
                return out

            return wrapper

        FSDPParamGroup.unshard = probed(FSDPParamGroup.unshard)
        FSDPParamGroup.wait_for_unshard = probed(FSDPParamGroup.wait_for_unshard)

    def most_gathered() -> tuple[int, int, int]:
        probes = (len(gathered), max(h for h, _ in gathered), max(p for _, p in gathered))
        gathered.clear()
        return probes

    return gathered, most_gathered


@contextlib.contextmanager
def mlp_tokens_counted(model):
    """Counts, in `[n]`, the tokens that the decoder layers' MLPs run (forward calls), averaged over the layers."""
    count = [0]
    layers = model.get_decoder().layers

    def hook(module, inputs):
        count[0] += inputs[0].shape[:-1].numel() / len(layers)

    hooks = [layer.mlp.register_forward_pre_hook(hook) for layer in layers]
    try:
        yield count
    finally:
        for h in hooks:
            h.remove()


@contextlib.contextmanager
def mixer_outputs_counted(model):
    """Counts the calls that compute a token mixer's output, by decoder layer and pass: the prompt attention of
    llama's and qwen3_5's attention layers (`kv.attend`, sharded or not), glm_moe_dsa's DSA selection and sparse
    latent attention (sharded or not), and Gated DeltaNet's delta rule with queries (without them it computes its
    state, the record, alone). Yields `{"prompt last": n, "prompt earlier": n, "branch last": n}`: the calls of the
    last decoder layer in prompt passes (`Engine.prefill`, `Engine.reverse` and their lockstep fillers, checkpoint
    recomputes included), those of the other layers there, and those of the last layer elsewhere (the branches)."""
    import trl_longstraw.glm_moe_dsa as glm
    import trl_longstraw.kv as kv
    import trl_longstraw.qwen3_5 as qwen
    from trl_longstraw.engine import BRANCH, Engine

    layers = model.get_decoder().layers
    counts = {"prompt last": 0, "prompt earlier": 0, "branch last": 0}
    current, prompt = [None], [0]

    def entering(i: int):
        def hook(module, args):
            current[0] = i

        return hook

    def in_prompt(fn, applies=lambda *args, **kwargs: True):
        def wrapper(self, *args, **kwargs):
            on = bool(applies(*args, **kwargs))
            prompt[0] += on
            try:
                return fn(self, *args, **kwargs)
            finally:
                prompt[0] -= on

        return wrapper

    def counted(fn, computes=lambda *args, **kwargs: True):
        def wrapper(*args, **kwargs):
            if computes(*args, **kwargs):
                last = current[0] == len(layers) - 1
                if prompt[0]:
                    counts["prompt last" if last else "prompt earlier"] += 1
                elif last:
                    counts["branch last"] += 1
            return fn(*args, **kwargs)

        return wrapper

    methods = {name: getattr(Engine, name) for name in ("prefill", "reverse", "_filler")}
    functions = [(kv, "attend", None), (qwen, "gated_delta_rule", lambda query, *args, **kwargs: query is not None)]
    functions += [
        (glm, name, None)
        for name in ("select_topk", "sharded_select_topk", "sparse_latent_attention", "sharded_latent_attention")
    ]
    saved = [getattr(module, name) for module, name, _ in functions]
    # On the layers' submodules: transformers checkpoints a layer's `forward`, inside its own hooks, so only the
    # submodules' hooks run again in a recompute.
    hooks = [m.register_forward_pre_hook(entering(i)) for i, layer in enumerate(layers) for m in layer.children()]
    try:
        Engine.prefill = in_prompt(methods["prefill"])
        Engine.reverse = in_prompt(methods["reverse"])
        Engine._filler = in_prompt(methods["_filler"], lambda kind, *args, **kwargs: kind != BRANCH)
        for module, name, computes in functions:
            setattr(module, name, counted(getattr(module, name), *([computes] if computes else [])))
        yield counts
    finally:
        for h in hooks:
            h.remove()
        for name, method in methods.items():
            setattr(Engine, name, method)
        for (module, name, _), fn in zip(functions, saved, strict=True):
            setattr(module, name, fn)


@contextlib.contextmanager
def prompt_positions_counted(backbone, groups: list):
    """Counts, per prompt of `groups` (`engine.PromptGroup`s), how many times `backbone` runs each of its prefix
    positions: in `[{position: count}]`, one dict per prompt. A row of a forward counts for a prompt when all its
    positions lie in the prompt's prefix (`pad` to `pad + L - 2`) and its tokens are the prompt's there; branch rows
    start at the last prompt token, outside every prefix. A row that would count for two prompts raises."""
    counts: list[dict[int, int]] = [{} for _ in groups]

    def hook(module, args, kwargs):
        ids, positions = kwargs["input_ids"], kwargs.get("position_ids")
        if positions is None:  # numbered from 0, as the backbone does then
            positions = torch.arange(ids.shape[1])[None]
        positions = positions.expand_as(ids)
        for row_ids, row_positions in zip(ids.tolist(), positions.tolist(), strict=True):
            matches = []
            for k, group in enumerate(groups):
                prefix = group.tokens[:-1].tolist()
                offsets = [p - group.pad for p in row_positions]
                if all(0 <= o < len(prefix) and prefix[o] == t for o, t in zip(offsets, row_ids, strict=True)):
                    matches.append(k)
            if len(matches) > 1:
                raise AssertionError(f"a forward at positions {row_positions} matches prompts {matches}")
            for k in matches:
                for p in row_positions:
                    counts[k][p] = counts[k].get(p, 0) + 1

    handle = backbone.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield counts
    finally:
        handle.remove()


class _Records(logging.Handler):
    """Keeps the messages logged to the logger it is added to."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def rows_of(batch: dict, rank: int) -> dict:
    """The rows of a global micro-batch that `rank` runs (`batch["rank"]`), with the global token count."""
    keep = (batch["rank"] == rank).nonzero().flatten()
    local = {k: v[keep] for k, v in batch.items() if isinstance(v, torch.Tensor) and v.ndim > 0 and k != "rank"}
    local["num_items_in_batch"] = batch["num_items_in_batch"]
    return local


def sharded_attention_errors(rank: int, world: int) -> dict[str, float]:
    """fp64 max abs errors of `sharded_prefix_attention` against `prefix_merge_attention` over the whole prefix.

    GQA (4 query heads, 2 key heads), key blocks of 2 (so that prefix and causal parts span several blocks), prefixes
    of 3 chunks (both ranks hold some) and of 1 chunk (rank 1 holds none). Branch rounds: different queries and
    lengths per rank (3 and 5); the gradient of each prefix chunk must reach its owner whole (the sum over ranks of
    the references'). Replicated passes (prefill, reverse): both ranks run the same 4 queries and back-propagate
    different shares of the loss; the shares' query, key and value gradients must add up to the reference's for the
    sum of the shares, and each chunk's gradient on its owner must be the whole; once more in fp32, through the fused
    CPU kernels, against the fp64 reference (keys `fp32/...`).
    """
    from trl_longstraw import attention
    from trl_longstraw.attention import prefix_merge_attention
    from trl_longstraw.sharding import PromptShards, sharded_prefix_attention

    errors: dict[str, float] = {}
    saved_block, attention.KEY_BLOCK = attention.KEY_BLOCK, 2
    try:
        for chunk_lengths, replicated, dtype in [
            ([5, 4, 2], False, torch.float64),
            ([3], False, torch.float64),
            ([5, 4, 2], True, torch.float64),
            ([3], True, torch.float64),
            ([5, 4, 2], True, torch.float32),  # the fused CPU kernels (fp32) against the fp64 reference
        ]:
            g = torch.Generator().manual_seed(len(chunk_lengths) + 10 * replicated)

            def rand(*shape, g=g, dtype=dtype):
                return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

            lengths = [4, 4] if replicated else [3, 5]
            chunks = [(rand(1, 2, n, 8), rand(1, 2, n, 8)) for n in chunk_lengths]
            rows = [(rand(1, 4, t, 8), rand(1, 2, t, 8), rand(1, 2, t, 8), rand(1, 4, t, 8)) for t in lengths]
            shards = PromptShards(None)
            if replicated:
                shards.replicated(lengths[0])
                q, k, v = rows[0][:3]  # the same queries on both ranks
                grad_out = rows[rank][3]  # this rank's share
                grad_ref = rows[0][3] + rows[1][3]
            else:
                shards.branch_round(lengths)
                q, k, v, grad_out = rows[rank]
                grad_ref = grad_out

            def leaves(*xs):
                return [x.clone().requires_grad_() for x in xs]

            mine = [leaves(*c) if shards.owner(i) == rank else None for i, c in enumerate(chunks)]
            whole = [leaves(*c) for c in chunks]
            ours, ref = leaves(q, k, v), [x.double() for x in leaves(q, k, v)]
            whole = [[x.double() for x in c] for c in whole]
            for x in ref + [x for c in whole for x in c]:
                x.retain_grad()
            out = sharded_prefix_attention(*ours, mine, 0.3, shards)
            expected = prefix_merge_attention(*ref, whole, 0.3)
            out.backward(grad_out)
            expected.backward(grad_ref.double())
            tag = ("fp32/" if dtype == torch.float32 else "") + f"{len(chunk_lengths)}chunks"
            tag += "/replicated" if replicated else ""
            errors[f"{tag}/out"] = (out - expected).abs().max().item()
            for name, a, b in zip("qkv", ours, ref, strict=True):
                got = a.grad.double()
                if replicated:  # the ranks' shares add up
                    dist.all_reduce(got)
                errors[f"{tag}/d{name}"] = (got - b.grad).abs().max().item()
            for i, pair in enumerate(whole):
                for j, x in enumerate(pair):
                    total = x.grad.clone()
                    if not replicated:  # each rank's reference saw its own queries only
                        dist.all_reduce(total)
                    if mine[i] is not None:
                        errors[f"{tag}/dprefix{i}.{j}"] = (mine[i][j].grad.double() - total).abs().max().item()
        errors |= context_parallel_round_errors(rank)
    finally:
        attention.KEY_BLOCK = saved_block
    return errors


def context_parallel_round_errors(rank: int) -> dict[str, float]:
    """Max abs errors of `sharded_prefix_attention` in a context-parallel round against `prefix_merge_attention` in
    fp64: in fp64 (portable path) and in fp32 (the fused CPU kernels, keys `fp32/...`).

    Prefix chunks of 5, 4 and 2 keys (on their owners), then a round in which rank 0 runs the next chunk (3 queries)
    and rank 1 the one after it (5 queries): rank 1's queries see rank 0's keys of the round too. The reference runs
    both chunks in one process with the loss of both; each rank's query, key and value gradients and each prefix
    chunk's gradient on its owner must be the reference's.
    """
    from trl_longstraw.attention import prefix_merge_attention
    from trl_longstraw.sharding import PromptShards, sharded_prefix_attention

    errors = {}
    for dtype in (torch.float64, torch.float32):
        g = torch.Generator().manual_seed(7)

        def rand(*shape, g=g):
            return torch.randn(*shape, generator=g, dtype=torch.float64)

        def leaves(*xs, dtype=torch.float64):
            return [x.detach().clone().to(dtype).requires_grad_() for x in xs]

        lengths = [3, 5]
        chunks = [(rand(1, 2, n, 8), rand(1, 2, n, 8)) for n in (5, 4, 2)]
        rows = [(rand(1, 4, t, 8), rand(1, 2, t, 8), rand(1, 2, t, 8), rand(1, 4, t, 8)) for t in lengths]
        shards = PromptShards(None)
        shards.cp_round(lengths)
        mine = [leaves(*c, dtype=dtype) if shards.owner(i) == rank else None for i, c in enumerate(chunks)]
        ours = leaves(*rows[rank][:3], dtype=dtype)
        out = sharded_prefix_attention(*ours, mine, 0.3, shards)
        out.backward(rows[rank][3].to(dtype))
        whole = [leaves(*c) for c in chunks]
        ref = [leaves(*row[:3]) for row in rows]
        expected = [
            prefix_merge_attention(*ref[0], whole, 0.3),
            prefix_merge_attention(*ref[1], whole + [tuple(ref[0][1:])], 0.3),
        ]
        sum((e * row[3]).sum() for e, row in zip(expected, rows, strict=True)).backward()
        tag = "fp32/round" if dtype == torch.float32 else "round"
        errors[f"{tag}/out"] = (out.double() - expected[rank]).abs().max().item()
        for name, a, b in zip("qkv", ours, ref[rank], strict=True):
            errors[f"{tag}/d{name}"] = (a.grad.double() - b.grad).abs().max().item()
        for i, pair in enumerate(whole):
            for j, x in enumerate(pair):
                if mine[i] is not None:
                    errors[f"{tag}/dprefix{i}.{j}"] = (mine[i][j].grad.double() - x.grad).abs().max().item()
    return errors


def sharded_dsa_errors(rank: int, world: int) -> dict[str, float]:
    """The glm_moe_dsa sharded kernels against their single-process references, in fp64 (the indexer in fp32, as it
    runs).

    `sharded_select_topk` must select exactly `reference_select`'s keys (a set per query: the order within a row is
    free), and `sharded_latent_attention` must give `reference_latent_attention`'s output and gradients, each prefix
    chunk's gradient reaching its owner whole. Branch rounds: query lengths 3 and 1 per rank, the chunk gradients
    summed over the ranks' references. Replicated passes (prefill, reverse): both ranks run the same 3 queries and
    back-propagate different shares of the loss, whose query and own-key gradients must add up to the reference's for
    the sum of the shares. Prefixes of 3 chunks (both ranks hold some) and of 1 (rank 1 holds none); top-k 5
    (selection across shards), 13 (in branch rounds rank 1's queries see every key, rank 0's do not: ragged widths)
    and 64 (dense: no exchange). Blocks are tiny so that tiles and key blocks span chunks. `ties` makes whole chunks
    score the same (integer queries, constant weights, equal keys): the earlier key must win across shards as it
    does unsharded, here a chunk of rank 1 against a later chunk of rank 0. Returns max abs errors, and for the
    selection the number of queries whose set differs.
    """
    import trl_longstraw.glm_moe_dsa as glm
    from trl_longstraw.sharding import PromptShards

    heads, dim, rank_dim, rope = 3, 4, 5, 2
    errors: dict[str, float] = {}
    saved = glm.INDEX_KEY_BLOCK, glm.INDEX_TILE, glm.ATTN_SLOTS
    glm.INDEX_KEY_BLOCK, glm.INDEX_TILE, glm.ATTN_SLOTS = 3, 2 * heads * 3, 2 * 5
    try:
        for chunk_lengths, topk, ties, replicated in [
            ([5, 4, 3], 5, False, False),
            ([5, 4, 3], 5, True, False),
            ([5, 4, 3], 13, False, False),
            ([9], 5, False, False),
            ([5, 4, 3], 64, False, False),
            ([5, 4, 3], 5, False, True),
            ([5, 4, 3], 5, True, True),
            ([9], 5, False, True),
        ]:
            tag = f"{len(chunk_lengths)}chunks/top{topk}" + ("/ties" if ties else "") + ("/rep" if replicated else "")
            g = torch.Generator().manual_seed(topk + len(chunk_lengths) + ties)

            def index(*shape, g=g, ties=ties):
                """Indexer tensors, fp32 as the indexer computes them."""
                if ties:
                    return torch.randint(1, 3, shape, generator=g).float()
                return torch.randn(*shape, generator=g)

            def rand(*shape, g=g):
                return torch.randn(*shape, generator=g, dtype=torch.float64)

            lengths = [3, 3] if replicated else [3, 1]
            starts = [0]
            for n in chunk_lengths:
                starts.append(starts[-1] + n)
            index_keys = [index(n, dim) for n in chunk_lengths]
            if ties:
                # Rank 0's first chunk scores nothing, the keys of rank 1's chunk 1 and of rank 0's chunk 2 all score
                # the same: the top-k must take chunk 1 first, then the start of chunk 2.
                index_keys = [torch.zeros(chunk_lengths[0], dim)] + [torch.ones(n, dim) for n in chunk_lengths[1:]]
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
            shards = PromptShards(None)
            if replicated:
                shards.replicated(lengths[0])
                # The same queries on both ranks, each with its own share of the output gradient.
                rows = [rows[0][:5] + (rows[0][5],), rows[0][:5] + (rows[1][5],)]
                references = [rows[0][:5] + (rows[0][5] + rows[1][5],)]
            else:
                shards.branch_round(lengths)
                references = rows
            held = [shards.owner(c) == rank for c in range(len(chunk_lengths))]
            iq, iw, ik, q, own_kv, grad_out = rows[rank]
            sel = glm.sharded_select_topk(
                iq,
                iw,
                [k if h else None for k, h in zip(index_keys, held, strict=True)],
                starts,
                ik,
                topk,
                0.5,
                shards,
            )
            full = glm._index_scores(iq, iw, torch.cat(index_keys + [ik]), 0.5)
            expected = glm.reference_select(full, starts[-1], topk)
            errors[f"{tag}/selection"] = float(
                sum(set(a[a >= 0].tolist()) != set(b[b >= 0].tolist()) for a, b in zip(sel, expected, strict=True))
            )
            # One width on every rank: the widest rank's (its queries see the most keys).
            errors[f"{tag}/selection_width"] = float(sel.shape[1] != min(topk, starts[-1] + max(lengths)))

            def leaves(*xs):
                return [x.clone().requires_grad_() for x in xs]

            def grad(x):
                """None when no query selected any of the rows: zero."""
                return torch.zeros_like(x) if x.grad is None else x.grad

            mine = [leaves(x)[0] if h else None for x, h in zip(kv, held, strict=True)]
            ours = leaves(q, own_kv)
            out = glm.sharded_latent_attention(ours[0], mine, starts, ours[1], sel, 0.4, rank_dim, shards)
            out.backward(grad_out)
            # Every rank's reference (all ranks draw the same tensors), for the prefix gradients summed over ranks.
            whole = leaves(*kv)
            for r, (riq, riw, rik, rq, rkv, rgrad) in enumerate(references):
                rsel = glm.reference_select(
                    glm._index_scores(riq, riw, torch.cat(index_keys + [rik]), 0.5), starts[-1], topk
                )
                ref_leaves = leaves(rq, rkv)
                ref = glm.reference_latent_attention(ref_leaves[0], whole + [ref_leaves[1]], rsel, 0.4, rank_dim)
                ref.backward(rgrad)
                if replicated or r == rank:
                    dq, dkv = ours[0].grad.clone(), grad(ours[1]).clone()
                    if replicated:  # the ranks' shares add up
                        dist.all_reduce(dq)
                        dist.all_reduce(dkv)
                    errors[f"{tag}/out"] = (out - ref).abs().max().item()
                    errors[f"{tag}/dq"] = (dq - ref_leaves[0].grad).abs().max().item()
                    errors[f"{tag}/dkv_own"] = (dkv - grad(ref_leaves[1])).abs().max().item()
            for c, x in enumerate(mine):
                if x is not None:
                    errors[f"{tag}/dprefix{c}"] = (grad(x) - grad(whole[c])).abs().max().item()
    finally:
        glm.INDEX_KEY_BLOCK, glm.INDEX_TILE, glm.ATTN_SLOTS = saved
    return errors


def boundary_broadcast_problems(rank: int) -> tuple[int, list[str]]:
    """Runs `PromptShards.broadcast_boundary` as the exact-mode reverse pass of a 3-chunk prompt does (boundary 1, then
    boundary 0) on two recurrent layers in the dtypes of a bf16 model (conv tail `[1, 6, 3]` bf16, state
    `[1, 2, 4, 4]` fp32: one buffer per dtype), within a process group object.

    Returns:
        The number of tensors this rank received, and the problems found with them: each must equal its owner's
        record bit for bit, in its dtype, and be a leaf that requires grad.
    """
    from trl_longstraw.engine import PromptState
    from trl_longstraw.sharding import PromptShards

    shards = PromptShards(dist.new_group(list(range(dist.get_world_size()))))
    g = torch.Generator().manual_seed(7)
    layers = (1, 3)
    full = {
        layer: [(torch.randn(1, 6, 3, generator=g).bfloat16(), torch.randn(1, 2, 4, 4, generator=g)) for _ in range(3)]
        for layer in layers
    }
    state = PromptState(boundaries=True, recurrent=set(layers))
    # After the prefill: the boundaries of this rank's chunks, and the final one.
    state.records = {
        layer: [r if c == 2 or shards.owner(c) == rank else None for c, r in enumerate(records)]
        for layer, records in full.items()
    }
    received, problems = 0, []
    for chunk in (1, 0):
        owned = shards.owner(chunk) == rank
        shards.broadcast_boundary(state, chunk)
        if owned:
            continue
        for layer in layers:
            for i, (got, want) in enumerate(zip(state.records[layer][chunk], full[layer][chunk], strict=True)):
                received += 1
                if got.dtype != want.dtype or not torch.equal(got, want):
                    problems.append(f"layer {layer} chunk {chunk} tensor {i}: differs from the owner's")
                if not (got.is_leaf and got.requires_grad):
                    problems.append(f"layer {layer} chunk {chunk} tensor {i}: not a leaf that requires grad")
    return received, problems


def main(model_path: str, batches_path: str, out_path: str) -> None:
    os.environ.setdefault("ACCELERATE_USE_CPU", "1")
    from datasets import Dataset
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from trl_longstraw import LongStrawGRPOTrainer
    from trl_longstraw.engine import group_prompts

    log: list = []
    batches = torch.load(batches_path)

    def reward(completions, **kwargs):
        return [0.0] * len(completions)

    config = trainer_config(tempfile.mkdtemp(), num_generations=8, shard_prompt_state=True)
    trainer = LongStrawGRPOTrainer(model_path, reward, config, train_dataset=Dataset.from_dict({"prompt": ["a"] * 8}))
    world, rank = dist.get_world_size(), dist.get_rank()
    assert world == 2, f"the distributed tests need 2 processes, got {world}"
    assert trainer.accelerator.num_processes == 2
    assert trainer._prompt_shards is not None and trainer._prompt_shards.world == 2
    shards = trainer._prompt_shards
    trainer._prepare_inputs = lambda x: x
    trainer.current_gradient_accumulation_steps = 1
    count_collectives(log)
    results: dict = {"collectives": {}, "state_bytes": {}, "gathered": {}, "prompt_passes": {}, "hold_warnings": {}}
    results["mixer_outputs"] = {}

    def full_grads(model) -> dict[str, torch.Tensor]:
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad
            if isinstance(g, DTensor):
                g = g.full_tensor()
            grads[name] = None if g is None else g.detach().clone()
        return grads

    def step(model, batch: dict, mode: str) -> None:
        trainer.args.prompt_gradient = mode
        trainer.training_step(model, rows_of(batch, rank), batch["num_items_in_batch"])

    def set_sharded(on: bool) -> None:
        trainer._prompt_shards = shards if on else None
        trainer._engines.clear()

    # DDP: the wrapper must never run forward (no buffer broadcast, no reducer armed).
    set_sharded(False)
    ddp = trainer.accelerator.prepare_model(trainer.model)
    assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel)
    wrapper_calls = []
    ddp.register_forward_pre_hook(lambda *a: wrapper_calls.append(1))
    for name, mode, micro_batches in [("ddp_exact", "exact", "AB"), ("ddp_detached", "detached", "B")]:
        start = len(log)
        trainer.model.zero_grad(set_to_none=True)
        for i, key in enumerate(micro_batches):
            if i < len(micro_batches) - 1:
                with trainer.accelerator.no_sync(ddp):
                    step(ddp, batches[key], mode)
            else:
                step(ddp, batches[key], mode)
        results[name] = full_grads(trainer.model)
        results["collectives"][name] = log[start:]
    assert not wrapper_calls, "the engine ran a forward through the DDP wrapper"

    # FSDP2 applied directly: on CPU, accelerate would silently turn an FSDP config into DDP.
    from torch.distributed.device_mesh import init_device_mesh

    fsdp = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    add_fused_lm_head(fsdp, temperature=trainer.temperature, outputs=("log_probs", "entropy"))
    mesh = init_device_mesh("cpu", (world,))
    for layer in fsdp.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    assert all(isinstance(p, DTensor) for p in fsdp.parameters()), "FSDP2 is not active"
    gathered, most_gathered = probe_gathers(fsdp)

    for name, mode, micro_batches in [("fsdp2_exact", "exact", "AB"), ("fsdp2_detached", "detached", "B")]:
        start = len(log)
        fsdp.zero_grad(set_to_none=True)
        gathered.clear()
        if mode == "exact":  # as the recipes run FSDP2: recomputed layers are gathered again by FSDP2
            fsdp.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for i, key in enumerate(micro_batches):
            fsdp.set_requires_gradient_sync(i == len(micro_batches) - 1)
            step(fsdp, batches[key], mode)
        fsdp.gradient_checkpointing_disable()
        results[name] = full_grads(fsdp)
        results["collectives"][name] = log[start:]
        results["gathered"][name] = most_gathered()
        assert all(isinstance(p, DTensor) for p in fsdp.parameters()), "parameters left unsharded"
    # Scoring with branches packed into batches of at most BATCH_TOKENS tokens (old-policy and reference log-probs),
    # on `A`: the ranks run different numbers of prompts, chunks and batches.
    local = rows_of(batches["A"], rank)
    start = len(log)
    with torch.no_grad():
        batched_logps, _ = trainer._engine(fsdp).score(
            local["prompt_ids"],
            local["prompt_mask"],
            local["completion_ids"],
            local["completion_mask"],
            batch_tokens=BATCH_TOKENS,
        )
    results["collectives"]["fsdp2_batched_scoring"] = log[start:]
    results["gathered"]["fsdp2_batched_scoring"] = most_gathered()

    # Sharded prompt state (over DDP), with the trainer's hold budget (on CPU: no limit).
    set_sharded(True)
    local = rows_of(batches["S"], rank)
    # Shortest first on both ranks (each rank lists the prompts in the order of its own rows).
    s_prompts = sorted(group_prompts(local["prompt_ids"], local["prompt_mask"]), key=lambda g: g.tokens.shape[0])
    for name, mode in [("sharded_exact", "exact"), ("sharded_detached", "detached")]:
        start = len(log)
        trainer.model.zero_grad(set_to_none=True)
        if mode == "exact":
            trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            trainer.model.gradient_checkpointing_disable()
        with (
            prompt_positions_counted(trainer.model.base_model, s_prompts) as counts,
            mixer_outputs_counted(trainer.model) as outputs,
        ):
            step(ddp, batches["S"], mode)
        results["mixer_outputs"][name] = outputs
        results[name] = full_grads(trainer.model)
        results["collectives"][name] = log[start:]
        results["prompt_passes"][name] = [counts]
    # A hold budget: first the memory guard's, as on GPU (1 TiB free here), which fits both states of `S` (held from
    # scoring to backward, each state counted as its largest share on either rank); then one that does not (the
    # state scored first is prefilled again in the backward pass), for two steps, which say so once.
    from trl_longstraw import guards

    engine_log = logging.getLogger("trl_longstraw.engine")
    warnings = _Records()
    engine_log.addHandler(warnings)
    free_memory = guards.device_free_memory
    try:
        for name, budget, steps in [("sharded_held_detached", None, 1), ("sharded_unheld_detached", 1, 2)]:
            trainer._engines.clear()
            if budget is None:
                guards.device_free_memory = lambda device: (2**40, 2**41)
                trainer._check_memory(trainer.model, local["prompt_ids"].shape[1], local["completion_ids"].shape[1])
                guards.device_free_memory = free_memory
                results["hold_budget"] = (trainer._hold_budget, trainer.memory_estimate["to_allocate"])
            else:
                trainer._hold_budget = budget
            start = len(log)
            per_step = []
            for _ in range(steps):
                trainer.model.zero_grad(set_to_none=True)
                with prompt_positions_counted(trainer.model.base_model, s_prompts) as counts:
                    step(ddp, batches["S"], "detached")
                per_step.append(counts)
            results[name] = full_grads(trainer.model)
            results["collectives"][name] = log[start:]
            results["prompt_passes"][name] = per_step
            results["hold_warnings"][name] = [m for m in warnings.messages if "do not all fit" in m]
            warnings.messages.clear()
    finally:
        engine_log.removeHandler(warnings)
        guards.device_free_memory = free_memory
        trainer._hold_budget = None
    results["context_parallel"] = trainer._engine(ddp).context_parallel
    # A long prompt: the tokens that run through the MLPs on this rank (context parallelism splits the prompt's).
    start = len(log)
    trainer.model.zero_grad(set_to_none=True)
    with mlp_tokens_counted(trainer.model) as mlp_tokens, mixer_outputs_counted(trainer.model) as outputs:
        step(ddp, batches["L"], "exact")
    results["mixer_outputs"]["sharded_long_exact"] = outputs
    results["sharded_long_exact"] = full_grads(trainer.model)
    results["collectives"]["sharded_long_exact"] = log[start:]
    results["mlp_tokens"] = mlp_tokens[0]
    # The same exact step with the recurrent boundaries in host memory (offload_boundary_states): owners stash theirs
    # after the prefill and restore them before broadcasting them in the reverse pass.
    trainer.args.offload_boundary_states = True
    trainer._engines.clear()
    trainer.model.zero_grad(set_to_none=True)
    trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    start = len(log)
    step(ddp, batches["S"], "exact")
    trainer.model.gradient_checkpointing_disable()
    results["offload_sharded_exact"] = full_grads(trainer.model)
    results["collectives"]["offload_sharded_exact"] = log[start:]
    trainer.args.offload_boundary_states = False
    trainer._engines.clear()
    start = len(log)
    fsdp.zero_grad(set_to_none=True)
    fsdp.set_requires_gradient_sync(True)
    gathered.clear()
    # With non-reentrant checkpointing, as the recipes run FSDP2: recomputed layers are gathered again by FSDP2.
    fsdp.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with mixer_outputs_counted(fsdp) as outputs:
        step(fsdp, batches["S"], "exact")
    results["mixer_outputs"]["fsdp2_sharded_exact"] = outputs
    fsdp.gradient_checkpointing_disable()
    results["fsdp2_sharded_exact"] = full_grads(fsdp)
    results["collectives"]["fsdp2_sharded_exact"] = log[start:]
    results["gathered"]["fsdp2_sharded_exact"] = most_gathered()
    # Shard groups smaller than the world (one rank each): each group pads its passes to the world's agreed counts.
    from trl_longstraw.sharding import PromptShards

    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    trainer._prompt_shards = PromptShards(singles[rank])
    trainer._engines.clear()
    start = len(log)
    fsdp.zero_grad(set_to_none=True)
    gathered.clear()
    with mixer_outputs_counted(fsdp) as outputs:
        step(fsdp, batches["B"], "detached")
    results["mixer_outputs"]["fsdp2_grouped_sharded_detached"] = outputs
    results["fsdp2_grouped_sharded_detached"] = full_grads(fsdp)
    results["collectives"]["fsdp2_grouped_sharded_detached"] = log[start:]
    results["gathered"]["fsdp2_grouped_sharded_detached"] = most_gathered()
    # An idle rank: nothing to back-propagate on rank 1 (micro-batch C, beta = 0), sharded or not.
    trainer.beta = 0.0
    for name, model, sharded in [
        ("ddp_idle_rank", ddp, False),
        ("fsdp2_idle_rank", fsdp, False),
        ("sharded_idle_rank", ddp, True),
    ]:
        set_sharded(sharded)
        start = len(log)
        model.zero_grad(set_to_none=True)
        gathered.clear()
        step(model, batches["C"], "exact")
        results[name] = full_grads(model.module if model is ddp else model)
        results["collectives"][name] = log[start:]
        if model is fsdp:
            results["gathered"][name] = most_gathered()
    trainer.beta = config.beta
    set_sharded(True)
    engine = trainer._engine(ddp)
    local = rows_of(batches["S"], rank)
    scored = (local["prompt_ids"], local["prompt_mask"], local["completion_ids"], local["completion_mask"])
    engine.stats.reset()
    with torch.no_grad():
        logps, _ = engine.score(*scored)
    results["state_bytes"]["sharded"] = engine.stats.state_bytes
    # An exact-mode prefill of the longest prompt of `S` (12 prefix tokens): the chunks whose recurrent records this
    # rank holds.
    longest = max(group_prompts(local["prompt_ids"], local["prompt_mask"]), key=lambda g: g.tokens.shape[0])
    state = engine.prefill(longest, boundaries=True)
    held = {layer: [c for c, r in enumerate(state.records[layer]) if r is not None] for layer in state.recurrent}
    set_sharded(False)
    engine = trainer._engine(ddp)
    engine.stats.reset()
    with torch.no_grad():
        engine.score(*scored)
    results["state_bytes"]["unsharded"] = engine.stats.state_bytes
    # A non-finite loss on rank 1 only: both ranks raise.
    set_sharded(True)
    trainer.args.on_nonfinite = "raise"
    trainer.args.prompt_gradient = "exact"
    poisoned = rows_of(batches["S"], rank)
    if rank == 1:
        poisoned["advantages"] = poisoned["advantages"].clone()
        poisoned["advantages"][0] = float("nan")
    start = len(log)
    try:
        trainer.training_step(ddp, poisoned, batches["S"]["num_items_in_batch"])
        raised = None
    except FloatingPointError as error:
        raised = str(error)
    nonfinite = (raised, log[start:])
    trainer.model.zero_grad(set_to_none=True)

    # Gather what rank 1 saw: its logps, collective sequences and state sizes.
    everyone: list = [None] * world
    mine = (
        logps,
        results["collectives"],
        results["state_bytes"],
        held,
        results["gathered"],
        batched_logps,
        results["mlp_tokens"],
        nonfinite,
        results["prompt_passes"],
        results["hold_warnings"],
        results["mixer_outputs"],
    )
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        results["sharded_logps"] = [e[0] for e in everyone]
        results["collectives"] = [e[1] for e in everyone]
        results["state_bytes"] = [e[2] for e in everyone]
        results["boundaries"] = [e[3] for e in everyone]
        results["gathered"] = [e[4] for e in everyone]
        results["batched_logps"] = [e[5] for e in everyone]
        results["mlp_tokens"] = [e[6] for e in everyone]
        results["nonfinite"] = [e[7] for e in everyone]
        results["prompt_passes"] = [e[8] for e in everyone]
        results["hold_warnings"] = [e[9] for e in everyone]
        results["mixer_outputs"] = [e[10] for e in everyone]
        torch.save(results, out_path)
    dist.barrier()


def kernels(out_path: str) -> None:
    """The sharded attention (`sharded_attention_errors`, `sharded_dsa_errors`) and `broadcast_boundary`
    (`boundary_broadcast_problems`) alone, on synthetic tensors: no model involved. Rank 0 writes every rank's
    `{"attention_errors": ..., "boundary_broadcast": ...}` to `OUT`."""
    if not dist.is_initialized():  # the launch's model cases set it up through their trainers
        dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    assert world == 2, f"the distributed tests need 2 processes, got {world}"
    mine = (sharded_attention_errors(rank, world) | sharded_dsa_errors(rank, world), boundary_broadcast_problems(rank))
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        torch.save(
            {"attention_errors": [e[0] for e in everyone], "boundary_broadcast": [e[1] for e in everyone]}, out_path
        )
