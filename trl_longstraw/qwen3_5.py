"""Adapter for the Qwen3.5 / Qwen3.6 hybrid models (transformers `qwen3_5`, e.g. Qwen3.6-27B), text only.

The decoder interleaves two token mixers:

- *Gated attention* layers (`Qwen3_5Attention`): q/k RMS norms, partial (m)RoPE, then the attention function
  registered under `config._attn_implementation`, then a sigmoid output gate. The norms, RoPE and gate run outside the
  attention function, so the generic `longstraw_attention` of `kv.py` serves them unchanged: record `(keys, values)`
  `[1, Hkv, n, D]` per chunk.
- *Gated DeltaNet* layers (`Qwen3_5GatedDeltaNet`): a depthwise causal conv over `[q | k | v]`, then the gated delta
  rule, a linear recurrence over a `[Hv, Dk, Dv]` fp32 state. Later tokens need only the last `kernel - 1` conv inputs
  and the recurrent state at the end of the prefix, so the record of a chunk is `(conv_tail, state)`,
  `[1, C, kernel - 1]` and `[1, Hv, Dk, Dv]` fp32, and it supersedes the records of earlier chunks: detached mode keeps
  one per layer. Exact mode keeps one per chunk boundary (`PromptState.boundaries`), since the reverse pass restarts
  every chunk from the state at its start; with a sharded prompt state, each boundary only on the rank owning its
  chunk (plus the final one on every rank), broadcast to every rank when the reverse pass reaches it. In a
  context-parallel round of a sharded state (`context_parallel`) the conv and delta rule run sequence-parallel over
  the ranks (`_round_core`, `segment_gated_delta_rule`).

While the engine runs, the DeltaNet modules' `forward` is replaced by `_gated_deltanet_forward`, which starts from the
last visible record (zero history and zero state if none), never writes a tensor in place (the stock cache's
`update_recurrent_state` does, which breaks backward), and emits its end-of-chunk record. The gradient flows into the
initial conv tail and state, which are leaves in exact mode.

Decoding (`generation.DecodePass`): each of the G rows of a prompt starts from the prompt's final `(conv_tail,
state)` (batch 1, expanded, never written) and keeps its own `[G, ...]` record in the decode tail, replaced at every
step; the step runs the per-token rule transformers decodes with (`torch_recurrent_gated_delta_rule`, or fla's fused
recurrent kernel on CUDA when installed). The gated-attention layers read the prompt's keys and values broadcast,
then the rows' own decoded ones, as on the generic adapter.

Positions: the engine passes `[1, n]` position ids; `Qwen3_5TextModel` broadcasts 2D ids to its 3 mRoPE streams and
the text stream exactly as it does for its own default `arange`, so text positions and rotary angles equal stock's.

Mixed precision: under autocast the conv tail comes out in the autocast dtype (the in-projection's) and the recurrent
state stays fp32, as in stock's cache; `torch_gated_delta_rule` runs the operations of stock's torch fallback, whose
matmuls autocast lowers to its dtype in both.

Cost: stock's torch fallback of the chunked delta rule writes each chunk's output in place into one buffer and slices
its inputs chunk by chunk; autograd turns both into full-size buffers per chunk, so its backward grows quadratically
with the length of the forward. `torch_gated_delta_rule` below is the same algorithm with `unbind`/`stack`, whose
backward is linear, so the cost of exact mode is linear in the prompt length for any chunk size. Without autograd
(prefill, scoring) it builds its within-block `[B, H, n, 64, 64]` terms for groups of blocks no larger than the
chunk's values, so a chunk's transient memory stays that of its inputs (same bits as building them at once).

When autograd records (the chunk forwards of exact mode's reverse pass), the torch path runs
`hand_backward_gated_delta_rule`: the same rule as an autograd Function with a hand-written backward
(`_DeltaRuleFunction`), the decomposition of fla's chunked backward (per-block states kept, a reverse scan of the
state's gradient, everything else for all blocks at once) in plain torch operations. fla's own kernels need CUDA and
Triton; on CPU, autograd through `torch_gated_delta_rule` records some ten small operations per 64-token block and
runs twice as many in backward, while the Function's backward runs three per block and everything else for all
blocks at once. Its forward runs the plain rule's operations, so outputs and states are the plain rule's bits (the
prefill, without autograd, runs the plain rule). `torch_gated_delta_rule` stays as the plain reference
(tests/test_gdn_backward.py compares outputs, final state and every input gradient).

On CUDA, when `fla` is installed (the `[cuda]` extra), flash-linear-attention's kernels run the delta rule for bf16 or
fp16 inputs (it rejects fp32) and the causal conv, both from the recorded state and both differentiable in it.
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.activations import ACT2FN
from transformers.integrations.accelerate import force_accelerate_hooks
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5GatedDeltaNet,
    Qwen3_5TextModel,
    apply_mask_to_padding_states,
    l2norm,
)

from .context_parallel import gather
from .engine import active_pass
from .generation import DecodePass
from .kv import KVTail, attention_switched

try:  # flash-linear-attention (CUDA, Triton): `pip install ".[cuda]"` in a checkout
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule
except ImportError:  # CPU installs, or GPU installs without fla: the torch path below
    fla_chunk_gated_delta_rule = None
try:
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_fused_recurrent_gated_delta_rule
except ImportError:
    fla_fused_recurrent_gated_delta_rule = None
try:
    from fla.modules.causal_conv1d import causal_conv1d as fla_causal_conv1d
except ImportError:
    try:  # fla releases before 0.5
        from fla.modules.convolution import causal_conv1d as fla_causal_conv1d
    except ImportError:
        fla_causal_conv1d = None

# Positions per block of the chunked delta rule; stock uses 64 too.
DELTA_RULE_BLOCK = 64


def _heads_fp32(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """The delta rule's inputs as stock prepares them: key heads repeated to the value heads, `[B, H, T, ...]` in
    fp32, query and key L2-normalized (not yet scaled: the chunked and the per-token rule scale as their stock
    counterparts do, which differ in the last bit).

    Args: query (or None), key `[B, T, Hk, Dk]`; value `[B, T, Hv, Dv]`; g, beta `[B, T, Hv]`.
    Returns: query (None for None), key `[B, Hv, T, Dk]`; value `[B, Hv, T, Dv]`; g, beta `[B, Hv, T]`.
    """
    v_heads, k_heads = value.shape[-2], key.shape[-2]
    if v_heads != k_heads:
        query = None if query is None else query.repeat_interleave(v_heads // k_heads, dim=2)
        key = key.repeat_interleave(v_heads // k_heads, dim=2)
    query, key, value, g, beta = (
        None if x is None else x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
        for x in (query, key, value, g, beta)
    )
    query = None if query is None else l2norm(query, dim=-1, eps=1e-6)
    return query, l2norm(key, dim=-1, eps=1e-6), value, g, beta


def _recording(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records an operation on `tensors` (None entries ignored)."""
    return torch.is_grad_enabled() and any(x.requires_grad for x in tensors if x is not None)


