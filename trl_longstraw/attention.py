"""Prefix-merge attention: queries attend to a frozen prefix (held as chunks) and causally to their own keys.

The prefix is never concatenated and never repeated per query head. Each key block is scored on its own and the
partial results are merged through their log-sum-exp, as in flash attention. The backward recomputes the scores block
by block from the saved queries, keys, output and log-sum-exp, so one call saves its inputs, its output and
`[B, Hq, T]` statistics, whatever the prefix length. Gradients reach the queries, the new keys and values, and, where
they require grad (exact mode), the prefix keys and values.

Grouped-query attention is handled by folding the `g = Hq / Hkv` query heads that share a key head into the query
axis: `[B, Hq, T, D] -> [B, Hkv, g, T, D]`.

Two implementations of the same math: where PyTorch has a fused attention kernel that returns the log-sum-exp (the
CPU flash kernel; on CUDA for fp16/bf16 with equal key and value widths up to 256, FlashAttention-2 or, with
`CUDA_BACKEND = "cudnn"`, cuDNN's attention), each part runs through that kernel and its backward is the kernel's
backward fed with the *merged* output and log-sum-exp, which gives exactly the part's share of the gradients.
Elsewhere (fp64, other devices, value width != key width, or `USE_KERNELS = False`) the portable path scores blocks of
`KEY_BLOCK` keys with einsum in fp32.

Mixed precision. Under autocast (accelerate's `bf16=True`/`fp16=True` over fp32 weights), transformers' attention
receives post-RoPE queries and keys in fp32 (fp32 residual stream times fp32 cos/sin) and values in the autocast
dtype, and autocast casts all three to its dtype at the SDPA call (SDPA is on its lower-precision list). Callers
reproduce that cast with `autocast_inputs` before attending, so the records hold the autocast dtype as stock's
attention sees it. The autograd Functions below then run with autocast off (`autocast_off`): autocast would lower
their fp32 einsums to the autocast dtype, in the forward and, since the autograd engine runs a backward under the
autocast state of the thread that calls `backward`, in the backward too.
"""

from __future__ import annotations

import functools

import torch

# Keys scored at once by the portable path. Bounds its `[B, Hq, T, KEY_BLOCK]` fp32 score tile.
KEY_BLOCK = 4096
# Use the fused kernels where `_kernel_for` finds one; False forces the portable path (tests compare the two).
USE_KERNELS = True
# The SDPA kernel of the CUDA parts: "flash" (FlashAttention-2) or "cudnn". Both return the log-sum-exp that the merge
# needs; benchmarks/gpu_check.py measures both against the reference on the GPU and reports the fastest exact one.
CUDA_BACKENDS = ("flash", "cudnn")
CUDA_BACKEND = "flash"


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The lower-precision dtype of the autocast active for `device`'s type, or None when autocast is off there."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


def autocast_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`tensors` as autocast hands them to an op of its lower-precision list (SDPA, matmul): floating tensors other
    than fp64 cast to the autocast dtype when autocast is on for their device, the others unchanged."""
    dtype = autocast_dtype(tensors[0].device)
    if dtype is None:
        return tensors
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t for t in tensors)


def autocast_off(method):
    """Decorates the `forward` or `backward` of an autograd Function to run with autocast off for the device of its
    first tensor argument (see the module docstring)."""

    @functools.wraps(method)
    def run(ctx, *args):
        device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), None)
        if device is None or not torch.is_autocast_enabled(device):
            return method(ctx, *args)
        with torch.autocast(device, enabled=False):
            return method(ctx, *args)

    return run


def _blocks(keys: torch.Tensor, values: torch.Tensor):
    """Yields `(start, k, v)` slices of at most KEY_BLOCK keys along dim 2."""
    for start in range(0, keys.shape[2], KEY_BLOCK):
        yield start, keys[:, :, start : start + KEY_BLOCK], values[:, :, start : start + KEY_BLOCK]


def _acc(x: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: fp32 for half types, else the input's own (fp64 stays fp64 for gradcheck)."""
    return torch.promote_types(x.dtype, torch.float32)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal_offset: int | None) -> torch.Tensor:
    """Scores `[B, Hkv, g, T, S]` of folded queries `q` `[B, Hkv, g, T, D]` against keys `k` `[B, Hkv, S, D]`.

    With `causal_offset`, key `j` is visible to query `i` only when `j + causal_offset <= i`.
    """
    s = torch.einsum("bhgtd,bhsd->bhgts", q.to(_acc(q)), k.to(_acc(q))) * scale
    if causal_offset is not None:
        t, n = s.shape[-2], s.shape[-1]
        rows = torch.arange(t, device=s.device)[:, None]
        cols = torch.arange(n, device=s.device)[None, :] + causal_offset
        s = s.masked_fill(cols > rows, float("-inf"))
    return s


