"""Adapter for GLM-5 / GLM-5.2 (transformers `glm_moe_dsa`): multi-head latent attention (MLA) with DeepSeek sparse
attention (DSA), and a mixture of experts.

Record of an attention layer for a prefill chunk of `n` tokens, in the compute dtype (the autocast dtype under mixed
precision, where stock rounds both to it before any use; else the model's):

- `kv` `[n, kv_lora_rank + qk_rope_head_dim]`: per token the compressed KV latent after `kv_a_layernorm`, then the
  shared rope key after RoPE (one row per token, the layout of FlashMLA's cache);
- `index_key` `[n, index_head_dim]`: the DSA indexer key after its norm and RoPE, on layers that run their own
  indexer (`config.indexer_types[layer] == "full"`); layers that reuse the previous layer's selection (`"shared"`)
  keep `(kv,)` only.

Keys and values are never decompressed. For the `S` queries of one forward (a prefill chunk or a branch), attending
to the visible keys `[prefix records | own tokens, causally]`:

1. **Selection** (`select_topk`). The indexer scores every visible key and keeps the `index_topk` best per query. The
   scores are computed over blocks of keys and merged into a running top-k, so neither the `[S, heads, T]` scores
   of transformers nor any `[S, T]` tensor exists. When a query sees at most `index_topk` keys it keeps all of them:
   attention is then dense causal MLA, as in transformers.
2. **Absorbed MLA** (`sparse_latent_attention`). `kv_b_proj` is folded into the query (`q_nope @ W_uk` per head) and
   the output (`o @ W_uv^T`), so each query attends over its gathered top-k `kv` rows directly. The gathers are
   recomputed in the backward instead of being saved.

**Decoding** (`generation.DecodePass`, `_decode_attention_forward`): the G rows of a prompt decode one token per
step against its records (batch 1, never written) and their own tail `(kv [G, t, R + Dr], index_key [G, t, D])`.
Each row's indexer query takes its top-k over the prompt's keys (the running top-k above) and its tail's, as
transformers' indexer does over its key cache at decode (`decode_select_topk`), then absorbed MLA reads the selected
rows of the prompt's records and of the row's tail.

**Sharded prompt state** (`sharding`): each rank holds the records of its chunks. The selection is the global top-k
(`sharded_select_topk`: each rank's best candidates among its chunks, merged in key order by the query owner) and the
attention merges each rank's part by log-sum-exp (`sharded_latent_attention`). The prefill and reverse passes are
context-parallel (`context_parallel`): in a round each rank runs its own chunk through the projections, the indexer and
the MoE, gathers the round's rows (`round_rows`: `kv` and index keys, which the queries see causally after the prefix),
and exchanges its queries with the other ranks for the prefix, `EXCHANGE_ROWS` gathered queries at a time. The last
layer of a prompt pass computes its records alone, sharded or not (`Pass.outputs_unread`): its MLA rows and indexer
keys, stored on their chunk's owner, without queries, selection, attention or their exchanges, which every rank of the
group skips together.

Stock semantics kept on purpose:

- **The indexer runs without autograd**, as in transformers, where `GlmMoeDsaIndexer.forward` is decorated with
  `torch.no_grad()`: the selection is a constant of the loss, the indexer's parameters (`wq_b`, `wk`, `k_norm`,
  `weights_proj`) get no gradient from GRPO, and in exact mode no gradient reaches the indexer-key records. The
  gradient reaches the `kv` records through the attention over the selected keys, as in stock.
- **Ties.** A query keeps its `index_topk` highest-scoring visible keys; among scores exactly equal to the cut-off,
  the earlier keys win. transformers' `torch.topk` leaves that order to the backend (CPU `nth_element`, CUDA radix
  select), so no chunked computation can reproduce it; both select the same keys whenever the `k`-th and `k+1`-th
  scores differ. Near-ties (within float noise) can flip between any two summation orders, which is why the tests
  spread the indexer weights as a trained model's are.
- **Mixed precision.** Under autocast the indexer's matmuls run in the autocast dtype, as stock's do (autocast lowers
  them despite their `.float()` inputs), so ties at the top-k cut-off are likelier than in fp32; they go to the
  earlier key, as above. The absorbed queries are cast as autocast casts stock's attention query, and
  the sparse attention accumulates in fp32 with autocast off (`attention.autocast_off`).
- **MoE routing** is token-wise (sigmoid router, group-limited top-k) and untouched: a token is routed the same way
  in a prefill chunk, a branch, and the padded full sequence.

Cost. Memory is bounded by the block constants below, whatever the prompt length. The work is plain torch ops in
Python loops over blocks: the selection runs `S * T * index_n_heads / INDEX_TILE` score tiles, and the attention
gathers from each record chunk that a block of `ATTN_SLOTS / index_topk` queries selects from. That is cheap for
branches; a multi-million-token prefill spends much of its time in these loops. On CUDA, `select_topk` and
`sparse_latent_attention` run the Triton kernels of `dsa_kernels` instead (a fused indexer score and running top-k,
and sparse MLA reading the record chunks in place), with this code as their reference.
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaAttention, apply_rotary_pos_emb_interleave

from .attention import autocast_inputs, autocast_off
from .engine import active_pass
from .generation import DecodePass
from .kv import KVTail
from .sharding import PromptShards, gather_tokens, merge_replicated, return_tokens

try:  # Triton kernels of the selection and the sparse attention, used on CUDA (see `dsa_kernels.enabled`)
    from . import dsa_kernels
except ImportError:  # no Triton: the PyTorch code below, which is also the kernels' reference
    dsa_kernels = None

# Query x selected-key slots gathered at once by the sparse attention. Bounds the `[Q * k, kv_lora_rank + rope]`
# gathered rows (and the `[Q, heads, k]` scores) alive during its forward and backward: 2^18 slots of 576 fp32 values
# are 0.6 GB.
ATTN_SLOTS = 1 << 18
# Selected rows copied at once between the record chunks and the gathered rows (`_Routing`), so that the copies do
# not hold a second `[ATTN_SLOTS, kv_lora_rank + rope]`.
ROUTE_ROWS = 1 << 14
# Keys per indexer block (a block may span record chunks), and query x head x key elements of one fp32 indexer score
# tile `[Q, heads, keys]` (2^26: 256 MB).
INDEX_KEY_BLOCK = 1 << 15
INDEX_TILE = 1 << 26
# Query x candidate elements whose tie ranks the top-k merge counts at once (`_keep_topk`: an int32 cumsum and its
# input's int32 copy, 2^20 elements: 4 MiB each).
TOPK_SLICE = 1 << 20
# Query rows of every rank gathered at once by the exchanges of a sharded prompt state (branch rounds and
# context-parallel rounds, `exchange_slices`): bounds the gathered indexer queries, absorbed queries `[rows, heads,
# R + Dr]`, top-k candidates and partial latents `[rows, heads, R + 1]` fp32 alive at once. GLM-5.2: about 1.8 GiB.
EXCHANGE_ROWS = 1 << 12


def _acc(x: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: fp32 for half types, else the input's own (fp64 stays fp64)."""
    return torch.promote_types(x.dtype, torch.float32)


# ------------------------------------------------------------------------------------------------------- selection
def _index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """Indexer scores `[Q, K]` of queries `q` `[Q, H, D]` with head weights `[Q, H]` against `keys` `[K, D]`.

    The operations of `GlmMoeDsaIndexer.forward`: fp32 dot products, ReLU, then a weighted sum over heads.
    """
    scores = torch.matmul(q.float(), keys.float().T)  # [Q, H, K]
    scores.mul_(scale).relu_()  # in place: one tile alive, not three
    return torch.matmul(weights[:, None, :], scores)[:, 0]


