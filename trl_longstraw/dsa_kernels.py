"""Triton kernels for GLM's DeepSeek sparse attention: the indexer's scores and top-k, and sparse MLA forward and
backward. `glm_moe_dsa` dispatches to them for CUDA tensors when Triton is importable (`enabled`); its PyTorch code
(`select_topk` / `_running_topk`, `_SparseLatentAttention`) stays the reference and the CPU path, and the tests run
these kernels against it on CPU through Triton's interpreter (`TRITON_INTERPRET=1`).

Why our own: FlashMLA's and DeepGEMM's DSA kernels are inference kernels (no backward, FP8 indexer, fixed head counts
and Hopper-only builds), and neither keeps the running top-k over a prefix held as separate record chunks. The
reference's costs are Python loops over blocks, `[Q, heads, keys]` fp32 score tiles and `[Q * k, R + Dr]` gathered
rows; the kernels read the records in place through a table of chunk pointers and materialise neither.

**Selection** (`select_topk`, the semantics of `glm_moe_dsa.select_topk`). Key numbers run across the parts (prefix
chunks, then the queries' own tokens); query `i` sits at key `query_start + i` and sees keys `<= query_start + i`.
For each window of `KEY_WINDOW` keys and tile of queries:

1. `_index_scores_kernel` writes the indexer scores `[Q, N]` fp32 of the window: per query and key,
   `sum_h w[q, h] * relu(scale * q[q, h] . k)`, `-inf` for keys in the query's future. The heads are folded into the
   rows of one matrix product, `[BQ * H, D] @ [D, BN]`, so no `[Q, H, N]` tile exists.
2. `_topk_merge_kernel` merges the window into each query's running candidates `[S, KP]` (`KP` = `topk` rounded up
   to a power of two). A candidate is one int64: the score's bits mapped to an order-preserving int32 in the high
   word, `2^32 - 1 - key` in the low word. So "higher score, then earlier key" is plain integer order: the top `k` by
   that order is the reference's selection, ties at the cut-off going to the earlier key, whatever the blocking.
   Each `KP` scores of the window are sorted ascending and merged into the descending candidates by an elementwise
   max (the `KP` largest of the union, a bitonic sequence), then sorted again; a segment whose best does not beat the
   current `KP`-th candidate is skipped.

Candidates of score `-inf` (keys in the future, padding) come out as `-1`. A NaN score raises ValueError, as the
reference does.

**Sparse MLA** (`SparseLatentAttention`, the autograd function of `glm_moe_dsa._SparseLatentAttention`: same inputs,
`(out, lse)` outputs, and a backward that takes the log-sum-exp's gradient too). One program per query and block of
`HEAD_BLOCK` heads walks the query's selected slots `SLOT_BLOCK` at a time, resolves each key number to its record
chunk and row, loads the `kv` rows `[R | Dr]` straight from the chunk, and runs an online softmax (flash-attention
style) over `q_lat . kv_lat + q_rope . kv_rope`. The backward recomputes the probabilities from the saved
log-sum-exp; the query gradient is stored per program, the record gradients are added with fp32 atomics (a key is
selected by many queries). Half-precision inputs multiply in their own dtype with fp32 accumulation, the
probabilities rounded to that dtype for the value product as flash attention does; fp32 inputs multiply in full fp32
(`input_precision="ieee"`, no TF32).

The sharded passes (`glm_moe_dsa.sharded_select_topk`, `sharded_latent_attention`) still run the reference; the
attention kernel has the reference's `(out, lse)` interface, so they can take it where their parts are plain.

Shapes (GLM-5: H = 64 heads, R = 512 latent, Dr = 64 rope, k = 2048 slots; indexer Hi = 32 heads, Di = 128):

- selection: `q` `[S, Hi, Di]`, `weights` `[S, Hi]` fp32, key parts `[n_i, Di]` -> `[S, min(k, T)]` int64;
- attention: `q` `[S, H, R + Dr]`, kv parts `[n_i, R + Dr]`, `sel` `[S, k]` int64 (`-1` empty) ->
  `out` `[S, H, R]` in q's dtype and `lse` `[S, H]` fp32.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Use the kernels where `enabled` finds them applicable; False forces the PyTorch reference (the GPU check compares).
USE_KERNELS = True
# Also run them on CPU tensors: only meaningful under `TRITON_INTERPRET=1`, where the tests set it.
ON_CPU = False
# Keys scored per window of the selection, and fp32 elements of one `[Q, N]` score buffer (2^26: 256 MB).
KEY_WINDOW = 1 << 16
SCORE_TILE = 1 << 26
# Heads per program and selected slots per step of the sparse attention (both at least 16 for tensor-core products).
HEAD_BLOCK = 16
SLOT_BLOCK = 32
# Warps per program of the sparse attention (its `[HEAD_BLOCK, R]` fp32 accumulators and `[SLOT_BLOCK, R]` tiles are
# large for GLM's R = 512) and of the top-k merge (one `[KP]` int64 sort per program). Untuned: no GPU measured them.
ATTN_WARPS = 8
TOPK_WARPS = 8
# Rows (queries x heads) and keys per program of the score kernel.
SCORE_ROWS = 64
SCORE_KEY_BLOCK = 64

# Triton's interpreter multiplies half-precision tiles as raw integers: there the products run in fp32 on the
# half-precision values (exactly what the tensor cores compute: products of bf16 or fp16 values are exact in fp32).
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"))
# The int32 image of -inf in the order-preserving map; a candidate whose high word is at most this is no key.
_NO_KEY = -2139095041
_HALF = (torch.bfloat16, torch.float16)


def enabled(x: torch.Tensor) -> bool:
    """Whether the kernels serve inputs like `x`: CUDA (or CPU with `ON_CPU`), fp32 or half precision."""
    on_device = x.is_cuda or (ON_CPU and x.device.type == "cpu")
    return USE_KERNELS and on_device and x.dtype in (torch.float32, *_HALF)


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(max(1, n)))


def _common(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """The parts as contiguous tensors of one dtype, so that one pointer type reads them all."""
    dtype = parts[0].dtype
    for x in parts[1:]:
        dtype = torch.promote_types(dtype, x.dtype)
    return [x.to(dtype).contiguous() for x in parts]


def _tables(parts: list[torch.Tensor], device) -> tuple[torch.Tensor, torch.Tensor]:
    """`(pointers [P], starts [P + 1])` int64: each part's address and the key number of its first row."""
    pointers = torch.tensor([x.data_ptr() for x in parts], dtype=torch.int64, device=device)
    starts = [0]
    for x in parts:
        starts.append(starts[-1] + x.shape[0])
    return pointers, torch.tensor(starts, dtype=torch.int64, device=device)