def _prefix_parts(prefix):
    """`(k, v, None)` blocks of every prefix chunk (flat `k0, v0, k1, v1, ...`): no mask."""
    for pk, pv in zip(prefix[0::2], prefix[1::2], strict=True):
        for _, bk, bv in _blocks(pk, pv):
            yield bk, bv, None


def _self_parts(k, v):
    """`(k, v, causal_offset)` blocks of the queries' own keys."""
    for start, bk, bv in _blocks(k, v):
        yield bk, bv, start


def block_grads(qf, keys, values, dout, delta, lse, scale: float, causal: bool, need_kv: bool, dq: torch.Tensor):
    """Flash-attention backward of folded queries `qf` `[B, Hkv, g, T, D]` against one key/value part, given the
    merged output's `delta = sum(dout * out)` and log-sum-exp `lse` `[B, Hkv, g, T]`.

    Adds the part's share of the query gradient into `dq` and returns its key/value gradients `[B, Hkv, S, D]`
    (None when not `need_kv`).
    """
    acc = dq.dtype
    dks, dvs = [], []
    for start, bk, bv in _blocks(keys, values):
        s = _scores(qf, bk, scale, start if causal else None)
        p = torch.exp(s - lse[..., None])
        dp = torch.einsum("bhgtd,bhsd->bhgts", dout, bv.to(acc))
        ds = p * (dp - delta[..., None]) * scale
        dq.add_(torch.einsum("bhgts,bhsd->bhgtd", ds, bk.to(acc)))
        if need_kv:
            dvs.append(torch.einsum("bhgts,bhgtd->bhsd", p, dout))
            dks.append(torch.einsum("bhgts,bhgtd->bhsd", ds, qf.to(acc)))
    if not need_kv:
        return None, None
    return torch.cat(dks, dim=2).to(keys.dtype), torch.cat(dvs, dim=2).to(values.dtype)