def _key_blocks(parts: list[tuple[int, torch.Tensor]], block: int):
    """Yields `(first, last, numbers [n], keys [n, D])` over `parts` (`(first key number, keys [n_i, D])`, in
    increasing key order, numbered consecutively within a part), `block` keys at a time. A block may span parts."""
    pending, spans, count = [], [], 0

    def flush():
        device = pending[0].device
        numbers = torch.cat([torch.arange(first, first + n, device=device) for first, n in spans])
        return spans[0][0], spans[-1][0] + spans[-1][1] - 1, numbers, torch.cat(pending)

    for first, part in parts:
        start = 0
        while start < part.shape[0]:
            take = min(block - count, part.shape[0] - start)
            pending.append(part[start : start + take])
            spans.append((first + start, take))
            count += take
            start += take
            if count == block:
                yield flush()
                pending, spans, count = [], [], 0
    if count:
        yield flush()


def _keep_topk(
    values: torch.Tensor,
    keys: torch.Tensor,
    k: int,
    running: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` best candidates of each row, the earlier column winning ties, in column order: of `running`
    `(values, keys)` `[Q, r]` (if any) followed by `values` `[Q, n]` with key numbers `keys` (`[Q, n]`, or `[1, n]`
    shared by the rows), as if the two were concatenated (`k < r + n`).

    One `topk` for the cut-off value, then masks, so the merge is linear in `r + n`. Nothing of the width `r + n`
    is built but one bool mask: the cut-off comes from the new candidates' own top `k`, the tie ranks (a cumsum) are
    counted `TOPK_SLICE` elements at a time, and the kept values and key numbers are gathered from the two sets.
    Per new candidate this holds its fp32 score (the caller's) and a byte of mask, not 34 bytes of copies.
    """
    q, n = values.shape
    r = 0 if running is None else running[0].shape[1]
    top = values.topk(min(k, n), dim=1, sorted=False).values
    if r:  # the k-th best of the union is among the running candidates and the new ones' top k
        top = torch.cat([running[0], top], dim=1).topk(k, dim=1, sorted=False).values
    cutoff = top.amin(dim=1, keepdim=True)  # NaN if a row has one: then nothing is kept
    del top
    # Candidates equal to the cut-off that each row keeps: the first `quota` of them, in column order. Counted a
    # slice at a time too: a bool sum goes through an int64 copy. Tie ranks in int32: no int64 copies either.
    step = max(1, TOPK_SLICE // max(q, 1))
    quota = k - sum((values[:, a : a + step] > cutoff).sum(dim=1, keepdim=True) for a in range(0, n, step))
    keep = torch.empty(q, r + n, dtype=torch.bool, device=values.device)
    if not r:
        quota = quota.to(torch.int32)
    else:
        above, tied = running[0] > cutoff, running[0] == cutoff
        quota = (quota - above.sum(dim=1, keepdim=True)).to(torch.int32)
        ranks = tied.cumsum(dim=1, dtype=torch.int32)
        keep[:, :r] = above | (tied & (ranks <= quota))
        quota = quota - torch.minimum(ranks[:, -1:], quota)
        del above, tied, ranks
    for a in range(0, n, step):
        part = values[:, a : a + step]
        tied = part == cutoff
        ranks = tied.cumsum(dim=1, dtype=torch.int32)
        torch.gt(part, cutoff, out=keep[:, r + a : r + a + step])
        keep[:, r + a : r + a + step] |= tied & (ranks <= quota)
        quota = quota - torch.minimum(ranks[:, -1:], quota)
        del tied, ranks
    cols = keep.nonzero()[:, 1].clone()  # not a view that keeps the row numbers alive too
    del keep
    if cols.numel() != k * q:
        raise ValueError("the DSA indexer produced NaN scores")
    cols = cols.view(q, k)
    new_keys = keys.expand(q, -1)
    if not r:
        return values.gather(1, cols), new_keys.gather(1, cols)
    old = cols < r
    at_old, at_new = cols.clamp(max=r - 1), (cols - r).clamp_(min=0)
    return (
        torch.where(old, running[0].gather(1, at_old), values.gather(1, at_new)),
        torch.where(old, running[1].gather(1, at_old), new_keys.gather(1, at_new)),
    )


def _pad_columns(values: torch.Tensor, keys: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pads candidates `[Q, m]` to `width` columns with `(-inf, -1)`: no key."""
    extra = width - values.shape[1]
    if extra <= 0:
        return values, keys
    values = torch.cat([values, values.new_full((values.shape[0], extra), float("-inf"))], dim=1)
    return values, torch.cat([keys, keys.new_full((keys.shape[0], extra), -1)], dim=1)


def _running_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    blocks,
    query_start: int | None,
    topk: int,
    scale: float,
    key_block: int,
    initial: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's best `topk` (score, key number) candidates over `blocks` (from `_key_blocks`), in key order.

    Args:
        q, weights: `[S, H, D]` indexer queries and `[S, H]` head weights.
        query_start: key number of the first query, which sees keys `<= query_start + i`; None when every key
            of `blocks` precedes every query.
        key_block: the size of the blocks, which sets how many queries are scored per tile.
        initial: candidates `(values, keys)` `[S, m]` in key order, every key before those of `blocks`.

    Returns:
        `(values, keys)` `[S, min(topk, m)]`, `m` the number of candidates, padded with `(-inf, -1)` where a
        query saw fewer keys than another.
    """
    s, heads = q.shape[:2]
    device = q.device
    query_pos = None if query_start is None else torch.arange(query_start, query_start + s, device=device)
    query_block = max(1, INDEX_TILE // (heads * key_block))
    starts = list(range(0, s, query_block))
    # Running (values, key numbers) `[Q, <= topk]` of each query block, in key order.
    running = []
    for qs in starts:
        qe = min(qs + query_block, s)
        if initial is None:
            empty = torch.empty(qe - qs, 0, device=device)
            running.append((empty, empty.long()))
        else:
            running.append((initial[0][qs:qe], initial[1][qs:qe]))
    for first, last, numbers, block in blocks:
        for b, qs in enumerate(starts):
            qe = min(qs + query_block, s)
            if query_start is not None and first > query_start + qe - 1:
                continue  # every key of the block is in the future of these queries
            block_values = _index_scores(q[qs:qe], weights[qs:qe], block, scale)
            if query_start is not None and last > query_start + qs:
                block_values.masked_fill_(numbers[None, :] > query_pos[qs:qe, None], float("-inf"))
            values, keys = running[b]
            if values.shape[1] + block_values.shape[1] > topk:
                # Merged without concatenating: the running set stays `[Q, topk]`, the block's scores its only copy.
                running[b] = _keep_topk(block_values, numbers[None, :], topk, running=running[b])
            else:
                keys = torch.cat([keys, numbers[None, :].expand(qe - qs, -1)], dim=1)
                running[b] = torch.cat([values, block_values], dim=1), keys
            del values, keys, block_values
    running = [_keep_topk(v, k, topk) if v.shape[1] > topk else (v, k) for v, k in running]
    width = max(v.shape[1] for v, _ in running)
    padded = [_pad_columns(v, k, width) for v, k in running]
    return torch.cat([v for v, _ in padded]), torch.cat([k for _, k in padded])


def _dense_selection(s: int, query_start: int, total: int, topk: int, device) -> torch.Tensor:
    """The selection `[S, min(topk, total)]` when no query sees more than `topk` keys: every visible key."""
    keys = torch.arange(min(topk, total), device=device)[None, :].expand(s, -1)
    return keys.masked_fill(keys > torch.arange(query_start, query_start + s, device=device)[:, None], -1)


def _selection(values: torch.Tensor, keys: torch.Tensor, width: int) -> torch.Tensor:
    """Candidates `[S, m]` -> selection `[S, width]`: the key numbers of the finite candidates, `-1` elsewhere.

    `m` may exceed `width` only by candidates of no key, which sort last."""
    keys = keys.masked_fill(values == float("-inf"), -1)
    if keys.shape[1] > width:
        keys = keys.sort(dim=1, descending=True).values[:, :width]
    return torch.cat([keys, keys.new_full((keys.shape[0], width - keys.shape[1]), -1)], dim=1)


def select_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_parts: list[torch.Tensor],
    query_start: int,
    topk: int,
    scale: float,
) -> torch.Tensor:
    """The DSA selection of each query: its `topk` highest-scoring visible keys, by a running top-k over key blocks.

    Keys are numbered across `key_parts` in order (prefix chunks, then the queries' own tokens); query `i` sits at
    key number `query_start + i` and sees keys `<= query_start + i`. Among scores equal to the cut-off the earlier
    keys win: each query's candidates stay in key order (running set, then the new block) and `_keep_topk` keeps the
    first of the tied ones.

    Args:
        q: `[S, H, D]` indexer queries after RoPE.
        weights: `[S, H]` fp32 head weights (already scaled by `H ** -0.5`).
        key_parts: indexer keys `[n_i, D]` of each part.
        query_start: key number of the first query.
        topk: `index_topk` of the config.
        scale: indexer softmax scale.

    Returns:
        `[S, min(topk, T)]` int64 key numbers, `T` the total number of keys, with `-1` in the slots of a query that
        sees fewer than `topk` keys. The order within a row is unspecified.
    """
    total = sum(part.shape[0] for part in key_parts)
    s = q.shape[0]
    if query_start + s <= topk:
        return _dense_selection(s, query_start, total, topk, q.device)
    if dsa_kernels is not None and dsa_kernels.enabled(q):
        return dsa_kernels.select_topk(q, weights, key_parts, query_start, topk, scale)
    numbered, first = [], 0
    for part in key_parts:
        numbered.append((first, part))
        first += part.shape[0]
    key_block = min(INDEX_KEY_BLOCK, total)
    blocks = _key_blocks(numbered, key_block)
    return _selection(*_running_topk(q, weights, blocks, query_start, topk, scale, key_block), min(topk, total))


def sharded_select_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    prefix_keys: list[torch.Tensor | None],
    starts: list[int],
    own_keys: torch.Tensor,
    topk: int,
    scale: float,
    shards: PromptShards,
    own_start: int = 0,
) -> torch.Tensor:
    """`select_topk` over a prefix whose chunks are spread over the ranks of `shards`: the top-k is global.

    Each rank scores the queries against the index keys of its own chunks and keeps its best `topk` candidates per
    query: in a replicated pass (every rank runs the same queries) the candidates of every rank are all-gathered; in
    a branch round every rank's queries are gathered first and the candidates go back to the query owners
    (all-to-all). The owners merge them in key order with their own tokens' keys, so ties break as unsharded (a
    query's global top-k under the order "higher score, then earlier key" is the top-k of the ranks' top-ks).
    In a context-parallel round (`shards.in_round`) the prefix is exchanged as in a branch round, and `own_keys` are
    the index keys of every rank's chunk of the round (the same on every rank), of which this rank's queries are
    rows `own_start:` and see the rows up to their own.
    Collective: every rank of the group calls it for the same layer of the same pass.

    Args:
        q, weights: `[S, H, D]` and `[S, H]` this rank's queries (`S = shards.lengths[rank]`).
        prefix_keys: index keys `[n_c, D]` of each visible prefix chunk, None for chunks held by other ranks.
        starts: the first key number of each prefix chunk, then the prefix length (`len(prefix_keys) + 1` values).
        own_keys: `[S, D]` index keys of the queries' own tokens, numbered from the prefix length; in a
            context-parallel round `[sum(shards.lengths), D]`, every rank's chunk of the round in rank order.
        own_start: in a context-parallel round, the row of `own_keys` of this rank's first query (the tokens of the
            ranks before it); else 0.

    Returns:
        `[S, min(topk, P + n)]` as `select_topk` (`P` the prefix length, `n` the most keys after the prefix that a
        query of any rank sees: `max(shards.lengths)`, or `sum(shards.lengths)` in a context-parallel round): the
        same width on every rank, padded with `-1`.
    """
    s, prefix_len = q.shape[0], starts[-1]
    reach = prefix_len + (sum(shards.lengths) if shards.in_round else max(shards.lengths))
    # One width on every rank, as `sharded_latent_attention` exchanges selections.
    width = min(topk, reach)
    if reach <= topk:  # the same on every rank, so either all communicate or none
        return _dense_selection(s, prefix_len + own_start, reach, topk, q.device)
    first = prefix_len + own_start  # key number of this rank's first query
    if not prefix_len:  # the same on every rank (the ranks hold the same prompt): nothing to exchange
        return _own_selection(q, weights, None, own_keys, prefix_len, first, topk, scale, width)
    held = [(starts[c], keys) for c, keys in enumerate(prefix_keys) if keys is not None]
    key_block = min(INDEX_KEY_BLOCK, max(1, sum(keys.shape[0] for _, keys in held)))
    if shards.same_queries:
        # Every rank runs these queries: score them against this rank's chunks, then gather every rank's candidates.
        values, keys = _running_topk(q, weights, _key_blocks(held, key_block), None, topk, scale, key_block)
        values, keys = _pad_columns(values, keys, topk)
        values, keys = (gather_tokens(x, shards) for x in (values, keys))  # [W, S, topk]
        initial = _in_key_order(values, keys, prefix_len)
        return _own_selection(q, weights, initial, own_keys, prefix_len, first, topk, scale, width)
    # Every rank's queries, a slice at a time (`exchange_slices`): the candidates of a slice are merged into its
    # selection before the next slice is exchanged.
    pieces = []
    for a, n, mine in exchange_slices(shards):
        rows = slice(a, a + mine)
        values, keys = _round_candidates(q[rows], weights[rows], held, key_block, topk, scale, shards, n)
        if mine:
            initial = _in_key_order(values, keys, prefix_len)
            args = (own_keys, prefix_len, first + a, topk, scale, width)
            pieces.append(_own_selection(q[rows], weights[rows], initial, *args))
    return torch.cat(pieces) if pieces else torch.full((0, width), -1, dtype=torch.long, device=q.device)


def _own_selection(q, weights, initial, own_keys, prefix_len: int, first: int, topk: int, scale: float, width: int):
    """The selection `[S, width]` of queries `q` `[S, H, D]` (head weights `[S, H]`, the first at key number
    `first`) from their prefix candidates `initial` (`[S, m]` in key order, or None) and the keys after the prefix,
    `own_keys` `[n, D]` numbered from `prefix_len`, causally."""
    own_block = min(INDEX_KEY_BLOCK, own_keys.shape[0])
    blocks = _key_blocks([(prefix_len, own_keys)], own_block)
    merged = _running_topk(q, weights, blocks, first, topk, scale, own_block, initial=initial)
    return _selection(*merged, width)


def exchange_slices(shards: PromptShards):
    """Yields `(first, n, mine)`: the slices in which a branch round or a context-parallel round exchanges every
    rank's queries, rows `[first, first + n)` of every rank's (padded) tokens, at most `EXCHANGE_ROWS` gathered rows
    at a time; `mine` of them are this rank's. The same slices on every rank (collective)."""
    tmax, mine = max(shards.lengths), shards.lengths[shards.rank]
    step = max(1, EXCHANGE_ROWS // shards.world)
    for a in range(0, tmax, step):
        n = min(step, tmax - a)
        yield a, n, max(0, min(n, mine - a))


def _round_candidates(q, weights, held, key_block: int, topk: int, scale: float, shards: PromptShards, n: int):
    """In a branch round or a context-parallel round: every rank's queries `q` `[S, H, D]` (head weights `[S, H]`;
    a slice of at most `n` rows of each rank's, `exchange_slices`) are gathered, scored against this rank's chunks
    `held` (`(first key number, keys)`), and each rank's best `topk` go back to the query owners.
    Returns `(values, keys)` `[W, S, topk]`, rank by rank, `(-inf, -1)` for none."""
    world, s = shards.world, q.shape[0]
    everyone = gather_tokens(q, shards, n).flatten(0, 1)  # [W * n, H, D]
    everyone_weights = gather_tokens(weights, shards, n).flatten(0, 1)
    blocks = _key_blocks(held, key_block)
    values, keys = _running_topk(everyone, everyone_weights, blocks, None, topk, scale, key_block)
    values, keys = _pad_columns(values, keys, topk)
    values = return_tokens(values.view(world, n, topk), shards, s)  # [W, S, topk]
    keys = return_tokens(keys.view(world, n, topk), shards, s)
    return values, keys


def _in_key_order(values: torch.Tensor, keys: torch.Tensor, prefix_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`[W, S, topk]` candidates of each rank -> `[S, W * topk]`, in key order (no key last)."""
    world, s, topk = values.shape
    values = values.transpose(0, 1).reshape(s, world * topk)
    keys = keys.transpose(0, 1).reshape(s, world * topk)
    order = torch.where(keys < 0, prefix_len, keys).argsort(dim=1, stable=True)
    return values.gather(1, order), keys.gather(1, order)


def sharded_decode_select_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    prompt_keys: list[torch.Tensor | None],
    starts: list[int],
    row_keys: torch.Tensor,
    topk: int,
    scale: float,
    shards: PromptShards,
) -> torch.Tensor:
    """`decode_select_topk` against a prompt whose chunks are spread over the ranks of `shards`, in a branch round
    (`shards.lengths[r]` rows on rank `r`): the top-k over the prompt is global (`sharded_select_topk`'s exchange),
    then merged with each row's tail. Collective, for the same layer and step on every rank.

    Args:
        prompt_keys: index keys `[n_c, D]` of each prompt chunk, None for chunks held by other ranks.
        starts: the first key number of each prompt chunk, then the prompt length.
        row_keys: `[G, t, D]` each row's keys after the prompt, its current token's last (`t` the same on every rank).

    Returns:
        `[G, min(topk, P + t)]`, numbered as in `decode_select_topk`.
    """
    prefix_len, t = starts[-1], row_keys.shape[1]
    total = prefix_len + t
    if total <= topk:  # the same on every rank, so either all communicate or none
        return torch.arange(total, device=q.device)[None, :].expand(q.shape[0], -1)
    held = [(starts[c], keys) for c, keys in enumerate(prompt_keys) if keys is not None]
    key_block = min(INDEX_KEY_BLOCK, max(1, sum(keys.shape[0] for _, keys in held)))
    candidates = _round_candidates(q, weights, held, key_block, topk, scale, shards, max(shards.lengths))
    values, keys = _in_key_order(*candidates, prefix_len)
    scores = torch.relu(torch.matmul(q.float(), row_keys.float().transpose(1, 2)) * scale)  # [G, H, t]
    values = torch.cat([values, torch.matmul(weights[:, None, :], scores)[:, 0]], dim=1)
    keys = torch.cat([keys, torch.arange(prefix_len, total, device=q.device)[None, :].expand(q.shape[0], -1)], dim=1)
    return _selection(*_keep_topk(values, keys, topk), min(topk, total))


def reference_select(index_scores: torch.Tensor, query_start: int, topk: int) -> torch.Tensor:
    """Plain reference for `select_topk`: mask the full `[S, T]` score matrix causally and sort it once, stably."""
    s, t = index_scores.shape
    visible = torch.arange(t)[None, :] <= torch.arange(query_start, query_start + s)[:, None]
    values = index_scores.masked_fill(~visible, float("-inf"))
    values, order = values.sort(dim=1, descending=True, stable=True)
    width = min(topk, t)
    return order[:, :width].masked_fill(values[:, :width] == float("-inf"), -1)


# ------------------------------------------------------------------------------------------------- sparse attention
class _Routing:
    """Where the selected keys `idx` `[M]` (key numbers, `-1` for none) live among parts of sizes `sizes`.

    `pieces` lists, for each part that is read, `(part, slots, rows)`: the slots of `idx` that read it and the rows
    they read, found with one sort instead of one mask per part.
    """

    def __init__(self, idx: torch.Tensor, sizes: list[int]):
        starts = [0]
        for n in sizes:
            starts.append(starts[-1] + n)
        self.numel = idx.shape[0]
        sorted_idx, order = torch.where(idx >= 0, idx, starts[-1]).sort()
        bounds = torch.searchsorted(sorted_idx, torch.tensor(starts, device=idx.device)).tolist()
        self.pieces = [
            (p, order[bounds[p] : bounds[p + 1]], sorted_idx[bounds[p] : bounds[p + 1]] - starts[p])
            for p in range(len(sizes))
            if bounds[p + 1] > bounds[p]
        ]

    def gather(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """`[M, D]` rows of `parts` (`[n_i, D]` each) in slot order, zeros for empty slots. Copied `ROUTE_ROWS` rows
        at a time, so that no second `[M, D]` exists."""
        out = torch.zeros(self.numel, parts[0].shape[1], dtype=dtype, device=parts[0].device)
        for p, slots, rows in self.pieces:
            for a in range(0, slots.shape[0], ROUTE_ROWS):
                out[slots[a : a + ROUTE_ROWS]] = parts[p][rows[a : a + ROUTE_ROWS]].to(dtype)
        return out

    def scatter_add(self, grads: list[torch.Tensor | None], src: torch.Tensor, parts: list[torch.Tensor], need):
        """Adds the rows of `src` `[M, D]` into `grads[p]` (created on first use) for each part `p` in `need`."""
        for p, slots, rows in self.pieces:
            if need[p]:
                if grads[p] is None:
                    grads[p] = torch.zeros(parts[p].shape, dtype=src.dtype, device=src.device)
                # `ROUTE_ROWS` rows at a time, in slot order: the same additions in the same order.
                for a in range(0, slots.shape[0], ROUTE_ROWS):
                    grads[p].index_add_(0, rows[a : a + ROUTE_ROWS], src[slots[a : a + ROUTE_ROWS]])


def _latent_scores(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, scale: float) -> torch.Tensor:
    """Scores `[Q, H, k]` of queries `[Q, H, R + Dr]` against their gathered `kv` rows `[Q, k, R + Dr]`."""
    return (torch.einsum("qhd,qkd->qhk", q, kv) * scale).masked_fill((idx < 0)[:, None, :], float("-inf"))


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """`lse` with the `-inf` of queries that selected no key replaced by 0, so that `exp(scores - lse)` is 0 there."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


class _SparseLatentAttention(torch.autograd.Function):
    @staticmethod
    @autocast_off
    def forward(ctx, scale: float, rank: int, sel, q, *parts):
        sizes = [x.shape[0] for x in parts]
        acc = _acc(q)
        s, h, _ = q.shape
        k = sel.shape[1]
        out = torch.empty(s, h, rank, dtype=acc, device=q.device)
        lse = torch.empty(s, h, dtype=acc, device=q.device)
        block = max(1, ATTN_SLOTS // k)
        for qs in range(0, s, block):
            qe = min(qs + block, s)
            idx = sel[qs:qe]
            kv = _Routing(idx.reshape(-1), sizes).gather(parts, acc).view(qe - qs, k, -1)
            scores = _latent_scores(q[qs:qe].to(acc), kv, idx, scale)
            lse[qs:qe] = torch.logsumexp(scores, dim=-1)
            p = torch.exp(scores - _finite(lse[qs:qe])[:, :, None])
            out[qs:qe] = torch.einsum("qhk,qkr->qhr", p, kv[..., :rank])
            del kv, scores, p  # before the next block's are built
        ctx.scale, ctx.rank = scale, rank
        ctx.save_for_backward(sel, q, out, lse, *parts)
        return out.to(q.dtype), lse

    @staticmethod
    @autocast_off
    def backward(ctx, grad_out, grad_lse):
        sel, q, out, lse, *parts = ctx.saved_tensors
        scale, rank = ctx.scale, ctx.rank
        need = ctx.needs_input_grad[4:]
        sizes = [x.shape[0] for x in parts]
        acc = out.dtype
        s, k = sel.shape
        dout = grad_out.to(acc)
        # d lse / d scores = p, so the gradient of the log-sum-exp joins that of the output's normalisation.
        delta = (dout * out).sum(-1) - (0 if grad_lse is None else grad_lse.to(acc))  # [S, H]
        lse = _finite(lse)
        dq = torch.empty(q.shape, dtype=acc, device=q.device)
        dparts: list[torch.Tensor | None] = [None] * len(parts)
        block = max(1, ATTN_SLOTS // k)
        for qs in range(0, s, block):
            qe = min(qs + block, s)
            idx = sel[qs:qe]
            route = _Routing(idx.reshape(-1), sizes)
            kv = route.gather(parts, acc).view(qe - qs, k, -1)
            qb, do = q[qs:qe].to(acc), dout[qs:qe]
            p = torch.exp(_latent_scores(qb, kv, idx, scale) - lse[qs:qe, :, None])
            ds = p * (torch.einsum("qhr,qkr->qhk", do, kv[..., :rank]) - delta[qs:qe, :, None]) * scale
            dq[qs:qe] = torch.einsum("qhk,qkd->qhd", ds, kv)
            if any(need):
                dkv = torch.einsum("qhk,qhd->qkd", ds, qb)
                dkv[..., :rank] += torch.einsum("qhk,qhr->qkr", p, do)
                route.scatter_add(dparts, dkv.reshape(-1, dkv.shape[-1]), parts, need)
                del dkv
            del kv, p, ds, route  # before the next block's are built
        grads = [None if g is None else g.to(x.dtype) for g, x in zip(dparts, parts, strict=True)]
        return None, None, None, dq.to(q.dtype), *grads


def sparse_latent_attention(
    q: torch.Tensor, kv_parts: list[torch.Tensor], sel: torch.Tensor, scale: float, rank: int
) -> torch.Tensor:
    """Absorbed MLA of each query over its selected keys.

    Args:
        q: `[S, H, R + Dr]` per head the nope query folded through `W_uk` into latent space, then the rope query.
        kv_parts: `[n_i, R + Dr]` latent and rope key rows of each part (prefix chunks, then own tokens).
        sel: `[S, k]` selected key numbers across the parts, `-1` for none. A row with no key gets a zero output (and
            a log-sum-exp of `-inf`, which `sharded_latent_attention` uses to merge parts).
        scale: softmax scale.
        rank: `R`, the latent width (the values are the first `R` columns of the rows).

    Returns:
        `[S, H, R]` softmax-weighted latents (to be unfolded through `W_uv`), in the dtype of `q`.
    """
    kernel = dsa_kernels is not None and dsa_kernels.enabled(q)
    return (dsa_kernels.SparseLatentAttention if kernel else _SparseLatentAttention).apply(
        scale, rank, sel, q, *kv_parts
    )[0]


def _localize(sel: torch.Tensor, starts: list[int], held: list[bool]) -> torch.Tensor:
    """Maps global prefix key numbers `sel` `[M, k]` to rows of the concatenated chunks this rank holds (`held[c]`
    for chunk `c`, which starts at key `starts[c]`); `-1` for keys held elsewhere, own tokens and empty slots."""
    first = torch.tensor(starts[:-1], device=sel.device)
    offsets, offset = [], 0
    for c, mine in enumerate(held):
        offsets.append(offset if mine else -1)
        offset += (starts[c + 1] - starts[c]) if mine else 0
    offsets = torch.tensor(offsets, device=sel.device)
    inside = (sel >= 0) & (sel < starts[-1])
    key = sel.clamp(0, starts[-1] - 1)
    chunk = torch.searchsorted(first, key, right=True) - 1
    row = offsets[chunk] + key - first[chunk]
    return torch.where(inside & (offsets[chunk] >= 0), row, -1)


def round_rows(x: torch.Tensor, shards: PromptShards) -> torch.Tensor:
    """In a context-parallel round, the rows `x` `[S, ...]` of every rank's chunk in rank (so token) order:
    `[sum(shards.lengths), ...]`. Collective; differentiable: each rank's rows get the sum of every rank's gradient of
    them (`sharding.gather_tokens`)."""
    everyone = gather_tokens(x, shards)  # [W, Tmax, ...]
    return torch.cat([everyone[r, :n] for r, n in enumerate(shards.lengths)])


def sharded_latent_attention(
    q: torch.Tensor,
    prefix_kv: list[torch.Tensor | None],
    starts: list[int],
    own_kv: torch.Tensor,
    sel: torch.Tensor,
    scale: float,
    rank: int,
    shards: PromptShards,
) -> torch.Tensor:
    """`sparse_latent_attention` over a prefix whose chunks are spread over the ranks of `shards`.

    Each rank attends the queries to the keys they selected among its own chunks. In a replicated pass (every rank
    runs the same queries) the parts merge by all-reduce (`sharding.merge_replicated`); in a branch round every
    rank's queries are gathered and the partial latents and log-sum-exps go back to the query owners (all-to-all).
    Either way they then merge with the part over the queries' own tokens (in a context-parallel round: the rows of
    every rank's chunk of the round, `round_rows`). The collectives are differentiable, so
    the backward is the same exchange in reverse and each chunk's gradient stays with the rank that holds it.
    Collective: every rank of the group calls it for the same layer of the same pass.

    Args:
        q: `[S, H, R + Dr]` absorbed queries of this rank (`S = shards.lengths[rank]`).
        prefix_kv: `[n_c, R + Dr]` rows of each visible prefix chunk, None for chunks held by other ranks.
        starts: the first key number of each prefix chunk, then the prefix length.
        own_kv: `[S, R + Dr]` rows of the queries' own tokens, numbered from the prefix length (in a context-parallel
            round, `[sum(shards.lengths), R + Dr]`: the round's rows).
        sel: `[S, k]` global selection (`sharded_select_topk`), `k` the same on every rank.

    Returns:
        `[S, H, R]` in the dtype of `q`.
    """
    prefix_len = starts[-1]
    own = torch.where(sel >= prefix_len, sel - prefix_len, -1)
    out, lse = _SparseLatentAttention.apply(scale, rank, own, q, own_kv)
    if prefix_len == 0:  # the same on every rank: the ranks hold the same prompt
        return out
    is_held = [kv is not None for kv in prefix_kv]
    held = [kv for kv in prefix_kv if kv is not None] or [own_kv.new_zeros(0, own_kv.shape[1])]
    if shards.same_queries:
        # Every rank runs these queries: attend them to this rank's chunks and merge the parts by all-reduce.
        mine = _localize(sel, starts, is_held)
        part, part_lse = _SparseLatentAttention.apply(scale, rank, mine, q, *held)
        part, part_lse = merge_replicated(part.to(lse.dtype), part_lse, shards)
        return _merge_two(out, lse, part, part_lse).to(q.dtype)
    # Every rank's queries, a slice at a time (`exchange_slices`), each slice merged with its own part before the next.
    # With autograd, each slice is a checkpoint: its backward gathers the slice again rather than keeping what the
    # forward gathered (every rank runs the same slices, so the recomputed collectives meet).
    grad = torch.is_grad_enabled() and (q.requires_grad or out.requires_grad or any(x.requires_grad for x in held))
    pieces = []
    for a, n, mine in exchange_slices(shards):
        rows = slice(a, a + mine)
        args = (q[rows], sel[rows], out[rows], lse[rows], *held)
        step = functools.partial(_exchange_slice, n, starts, is_held, scale, rank, shards)
        # Kept even when empty (no row of this rank): its backward still meets the other ranks' collectives.
        pieces.append(checkpoint(step, *args, use_reentrant=False) if grad else step(*args))
    return torch.cat(pieces).to(q.dtype)


def _exchange_slice(n: int, starts, is_held, scale: float, rank: int, shards: PromptShards, q, sel, out, lse, *held):
    """One slice of `sharded_latent_attention`'s exchange in a round: every rank's queries `q` `[s, H, R + Dr]` (at
    most `n` rows per rank) and selections `sel` `[s, k]` are gathered, attended to this rank's chunks `held`, and
    the partial latents and log-sum-exps go back to the query owners, where they merge with the own part `(out [s,
    H, R], lse [s, H])`. Returns `[s, H, R]` in the accumulation dtype. Collective."""
    world, k, s = shards.world, sel.shape[1], q.shape[0]
    everyone = gather_tokens(q, shards, n).flatten(0, 1)  # [W * n, H, R + Dr]
    with torch.no_grad():
        mine = _localize(gather_tokens(sel, shards, n).view(world * n, k), starts, is_held)
    part, part_lse = _SparseLatentAttention.apply(scale, rank, mine, everyone, *held)
    packed = torch.cat([part.to(lse.dtype), part_lse[..., None]], dim=-1).view(world, n, *part_lse.shape[1:], -1)
    received = return_tokens(packed, shards, s)  # [W, s, H, R + 1]
    lses = torch.cat([lse[None], received[..., rank]])  # [W + 1, s, H]
    total = torch.logsumexp(lses, dim=0)  # finite: every query selects at least one key
    weights = torch.exp(lses - total)[..., None]
    return (weights * torch.cat([out[None].to(lse.dtype), received[..., :rank]])).sum(0)


def _merge_two(out_a, lse_a, out_b, lse_b) -> torch.Tensor:
    """Attention `[S, H, R]` over the union of two key sets, from each one's output and log-sum-exp `[S, H]`."""
    lse = torch.logaddexp(lse_a, lse_b)  # finite: every query selects at least one key
    return out_a.to(lse.dtype) * torch.exp(lse_a - lse)[..., None] + out_b * torch.exp(lse_b - lse)[..., None]


def reference_latent_attention(
    q: torch.Tensor, kv_parts: list[torch.Tensor], sel: torch.Tensor, scale: float, rank: int
) -> torch.Tensor:
    """Plain reference for `sparse_latent_attention`: full `[S, H, T]` scores, masked to the selected keys."""
    kv = torch.cat(kv_parts)
    acc = _acc(q)
    scores = (q.to(acc) @ kv.to(acc).T) * scale  # [S, H, T]
    chosen = torch.zeros(sel.shape[0], kv.shape[0] + 1, dtype=torch.bool, device=sel.device)
    chosen.scatter_(1, torch.where(sel >= 0, sel, kv.shape[0]), True)
    scores = scores.masked_fill(~chosen[:, None, :-1], float("-inf"))
    return (scores.softmax(-1) @ kv[:, :rank].to(acc)).to(q.dtype)


# ------------------------------------------------------------------------------------------------ patched attention
def _dense_weight(linear: nn.Module, like: torch.Tensor) -> torch.Tensor:
    """`[out, in]` matrix of a bias-free linear map: the weight of an `nn.Linear`, else (e.g. a PEFT LoRA layer, whose
    delta is folded in, or a quantized layer) the map applied to the identity, in the dtype and device of `like`.

    Raises:
        ValueError: for a wrapped layer with active dropout, whose per-token masks the folded matrix cannot apply.
    """
    if type(linear) is nn.Linear:
        return linear.weight
    if linear.training and any(isinstance(m, nn.Dropout) and m.p > 0 for m in linear.modules()):
        raise ValueError(
            "kv_b_proj carries dropout (e.g. LoRA lora_dropout > 0), which absorbed MLA cannot apply per token: set "
            "lora_dropout=0.0 or leave kv_b_proj out of target_modules."
        )
    return linear(torch.eye(linear.in_features, dtype=like.dtype, device=like.device)).T


def _indexer_rows(
    module: nn.Module, hidden: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
):
    """Queries `[B, S, H, D]`, fp32 head weights `[B, S, H]` and keys `[B, S, D]` of `GlmMoeDsaIndexer`, as its
    forward computes them. Call without autograd, as transformers does."""
    b, s = hidden.shape[:2]
    q = module.wq_b(q_resid).view(b, s, module.n_heads, module.head_dim)
    rope, rest = module.qk_rope_head_dim, module.head_dim - module.qk_rope_head_dim
    q_rot, q_pass = torch.split(q, [rope, rest], dim=-1)
    q = torch.cat([_rotated(q_rot, cos, sin, unsqueeze_dim=2), q_pass], dim=-1)
    weights = module.weights_proj(hidden.to(module.weights_proj.weight.dtype)).float() * (module.n_heads**-0.5)
    return q, weights, _index_keys(module, hidden, cos, sin)


def _index_keys(module: nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Keys `[B, S, D]` of `GlmMoeDsaIndexer`, as its forward computes them. Call without autograd."""
    rope, rest = module.qk_rope_head_dim, module.head_dim - module.qk_rope_head_dim
    k = module.k_norm(module.wk(hidden)).unsqueeze(2)  # [B, S, 1, D]
    k_rot, k_pass = torch.split(k, [rope, rest], dim=-1)
    return torch.cat([_rotated(k_rot, cos, sin, unsqueeze_dim=2), k_pass], dim=-1)[:, :, 0]


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1) -> torch.Tensor:
    """`x` rotated as `apply_rotary_pos_emb_interleave` rotates its query or key (each on its own, elementwise, so
    either alone gives the same bits)."""
    return apply_rotary_pos_emb_interleave(x, x, cos, sin, unsqueeze_dim=unsqueeze_dim)[1]


def _indexer(module: nn.Module, hidden: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """`_indexer_rows` of a batch of one: queries `[S, H, D]`, head weights `[S, H]`, keys `[S, D]`."""
    return tuple(x[0] for x in _indexer_rows(module, hidden, q_resid, cos, sin))


def decode_select_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    prompt_keys: list[torch.Tensor],
    row_keys: torch.Tensor,
    topk: int,
    scale: float,
) -> torch.Tensor:
    """The DSA selection of one decoding step of G rows that share a prompt: each row's `topk` best keys among the
    prompt's and its own tail's (the step's token last), ties to the earlier key as in `select_topk`.

    Args:
        q, weights: `[G, H, D]` indexer queries after RoPE and `[G, H]` fp32 head weights, one query per row.
        prompt_keys: the prompt's indexer keys `[n_i, D]` per chunk, shared by the rows (`P` keys in all).
        row_keys: `[G, t, D]` each row's keys after the prompt, its current token's last.
        topk: `index_topk` of the config; scale: indexer softmax scale.

    Returns:
        `[G, min(topk, P + t)]` key numbers, the prompt's `[0, P)` then row `g`'s tail from `P`, `-1` for none. On
        CUDA, the Triton selection of `dsa_kernels` (one launch per row), with this code as its reference.
    """
    prefix_len = sum(part.shape[0] for part in prompt_keys)
    g, t = row_keys.shape[:2]
    total = prefix_len + t
    if total <= topk:
        return torch.arange(total, device=q.device)[None, :].expand(g, -1)
    if dsa_kernels is not None and dsa_kernels.enabled(q):
        # The kernels' selection row by row: the prompt's chunks and the row's tail are its key parts, its token last.
        return torch.cat(
            [
                dsa_kernels.select_topk(
                    q[r : r + 1], weights[r : r + 1], [*prompt_keys, row_keys[r]], total - 1, topk, scale
                )
                for r in range(g)
            ]
        )
    numbers = torch.arange(prefix_len, total, device=q.device)[None, :].expand(g, -1)
    # The tail's scores, per row, by the operations of `_index_scores` (stock's at decode).
    scores = torch.relu(torch.matmul(q.float(), row_keys.float().transpose(1, 2)) * scale)  # [G, H, t]
    tail = torch.matmul(weights[:, None, :], scores)[:, 0]
    if prefix_len:
        key_block = min(INDEX_KEY_BLOCK, prefix_len)
        numbered, first = [], 0
        for part in prompt_keys:
            numbered.append((first, part))
            first += part.shape[0]
        values, keys = _running_topk(q, weights, _key_blocks(numbered, key_block), None, topk, scale, key_block)
        values, keys = torch.cat([values, tail], dim=1), torch.cat([keys, numbers], dim=1)
    else:
        values, keys = tail, numbers
    if values.shape[1] > topk:
        values, keys = _keep_topk(values, keys, topk)
    return _selection(values, keys, min(topk, total))


def longstraw_attention_forward(
    self: GlmMoeDsaAttention,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None = None,
    past_key_values=None,
    position_ids: torch.Tensor | None = None,
    prev_topk_indices: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None, torch.Tensor]:
    """`GlmMoeDsaAttention.forward` over the engine's active pass, for `hidden_states` `[1, S, hidden]`.

    The mask built by the model is not read: the engine never pads, so visibility is the causal order over
    `[records | own tokens]`. Returns the output `[1, S, hidden]`, no attention weights, and the selection `[S, k]`
    that a following `"shared"` layer reuses, as stock passes its top-k indices on.
    """
    p = active_pass()
    if isinstance(p, DecodePass):
        return _decode_attention_forward(self, p, hidden_states, position_embeddings, prev_topk_indices)
    if hidden_states.shape[0] != 1:
        raise ValueError(f"trl_longstraw runs one sequence per forward, got a batch of {hidden_states.shape[0]}")
    s = hidden_states.shape[1]
    heads, nope = self.num_heads, self.qk_nope_head_dim
    cos, sin = position_embeddings
    kv_pass, k_rot = torch.split(
        self.kv_a_proj_with_mqa(hidden_states), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
    )
    if p.outputs_unread(self.layer_idx):
        # The last layer of a prompt pass: nothing reads its output, so it emits its records (MLA rows, index keys)
        # without queries (a key's rotation does not read the query's), selection or attention.
        k_rot = k_rot.view(1, 1, s, -1)
        (kv,) = autocast_inputs(torch.cat([self.kv_a_layernorm(kv_pass)[0], _rotated(k_rot, cos, sin)[0, 0]], dim=-1))
        if self.indexer is None:
            p.emit(self.layer_idx, (kv,), sharded=True)
        else:
            with torch.no_grad():
                (index_key,) = autocast_inputs(_index_keys(self.indexer, hidden_states, cos, sin)[0])
            p.emit(self.layer_idx, (kv, index_key), sharded=True)
        return hidden_states.new_zeros(()), None, None
    q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
    q = self.q_b_proj(q_resid).view(1, s, heads, self.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q, [nope, self.qk_rope_head_dim], dim=-1)
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot.view(1, 1, s, -1), cos, sin)
    # [S, R + Dr]. Under autocast the normed latent and the rope key come out in fp32, and stock rounds both to the
    # autocast dtype before any use (autocast casts kv_b_proj's input; the rope key is copied into the key buffer of
    # kv_b_proj's output dtype), so the record holds that dtype and loses nothing stock keeps.
    (kv,) = autocast_inputs(torch.cat([self.kv_a_layernorm(kv_pass)[0], k_rot[0, 0]], dim=-1))

    records = p.read(self.layer_idx)
    # Key numbers of the prefix chunks; with a sharded state, `records` holds None for chunks of other ranks.
    starts = p.chunk_starts()
    # A context-parallel round (`context_parallel`): the queries see every rank's chunk of the round up to their own
    # tokens, so each rank gathers the round's rows (`kv` and the index keys: `R + Dr + D` values per token) and
    # numbers them after the prefix; this rank's tokens start at row `own_start`.
    in_round = p.shard is not None and p.shard.in_round
    own_start = sum(p.shard.lengths[: p.shard.rank]) if in_round else 0
    own_kv = round_rows(kv, p.shard) if in_round else kv
    if self.indexer is not None:
        with torch.no_grad():
            index_q, index_weights, index_key = _indexer(self.indexer, hidden_states, q_resid, cos, sin)
            # Stock's only use of the key is a matmul, which autocast casts to its dtype: store it so.
            (index_key,) = autocast_inputs(index_key)
            index_args = (self.indexer.index_topk, self.indexer.softmax_scale)
            if p.shard is None:
                index_keys = [record[1] for record in records] + [index_key]
                sel = select_topk(index_q, index_weights, index_keys, starts[-1], *index_args)
            else:
                index_keys = [None if record is None else record[1] for record in records]
                own_keys = round_rows(index_key, p.shard) if in_round else index_key
                sel = sharded_select_topk(
                    index_q, index_weights, index_keys, starts, own_keys, *index_args, p.shard, own_start=own_start
                )
        p.emit(self.layer_idx, (kv, index_key), sharded=True)
    else:
        if prev_topk_indices is None:
            raise ValueError("Shared DSA layers require top-k indices from a previous full indexer layer.")
        sel = prev_topk_indices
        p.emit(self.layer_idx, (kv,), sharded=True)

    w_kv = _dense_weight(self.kv_b_proj, like=q_pass).view(heads, nope + self.v_head_dim, self.kv_lora_rank)
    q_lat = torch.einsum("hsd,hdr->shr", q_pass[0], w_kv[:, :nope])
    # [S, H, R + Dr], cast as autocast casts stock's attention query.
    (q_abs,) = autocast_inputs(torch.cat([q_lat, q_rot[0].transpose(0, 1)], dim=-1))
    if p.shard is None:
        kv_parts = [record[0] for record in records] + [kv]
        o_lat = sparse_latent_attention(q_abs, kv_parts, sel, self.scaling, self.kv_lora_rank)
    else:
        prefix_kv = [None if record is None else record[0] for record in records]
        args = (self.scaling, self.kv_lora_rank, p.shard)
        o_lat = sharded_latent_attention(q_abs, prefix_kv, starts, own_kv, sel, *args)
    out = torch.einsum("shr,hvr->shv", o_lat, w_kv[:, nope:]).reshape(1, s, heads * self.v_head_dim)
    return self.o_proj(out), None, sel


def _decode_attention_forward(
    self: GlmMoeDsaAttention,
    p: DecodePass,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    prev_topk_indices: torch.Tensor | None,
) -> tuple[torch.Tensor, None, torch.Tensor]:
    """One decoding step of G rows that share a prompt state: `hidden_states` `[G, 1, hidden]` -> `[G, 1, hidden]`.

    Each row's token is appended to the row's tail (`(kv [G, t, R + Dr], index_key [G, t, D])` in the decode tail),
    then selects its top-k among the prompt's index keys (batch 1, read, never written) and its tail's
    (`decode_select_topk`), and attends in latent space (absorbed MLA) to the selected rows of the prompt's records
    and of its own tail. Returns the selection in that numbering (prompt, then the row's tail) for `"shared"` layers.
    """
    g = hidden_states.shape[0]
    heads, nope = self.num_heads, self.qk_nope_head_dim
    q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
    q = self.q_b_proj(q_resid).view(g, 1, heads, self.qk_head_dim).transpose(1, 2)  # [G, H, 1, Dq]
    q_pass, q_rot = torch.split(q, [nope, self.qk_rope_head_dim], dim=-1)
    kv_pass, k_rot = torch.split(
        self.kv_a_proj_with_mqa(hidden_states), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
    )
    cos, sin = position_embeddings
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot.view(g, 1, 1, -1), cos, sin)
    (kv,) = autocast_inputs(torch.cat([self.kv_a_layernorm(kv_pass)[:, 0], k_rot[:, 0, 0]], dim=-1))  # [G, R + Dr]
    prompt = p.prompt_records(self.layer_idx)
    if self.indexer is not None:
        with torch.no_grad():
            index_q, index_weights, index_key = _indexer_rows(self.indexer, hidden_states, q_resid, cos, sin)
            (index_key,) = autocast_inputs(index_key)
        p.emit(self.layer_idx, (kv[:, None], index_key))
    else:
        if prev_topk_indices is None:
            raise ValueError("Shared DSA layers require top-k indices from a previous full indexer layer.")
        p.emit(self.layer_idx, (kv[:, None],))
    ((tail_kv, *tail_index),) = p.tail.records(self.layer_idx)  # [G, t, ...], this step's token last
    # Key numbers of the prompt's chunks; with a sharded state, `prompt` holds None for chunks of other ranks.
    starts = p.chunk_starts()
    if self.indexer is not None:
        with torch.no_grad():
            args = (self.indexer.index_topk, self.indexer.softmax_scale)
            prompt_keys = [None if record is None else record[1] for record in prompt]
            if p.shard is None:
                sel = decode_select_topk(index_q[:, 0], index_weights[:, 0], prompt_keys, tail_index[0], *args)
            else:
                queries = (index_q[:, 0], index_weights[:, 0])
                sel = sharded_decode_select_topk(*queries, prompt_keys, starts, tail_index[0], *args, p.shard)
    else:
        sel = prev_topk_indices
    # The rows' tails as one part after the prompt's chunks: row r's key P + j is row r * t + j of that part.
    prefix_len, t = starts[-1], tail_kv.shape[1]
    rows = torch.arange(g, device=sel.device)[:, None]
    flat = torch.where(sel >= prefix_len, sel + rows * t, sel)
    w_kv = _dense_weight(self.kv_b_proj, like=q_pass).view(heads, nope + self.v_head_dim, self.kv_lora_rank)
    q_lat = torch.einsum("ghd,hdr->ghr", q_pass[:, :, 0], w_kv[:, :nope])
    (q_abs,) = autocast_inputs(torch.cat([q_lat, q_rot[:, :, 0]], dim=-1))  # [G, H, R + Dr]
    tails = tail_kv.reshape(g * t, -1)
    if p.shard is None:
        kv_parts = [record[0] for record in prompt] + [tails]
        o_lat = sparse_latent_attention(q_abs, kv_parts, flat, self.scaling, self.kv_lora_rank)
    else:
        # The tails play the queries' own tokens: the prompt parts merge across the ranks, the tails stay here.
        prefix_kv = [None if record is None else record[0] for record in prompt]
        args = (self.scaling, self.kv_lora_rank, p.shard)
        o_lat = sharded_latent_attention(q_abs, prefix_kv, starts, tails, flat, *args)
    out = torch.einsum("ghr,hvr->ghv", o_lat, w_kv[:, nope:]).reshape(g, 1, heads * self.v_head_dim)
    return self.o_proj(out), None, sel


class GlmMoeDsaAdapter:
    """Routes the `GlmMoeDsaAttention` layers of a `glm_moe_dsa` causal LM through the engine's active pass.

    Records per layer and chunk: `(kv [n, kv_lora_rank + qk_rope_head_dim], index_key [n, index_head_dim])`, without
    `index_key` on `"shared"` indexer layers.
    """

    # Every record is per token: MLA rows and index keys shard by chunk, and the DSA top-k is taken across the shards
    # (`sharded_select_topk`, `sharded_latent_attention`).
    shards_prompt_state = True
    # Decoding against a sharded state too: `sharded_decode_select_topk`, then `sharded_latent_attention` with the
    # rows' tails as their own tokens.
    decodes_sharded = True

    @staticmethod
    def context_parallel(world: int) -> bool:
        """Whether the prompt passes of a state sharded over `world` ranks can split their tokens (see
        `context_parallel`): always. In a round each rank runs its chunk through the projections, the indexer and the
        MoE; the round's MLA rows and index keys are gathered (`round_rows`), and the prefix is exchanged as in a
        branch round, so the DSA top-k stays global."""
        return True

    def __init__(self, causal_lm: PreTrainedModel):
        config = causal_lm.config.get_text_config()
        if config.attention_dropout:
            raise ValueError(
                f"attention_dropout={config.attention_dropout} is not supported by trl_longstraw (its random masks "
                "cannot be reproduced by sparse attention over records): set attention_dropout=0.0."
            )
        self.causal_lm = causal_lm
        self.attentions = [m for m in causal_lm.modules() if isinstance(m, GlmMoeDsaAttention)]

    @contextlib.contextmanager
    def activate(self):
        """Patches each attention module's `forward` for the duration of the block, then restores it."""
        previous = [m.__dict__.get("forward") for m in self.attentions]
        for m in self.attentions:
            m.forward = types.MethodType(longstraw_attention_forward, m)
        try:
            yield
        finally:
            for m, forward in zip(self.attentions, previous, strict=True):
                if forward is None:
                    del m.forward
                else:
                    m.forward = forward

    @staticmethod
    def decode_tail(capacity: int) -> KVTail:
        """Storage of the decoded rows (see `generation.DecodePass`): per layer `(kv [G, capacity, R + Dr],
        index_key [G, capacity, D])`, without `index_key` on `"shared"` layers."""
        return KVTail(capacity, time_dim=1)

    @staticmethod
    def state_bytes(config, dtype_bytes: int = 2) -> tuple[int, int]:
        """`(bytes per prompt token, fixed bytes)`: per layer the latent and the rope key, plus the indexer key on
        layers that run their own indexer. GLM-5.2: 78 x (512 + 64 + 128) x 2 B = 107.25 KiB per token in bf16."""
        full = sum(kind == "full" for kind in config.indexer_types)
        per_layer = config.kv_lora_rank + config.qk_rope_head_dim
        return (config.num_hidden_layers * per_layer + full * config.index_head_dim) * dtype_bytes, 0