@triton.jit
def _locate(key, starts, P, BP: tl.constexpr):
    """Part `[N]` and row `[N]` of key numbers `key` (`>= 0`), given the parts' first key numbers `starts`."""
    p = tl.arange(0, BP)
    ends = tl.load(starts + 1 + p, mask=p < P, other=9223372036854775807)
    part = tl.sum((key[:, None] >= ends[None, :]).to(tl.int32), axis=1)
    part = tl.minimum(part, P - 1)
    return part, key - tl.load(starts + part)


@triton.jit
def _cast(x, LOW: tl.constexpr):
    """`x` as the kernels multiply it: as loaded when LOW (half precision), else fp32."""
    if LOW:
        return x
    return x.to(tl.float32)


@triton.jit
def _dot(a, b, LOW: tl.constexpr):
    """`a @ b` with fp32 accumulation: in the inputs' half dtype when LOW, else in full fp32 (no TF32)."""
    if LOW and not _INTERPRETED:
        return tl.dot(a, b)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


# ------------------------------------------------------------------------------------------------------- selection
@triton.jit
def _index_scores_kernel(
    q,  # [S, H, D] indexer queries
    w,  # [S, H] fp32 head weights
    pointers,  # [P] int64 addresses of the key parts [n_p, D]
    starts,  # [P + 1] int64
    keys0,  # the first key part: its pointer type reads every part
    out,  # [Q, N] fp32 scores of queries q0.. against keys k0..
    q0,
    k0,
    Q,
    N,
    T,
    query_start,  # key number of query 0; keys after query_start + i are in query i's future
    scale,
    H: tl.constexpr,
    D: tl.constexpr,
    P,
    BQ: tl.constexpr,
    BH: tl.constexpr,
    BD: tl.constexpr,
    BN: tl.constexpr,
    BP: tl.constexpr,
    LOW: tl.constexpr,
):
    qi = tl.program_id(0) * BQ + tl.arange(0, BQ)  # rows of `out`
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    h = tl.arange(0, BH)
    d = tl.arange(0, BD)
    key = k0 + cols
    valid = (cols < N) & (key < T)
    part, row = _locate(tl.where(valid, key, 0), starts, P, BP)
    base = tl.load(pointers + part).to(keys0.dtype)
    k = tl.load(base[:, None] + row[:, None] * D + d[None, :], mask=valid[:, None] & (d < D)[None, :], other=0.0)
    qm = (qi < Q)[:, None, None] & (h < H)[None, :, None] & (d < D)[None, None, :]
    qrows = (q0 + qi).to(tl.int64)
    qt = tl.load(q + qrows[:, None, None] * H * D + h[None, :, None] * D + d[None, None, :], mask=qm, other=0.0)
    s = _dot(tl.reshape(qt, (BQ * BH, BD)), tl.trans(k), LOW)  # [BQ * BH, BN]
    s = tl.maximum(s * scale, 0.0)
    wm = (qi < Q)[:, None] & (h < H)[None, :]
    wt = tl.load(w + qrows[:, None] * H + h[None, :], mask=wm, other=0.0)
    scores = tl.sum(tl.reshape(s, (BQ, BH, BN)) * wt[:, :, None], axis=1)  # [BQ, BN]
    future = key[None, :] > query_start + q0 + qi[:, None]
    scores = tl.where(future, float("-inf"), scores)
    om = (qi < Q)[:, None] & (cols < N)[None, :]
    tl.store(out + qi[:, None].to(tl.int64) * N + cols[None, :], scores, mask=om)