class _PrefixMergeAttention(torch.autograd.Function):
    @staticmethod
    @autocast_off
    def forward(ctx, scale: float, shards, q, k, v, *prefix):
        b, hq, t, d = q.shape
        hkv = k.shape[1]
        qf = q.view(b, hkv, hq // hkv, t, d)
        acc = _acc(q)
        out = torch.zeros(b, hkv, hq // hkv, t, v.shape[-1], dtype=acc, device=q.device)
        lse = torch.full((b, hkv, hq // hkv, t), float("-inf"), dtype=acc, device=q.device)

        def add(parts, out, lse):
            for bk, bv, causal_offset in parts:
                s = _scores(qf, bk, scale, causal_offset)
                new_lse = torch.logaddexp(lse, torch.logsumexp(s, dim=-1))
                # A block that is fully masked for a row has lse -inf; exp(-inf - finite) = 0 keeps it out.
                p = torch.exp(s - new_lse[..., None])
                out = out * torch.exp(lse - new_lse)[..., None] + torch.einsum("bhgts,bhsd->bhgtd", p, bv.to(acc))
                lse = new_lse
            return out, lse

        out, lse = add(_prefix_parts(prefix), out, lse)
        if shards is not None:  # this rank's chunks are part of the prefix: merge the ranks' parts
            out, lse = shards.merge_parts(out, lse)
        out, lse = add(_self_parts(k, v), out, lse)
        ctx.scale, ctx.shards = scale, shards
        ctx.save_for_backward(q, k, v, out, lse, *prefix)
        return out.view(b, hq, t, -1).to(q.dtype)

    @staticmethod
    @autocast_off
    def backward(ctx, grad_out):
        q, k, v, out, lse, *prefix = ctx.saved_tensors
        scale = ctx.scale
        b, hq, t, d = q.shape
        hkv = k.shape[1]
        qf = q.view(b, hkv, hq // hkv, t, d)
        acc = out.dtype
        dout = grad_out.to(acc).view(out.shape)
        # Sharded replicated pass: `dout` is this rank's share; the chunks, held once, take the sum of the shares.
        dout_prefix = dout if ctx.shards is None else ctx.shards.sum_shares(dout)
        dq = torch.zeros(qf.shape, dtype=acc, device=q.device)
        prefix_grads = []
        delta = (dout_prefix * out).sum(-1)  # [B, Hkv, g, T]
        for i, (pk, pv) in enumerate(zip(prefix[0::2], prefix[1::2], strict=True)):
            need = ctx.needs_input_grad[5 + 2 * i] or ctx.needs_input_grad[6 + 2 * i]
            prefix_grads += block_grads(qf, pk, pv, dout_prefix, delta, lse, scale, False, need, dq)
        dk, dv = block_grads(qf, k, v, dout, (dout * out).sum(-1), lse, scale, True, True, dq)
        return None, None, dq.view(q.shape).to(q.dtype), dk, dv, *prefix_grads


def _kernel_for(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> str | None:
    """The fused kernel family for these inputs (`"cpu"`, `"cuda_flash"` or `"cuda_cudnn"`), or None for the portable
    path."""
    if CUDA_BACKEND not in CUDA_BACKENDS:
        raise ValueError(f"trl_longstraw.attention.CUDA_BACKEND={CUDA_BACKEND!r}: choose one of {CUDA_BACKENDS}")
    if not USE_KERNELS or key.shape[-1] != value.shape[-1]:
        return None
    if query.device.type == "cpu" and query.dtype in (torch.float32, torch.bfloat16):
        return "cpu"
    if (
        query.device.type == "cuda"
        and query.dtype in (torch.float16, torch.bfloat16)
        and query.shape[-1] <= 256
        and query.shape[-1] % 8 == 0
    ):
        return f"cuda_{CUDA_BACKEND}"
    return None


def _dense_last(x: torch.Tensor) -> torch.Tensor:
    """`x` itself when its last dim is dense, as the kernels need, else a copy. Records are usually transposed views
    (`[B, T, H, D] -> [B, H, T, D]`) with a dense last dim, so the prefix is not copied per call."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _kernel_forward(kind: str, q, k, v, causal: bool, scale: float):
    """One part through the fused kernel: `(out [B, H, T, D] in q's dtype, lse [B, H, T] fp32, extra)`, where
    `extra` is what the kernel's backward needs besides the inputs, output and lse."""
    if kind == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse, ()
    if kind == "cuda_cudnn":
        # No bias; the log-sum-exp comes as [B, H, T, 1].
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )
        return out, lse[..., 0], (cum_q, cum_k, max_q, max_k, seed, offset)
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale
    )
    return out, lse[..., : q.shape[2]], (cum_q, cum_k, max_q, max_k, seed, offset)


def _kernel_backward(kind: str, dout, q, k, v, out, lse, causal: bool, scale: float, extra):
    """`(dq, dk, dv)` of one part, given the merged `out` and `lse` of the whole attention."""
    if kind == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    cum_q, cum_k, max_q, max_k, seed, offset = extra
    if kind == "cuda_cudnn":
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout,
            q,
            k,
            v,
            out,
            lse[..., None],
            seed,
            offset,
            None,
            cum_q,
            cum_k,
            max_q,
            max_k,
            0.0,
            causal,
            scale=scale,
        )[:3]
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale
    )[:3]


class _KernelPrefixMergeAttention(torch.autograd.Function):
    """The same attention as `_PrefixMergeAttention`, each part computed by a fused kernel that returns its lse.

    Prefix parts see every key, so the `g` query heads of a key head are folded into the query axis
    (`[B, Hkv, g * T, D]`) and the prefix is never repeated. The causal self part cannot be folded (the mask follows
    the row index), so its own `T` keys and values are repeated to `Hq` heads: `[B, Hq, T, D]`, the size of `q`.
    """

    @staticmethod
    @autocast_off
    def forward(ctx, kind: str, scale: float, shards, reuse: dict | None, q, k, v, *prefix):
        q = q.contiguous()
        if reuse:
            # Gradient checkpointing's recompute of the call that filled `reuse`: the same inputs give the same
            # output, log-sum-exp and kernel extras, so they are taken instead of attending again.
            out, lse, extras = reuse.pop("out"), reuse.pop("lse"), reuse.pop("extras")
            if out.shape[:3] != q.shape[:3]:
                raise RuntimeError(f"attention reuse: kept output {tuple(out.shape)} for queries {tuple(q.shape)}")
        else:
            out, lse, extras = _KernelPrefixMergeAttention.attend(kind, scale, shards, q, k, v, prefix)
            if reuse is not None:
                reuse.update(out=out.detach(), lse=lse, extras=extras)
        ctx.kind, ctx.scale, ctx.extras, ctx.shards = kind, scale, extras, shards
        ctx.save_for_backward(q, k, v, out, lse, *prefix)
        return out

    @staticmethod
    def attend(kind: str, scale: float, shards, q, k, v, prefix):
        """The forward's work: `(out [B, Hq, T, Dv] in q's dtype, lse [B, Hq, T] fp32, the kernel extras per part)`."""
        b, hq, t, d = q.shape
        hkv = k.shape[1]
        g = hq // hkv
        qf = q.view(b, hkv, g * t, d)
        out = torch.zeros(b, hq, t, v.shape[-1], dtype=torch.float32, device=q.device)
        lse = torch.full((b, hq, t), float("-inf"), dtype=torch.float32, device=q.device)
        extras = []

        def merge(part_out, part_lse):
            new_lse = torch.logaddexp(lse, part_lse)
            out.mul_(torch.exp(lse - new_lse)[..., None]).add_(part_out * torch.exp(part_lse - new_lse)[..., None])
            lse.copy_(new_lse)

        for pk, pv in zip(prefix[0::2], prefix[1::2], strict=True):
            if pk.shape[2] == 0:
                extras.append(None)
                continue
            part_out, part_lse, extra = _kernel_forward(kind, qf, _dense_last(pk), _dense_last(pv), False, scale)
            merge(part_out.reshape(b, hq, t, -1).float(), part_lse.reshape(b, hq, t))
            extras.append(extra)
        if shards is not None:  # this rank's chunks are part of the prefix: merge the ranks' parts
            merged_out, merged_lse = shards.merge_parts(out, lse)
            out.copy_(merged_out)
            lse.copy_(merged_lse)
        ke, ve = (x.repeat_interleave(g, dim=1) for x in (k, v))
        part_out, part_lse, extra = _kernel_forward(kind, q, ke, ve, True, scale)
        merge(part_out.float(), part_lse)
        extras.append(extra)
        return out.to(q.dtype), lse, extras

    @staticmethod
    @autocast_off
    def backward(ctx, grad_out):
        q, k, v, out, lse, *prefix = ctx.saved_tensors
        kind, scale = ctx.kind, ctx.scale
        b, hq, t, d = q.shape
        hkv = k.shape[1]
        g = hq // hkv
        dout = grad_out.contiguous().to(q.dtype)
        # Sharded replicated pass: `dout` is this rank's share; the chunks, held once, take the sum of the shares.
        dout_prefix = dout if ctx.shards is None else ctx.shards.sum_shares(grad_out).to(q.dtype)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        folded = (q.view(b, hkv, g * t, d), dout_prefix.view(b, hkv, g * t, -1), out.view(b, hkv, g * t, -1))
        lse_f = lse.view(b, hkv, g * t)
        prefix_grads = []
        for i, (pk, pv) in enumerate(zip(prefix[0::2], prefix[1::2], strict=True)):
            need = ctx.needs_input_grad[7 + 2 * i] or ctx.needs_input_grad[8 + 2 * i]
            if pk.shape[2] == 0:
                prefix_grads += [torch.zeros_like(pk), torch.zeros_like(pv)] if need else [None, None]
                continue
            qf, dof, of = folded
            dqf, dpk, dpv = _kernel_backward(
                kind, dof, qf, _dense_last(pk), _dense_last(pv), of, lse_f, False, scale, ctx.extras[i]
            )
            dq += dqf.reshape(q.shape)
            prefix_grads += [dpk.to(pk.dtype), dpv.to(pv.dtype)] if need else [None, None]
        ke, ve = (x.repeat_interleave(g, dim=1) for x in (k, v))
        dq_self, dke, dve = _kernel_backward(kind, dout, q, ke, ve, out, lse, True, scale, ctx.extras[-1])
        dq += dq_self
        dk = dke.reshape(b, hkv, g, t, -1).sum(2, dtype=torch.float32).to(k.dtype)
        dv = dve.reshape(b, hkv, g, t, -1).sum(2, dtype=torch.float32).to(v.dtype)
        return None, None, None, None, dq.to(q.dtype), dk, dv, *prefix_grads


def prefix_merge_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    prefix: list[tuple[torch.Tensor, torch.Tensor]],
    scale: float,
    shards=None,
    reuse: dict | None = None,
) -> torch.Tensor:
    """Attention of `query` over `prefix` (all visible) and causally over its own `key`/`value`.

    Args:
        query: `[B, Hq, T, D]`.
        key, value: `[B, Hkv, T, D]` (`Dv` for value), the keys of the same `T` positions as `query`.
        prefix: chunks `(k_i, v_i)` of shape `[B, Hkv, S_i, D]` (or `[1, Hkv, S_i, D]`, shared by the B rows) that
            precede the queries.
        scale: softmax scale.
        shards: a `sharding.PromptShards` in a replicated pass of a sharded prompt state: every rank runs the same
            queries, `prefix` holds this rank's chunks, and the ranks' prefix parts merge across the group
            (collective). The backward then takes `grad` as this rank's share of the loss gradient.
        reuse: an empty dict for a forward that gradient checkpointing will recompute (the exact-mode reverse pass):
            the fused-kernel path keeps its output and log-sum-exp there, and the recompute, called with the same dict,
            takes them instead of attending again (the portable path ignores it). Exact: the recompute's inputs are
            those of the first call, as checkpointing requires.

    Returns:
        `[B, Hq, T, Dv]` in the dtype of `query`.
    """
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"query heads ({query.shape[1]}) must be a multiple of key heads ({key.shape[1]})")
    flat = [x for kv in prefix for x in kv]
    kind = _kernel_for(query, key, value)
    # A prefix of batch 1 shared by B query rows (shared-prompt decoding, batched scoring) broadcasts in the portable
    # path's einsums; the fused kernels would need it copied B times.
    if kind is not None and all(x.shape[0] == query.shape[0] for x in flat):
        return _KernelPrefixMergeAttention.apply(kind, scale, shards, reuse, query, key, value, *flat)
    return _PrefixMergeAttention.apply(scale, shards, query, key, value, *flat)


def reference_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    prefix: list[tuple[torch.Tensor, torch.Tensor]],
    scale: float,
) -> torch.Tensor:
    """Plain reference for `prefix_merge_attention`: concatenate, repeat the key heads, mask, softmax."""
    keys = torch.cat([k for k, _ in prefix] + [key], dim=2)
    values = torch.cat([v for _, v in prefix] + [value], dim=2)
    groups = query.shape[1] // key.shape[1]
    keys = keys.repeat_interleave(groups, dim=1)
    values = values.repeat_interleave(groups, dim=1)
    t, n = query.shape[2], keys.shape[2]
    acc = torch.promote_types(query.dtype, torch.float32)
    scores = (query.to(acc) @ keys.to(acc).transpose(-1, -2)) * scale
    visible = torch.arange(n)[None, :] <= torch.arange(t)[:, None] + (n - t)
    scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
    return (scores.softmax(-1) @ values.to(acc)).to(query.dtype)
