"""Prompt state sharded across the ranks of a process group (`shard_prompt_state`).

The ranks of a *shard group* hold the same prompts in every micro-batch (different completions of them). Each rank
keeps the records of 1/W of the prompt's chunks: chunk `c` belongs to rank `c % W`, so the prompt state shrinks W
times. With context parallelism (adapters that support it, see `context_parallel`) the prefill and reverse passes
run in rounds in which each rank runs the chunk it owns (`PromptShards.cp_round`); otherwise every rank runs every
prefill and reverse chunk (the chunk's token-wise compute is replicated, its state and its prompt attention are not).

Attention over the prompt is a log-sum-exp merge of per-shard parts (`sharded_prefix_attention`), done in one of two
ways. In a *replicated* pass (a prefill or reverse chunk, `PromptShards.replicated`) every rank runs the same
queries: each attends them to its own chunks and the parts merge by all-reduce (`merge_replicated`); in the backward
each rank's own causal part takes its share of the loss gradient and the chunks take the sum of the shares, so each
chunk's gradient is whole on its owner and the ranks' query gradients add up in the data-parallel reduction. In a
*branch round* (`PromptShards.branch_round`) each rank runs its own completion: the queries of every rank are
gathered, each rank scores them against its own chunks, the partial outputs and log-sum-exps go back to the query
owners (one all-to-all) and are merged there with the branch's causal part. The backward is the flash
decomposition: the owners' queries (again), `dout`, output and global log-sum-exp are gathered, each rank
computes the gradient of its own chunks (which thus stays on the rank that owns the record: exact mode reverses it
there) and its share of every rank's query gradient, which an all-to-all returns to the query owners. A
*context-parallel round* is the same exchange in which the ranks also attend the queries of the later ranks of the
round to the earlier ranks' chunks (the chunks of a round follow each other in rank order), each rank half of them
(`_RoundSplit`).

Lockstep: a pass's collectives must meet partners on every rank, so all ranks run the same sequence of passes. Prompts
are taken in one agreed order; prefill and reverse chunks are the same everywhere; branches run in rounds, and a rank
with fewer completions than the others in a round runs a one-token *dummy* branch of weight zero.

Records an adapter does not shard (emitted with `sharded=False`, e.g. a recurrent state, which is small and
sequential) are replicated: every rank keeps its copy and accumulates the gradient of its own consumers into it;
the replicated reverse pass back-propagates each rank's share, and the shares add up in the data-parallel gradient
reduction. A recurrent record (`supersedes=True`) in exact mode is the exception, as one is kept per chunk boundary:
after the prefill each rank keeps the boundaries of its own chunks plus the final one (which the branches read), and
before recomputing chunk `c` the reverse pass broadcasts boundary `c - 1` from its owner to every rank
(`PromptShards.broadcast_boundary`); the received copies then collect each rank's share of the gradient as above.
For the hooks an adapter uses, see `attend` and `Pass.emit(..., sharded=True)`.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from .attention import (
    _acc,
    _dense_last,
    _kernel_backward,
    _kernel_for,
    _kernel_forward,
    _prefix_parts,
    _scores,
    _self_parts,
    autocast_inputs,
    autocast_off,
    block_grads,
    prefix_merge_attention,
)
from .generation import DecodePass


class PromptShards:
    """The shard group of this rank, and the per-rank query lengths of the pass in progress.

    Args:
        group: the process group whose ranks share prompts (None: all processes).
    """

    def __init__(self, group=None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        # Query tokens of each rank in the current pass; set by the engine before every sharded pass.
        self.lengths: list[int] = []
        # Whether every rank runs the same queries in the current pass (a prefill or reverse chunk): attention then
        # merges the ranks' parts with all-reduces instead of exchanging every rank's queries.
        self.same_queries = False
        # Whether the current pass is a context-parallel round (`context_parallel`): rank `r` runs chunk
        # `first + r`, whose keys the queries of the ranks after it also see.
        self.in_round = False

    def owner(self, chunk: int) -> int:
        """The rank (in the group) that keeps the records of prompt chunk `chunk`."""
        return chunk % self.world

    def broadcast_boundary(self, state, chunk: int, like: int | None = None) -> None:
        """Gives every rank the records of `state`'s recurrent layers at the end of prompt chunk `chunk`.

        Collective, for the exact-mode reverse pass about to recompute chunk `chunk + 1`: the owner of `chunk` sends
        its records, e.g. qwen3_5's `(conv_tail [1, C, kernel-1], state [1, Hv, Dk, Dv] fp32)` per DeltaNet layer,
        packed into one flat buffer per dtype. The other ranks shape what they receive like the layer's records of
        chunk `chunk + 1`, which every rank holds at that point (`Pass.emit` checks that a recurrent layer's records
        keep their shapes), and store it in `state.records[layer][chunk]` as leaves that require grad, so that the
        recompute of chunk `chunk + 1` accumulates their gradient as it does on the owner's.

        Args:
            state: an `engine.PromptState` prefilled with `boundaries=True` under these shards.
            chunk: the chunk whose end-of-chunk records to broadcast.
            like: a chunk whose records every rank holds, to shape the received ones (default `chunk + 1`; the last
                chunk of the round in a context-parallel reverse pass).
        """
        owner = self.owner(chunk)
        like = chunk + 1 if like is None else like
        src = owner if self.group is None else dist.get_global_rank(self.group, owner)
        layers = sorted(state.recurrent)  # the same order on every rank
        templates = [t for layer in layers for t in state.records[layer][like]]
        sources = [t for layer in layers for t in state.records[layer][chunk]] if owner == self.rank else None
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(templates):
            by_dtype.setdefault(t.dtype, []).append(i)
        received: list[torch.Tensor | None] = [None] * len(templates)
        for dtype, indices in by_dtype.items():
            if sources is not None:  # the owner keeps its own records
                dist.broadcast(torch.cat([sources[i].detach().reshape(-1) for i in indices]), src, group=self.group)
                continue
            sizes = [templates[i].numel() for i in indices]
            flat = torch.empty(sum(sizes), dtype=dtype, device=templates[indices[0]].device)
            dist.broadcast(flat, src, group=self.group)
            for i, part in zip(indices, flat.split(sizes), strict=True):
                received[i] = part.view(templates[i].shape).requires_grad_(True)
        if sources is None:
            parts = iter(received)
            for layer in layers:
                state.records[layer][chunk] = tuple(next(parts) for _ in state.records[layer][like])

    def replicated(self, n: int) -> None:
        """Declares a pass where every rank runs the same `n` query tokens (a prefill or reverse chunk)."""
        self.lengths = [n] * self.world
        self.same_queries = True
        self.in_round = False

    def merge_parts(self, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention over every rank's chunks, from this rank's part `out` `[..., Dv]`, `lse` `[...]`, in a
        replicated pass (`merge_replicated`, without autograd)."""
        with torch.no_grad():
            return merge_replicated(out, lse, self)

    def sum_shares(self, grad: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of their shares `grad` of a loss gradient, in fp32 (or wider)."""
        return _summed(grad.to(torch.promote_types(grad.dtype, torch.float32)), self.group)

    def branch_round(self, lengths: list[int]) -> None:
        """Declares a pass where rank `r` runs its own `lengths[r]` query tokens (one branch per rank)."""
        self.lengths = list(lengths)
        self.same_queries = False
        self.in_round = False

    def cp_round(self, lengths: list[int]) -> None:
        """Declares a context-parallel round: rank `r` runs the `lengths[r]` tokens of the prompt chunk after those of
        rank `r - 1` (see `context_parallel`)."""
        self.lengths = list(lengths)
        self.same_queries = False
        self.in_round = True

    def agree(self, groups: list, lengths: list[list[int]]) -> tuple[list[int], list[list[list[int]]]]:
        """Checks that every rank holds the same prompts and exchanges the branch lengths of each.

        Args:
            groups: this rank's prompt groups (`engine.PromptGroup`).
            lengths: for each group, the lengths of the branches this rank will run.

        Returns:
            `(order, plan)`: the indices of `groups` in the agreed order, and `plan[i][r]`: the branch lengths of
            rank `r` for the `i`-th prompt of that order.

        Raises:
            ValueError: on every rank, when the ranks hold different prompts.
        """
        keys = [_prompt_key(g) for g in groups]
        order = sorted(range(len(groups)), key=keys.__getitem__)
        mine = ([keys[i] for i in order], [lengths[i] for i in order])
        everyone: list = [None] * self.world
        dist.all_gather_object(everyone, mine, group=self.group)
        if any(other[0] != mine[0] for other in everyone):
            counts = [len(other[0]) for other in everyone]
            raise ValueError(
                "shard_prompt_state needs every rank of a shard group to hold the same prompts (with the same left "
                f"padding) in each micro-batch, but the ranks hold different ones (distinct prompts per rank: "
                f"{counts}). Spread each prompt's completions over the group: make num_generations a multiple of "
                "per_device_train_batch_size * prompt_shard_group_size (or of the whole world size), keep "
                "group_shuffle=True, or set shard_prompt_state=False."
            )
        return order, [[other[1][i] for other in everyone] for i in range(len(order))]

    def extremes(self, values: list[int], device) -> tuple[list[int], list[int]]:
        """The smallest and largest of each of `values` over the ranks of the group (one all-reduce).

        Collective: every rank passes as many values, in one agreed order (e.g. of the prompts `agree` ordered).
        """
        both = torch.tensor([*values, *(-v for v in values)], dtype=torch.long, device=device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        highest, negated = both.tolist()[: len(values)], both.tolist()[len(values) :]
        return [-v for v in negated], highest


def shard_group_size(world: int, requested: int, num_generations: int, rows_per_process: int) -> int:
    """The number of ranks per prompt shard group, checked against the way TRL spreads prompts over processes.

    TRL gives each process `rows_per_process = per_device_train_batch_size * steps_per_generation` consecutive rows
    of a stream in which each prompt repeats `num_generations` times, so the ranks of a group of consecutive ranks
    hold the same prompts exactly when one prompt's completions cover the whole group.

    Args:
        world: number of processes.
        requested: `prompt_shard_group_size`; 0 means all processes.

    Raises:
        ValueError: naming the settings to change.
    """
    size = requested or world
    if world % size:
        raise ValueError(
            f"prompt_shard_group_size={size} does not divide the {world} processes: use a divisor of {world}, e.g. "
            "the number of GPUs per node, or 0 for all processes."
        )
    if num_generations % (size * rows_per_process):
        raise ValueError(
            f"shard_prompt_state needs the {size} ranks of a shard group to hold the same prompts, so num_generations "
            f"({num_generations}) must be a multiple of prompt_shard_group_size * per_device_train_batch_size * "
            f"steps_per_generation ({size} * {rows_per_process} rows per process). Raise num_generations, lower the "
            "per-device batch or the shard group size, or set shard_prompt_state=False."
        )
    return size


def _prompt_key(group) -> str:
    digest = hashlib.sha256(group.tokens.cpu().numpy().tobytes()).hexdigest()
    return f"{group.pad}:{group.tokens.shape[0]}:{digest}"


def _merge(qf: torch.Tensor, parts, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of folded queries `qf` `[1, Hkv, g, T, D]` over `parts` (`(k, v, causal_offset)`).

    Returns `out` `[1, Hkv, g, T, Dv]` and `lse` `[1, Hkv, g, T]` in the accumulation dtype; `lse` is -inf (and
    `out` zero) for rows that see no key.
    """
    acc = _acc(qf)
    out = lse = None
    for bk, bv, causal_offset in parts:
        s = _scores(qf, bk, scale, causal_offset)
        block_lse = torch.logsumexp(s, dim=-1)
        if out is None:
            out = torch.zeros(*qf.shape[:-1], bv.shape[-1], dtype=acc, device=qf.device)
            lse = torch.full(qf.shape[:-1], float("-inf"), dtype=acc, device=qf.device)
        new_lse = torch.logaddexp(lse, block_lse)
        # Rows with new_lse = -inf saw no key yet: keep them at zero instead of exp(-inf - -inf) = nan.
        safe = torch.where(torch.isinf(new_lse), torch.zeros_like(new_lse), new_lse)
        p = torch.exp(s - safe[..., None])
        out = out * torch.exp(lse - safe)[..., None] + torch.einsum("bhgts,bhsd->bhgtd", p, bv.to(acc))
        lse = new_lse
    return out, lse


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """`x` `[W, ...]`: slice `j` goes to rank `j`; returns `[W, ...]` whose slice `s` came from rank `s`."""
    x = x.contiguous()
    out = torch.empty_like(x)  # after contiguous(): empty_like would keep a permuted layout
    dist.all_to_all_single(out, x, group=group)
    return out


def _all_gather(x: torch.Tensor, world: int, group) -> torch.Tensor:
    """`x` `[1, ...]` of every rank, stacked: `[W, ...]`."""
    out = x.new_empty(world, *x.shape[1:])
    dist.all_gather_single(out, x.contiguous(), group=group)
    return out


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, world: int, group):
        ctx.group = group
        out = x.new_empty(world, *x.shape)
        dist.all_gather_single(out, x.contiguous()[None], group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        # Rank `j` holds the gradient of every rank's rows: each rank gets its own rows back and sums them.
        return _all_to_all(grad, ctx.group).sum(0), None, None


class _ReturnTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad):
        # An all-to-all is a permutation whose inverse is the all-to-all of the gradients.
        return _all_to_all(grad, ctx.group), None