@triton.jit
def _topk_merge_kernel(
    scores,  # [Q, N] fp32
    cand,  # [S, KP] int64 running candidates of each query, in descending order
    nan,  # [S] int32, set where a NaN score was seen
    q0,
    k0,
    N,
    KP: tl.constexpr,
):
    i = tl.program_id(0)
    row = (q0 + i).to(tl.int64)
    slots = tl.arange(0, KP)
    best = tl.load(cand + row * KP + slots)
    seen_nan = tl.zeros((KP,), dtype=tl.int32)
    for start in range(0, N, KP):
        cols = start + slots
        s = tl.load(scores + i.to(tl.int64) * N + cols, mask=cols < N, other=float("-inf"))
        seen_nan = seen_nan | (s != s).to(tl.int32)
        s = s + 0.0  # -0.0 -> +0.0: equal scores must map to one integer
        bits = s.to(tl.int32, bitcast=True)
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        packed = (ordered.to(tl.int64) << 32) | (4294967295 - (k0 + cols).to(tl.int64))
        if tl.max(packed, axis=0) > tl.min(best, axis=0):
            best = tl.sort(tl.maximum(best, tl.sort(packed)), descending=True)
    tl.store(cand + row * KP + slots, best)
    tl.store(nan + row, tl.max(seen_nan, axis=0), mask=tl.max(seen_nan, axis=0) > 0)