def torch_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    block: int = DELTA_RULE_BLOCK,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The gated delta rule, chunked along the sequence as in stock `torch_chunk_gated_delta_rule`, in fp32 (under
    autocast its matmuls run in the autocast dtype, as stock's do).

    Same mathematics and operation order as stock (q/k L2-normalised in the kernel), but the scan over blocks reads
    its inputs through `unbind` and collects outputs with `stack`, so that its backward is linear in the length.

    Args:
        query, key: `[B, T, Hk, Dk]`. With `query` None the rule computes the final state alone (the same bits), none
            of the query-side terms, and returns no output.
        value: `[B, T, Hv, Dv]`, `Hv` a multiple of `Hk` (each key head serves `Hv / Hk` consecutive value heads).
        g: `[B, T, Hv]` log-decay (<= 0).
        beta: `[B, T, Hv]` write strength.
        initial_state: `[B, Hv, Dk, Dv]`, or None for zeros. Receives a gradient when it requires one.

    Returns:
        The output `[B, T, Hv, Dv]` in the dtype of `query` (None without `query`), and the final state
        `[B, Hv, Dk, Dv]` in fp32.
    """
    out_dtype = (key if query is None else query).dtype
    batch, length, k_heads, k_dim = key.shape
    v_heads, v_dim = value.shape[-2:]
    blocks = -(-length // block)
    # The within-block terms take `[B, H, n, block, block]` per tensor for n blocks. Computed for every block at once
    # when autograd records (one graph node per operation, so the backward stays linear in the length); without it
    # (prefill, scoring), for groups of blocks whose such tensor is no larger than the layer's values `[B, H, T, Dv]`,
    # the inputs converted group by group too, so that the transient memory of a chunk does not exceed its inputs'.
    # Every operation before the scan is per token or per block, so the results are the same bits.
    recording = _recording(query, key, value, g, beta, initial_state)
    per_group = blocks if recording else max(1, blocks * v_dim // block)
    upper = torch.ones(block, block, dtype=torch.bool, device=key.device).triu(1)

    if initial_state is None:
        state = torch.zeros(batch, v_heads, k_dim, v_dim, dtype=torch.float32, device=key.device)
    else:
        state = initial_state.to(torch.float32)
    outputs = []
    for first in range(0, blocks, per_group):
        inputs = (query, key, value, g, beta)
        if per_group < blocks:
            span = slice(first * block, min((first + per_group) * block, length))
            inputs = tuple(None if x is None else x[:, span] for x in inputs)
        terms = _block_terms(*_blocked(*inputs, block), upper)
        # Across blocks: the sequential scan. `unbind` has one backward for all blocks, where indexing would have one
        # full-size gradient buffer per block.
        blocks_of = [x.unbind(2) if x is not None else [None] * terms[1].shape[2] for x in terms]
        for q_i, k_i, a_i, u_i, w_i, d_i in zip(*blocks_of, strict=True):
            v_new = u_i - w_i @ state
            if q_i is not None:
                outputs.append(q_i @ state + a_i @ v_new)
            state = state * d_i + k_i.transpose(-1, -2) @ v_new
        del terms, blocks_of
    if query is None:
        return None, state
    out = torch.stack(outputs, dim=2).reshape(batch, v_heads, -1, v_dim)[:, :, :length]
    return out.transpose(1, 2).to(out_dtype, memory_format=torch.contiguous_format), state


def _blocked(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, block: int
) -> tuple[torch.Tensor, ...]:
    """The delta rule's inputs over `n` tokens (shapes as in `torch_gated_delta_rule`) as its blocks: scaled query
    (None for None), key, `beta`-weighted key and value `[B, H, N, block, D]` in fp32, and `g` `[B, H, N, block]`,
    zero-padded to whole blocks (k = 0 and g = 0 leave the state unchanged)."""
    batch, length, k_heads, k_dim = key.shape
    v_heads = value.shape[-2]
    query, key, value, g, beta = _heads_fp32(query, key, value, g, beta)
    query = None if query is None else query * k_dim**-0.5
    pad = (block - length % block) % block
    if pad:  # F.pad copies even when there is nothing to pad
        query, key, value = (None if x is None else F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
        beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    del value, beta
    # [B, H, N, block, ...]
    query, key, k_beta, v_beta = (
        None if x is None else x.reshape(batch, v_heads, -1, block, x.shape[-1]) for x in (query, key, k_beta, v_beta)
    )
    return query, key, k_beta, v_beta, g.reshape(batch, v_heads, -1, block)


def _block_terms(
    query: torch.Tensor, key: torch.Tensor, k_beta: torch.Tensor, v_beta: torch.Tensor, g: torch.Tensor, upper
) -> tuple[torch.Tensor, ...]:
    """The within-block terms of the chunked delta rule for `n` blocks: inputs `[B, H, n, block, D]` (`g`
    `[B, H, n, block]`); returns the decayed queries and keys, the intra-block attention `[B, H, n, block, block]`,
    the UT-transformed values and key decays, and the per-block decay `[B, H, n, 1, 1]`. Without `query` (None), the
    decayed queries and the intra-block attention are None."""
    cum = g.cumsum(dim=3)
    pairwise = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    # Within a block: the UT transform turns the sequential delta updates into triangular solves.
    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise
    intra = None if query is None else (query @ key.transpose(-1, -2)) * pairwise
    del pairwise
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(
        ut_system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True
    )
    del ut_system
    query = None if query is None else query * cum.exp().unsqueeze(-1)
    key = key * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    block_decay = cum[..., -1].exp()[..., None, None]
    return query, key, intra, new_values, k_cumdecay, block_decay


def hand_backward_gated_delta_rule(
    query: torch.Tensor | None,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """`torch_gated_delta_rule` with a hand-written backward (`_DeltaRuleFunction`): what `gated_delta_rule` runs on
    the torch path when autograd records (the reverse pass of exact mode). Same arguments, results and mathematics;
    the key-head repeat, the L2 norms and the fp32 conversions stay in autograd around it. Output and final state are
    the plain rule's bits, also under autocast (matmuls in the autocast dtype, the state in fp32)."""
    out_dtype = (key if query is None else query).dtype
    device_type = key.device.type
    low = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    query, key, value, g, beta = _heads_fp32(query, key, value, g, beta)
    state = None if initial_state is None else initial_state.to(torch.float32)
    out, state = _DeltaRuleFunction.apply(query, key, value, g, beta, state, low)
    if out is None:
        return None, state
    return out.transpose(1, 2).to(out_dtype, memory_format=torch.contiguous_format), state


def _matmul(a: torch.Tensor, b: torch.Tensor, low: torch.dtype | None) -> torch.Tensor:
    """`a @ b` in fp32; or as autocast runs it in dtype `low` (operands and result rounded to `low`), returned in
    fp32."""
    return a @ b if low is None else (a.to(low) @ b.to(low)).float()


def _to_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """`[B, H, T, ...]` -> `[N, B * H, block, ...]`, contiguous and zero-padded to whole blocks (k = 0 and g = 0 leave
    the state unchanged): the layout of `_DeltaRuleFunction`, in which block `i` of every head is the slab `x[i]`."""
    pad = (block - x.shape[2] % block) % block
    if pad:  # F.pad copies even when there is nothing to pad
        x = F.pad(x, (0, 0, 0, pad) if x.dim() == 4 else (0, pad))
    x = x.reshape(x.shape[0] * x.shape[1], -1, block, *x.shape[3:])
    return x.transpose(0, 1).contiguous()


def _from_blocks(x: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """The inverse of `_to_blocks`: `[N, B * H, block, ...]` -> `[B, H, T, ...]`."""
    x = x.transpose(0, 1).flatten(1, 2)[:, :length]
    return x.reshape(batch, -1, *x.shape[1:])


def _delta_rule_terms(query, key, value, g, beta, low) -> types.SimpleNamespace:
    """The within-block terms of `_DeltaRuleFunction` for every block at once, `[N, B * H, block, ...]`: the
    mathematics and operations of `_blocked` and `_block_terms`, laid out for the scan. Inputs as
    `_DeltaRuleFunction` takes them."""
    block, k_dim = DELTA_RULE_BLOCK, key.shape[-1]
    t = types.SimpleNamespace(q=None, q_d=None, intra=None)
    t.k, t.v, t.beta, g = (_to_blocks(x, block) for x in (key, value, beta, g))
    t.k_beta = t.k * t.beta.unsqueeze(-1)
    v_beta = t.v * t.beta.unsqueeze(-1)
    cum = g.cumsum(dim=-1)
    t.cum_exp = cum.exp().unsqueeze(-1)
    # exp(c_i - c_j) on and below the diagonal; above it the exponent is >= 0 (it may overflow to inf), and tril_
    # writes zeros over it: the bits of the plain rule's masked_fill(-inf).exp().
    t.pairwise = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).exp_().tril_()
    t.ut_system = _matmul(t.k_beta, t.k.transpose(-1, -2), low).mul_(t.pairwise)
    t.k_cum = t.k_beta * t.cum_exp
    # The UT-transformed values and key decays (two solves, as the plain rule: one solve of both side by side gives
    # other bits, and the prefill's records come from the plain rule).
    t.u = torch.linalg.solve_triangular(t.ut_system, v_beta, upper=False, unitriangular=True)
    t.w = torch.linalg.solve_triangular(t.ut_system, t.k_cum, upper=False, unitriangular=True)
    t.to_end = (cum[..., -1:] - cum).exp().unsqueeze(-1)
    t.k_d = t.k * t.to_end
    t.decay = cum[..., -1].exp()[..., None, None]
    if query is not None:
        t.q = _to_blocks(query, block) * k_dim**-0.5
        t.q_d = t.q * t.cum_exp
        t.intra = _matmul(t.q, t.k.transpose(-1, -2), low).mul_(t.pairwise)
    return t


# The terms `_DeltaRuleFunction` saves for its backward (with `v_new` and the per-block states).
_SAVED_TERMS = (
    "k", "v", "beta", "q", "k_beta", "cum_exp", "pairwise", "ut_system", "k_cum", "u", "w", "to_end", "k_d", "decay",
    "q_d", "intra",
)  # fmt: skip


class _DeltaRuleFunction(torch.autograd.Function):
    """The chunked gated delta rule of `torch_gated_delta_rule` with a hand-written backward.

    Per block of 64 tokens and head (`c` the cumulative log-decay within the block, `P_ij = exp(c_i - c_j)` for
    `j <= i`, else 0): the UT transform `L = I + strict_lower((beta k k^T) * P)`, `u = L^-1 (beta v)`, `w = L^-1
    (beta k exp(c))`; the scan over blocks `v_new = u - w S`, `S' = exp(c_last) S + k_d^T v_new` with `k_d = k
    exp(c_last - c)`; the output `o = (q exp(c)) S + ((q k^T) * P) v_new`.

    Forward (no graph): the block terms for every block at once, the scan (five operations per block), then the
    outputs of every block at once; the operations of the plain rule, so its output and final state are the same bits
    (in fp32 and under autocast), as `prefill_attention_reuse` needs: the prefill runs the plain rule without autograd
    and the reverse pass this one. Saved: the block terms, `v_new` and the state at the start of every block (no more
    than the plain rule's autograd saves). Backward: the reverse scan of the state's gradient (three operations per
    block: `dv_new = (q k^T * P)^T do + k_d dS'`, `dS = exp(c_last) dS' + (q exp(c))^T do - w^T dv_new`), then every
    other gradient for every block at once, the UT transform's through one transposed triangular solve. The plain
    rule records about ten operations per block in its forward and runs twice as many in its backward.

    Inputs as `_heads_fp32` returns them, in fp32: query (None: the final state alone) and key `[B, H, T, Dk]`
    (L2-normalized, not scaled), value `[B, H, T, Dv]`, g and beta `[B, H, T]`, the initial state `[B, H, Dk, Dv]`
    (None: zeros); `low`: the autocast dtype of the matmuls (None: fp32). Returns the output `[B, H, T, Dv]` (fp32, or
    `low`; None without query) and the final state `[B, H, Dk, Dv]` fp32.
    """

    @staticmethod
    def forward(ctx, query, key, value, g, beta, initial_state, low):
        ctx.set_materialize_grads(False)
        batch, heads, length, k_dim = key.shape
        v_dim = value.shape[-1]
        with torch.autocast(key.device.type, enabled=False):
            t = _delta_rule_terms(query, key, value, g, beta, low)
            # states[i]: the state at the start of block i, states[-1] the final one.
            states = key.new_empty(t.u.shape[0] + 1, batch * heads, k_dim, v_dim)
            states[0] = 0 if initial_state is None else initial_state.reshape(batch * heads, k_dim, v_dim)
            v_new = torch.empty_like(t.u)
            # The plain rule's operations (a fused baddbmm would round differently), so that the outputs and states
            # are its bits: the prefill runs the plain rule, and prefill_attention_reuse keeps its attention outputs.
            w, k_dt = t.w, t.k_d.transpose(-1, -2)
            if low is not None:
                w, k_dt = w.to(low), k_dt.to(low)
            for i in range(v_new.shape[0]):
                torch.sub(t.u[i], _matmul(w[i], states[i], low), out=v_new[i])
                torch.add(states[i] * t.decay[i], _matmul(k_dt[i], v_new[i], low), out=states[i + 1])
            out = None
            if query is not None:
                out = _matmul(t.q_d, states[:-1], low) + _matmul(t.intra, v_new, low)
                # Under autocast the plain rule adds the two matmuls' results in their dtype.
                out = _from_blocks(out if low is None else out.to(low), batch, length)
        ctx.save_for_backward(*(getattr(t, name) for name in _SAVED_TERMS), v_new, states)
        ctx.low, ctx.shape = low, (batch, heads, length, k_dim, v_dim)
        return out, states[-1].reshape(batch, heads, k_dim, v_dim).clone()

    @staticmethod
    def backward(ctx, d_out, d_final):
        low = ctx.low
        batch, heads, length, k_dim, v_dim = ctx.shape
        *terms, v_new, states = ctx.saved_tensors
        t = types.SimpleNamespace(**dict(zip(_SAVED_TERMS, terms, strict=True)))
        starts, block = states[:-1], DELTA_RULE_BLOCK
        with torch.autocast(states.device.type, enabled=False):
            # From the outputs: into v_new (through the intra-block attention) and into each block's start state.
            d_o = None if d_out is None else _to_blocks(d_out.to(states.dtype), block)
            if d_o is None:
                from_out, into_state = torch.zeros_like(v_new), torch.zeros_like(starts)
            else:
                from_out = _matmul(t.intra.transpose(-1, -2), d_o, low)
                into_state = _matmul(t.q_d.transpose(-1, -2), d_o, low)
            # d_states[i]: the gradient of the state at the start of block i (d_states[-1]: of the final state).
            d_states = torch.empty_like(states)
            d_states[-1] = 0 if d_final is None else d_final.reshape(d_states.shape[1:])
            d_v_new = torch.empty_like(v_new)
            if low is None:
                w_t = t.w.transpose(-1, -2)
                for i in reversed(range(v_new.shape[0])):
                    torch.baddbmm(from_out[i], t.k_d[i], d_states[i + 1], out=d_v_new[i])
                    carried = torch.addcmul(into_state[i], d_states[i + 1], t.decay[i])
                    torch.baddbmm(carried, w_t[i], d_v_new[i], alpha=-1, out=d_states[i])
            else:
                k_d, w_t = t.k_d.to(low), t.w.transpose(-1, -2).to(low)
                for i in reversed(range(v_new.shape[0])):
                    d_v_new[i] = from_out[i] + (k_d[i] @ d_states[i + 1].to(low)).float()
                    carried = torch.addcmul(into_state[i], d_states[i + 1], t.decay[i])
                    d_states[i] = carried - (w_t[i] @ d_v_new[i].to(low)).float()
            del from_out, into_state
            ends = d_states[1:]  # the gradient of the state at the end of each block
            d_decay = (ends * starts).sum((-1, -2))
            d_k_d = _matmul(v_new, ends.transpose(-1, -2), low)
            d_w = _matmul(d_v_new, starts.transpose(-1, -2), low).neg_()
            # The UT transform: x = L^-1 r gives dr = L^-T dx and dL = -dr x^T, of which the strictly lower part
            # (the solve reads neither the diagonal nor the upper triangle).
            d_rhs = torch.linalg.solve_triangular(
                t.ut_system.transpose(-1, -2), torch.cat([d_v_new, d_w], -1), upper=True, unitriangular=True
            )
            del d_v_new, d_w
            d_ut = (d_rhs @ torch.cat([t.u, t.w], -1).transpose(-1, -2).neg_()).tril_(-1)
            d_v_beta, d_k_cum = d_rhs.split([v_dim, k_dim], dim=-1)
            # The gradients of the products k_beta k^T and q k^T, stacked `[..., 2 block, block]`, so that their
            # matmuls with k (into k_beta and q) and their transposed ones (into k, summed) run once each.
            products = d_ut.new_empty(*d_ut.shape[:-2], block * (1 if d_o is None else 2), block)
            torch.mul(d_ut, t.pairwise, out=products[..., :block, :])
            # The gradient of P's exponents: d(P_ij) P_ij, with P's uses (k_beta k^T) * P and (q k^T) * P.
            d_exponents = d_ut.mul_(t.ut_system)
            d_cum = -(d_k_d * t.k_d).sum(-1)
            d_last = -d_cum.sum(-1) + d_decay * t.decay[..., 0, 0]
            d_cum += (d_k_cum * t.k_cum).sum(-1)
            left = t.k_beta
            if d_o is not None:
                d_intra = _matmul(d_o, v_new.transpose(-1, -2), low)
                torch.mul(d_intra, t.pairwise, out=products[..., block:, :])
                d_exponents.addcmul_(d_intra, t.intra)
                del d_intra
                d_q_d = _matmul(d_o, starts.transpose(-1, -2), low)
                d_cum += (d_q_d * t.q_d).sum(-1)
                left = torch.cat([t.k_beta, t.q], dim=-2)
            into_left = _matmul(products, t.k, low)  # [d k_beta; d q] through the products
            d_k = _matmul(products.transpose(-1, -2), left, low) + d_k_d * t.to_end
            del products
            d_k_beta = into_left[..., :block, :] + d_k_cum * t.cum_exp
            d_q = None
            if d_o is not None:
                d_q = (into_left[..., block:, :] + d_q_d * t.cum_exp) * k_dim**-0.5
            d_cum += d_exponents.sum(-1) - d_exponents.sum(-2)
            d_cum[..., -1] += d_last
            # c = cumsum(g): the gradient of g_j sums that of every c_i with i >= j.
            d_g = d_cum.flip(-1).cumsum(-1).flip(-1)
            d_k += d_k_beta * t.beta.unsqueeze(-1)
            d_beta = (d_k_beta * t.k).sum(-1) + (d_v_beta * t.v).sum(-1)
            d_v = d_v_beta * t.beta.unsqueeze(-1)
            grads = [None if x is None else _from_blocks(x, batch, length) for x in (d_q, d_k, d_v, d_g, d_beta)]
            d_initial = d_states[0].reshape(batch, heads, k_dim, v_dim) if ctx.needs_input_grad[5] else None
        return (*grads, d_initial, None)


def _fla(kernel, query, key, value, g, beta, initial_state) -> tuple[torch.Tensor, torch.Tensor]:
    """Calls an fla gated-delta-rule `kernel` (chunked or fused recurrent) with q/k L2-normalized in the kernel.
    Shapes as in `torch_gated_delta_rule`; returns the output and the fp32 final state `[B, Hv, Dk, Dv]`."""
    v_heads = value.shape[-2]
    if key.shape[-2] != v_heads:
        # Older fla releases need as many q/k heads as v heads.
        query = query.repeat_interleave(v_heads // key.shape[-2], dim=2)
        key = key.repeat_interleave(v_heads // key.shape[-2], dim=2)
    out, state = kernel(
        query,
        key,
        value,
        g=g,
        beta=beta,
        # A copy: the fused recurrent kernel may update its initial state in place, and decoding rows start from the
        # prompt's state.
        initial_state=None if initial_state is None else initial_state.to(torch.float32, copy=True),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return out, state.to(torch.float32)


def gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """`torch_gated_delta_rule`, or the flash-linear-attention kernel for bf16/fp16 CUDA inputs when installed; on the
    torch path when autograd records, `hand_backward_gated_delta_rule` (the same rule, with a hand-written backward).

    Shapes as in `torch_gated_delta_rule`; the final state is fp32 `[B, Hv, Dk, Dv]`. With `query` None, the final
    state alone (the kernel, which always computes an output, gets the keys as queries: the state does not read them).
    """
    if fla_chunk_gated_delta_rule is not None and key.is_cuda and key.dtype in (torch.bfloat16, torch.float16):
        queries = key if query is None else query
        out, state = _fla(fla_chunk_gated_delta_rule, queries, key, value, g, beta, initial_state)
        return (None if query is None else out), state
    if _recording(query, key, value, g, beta, initial_state):
        return hand_backward_gated_delta_rule(query, key, value, g, beta, initial_state)
    return torch_gated_delta_rule(query, key, value, g, beta, initial_state)


def torch_recurrent_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token, in fp32: the operations of stock `torch_recurrent_gated_delta_rule`,
    which transformers runs for each decoded token, without its in-place writes (outputs are stacked).

    Shapes as in `torch_gated_delta_rule`. Decoding calls it with `T = 1` per step; it never writes
    `initial_state`, so the rows of a shared prompt can all start from the prompt's state (broadcast).

    Returns:
        The output `[B, T, Hv, Dv]` in the dtype of `query` (None without `query`), and the final state
        `[B, Hv, Dk, Dv]` in fp32.
    """
    out_dtype = (key if query is None else query).dtype
    batch, length, k_heads, k_dim = key.shape
    v_heads, v_dim = value.shape[-2:]
    query, key, value, g, beta = _heads_fp32(query, key, value, g, beta)
    query = query / (query.shape[-1] ** 0.5)
    if initial_state is None:
        state = torch.zeros(batch, v_heads, k_dim, v_dim, dtype=torch.float32, device=query.device)
    else:
        state = initial_state.to(torch.float32)
    outputs = []
    for i in range(length):
        q_t, k_t, v_t = query[:, :, i], key[:, :, i], value[:, :, i]
        state = state * g[:, :, i].exp()[..., None, None]
        kv_mem = (state * k_t.unsqueeze(-1)).sum(dim=-2)
        delta = (v_t - kv_mem) * beta[:, :, i].unsqueeze(-1)
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        outputs.append((state * q_t.unsqueeze(-1)).sum(dim=-2))
    out = torch.stack(outputs, dim=1)  # [B, T, Hv, Dv]
    return out.to(out_dtype), state


def recurrent_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch_recurrent_gated_delta_rule`, or flash-linear-attention's fused recurrent kernel (the one transformers
    runs for decode steps) for CUDA inputs when installed. Shapes as in `torch_gated_delta_rule`; no autograd needed.
    """
    if fla_fused_recurrent_gated_delta_rule is not None and query.is_cuda:
        return _fla(fla_fused_recurrent_gated_delta_rule, query, key, value, g, beta, initial_state)
    return torch_recurrent_gated_delta_rule(query, key, value, g, beta, initial_state)


def torch_causal_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str, history: torch.Tensor | None
) -> torch.Tensor:
    """The depthwise causal conv of `Qwen3_5GatedDeltaNet` over `x` `[B, n, C]`, preceded by `history`.

    Args:
        weight: `[C, 1, W]`; bias: `[C]` or None.
        history: `[B, C, W - 1]` the inputs before `x` (None: zeros, as stock pads the start of a sequence).

    Returns:
        `activation(conv)` `[B, n, C]` in the dtype of `x`.
    """
    x = x.transpose(1, 2)
    if history is None:
        history = x.new_zeros(x.shape[0], x.shape[1], weight.shape[-1] - 1)
    window = torch.cat([history.to(x.dtype), x], dim=-1)  # [B, C, W - 1 + n]
    conv = F.conv1d(window.to(weight.dtype), weight, bias, groups=weight.shape[0])
    return ACT2FN[activation](conv).to(x.dtype).transpose(1, 2)


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str, history: torch.Tensor | None
) -> torch.Tensor:
    """`torch_causal_conv`, or flash-linear-attention's `causal_conv1d` for CUDA inputs when installed.

    fla keeps a conv state of `W` inputs per channel, the oldest first, of which the first is not read: the history
    goes in its last `W - 1` columns. Its backward gives the gradient of that initial state, which exact mode needs.
    """
    if fla_causal_conv1d is None or not x.is_cuda or activation not in ("silu", "swish"):
        return torch_causal_conv(x, weight, bias, activation, history)
    initial = None
    if history is not None:
        initial = torch.cat([history.new_zeros(*history.shape[:2], 1), history], dim=-1).to(x.dtype)
    out, _ = fla_causal_conv1d(
        x=x.contiguous(), weight=weight[:, 0], bias=bias, initial_state=initial, activation=activation
    )
    return out


@force_accelerate_hooks("conv1d")
def _gated_deltanet_forward(
    self: Qwen3_5GatedDeltaNet,
    hidden_states: torch.Tensor,
    cache_params=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """`Qwen3_5GatedDeltaNet.forward` over the active pass: `hidden_states` `[1, n, hidden]` -> `[1, n, hidden]`.

    Starts from the last visible record of this layer and emits `(conv_tail [1, C, kernel-1], state [1, Hv, Dk, Dv])`
    at the end of the chunk. Writes nothing in place.
    """
    if cache_params is not None:
        raise ValueError("trl_longstraw runs Qwen3.5 without a cache: call the model with use_cache=False")
    if kwargs.get("cu_seq_lens_q") is not None:
        raise ValueError("packed sequences (cu_seq_lens_q) are not supported by trl_longstraw: pass one row per call")
    hidden_states = apply_mask_to_padding_states(hidden_states, attention_mask)
    batch, length, _ = hidden_states.shape
    p = active_pass()
    records = p.read(self.layer_idx)
    width = self.conv_kernel_size - 1

    projected = self.in_proj_qkv(hidden_states)  # [B, n, C]
    # The last layer of a prompt pass emits its record and returns zeros: nothing reads its output. In a
    # context-parallel round its collectives then carry the records alone (`_round_core`).
    unread = p.outputs_unread(self.layer_idx)
    z = None if unread else self.in_proj_z(hidden_states).reshape(batch, length, -1, self.head_v_dim)
    b = self.in_proj_b(hidden_states)
    a = self.in_proj_a(hidden_states)

    # Stock pads the conv with zeros on the left and starts the recurrence from zeros.
    history, initial_state = records[-1] if records else (None, None)
    if history is not None and history.shape[0] != batch:
        # Decoding: the G rows start from the prompt's record (batch 1), read, never written; each row's own record
        # then replaces it in the decode tail.
        history = history.expand(batch, -1, -1)
        initial_state = initial_state.expand(batch, -1, -1, -1)
    if p.cp is not None:
        core = _round_core(self, p, projected, a, b, history, initial_state, outputs=not unread)
        if unread:
            return hidden_states.new_zeros(())
        core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(core.reshape(batch, length, -1))
    mixed_qkv = causal_conv(projected, self.conv1d.weight, self.conv1d.bias, self.activation, history)

    query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    query = query.reshape(batch, length, -1, self.head_k_dim)
    key = key.reshape(batch, length, -1, self.head_k_dim)
    value = value.reshape(batch, length, -1, self.head_v_dim)
    beta = b.sigmoid()
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
    if isinstance(p, DecodePass):
        # One token per row and step, as transformers decodes (its recurrent rule, not the chunked one).
        core, state = recurrent_gated_delta_rule(query, key, value, g, beta, initial_state)
    else:
        core, state = gated_delta_rule(None if unread else query, key, value, g, beta, initial_state)

    # The last `kernel - 1` conv inputs (reaching into the history for a chunk shorter than that); a copy, so that the
    # record does not keep the whole chunk's conv input alive.
    recent = projected[:, length - min(length, width) :].transpose(1, 2)
    past = recent.new_zeros(batch, recent.shape[1], width) if history is None else history.to(recent.dtype)
    tail = torch.cat([past, recent], dim=-1)[:, :, -width:].clone()
    p.emit(self.layer_idx, (tail, state), supersedes=True)
    if unread:
        return hidden_states.new_zeros(())

    core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(core.reshape(batch, length, -1))


def _round_core(
    self: Qwen3_5GatedDeltaNet,
    p,
    projected: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    history: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    outputs: bool = True,
) -> torch.Tensor | None:
    """The conv and delta rule of a context-parallel round (`context_parallel`), sequence-parallel over the W ranks.

    Rank `r` runs its own chunk (`p.cp.chunk`, all heads). One all-gather of every rank's last `kernel - 1` conv
    inputs gives each rank the conv history at the start of its chunk (the round's history for rank 0). Rank 0 runs the
    delta rule from the round's state, as one process does; a later rank runs it from an unknown state
    (`segment_gated_delta_rule`: its chunk's output and final state from zero, and their linear action on the initial
    state). One all-gather of every rank's final state and transition gives every rank the state at each chunk
    boundary of the round, one after the other (`final + transition @ start`), so rank `r` resumes its output from the
    state at its chunk's start (`resume_gated_delta_rule`), and every rank has the whole records of every chunk.

    Args:
        p: the active pass, with its round `p.cp`: this rank holds the `n = p.cp.lengths[rank]` tokens of chunk
            `p.cp.chunk`.
        projected: `[1, n, C]` conv inputs; `a`, `b`: `[1, n, Hv]` decay and write-strength inputs.
        history, initial_state: the record before the round (`[1, C, kernel - 1]`, `[1, Hv, Dk, Dv]` fp32), or None.
        outputs: False for the records alone (the last layer of a prompt pass: `Pass.records_only`); the same
            collectives run.

    Returns:
        The delta rule's output `[1, n, Hv, Dv]` for this rank's tokens (None without `outputs`). Emits
        `(conv_tail, state)` of every chunk of the round (`Pass.emit_round`) when the pass records.
    """
    shards, cp = p.shard, p.cp
    world, rank, lengths, group = shards.world, shards.rank, cp.lengths, shards.group
    width, length, channels = self.conv_kernel_size - 1, projected.shape[1], projected.shape[2]
    # This rank's last `width` conv inputs (zeros before a chunk shorter than that), then every rank's.
    recent = projected[0, max(0, length - width) :]
    tails = gather(torch.cat([recent.new_zeros(width - recent.shape[0], channels), recent]), world, group)
    # The conv window (the last `width` inputs) at the end of each chunk of the round, from the round's history.
    window = projected.new_zeros(width, channels) if history is None else history[0].t().to(projected.dtype)
    windows = []
    for s, n in enumerate(lengths):
        window = torch.cat([window, tails[s, width - min(n, width) :]])[-width:]
        windows.append(window)
    past = history if rank == 0 else windows[rank - 1].t()[None]
    mixed = causal_conv(projected, self.conv1d.weight, self.conv1d.bias, self.activation, past)
    query, key, value = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    query = query.reshape(1, length, -1, self.head_k_dim)
    key = key.reshape(1, length, -1, self.head_k_dim)
    value = value.reshape(1, length, -1, self.head_v_dim)
    beta = b.sigmoid()
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
    state_shape = (1, self.num_v_heads, self.head_k_dim, self.head_v_dim)
    query = query if outputs else None
    if rank == 0:
        out, final = gated_delta_rule(query, key, value, g, beta, initial_state)
        transition = final.new_zeros(*state_shape[:-1], self.head_k_dim)  # the final state is already whole
    else:
        out, carry, final, transition = segment_gated_delta_rule(query, key, value, g, beta)
    # [W, Hv, Dk, Dv + Dk]: each rank's final state and transition.
    everyone = gather(torch.cat([final, transition], dim=-1)[0], world, group)
    start = final.new_zeros(state_shape) if initial_state is None else initial_state.to(torch.float32)
    states = []
    # In fp32 (autocast would round the carried state to its dtype at every chunk boundary).
    with torch.autocast(projected.device.type, enabled=False):
        for s in range(world):
            if s == rank and s > 0 and outputs:
                out = resume_gated_delta_rule(out, carry, start)
            finals, transitions = everyone[s : s + 1].split([self.head_v_dim, self.head_k_dim], dim=-1)
            # A copy for the first chunk: a record must not keep the whole gathered buffer alive.
            start = finals.contiguous() if s == 0 else finals + transitions @ start
            states.append(start)
    # With autograd, also in a gradient-checkpointing recompute (which emits nothing): the records are computed in
    # every pass, so that a recompute saves the tensors that its forward saved.
    if p.append or torch.is_grad_enabled():
        p.emit_round(
            self.layer_idx,
            [(w.t().contiguous()[None], state) for w, state in zip(windows, states, strict=True)],
        )
    return out


def segment_gated_delta_rule(
    query: torch.Tensor | None, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The gated delta rule over a segment whose initial state `S0` is not known yet (a later rank's chunk of a
    context-parallel round), as an affine function of `S0`.

    The rule is linear in `(state, values)` together: from `S0`, the state after the segment is `final + transition
    @ S0` and the output at token `t` is `out[t] + carry[t] @ S0` (per value head), where `out`, `final` are the rule
    from a zero state and `transition`, `carry` the rule's action on `S0` (zero values from the identity). Both are one
    call of `gated_delta_rule` (the torch rule, or fla's kernel) on values widened with `Dk` zero columns from the
    state `[0 | I]`: the operations of the plain rule on a wider value. `resume_gated_delta_rule` applies `S0`.

    Args: shapes as in `torch_gated_delta_rule` (`query` None: the final state and transition alone).

    Returns:
        out `[B, T, Hv, Dv]` and carry `[B, T, Hv, Dk]` in the dtype of `query` (None without `query`); final
        `[B, Hv, Dk, Dv]` and transition `[B, Hv, Dk, Dk]` in fp32.
    """
    batch, _, v_heads, v_dim = value.shape
    k_dim = key.shape[-1]
    widened = torch.cat([value, value.new_zeros(*value.shape[:-1], k_dim)], dim=-1)
    eye = torch.eye(k_dim, dtype=torch.float32, device=value.device).expand(batch, v_heads, k_dim, k_dim)
    start = torch.cat([eye.new_zeros(batch, v_heads, k_dim, v_dim), eye], dim=-1)
    out, state = gated_delta_rule(query, key, widened, g, beta, start)
    if out is None:
        return None, None, state[..., :v_dim], state[..., v_dim:]
    return out[..., :v_dim], out[..., v_dim:], state[..., :v_dim], state[..., v_dim:]


def resume_gated_delta_rule(out: torch.Tensor, carry: torch.Tensor, initial_state: torch.Tensor) -> torch.Tensor:
    """The output of `segment_gated_delta_rule`'s segment from `initial_state` `[B, Hv, Dk, Dv]` (fp32): `out + carry
    @ initial_state` per token and value head, summed in fp32 and returned in the dtype of `out` `[B, T, Hv, Dv]`."""
    resumed = out.float() + torch.einsum("bthk,bhkv->bthv", carry.float(), initial_state)
    return resumed.to(out.dtype)


class Qwen3_5Adapter:
    """Records: `(keys, values)` `[1, Hkv, n, D]` per gated-attention layer and chunk; `(conv_tail, state)`
    `[1, C, kernel-1]`, `[1, Hv, Dk, Dv]` fp32 per Gated DeltaNet layer, superseding the earlier ones."""

    # The gated-attention layers go through `sharding.attend` (kv.longstraw_attention); the DeltaNet records do not
    # grow with the prompt and are replicated on every rank of a shard group, except the exact-mode chunk boundaries,
    # which stay on their chunk's owner (see docs/distributed.md).
    shards_prompt_state = True
    # Decoding against a sharded prompt state: attention through `sharding.sharded_decode_attention`; the recurrent
    # records (qwen3_5) are whole on every rank after a sharded prefill.
    decodes_sharded = True

    @staticmethod
    def context_parallel(world: int) -> bool:
        """Whether the prompt passes of a state sharded over `world` ranks can split their tokens (see
        `context_parallel`): always, as the attention layers go through `sharding.attend` and the DeltaNet layers run
        sequence-parallel (`_round_core`) for any number of ranks and heads."""
        return True

    def __init__(self, causal_lm: PreTrainedModel):
        if not isinstance(causal_lm.base_model, Qwen3_5TextModel):
            raise ValueError(
                f"{type(causal_lm).__name__} is not supported by trl_longstraw, which trains Qwen3.5 text-only: load "
                "the checkpoint with transformers.Qwen3_5ForCausalLM.from_pretrained(path) and pass it with its "
                "tokenizer (processing_class=AutoTokenizer.from_pretrained(path))."
            )
        self.causal_lm = causal_lm
        self.deltanets = [m for m in causal_lm.modules() if isinstance(m, Qwen3_5GatedDeltaNet)]

    @staticmethod
    def decode_tail(capacity: int) -> KVTail:
        """Storage of the decoded rows (see `generation.DecodePass`): keys and values of up to `capacity` tokens per
        row on gated-attention layers, and each row's own `(conv_tail, state)` on DeltaNet layers, replaced at every
        step (`KVTail.replace`)."""
        return KVTail(capacity)

    @contextlib.contextmanager
    def activate(self):
        """Routes attention through `longstraw_attention` and DeltaNets through `_gated_deltanet_forward`."""
        # An instance attribute shadows the class's forward. Under accelerate's device hooks the instance `forward` is
        # the hook, which calls `_old_forward`: replace that one instead, so that the hook still runs.
        names = ["_old_forward" if "_old_forward" in m.__dict__ else "forward" for m in self.deltanets]
        previous = [m.__dict__.get(name) for m, name in zip(self.deltanets, names, strict=True)]
        try:
            for m, name in zip(self.deltanets, names, strict=True):
                setattr(m, name, types.MethodType(_gated_deltanet_forward, m))
            with attention_switched(self.causal_lm):
                yield
        finally:
            for m, name, forward in zip(self.deltanets, names, previous, strict=True):
                if forward is None:
                    delattr(m, name)
                else:
                    setattr(m, name, forward)

    @staticmethod
    def state_bytes(config, dtype_bytes: int = 2) -> tuple[int, int]:
        """`(bytes per prompt token, fixed bytes)` of the prompt state kept in detached mode.

        Per token: keys and values of the gated-attention layers (`dtype_bytes` each). Fixed: per DeltaNet layer, the
        conv tail (`kernel - 1` positions of the `2 Hk Dk + Hv Dv` conv channels, `dtype_bytes` each) and the fp32
        recurrent state `Hv Dk Dv`. Exact mode keeps the fixed part once per prefill chunk (split over the ranks under
        `shard_prompt_state`). `config` may be the text config or the composite `Qwen3_5Config`.
        """
        config = config.get_text_config()
        full = sum(t == "full_attention" for t in config.layer_types[: config.num_hidden_layers])
        linear = sum(t == "linear_attention" for t in config.layer_types[: config.num_hidden_layers])
        if full + linear != config.num_hidden_layers:
            raise ValueError(f"unknown layer types in {config.layer_types}: expected full_attention/linear_attention")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        per_token = full * 2 * config.num_key_value_heads * head_dim * dtype_bytes
        conv_channels = 2 * config.linear_num_key_heads * config.linear_key_head_dim + (
            config.linear_num_value_heads * config.linear_value_head_dim
        )
        tail = (config.linear_conv_kernel_dim - 1) * conv_channels * dtype_bytes
        state = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
        return per_token, linear * (tail + state)