def _summed(x: torch.Tensor, group) -> torch.Tensor:
    """A copy of `x` summed over the ranks of `group`."""
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _summed(x, group)

    @staticmethod
    def backward(ctx, grad):
        # Every rank's replica of the sum received a share of the loss gradient: each input gets their total.
        return _summed(grad, ctx.group), None


def all_reduce_sum(x: torch.Tensor, shards: PromptShards) -> torch.Tensor:
    """The sum of `x` over the ranks of `shards`, on every rank. Collective; differentiable, for a replicated pass:
    each rank back-propagates its share of the loss through its copy of the sum, so each input gets the total."""
    return _AllReduceSum.apply(x, shards.group)


def merge_replicated(out: torch.Tensor, lse: torch.Tensor, shards: PromptShards) -> tuple[torch.Tensor, torch.Tensor]:
    """Merges each rank's partial attention `out` `[..., Dv]` and log-sum-exp `lse` `[...]` over its own keys into the
    attention over every rank's keys, for queries that every rank runs (a replicated pass): one all-reduce of the
    maxima, one of the rescaled parts. Differentiable (the log-sum-exp maximum is a constant of the result).

    Returns `(out, lse)` in `out`'s dtype; `lse` is -inf (and `out` zero) for queries that no rank's keys reach.
    """
    with torch.no_grad():
        peak = lse.detach().clone()
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=shards.group)
        peak = torch.where(torch.isinf(peak), torch.zeros_like(peak), peak)
    weight = torch.exp(lse - peak)  # 0 where this rank's keys are out of reach
    total = all_reduce_sum(torch.cat([out * weight[..., None], weight[..., None]], dim=-1), shards)
    num, den = total[..., :-1], total[..., -1]
    reached = den > 0
    den = torch.where(reached, den, torch.ones_like(den))
    merged_lse = torch.where(reached, peak + torch.log(den), torch.full_like(den, float("-inf")))
    return num / den[..., None], merged_lse