def select_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_parts: list[torch.Tensor],
    query_start: int,
    topk: int,
    scale: float,
) -> torch.Tensor:
    """`glm_moe_dsa.select_topk` by the kernels: the `topk` best visible keys of each query, ties to the earlier key.

    Inputs and output as `glm_moe_dsa.select_topk` (`q` `[S, H, D]`, fp32 `weights` `[S, H]`, key parts `[n_i, D]`
    numbered across the parts -> `[S, min(topk, T)]` int64 with `-1` slots, row order unspecified); it computes
    every query's scores, also where a query sees fewer than `topk` keys.

    Raises:
        ValueError: when a visible key's score is NaN.
    """
    s, heads, dim = q.shape
    parts = _common(list(key_parts))
    total = sum(x.shape[0] for x in parts)
    width = min(topk, total)
    kp = _pow2(topk, 2)
    device = q.device
    cand = torch.full((s, kp), torch.iinfo(torch.int64).min, dtype=torch.int64, device=device)
    if s == 0 or total == 0:
        return cand[:, :width]
    nan = torch.zeros(s, dtype=torch.int32, device=device)
    q = q.contiguous()
    weights = weights.float().contiguous()
    pointers, starts = _tables(parts, device)
    low = q.dtype in _HALF and q.dtype == parts[0].dtype
    window = min(KEY_WINDOW, total)
    query_tile = max(1, SCORE_TILE // window)
    bh, bd = _pow2(heads, 1), _pow2(dim)
    bq = max(1, SCORE_ROWS // bh)
    for k0 in range(0, total, window):
        n = min(window, total - k0)
        for q0 in range(0, s, query_tile):
            rows = min(query_tile, s - q0)
            if k0 > query_start + q0 + rows - 1:
                continue  # every key of the window is in the future of these queries
            buffer = torch.empty(rows, n, dtype=torch.float32, device=device)
            grid = (triton.cdiv(rows, bq), triton.cdiv(n, SCORE_KEY_BLOCK))
            _index_scores_kernel[grid](
                q,
                weights,
                pointers,
                starts,
                parts[0],
                buffer,
                q0,
                k0,
                rows,
                n,
                total,
                query_start,
                scale,
                H=heads,
                D=dim,
                P=len(parts),
                BQ=bq,
                BH=bh,
                BD=bd,
                BN=SCORE_KEY_BLOCK,
                BP=_pow2(len(parts), 1),
                LOW=low,
            )
            _topk_merge_kernel[(rows,)](buffer, cand, nan, q0, k0, n, KP=kp, num_warps=TOPK_WARPS)
    if bool(nan.any()):
        raise ValueError("the DSA indexer produced NaN scores")
    cand = cand[:, :width]
    keys = 4294967295 - (cand & 4294967295)
    return torch.where((cand >> 32) > _NO_KEY, keys, -1)


# ------------------------------------------------------------------------------------------------ sparse attention
@triton.jit
def _slot_rows(
    sel,
    i,
    j0,
    K,
    pointers,
    starts,
    kv0,
    P,
    R: tl.constexpr,
    DR: tl.constexpr,
    BK: tl.constexpr,
    BR: tl.constexpr,
    BDR: tl.constexpr,
    BP: tl.constexpr,
    LOW: tl.constexpr,
):
    """The slots `j0..j0+BK` of query `i`: validity `[BK]`, part, row, and the `kv` rows' latent `[BK, BR]` and rope
    `[BK, BDR]` columns (zeros for empty slots)."""
    j = j0 + tl.arange(0, BK)
    key = tl.load(sel + i * K + j, mask=j < K, other=-1)
    valid = key >= 0
    part, row = _locate(tl.where(valid, key, 0), starts, P, BP)
    rows = tl.load(pointers + part).to(kv0.dtype) + row * (R + DR)
    r = tl.arange(0, BR)
    e = tl.arange(0, BDR)
    kv_lat = tl.load(rows[:, None] + r[None, :], mask=valid[:, None] & (r < R)[None, :], other=0.0)
    kv_rope = tl.load(rows[:, None] + R + e[None, :], mask=valid[:, None] & (e < DR)[None, :], other=0.0)
    return valid, part, row, _cast(kv_lat, LOW), _cast(kv_rope, LOW)


@triton.jit
def _latent_scores(q_lat, q_rope, kv_lat, kv_rope, scale, LOW: tl.constexpr):
    """Scores `[BH, BK]` of the absorbed queries against a tile of `kv` rows: latent and rope parts summed."""
    return (_dot(q_lat, tl.trans(kv_lat), LOW) + _dot(q_rope, tl.trans(kv_rope), LOW)) * scale


@triton.jit
def _query_rows(x, i, h0, H, width, offset, BH: tl.constexpr, BC: tl.constexpr, C):
    """`[BH, BC]` block of `x` `[S, H, width]`: heads h0.., columns offset.. (C of them), zeros outside."""
    h = h0 + tl.arange(0, BH)
    c = tl.arange(0, BC)
    mask = (h < H)[:, None] & (c < C)[None, :]
    return tl.load(x + (i * H + h[:, None]) * width + offset + c[None, :], mask=mask, other=0.0)


@triton.jit
def _sparse_mla_fwd_kernel(
    q,  # [S, H, R + DR]
    sel,  # [S, K] int64
    pointers,  # [P] int64 addresses of the kv parts [n_p, R + DR]
    starts,  # [P + 1] int64
    kv0,
    out,  # [S, H, R] fp32
    lse,  # [S, H] fp32
    scale,
    H,
    K,
    P,
    R: tl.constexpr,
    DR: tl.constexpr,
    BH: tl.constexpr,
    BK: tl.constexpr,
    BR: tl.constexpr,
    BDR: tl.constexpr,
    BP: tl.constexpr,
    LOW: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    h0 = tl.program_id(1) * BH
    h = h0 + tl.arange(0, BH)
    q_lat = _cast(_query_rows(q, i, h0, H, R + DR, 0, BH, BR, R), LOW)
    q_rope = _cast(_query_rows(q, i, h0, H, R + DR, R, BH, BDR, DR), LOW)
    m = tl.full((BH,), float("-inf"), dtype=tl.float32)
    total = tl.zeros((BH,), dtype=tl.float32)
    acc = tl.zeros((BH, BR), dtype=tl.float32)
    for j0 in range(0, K, BK):
        valid, part, row, kv_lat, kv_rope = _slot_rows(
            sel, i, j0, K, pointers, starts, kv0, P, R, DR, BK, BR, BDR, BP, LOW
        )
        s = _latent_scores(q_lat, q_rope, kv_lat, kv_rope, scale, LOW)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: exp(-inf) = 0 everywhere
        p = tl.exp(s - shift[:, None])
        alpha = tl.exp(m - shift)
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(kv_lat.dtype), kv_lat, LOW)
        m = m_new
    seen = total > 0
    result = tl.where(seen[:, None], acc / tl.where(seen, total, 1.0)[:, None], 0.0)
    r = tl.arange(0, BR)
    hm = h < H
    tl.store(out + (i * H + h[:, None]) * R + r[None, :], result, mask=hm[:, None] & (r < R)[None, :])
    tl.store(lse + i * H + h, tl.where(seen, m + tl.log(tl.where(seen, total, 1.0)), float("-inf")), mask=hm)


@triton.jit
def _sparse_mla_bwd_kernel(
    q,  # [S, H, R + DR]
    sel,  # [S, K] int64
    pointers,  # [P] int64
    starts,  # [P + 1] int64
    kv0,
    grads,  # [P] int64 addresses of fp32 gradient buffers [n_p, R + DR], 0 for parts that need none
    dout,  # [S, H, R]
    lse,  # [S, H] fp32, 0 where -inf
    delta,  # [S, H] fp32: sum(dout * out) - grad of lse
    dq,  # [S, H, R + DR] fp32 (also the pointer type of `grads`)
    scale,
    H,
    K,
    P,
    R: tl.constexpr,
    DR: tl.constexpr,
    BH: tl.constexpr,
    BK: tl.constexpr,
    BR: tl.constexpr,
    BDR: tl.constexpr,
    BP: tl.constexpr,
    LOW: tl.constexpr,
    NEED_KV: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    h0 = tl.program_id(1) * BH
    h = h0 + tl.arange(0, BH)
    hm = h < H
    q_lat = _cast(_query_rows(q, i, h0, H, R + DR, 0, BH, BR, R), LOW)
    q_rope = _cast(_query_rows(q, i, h0, H, R + DR, R, BH, BDR, DR), LOW)
    do = _cast(_query_rows(dout, i, h0, H, R, 0, BH, BR, R), LOW)
    row_lse = tl.load(lse + i * H + h, mask=hm, other=0.0)
    row_delta = tl.load(delta + i * H + h, mask=hm, other=0.0)
    dq_lat = tl.zeros((BH, BR), dtype=tl.float32)
    dq_rope = tl.zeros((BH, BDR), dtype=tl.float32)
    r = tl.arange(0, BR)
    e = tl.arange(0, BDR)
    for j0 in range(0, K, BK):
        valid, part, row, kv_lat, kv_rope = _slot_rows(
            sel, i, j0, K, pointers, starts, kv0, P, R, DR, BK, BR, BDR, BP, LOW
        )
        s = _latent_scores(q_lat, q_rope, kv_lat, kv_rope, scale, LOW)
        p = tl.where(hm[:, None] & valid[None, :], tl.exp(s - row_lse[:, None]), 0.0)
        dp = _dot(do.to(kv_lat.dtype), tl.trans(kv_lat), LOW)
        ds = p * (dp - row_delta[:, None]) * scale  # [BH, BK]
        dq_lat += _dot(ds.to(kv_lat.dtype), kv_lat, LOW)
        dq_rope += _dot(ds.to(kv_lat.dtype), kv_rope, LOW)
        if NEED_KV:
            address = tl.load(grads + part)
            need = valid & (address != 0)
            rows = address.to(dq.dtype) + row * (R + DR)
            ds_t = tl.trans(ds).to(q_lat.dtype)
            dkv_lat = _dot(ds_t, q_lat, LOW) + _dot(tl.trans(p).to(kv_lat.dtype), do.to(kv_lat.dtype), LOW)
            dkv_rope = _dot(ds_t, q_rope, LOW)
            tl.atomic_add(rows[:, None] + r[None, :], dkv_lat, mask=need[:, None] & (r < R)[None, :])
            tl.atomic_add(rows[:, None] + R + e[None, :], dkv_rope, mask=need[:, None] & (e < DR)[None, :])
    base = dq + (i * H + h[:, None]) * (R + DR)
    tl.store(base + r[None, :], dq_lat, mask=hm[:, None] & (r < R)[None, :])
    tl.store(base + R + e[None, :], dq_rope, mask=hm[:, None] & (e < DR)[None, :])


def _attention_launch(q: torch.Tensor, parts: list[torch.Tensor], rank: int) -> dict:
    """Grid and block sizes shared by the forward and the backward."""
    s, heads, width = q.shape
    return dict(
        grid=(s, triton.cdiv(heads, HEAD_BLOCK)),
        sizes=dict(
            R=rank,
            DR=width - rank,
            BH=HEAD_BLOCK,
            BK=SLOT_BLOCK,
            BR=_pow2(rank),
            BDR=_pow2(width - rank),
            BP=_pow2(len(parts), 1),
            LOW=q.dtype in _HALF and q.dtype == parts[0].dtype,
            num_warps=ATTN_WARPS,
        ),
    )


class SparseLatentAttention(torch.autograd.Function):
    """Absorbed MLA of each query over its selected keys: `apply(scale, rank, sel, q, *kv_parts) -> (out, lse)`.

    Inputs and outputs as `glm_moe_dsa._SparseLatentAttention`: `q` `[S, H, R + Dr]`, kv parts `[n_i, R + Dr]`,
    `sel` `[S, k]` (`-1` empty) -> `out` `[S, H, R]` in q's dtype (zeros for a query with no key) and `lse` `[S, H]`
    fp32 (`-inf` there). Gradients reach `q` and every part that requires one.
    """

    @staticmethod
    def forward(ctx, scale: float, rank: int, sel, q, *kv_parts):
        s, heads, _ = q.shape
        parts = _common(list(kv_parts))
        out = torch.zeros(s, heads, rank, dtype=torch.float32, device=q.device)
        lse = torch.full((s, heads), float("-inf"), dtype=torch.float32, device=q.device)
        q, sel = q.contiguous(), sel.contiguous()
        launch = _attention_launch(q, parts, rank)
        if s and sel.shape[1]:
            pointers, starts = _tables(parts, q.device)
            _sparse_mla_fwd_kernel[launch["grid"]](
                q,
                sel,
                pointers,
                starts,
                parts[0],
                out,
                lse,
                scale,
                heads,
                sel.shape[1],
                len(parts),
                **launch["sizes"],
            )
        ctx.scale, ctx.rank, ctx.dtypes = scale, rank, [x.dtype for x in kv_parts]
        ctx.save_for_backward(sel, q, out, lse, *parts)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        sel, q, out, lse, *parts = ctx.saved_tensors
        need = ctx.needs_input_grad[4:]
        s, heads, width = q.shape
        launch = _attention_launch(q, parts, ctx.rank)
        dout = grad_out.float()
        # d lse / d scores = p, so the gradient of the log-sum-exp joins that of the output's normalisation.
        delta = (dout * out).sum(-1) - (0 if grad_lse is None else grad_lse.float())
        dq = torch.zeros(s, heads, width, dtype=torch.float32, device=q.device)
        dparts = [
            torch.zeros(x.shape, dtype=torch.float32, device=x.device) if n else None
            for x, n in zip(parts, need, strict=True)
        ]
        if s and sel.shape[1]:
            pointers, starts = _tables(parts, q.device)
            addresses = [0 if g is None else g.data_ptr() for g in dparts]
            grads = torch.tensor(addresses, dtype=torch.int64, device=q.device)
            _sparse_mla_bwd_kernel[launch["grid"]](
                q,
                sel,
                pointers,
                starts,
                parts[0],
                grads,
                # Half-precision products take the gradient in its own dtype, as it came.
                (grad_out.to(q.dtype) if launch["sizes"]["LOW"] else dout).contiguous(),
                lse.masked_fill(lse == float("-inf"), 0.0).contiguous(),
                delta.contiguous(),
                dq,
                ctx.scale,
                heads,
                sel.shape[1],
                len(parts),
                NEED_KV=any(need),
                **launch["sizes"],
            )
        grads = [None if g is None else g.to(dtype) for g, dtype in zip(dparts, ctx.dtypes, strict=True)]
        return None, None, None, dq.to(q.dtype), *grads