def gather_tokens(x: torch.Tensor, shards: PromptShards, width: int | None = None) -> torch.Tensor:
    """Every rank's tokens, stacked: `x` `[T, ...]` (`T = shards.lengths[rank]`) -> `[W, Tmax, ...]`, zero-padded.

    With `width`, `x` is this rank's part of a slice of every rank's tokens, of at most `width` rows on every rank:
    `[W, width, ...]`. Collective; differentiable (the backward returns each rank the gradient of its own rows, summed
    over ranks).
    """
    width = max(shards.lengths) if width is None else width
    return _GatherTokens.apply(_pad_t(x, width, 0), shards.world, shards.group)


def return_tokens(x: torch.Tensor, shards: PromptShards, keep: int | None = None) -> torch.Tensor:
    """The inverse exchange of `gather_tokens`: `x` `[W, Tmax, ...]`, whose slice `j` was computed for the tokens of
    rank `j`, is sent to rank `j`; returns `[W, T, ...]` whose slice `s` came from rank `s` (`[W, keep, ...]` for a
    slice of which this rank has `keep` rows).

    Collective; differentiable.
    """
    return _ReturnTokens.apply(x, shards.group)[:, : shards.lengths[shards.rank] if keep is None else keep]


def _pad_t(x: torch.Tensor, t: int, dim: int) -> torch.Tensor:
    """Zero-pads dimension `dim` of `x` to length `t`."""
    if x.shape[dim] == t:
        return x
    shape = list(x.shape)
    shape[dim] = t - x.shape[dim]
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def _logaddexp_into(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Merges a part `(part_out [..., Dv], part_lse [...])` into `(out, lse)` in place (flash-attention rescaling).
    Rows that saw no key yet (`lse` -inf) take the part as it is."""
    new_lse = torch.logaddexp(lse, part_lse)
    safe = torch.where(torch.isinf(new_lse), torch.zeros_like(new_lse), new_lse)
    out.mul_(torch.exp(lse - safe)[..., None]).add_(part_out * torch.exp(part_lse - safe)[..., None])
    lse.copy_(new_lse)


def _part_forward(kind: str | None, qf: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float):
    """Folded queries `qf` `[1, Hkv, g, N, D]` against all of `keys`/`values` `[1, Hkv, S, D]`: `(out [1, Hkv, g, N,
    Dv], lse [1, Hkv, g, N])` in the accumulation dtype, and what the kernel's backward needs (portable path: None)."""
    if kind is None:
        out, lse = _merge(qf, _prefix_parts((keys, values)), scale)
        return out, lse, None
    _, hkv, g, n, d = qf.shape
    out, lse, extra = _kernel_forward(
        kind, qf.reshape(1, hkv, g * n, d), _dense_last(keys), _dense_last(values), False, scale
    )
    acc = _acc(qf)
    return out.view(1, hkv, g, n, -1).to(acc), lse.view(1, hkv, g, n).to(acc), extra


def _part_backward(kind, extra, qf, keys, values, dout, out, lse, delta, scale: float, need_kv: bool, dq):
    """The backward of `_part_forward` given the merged `out`, `dout`, `lse` (and `delta = rowsum(dout * out)` for
    the portable path) of the same folded queries: adds into `dq` `[1, Hkv, g, N, D]` (accumulation dtype) and returns
    the key/value gradients (None, None when not `need_kv`)."""
    if kind is None:
        return block_grads(qf, keys, values, dout, delta, lse, scale, False, need_kv, dq)
    _, hkv, g, n, d = qf.shape
    dtype = qf.dtype

    def fold(x):
        folded = x.reshape(1, hkv, g * n, *x.shape[4:]).to(dtype) if x.ndim == 5 else x.reshape(1, hkv, g * n)
        return folded.contiguous()

    dqf, dk, dv = _kernel_backward(
        kind,
        fold(dout),
        fold(qf),
        _dense_last(keys),
        _dense_last(values),
        fold(out),
        fold(lse).float(),
        False,
        scale,
        extra,
    )
    dq += dqf.view(dq.shape)
    return (dk.to(keys.dtype), dv.to(values.dtype)) if need_kv else (None, None)


class _RoundSplit:
    """How a context-parallel round splits the attention of each chunk's queries to the earlier chunks of the round.

    Rank `b`'s queries see the whole chunk of every rank `a < b` (the chunks of a round follow each other in rank
    order). The first `lengths[b] // 2` of them are attended to each such chunk by its owner `a` (they are among the
    gathered queries, and the parts return with the prefix parts), the others by `b` itself, against those chunks'
    keys, which the round gathers with the queries. So each rank attends `(W - 1) / 2` chunk pairs of the round (with
    chunks of equal length), where the key owners alone attended `W - 1 - r` on rank `r`: the ranks reach the round's
    exchanges together instead of the later ones waiting for rank 0.

    The keys and values are gathered again for the backward rather than kept from the forward, which the reverse
    pass runs for a whole chunk (every layer) before the backward.

    Attributes:
        later: `(b, rows)` for each later rank `b` with rows attended here: `rows` of its queries, from its first.
        own: the first of this rank's own queries that it attends to the earlier chunks (`lengths[rank]` if none).
        earlier: `(a, n_a)` for each earlier rank: its chunk's tokens.
    """

    def __init__(self, shards: PromptShards):
        rank, lengths = shards.rank, shards.lengths
        self.later = [(b, lengths[b] // 2) for b in range(rank + 1, shards.world) if lengths[b] // 2]
        self.own = lengths[rank] // 2 if rank else lengths[rank]
        self.earlier = [(a, lengths[a]) for a in range(rank)]

    def earlier_keys(self, kall: torch.Tensor, vall: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The earlier chunks' keys and values `[1, Hkv, sum(n_a), D]` from every rank's `kall`, `vall`
        `[W, Hkv, Tmax, D]`."""
        keys = torch.cat([kall[a, :, :n] for a, n in self.earlier], dim=1)[None]
        values = torch.cat([vall[a, :, :n] for a, n in self.earlier], dim=1)[None]
        return keys, values


class _ShardedPrefixAttention(torch.autograd.Function):
    """Attention of each rank's own queries over the chunks of every rank (branch rounds and context-parallel rounds):
    every rank's queries are gathered and attended to this rank's chunks, the parts return to their owners. Each part
    runs through the fused kernel `kind` (see `attention._kernel_for`) or, with `kind` None, the portable einsum path.
    In a context-parallel round the keys of the round's chunks are gathered too, for `_RoundSplit`.
    """

    @staticmethod
    @autocast_off
    def forward(ctx, kind, scale: float, shards: PromptShards, reuse: dict | None, q, k, v, *prefix):
        lengths = list(shards.lengths)
        _, hq, t, _ = q.shape
        if lengths[shards.rank] != t:
            raise RuntimeError(f"sharded attention: this rank runs {t} query tokens, the pass declared {lengths}")
        if reuse:
            # Gradient checkpointing's recompute of the call that filled `reuse` (every rank recomputes the same
            # layer of the same round, so all skip the exchange together): its inputs are those of the first call.
            out, lse, extras, split = (reuse.pop(key) for key in ("out", "lse", "extras", "split"))
            if out.shape[3] != t:
                raise RuntimeError(f"attention reuse: kept output {tuple(out.shape)} for queries {tuple(q.shape)}")
        else:
            out, lse, extras, split = _ShardedPrefixAttention.attend(kind, scale, shards, q, k, v, prefix)
            if reuse is not None:
                reuse.update(out=out, lse=lse, extras=extras, split=split)
        ctx.kind, ctx.scale, ctx.shards, ctx.lengths, ctx.split = kind, scale, shards, lengths, split
        ctx.extras = extras
        ctx.save_for_backward(q, k, v, out, lse, *prefix)
        return out.view(1, hq, t, -1).to(q.dtype)

    @staticmethod
    def attend(kind, scale: float, shards: PromptShards, q, k, v, prefix):
        """The forward's work: `(out [1, Hkv, g, T, Dv], lse [1, Hkv, g, T])` in the accumulation dtype, the kernel
        extras per part, and in a context-parallel round its `_RoundSplit` (else None)."""
        world, group, lengths = shards.world, shards.group, list(shards.lengths)
        _, hq, t, d = q.shape
        hkv, dv = k.shape[1], v.shape[-1]
        g, tmax = hq // hkv, max(lengths)
        split = earlier = None
        if shards.in_round:
            # Every rank's queries, keys and values in one all-gather.
            mine = [_pad_t(x, tmax, 2).reshape(-1) for x in (q, k, v)]
            everyone = _all_gather(torch.cat(mine)[None], world, group)  # [W, Tmax * (Hq * D + Hkv * (D + Dv))]
            qall, kall, vall = everyone.split([x.numel() for x in mine], dim=1)
            split = _RoundSplit(shards)
            if split.earlier:
                earlier = split.earlier_keys(kall.view(world, hkv, tmax, d), vall.view(world, hkv, tmax, dv))
            qall = qall.view(world, hkv, g, tmax, d)
        else:
            qall = _all_gather(_pad_t(q, tmax, 2), world, group).view(world, hkv, g, tmax, d)
        # Every rank's queries, stacked along the token axis: [1, Hkv, g, W * Tmax, D].
        qall = qall.permute(1, 2, 0, 3, 4).reshape(1, hkv, g, world * tmax, d)
        acc = _acc(q)
        o_loc = torch.zeros(1, hkv, g, world * tmax, dv, dtype=acc, device=q.device)
        lse_loc = torch.full((1, hkv, g, world * tmax), float("-inf"), dtype=acc, device=q.device)
        extras = []
        for pk, pv in zip(prefix[0::2], prefix[1::2], strict=True):
            part_out, part_lse, extra = _part_forward(kind, qall, pk, pv, scale)
            _logaddexp_into(o_loc, lse_loc, part_out, part_lse)
            extras.append(extra)
        for b, n in [] if split is None else split.later:  # later ranks' first queries, to this rank's chunk
            rows = slice(b * tmax, b * tmax + n)
            part_out, part_lse, extra = _part_forward(kind, qall[:, :, :, rows].contiguous(), k, v, scale)
            _logaddexp_into(o_loc[:, :, :, rows], lse_loc[:, :, :, rows], part_out, part_lse)
            extras.append(extra)
        packed = torch.cat([o_loc, lse_loc[..., None]], dim=-1).view(hkv, g, world, tmax, dv + 1)
        received = _all_to_all(packed.permute(2, 0, 1, 3, 4), group)[:, :, :, :t]  # [W, Hkv, g, T, Dv + 1]
        if kind is None:
            o_self, lse_self = _merge(q.view(1, hkv, g, t, d), _self_parts(k, v), scale)
            extras.append(None)
        else:  # the causal mask follows the row: the own keys are repeated to the query heads
            ke, ve = (x.repeat_interleave(g, dim=1) for x in (k, v))
            o_self, lse_self, extra = _kernel_forward(kind, q.contiguous(), ke, ve, True, scale)
            o_self, lse_self = o_self.view(1, hkv, g, t, dv).to(acc), lse_self.view(1, hkv, g, t).to(acc)
            extras.append(extra)
        if earlier is not None:  # this rank's last queries, to the round's earlier chunks
            own = split.own
            qf = q.view(1, hkv, g, t, d)[:, :, :, own:].contiguous()
            part_out, part_lse, extra = _part_forward(kind, qf, *earlier, scale)
            _logaddexp_into(o_self[:, :, :, own:], lse_self[:, :, :, own:], part_out, part_lse)
            extras.insert(-1, extra)
        lses = torch.cat([lse_self, received[..., dv]], dim=0)  # [W + 1, Hkv, g, T]
        lse = torch.logsumexp(lses, dim=0, keepdim=True)  # [1, Hkv, g, T], finite: each query sees its own key
        weights = torch.exp(lses - lse)[..., None]
        out = (weights * torch.cat([o_self, received[..., :dv]], dim=0)).sum(0, keepdim=True)  # [1, Hkv, g, T, Dv]
        return out, lse, extras, split

    @staticmethod
    @autocast_off
    def backward(ctx, grad_out):
        q, k, v, out, lse, *prefix = ctx.saved_tensors
        shards, scale, lengths, kind, extras, split = (
            ctx.shards,
            ctx.scale,
            ctx.lengths,
            ctx.kind,
            ctx.extras,
            ctx.split,
        )
        world, group = shards.world, shards.group
        _, hq, t, d = q.shape
        hkv, dv = k.shape[1], v.shape[-1]
        g, tmax = hq // hkv, max(lengths)
        acc = out.dtype
        dout = grad_out.to(acc).view(out.shape)  # [1, Hkv, g, T, Dv]
        delta = (dout * out).sum(-1)  # [1, Hkv, g, T]

        # Own causal part, with the global log-sum-exp.
        dq = torch.zeros(1, hkv, g, t, d, dtype=acc, device=q.device)
        if kind is None:
            dk, dvv = block_grads(q.view(1, hkv, g, t, d), k, v, dout, delta, lse, scale, True, True, dq)
        else:
            ke, ve = (x.repeat_interleave(g, dim=1) for x in (k, v))
            dq_self, dke, dve = _kernel_backward(
                kind,
                grad_out.contiguous().to(q.dtype),
                q.contiguous(),
                ke,
                ve,
                out.view(1, hq, t, dv).to(q.dtype),
                lse.view(1, hq, t).float(),
                True,
                scale,
                extras[-1],
            )
            dq += dq_self.view(dq.shape)
            dk = dke.view(1, hkv, g, t, -1).sum(2, dtype=acc).to(k.dtype)
            dvv = dve.view(1, hkv, g, t, -1).sum(2, dtype=acc).to(v.dtype)

        # Every rank's queries (gathered again rather than kept from the forward: W times the queries per layer), dout,
        # delta (portable path) or out (kernels), and lse, in the accumulation dtype, which holds the queries exactly.
        # Padded rows are zero: their scores are 0, p = 1 and dp = delta = 0.
        middle = delta[..., None] if kind is None else out
        mine = torch.cat([q.view(1, hkv, g, t, d).to(acc), dout, middle, lse[..., None]], dim=-1)
        mine = _pad_t(mine, tmax, 3)
        width = mine.shape[-1]
        if split is None:
            theirs = _all_gather(mine, world, group)  # [W, Hkv, g, Tmax, width]
        else:  # with every rank's keys and values (`_RoundSplit`), in the accumulation dtype
            keys = [_pad_t(x, tmax, 2).to(acc).reshape(-1) for x in (k, v)]
            everyone = _all_gather(torch.cat([mine.reshape(-1), *keys])[None], world, group)
            theirs, kall, vall = everyone.split([mine.numel(), *(x.numel() for x in keys)], dim=1)
            theirs = theirs.view(world, hkv, g, tmax, width)
        theirs = theirs.permute(1, 2, 0, 3, 4).reshape(1, hkv, g, world * tmax, width)
        # Contiguous once here, rather than once per part in `_part_backward`.
        qall = theirs[..., :d].to(q.dtype).contiguous()
        dout_all, lse_all = theirs[..., d : d + dv].contiguous(), theirs[..., -1].contiguous()
        delta_all = theirs[..., d + dv].contiguous() if kind is None else None
        out_all = None if kind is None else theirs[..., d + dv : d + 2 * dv].contiguous()
        # Context-parallel round: this rank's last queries against the round's earlier chunks, whose key and value
        # gradients go back to their owners with the query gradients below.
        earlier_grads = None
        if split is not None and split.earlier:
            keys, values = split.earlier_keys(kall.view(world, hkv, tmax, d), vall.view(world, hkv, tmax, dv))
            rows = (slice(None), slice(None), slice(None), slice(split.own, None))
            dq_own = torch.zeros(dq[rows].shape, dtype=acc, device=q.device)
            earlier_grads = _part_backward(
                kind,
                extras[-2],
                q.view(1, hkv, g, t, d)[rows].contiguous(),
                keys.to(q.dtype),
                values.to(v.dtype),
                dout[rows],
                out[rows],
                lse[rows],
                delta[rows],
                scale,
                True,
                dq_own,
            )
            dq[rows] += dq_own
        dq_all = torch.zeros(qall.shape, dtype=acc, device=q.device)
        prefix_grads = []
        for i, (pk, pv) in enumerate(zip(prefix[0::2], prefix[1::2], strict=True)):
            need = ctx.needs_input_grad[7 + 2 * i] or ctx.needs_input_grad[8 + 2 * i]
            prefix_grads += _part_backward(
                kind, extras[i], qall, pk, pv, dout_all, out_all, lse_all, delta_all, scale, need, dq_all
            )
        for m, (b, n) in enumerate([] if split is None else split.later):
            # This rank's own keys, seen by the first queries of a later rank of the round.
            rows = (slice(None), slice(None), slice(None), slice(b * tmax, b * tmax + n))
            dq_later = torch.zeros(qall[rows].shape, dtype=acc, device=q.device)
            dk_late, dv_late = _part_backward(
                kind,
                extras[len(prefix) // 2 + m],
                qall[rows].contiguous(),
                k,
                v,
                dout_all[rows],
                None if out_all is None else out_all[rows],
                lse_all[rows],
                None if delta_all is None else delta_all[rows],
                scale,
                True,
                dq_later,
            )
            dq_all[rows] += dq_later
            dk, dvv = dk + dk_late, dvv + dv_late
        # Each rank's share of every rank's query gradient goes back to the query owner, with (in a round) the
        # gradients of the earlier chunks' keys and values to their owners.
        shares = dq_all.view(hkv, g, world, tmax, d).permute(2, 0, 1, 3, 4)
        if split is None:
            dq = dq + _all_to_all(shares, group).sum(0, keepdim=True)[:, :, :, :t]
            return None, None, None, None, dq.view(q.shape).to(q.dtype), dk, dvv, *prefix_grads
        kv_grads = torch.zeros(world, hkv, tmax, d + dv, dtype=acc, device=q.device)
        if earlier_grads is not None:
            start = 0
            for a, n in split.earlier:
                kv_grads[a, :, :n, :d] = earlier_grads[0][0, :, start : start + n]
                kv_grads[a, :, :n, d:] = earlier_grads[1][0, :, start : start + n]
                start += n
        received = _all_to_all(torch.cat([shares.reshape(world, -1), kv_grads.view(world, -1)], dim=1), group)
        dq_shares, kv_shares = received.split([shares[0].numel(), kv_grads[0].numel()], dim=1)
        dq = dq + dq_shares.view(world, hkv, g, tmax, d).sum(0, keepdim=True)[:, :, :, :t]
        kv_in = kv_shares.view(world, hkv, tmax, d + dv).sum(0)[None, :, :t]  # [1, Hkv, T, D + Dv]
        dk = (dk.to(acc) + kv_in[..., :d]).to(k.dtype)
        dvv = (dvv.to(acc) + kv_in[..., d:]).to(v.dtype)
        return None, None, None, None, dq.view(q.shape).to(q.dtype), dk, dvv, *prefix_grads


def sharded_prefix_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    prefix: list[tuple[torch.Tensor, torch.Tensor] | None],
    scale: float,
    shards: PromptShards,
    reuse: dict | None = None,
) -> torch.Tensor:
    """`prefix_merge_attention` over a prefix whose chunks are spread over the ranks of `shards`.

    Collective: every rank of the group must call it for the same layer of the same pass (see `PromptShards`).

    Args:
        query: `[1, Hq, T, D]`, `T = shards.lengths[rank]`.
        key, value: `[1, Hkv, T, D]` (`Dv` for value), the keys of the queries' own positions (causal).
        prefix: the visible chunk records `(k_i, v_i)` `[1, Hkv, S_i, D]`, `None` for chunks held by other ranks.
        scale: softmax scale.
        reuse: the exact-mode reverse pass's slot for gradient checkpointing (`prefix_merge_attention`'s `reuse`):
            the forward keeps its output and log-sum-exp there and the recompute takes them, skipping its exchange.

    Returns:
        `[1, Hq, T, Dv]` in the dtype of `query`.
    """
    if query.shape[0] != 1:
        raise ValueError("sharded prompt state attends one row at a time (batch 1)")
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"query heads ({query.shape[1]}) must be a multiple of key heads ({key.shape[1]})")
    if shards.same_queries:
        # Every rank runs these queries: each attends them to its own chunks (through the fused kernels where they
        # apply) and the parts merge by all-reduce.
        own = [kv for kv in prefix if kv is not None]
        return prefix_merge_attention(query, key, value, own, scale, shards, reuse=reuse)
    flat = [x for kv in prefix if kv is not None for x in kv]
    kind = _kernel_for(query, key, value)
    return _ShardedPrefixAttention.apply(kind, scale, shards, reuse, query, key, value, *flat)


def sharded_decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    prompt: list[tuple[torch.Tensor, torch.Tensor] | None],
    tail: list[tuple[torch.Tensor, torch.Tensor]],
    scale: float,
    shards: PromptShards,
) -> torch.Tensor:
    """One decoding step of this rank's G rows over a prompt whose chunks are spread over the ranks of `shards`.

    In a branch round (`shards.lengths[r]`: the rows of rank `r`), every rank's row queries are gathered and attended
    to this rank's prompt chunks; the partial outputs and log-sum-exps go back to the rows' owners (one all-to-all)
    and merge there by log-sum-exp with each row's attention over its own decoded tail and its step's token, which
    stay on its rank. Without autograd (decoding). Collective: every rank of the group calls it for the same layer of
    the same step.

    Args:
        query: `[G, Hq, 1, D]` the rows' queries of this step.
        key, value: `[G, Hkv, 1, D]` (`Dv` for value), the step's own keys and values.
        prompt: the visible prompt chunks `(k_i, v_i)` `[1, Hkv, S_i, D]`, None for chunks held by other ranks.
        tail: at most one record `(k, v)` `[G, Hkv, t, D]` of the rows' earlier decoded tokens.
        scale: softmax scale.

    Returns:
        `[G, Hq, 1, Dv]` in the dtype of `query`.
    """
    rows, hq, _, d = query.shape
    hkv, dv = key.shape[1], value.shape[-1]
    g, world, lengths = hq // hkv, shards.world, list(shards.lengths)
    if lengths[shards.rank] != rows:
        raise RuntimeError(f"sharded decoding: this rank decodes {rows} rows, the step declared {lengths}")
    tmax, acc = max(lengths), _acc(query)
    with torch.no_grad():
        # The rows as the token axis of one query sequence: every rank's, [1, Hkv, g, W * Tmax, D].
        q = _pad_t(query[:, :, 0].transpose(0, 1)[None], tmax, 2)  # [1, Hq, Tmax, D]
        qall = _all_gather(q, world, shards.group)
        qall = qall.view(world, hkv, g, tmax, d).permute(1, 2, 0, 3, 4).reshape(1, hkv, g, world * tmax, d)
        o_loc = torch.zeros(1, hkv, g, world * tmax, dv, dtype=acc, device=query.device)
        lse_loc = torch.full((1, hkv, g, world * tmax), float("-inf"), dtype=acc, device=query.device)
        for record in prompt:
            if record is not None:
                part_out, part_lse, _ = _part_forward(None, qall, *record, scale)
                _logaddexp_into(o_loc, lse_loc, part_out, part_lse)
        packed = torch.cat([o_loc, lse_loc[..., None]], dim=-1).view(hkv, g, world, tmax, dv + 1)
        received = _all_to_all(packed.permute(2, 0, 1, 3, 4), shards.group)[:, :, :, :rows]  # [W, Hkv, g, G, Dv+1]
        received = received.permute(0, 3, 1, 2, 4)  # [W, G, Hkv, g, Dv + 1]
        # Each row over its own tail and token, [G, Hkv, g, t + 1].
        keys = torch.cat([*(record[0] for record in tail), key], dim=2).to(acc)
        values = torch.cat([*(record[1] for record in tail), value], dim=2).to(acc)
        scores = torch.einsum("bhgd,bhkd->bhgk", query[:, :, 0].reshape(rows, hkv, g, d).to(acc), keys) * scale
        lse_self = torch.logsumexp(scores, dim=-1)
        o_self = torch.einsum("bhgk,bhkd->bhgd", torch.exp(scores - lse_self[..., None]), values)
        lses = torch.cat([lse_self[None], received[..., dv]])  # [W + 1, G, Hkv, g], finite: each row sees its token
        lse = torch.logsumexp(lses, dim=0)
        out = (torch.exp(lses - lse)[..., None] * torch.cat([o_self[None], received[..., :dv]])).sum(0)
    return out.reshape(rows, hq, 1, dv).to(query.dtype)


def attend(p, layer_idx: int, query, key, value, scale: float) -> torch.Tensor:
    """The prompt attention of a KV layer for the active pass `p`: attends, then emits `(key, value)` as the record.

    Sharded when the pass is (`p.shard`), so adapters whose attention fits `(q, k, v)` need nothing else. Under
    autocast the inputs are first cast as autocast casts stock's SDPA inputs, so the records hold the autocast dtype.
    The last layer of a prompt pass (`Pass.outputs_unread`) does not call it: its adapter emits the same record
    alone (`kv.longstraw_attention`), on every rank of a shard group, which all skip the attention's collectives.
    """
    query, key, value = autocast_inputs(query, key, value)
    records = p.read(layer_idx)
    if p.shard is None:
        out = prefix_merge_attention(query, key, value, records, scale, reuse=p.attention_reuse(layer_idx))
    elif isinstance(p, DecodePass):
        out = sharded_decode_attention(
            query, key, value, p.prompt_records(layer_idx), p.tail.records(layer_idx), scale, p.shard
        )
    else:
        # The prompt's own passes (a context-parallel round, a replicated chunk) keep their attention for the
        # reverse pass's recompute; branch rounds do not (their lengths are declared anew by every round).
        own_pass = p.shard.in_round or p.shard.same_queries
        reuse = p.attention_reuse(layer_idx) if own_pass else None
        out = sharded_prefix_attention(query, key, value, records, scale, p.shard, reuse)
    p.emit(layer_idx, (key, value), sharded=True)
    return out
