"""The hand-written backward of qwen3_5's chunked gated delta rule (`hand_backward_gated_delta_rule`, the torch path of
exact mode's reverse pass) against the plain rule it replaces when autograd records (`torch_gated_delta_rule`,
autograd through plain operations): outputs and final state bit for bit, every input gradient within GRAD_RTOL, for
lengths that divide no block of 64, grouped value heads, with and without an initial state or queries, the widened
values of the context-parallel segments, and under bf16 autocast; and `gradcheck` of the autograd Function in fp64."""

from __future__ import annotations

import pytest
import torch

import trl_longstraw.qwen3_5 as qwen3_5
from tests.tolerances import BF16_ERROR_FACTOR, GRAD_RTOL
from trl_longstraw.qwen3_5 import (
    gated_delta_rule,
    hand_backward_gated_delta_rule,
    resume_gated_delta_rule,
    segment_gated_delta_rule,
    torch_gated_delta_rule,
)


def _inputs(length: int, initial: bool, k_heads: int = 2, v_heads: int = 6, batch: int = 1, seed: int = 0):
    """q, k `[B, T, Hk, 8]`, v `[B, T, Hv, 8]`, g, beta `[B, T, Hv]`, state `[B, Hv, 8, 8]` (None without `initial`),
    every one a leaf requiring grad; decays slow enough that the state carries across blocks."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, length, k_heads, 8, generator=g) for _ in range(2))
    v = torch.randn(batch, length, v_heads, 8, generator=g)
    decay = -torch.rand(batch, length, v_heads, generator=g) * 0.3
    beta = torch.rand(batch, length, v_heads, generator=g)
    state = torch.randn(batch, v_heads, 8, 8, generator=g) if initial else None
    return [x if x is None else x.requires_grad_() for x in (q, k, v, decay, beta, state)]


def _run(fn, inputs):
    """`fn`'s output (None without queries), final state, and the gradient of every input requiring one for a random
    linear function of both."""
    out, state = fn(*inputs)
    g = torch.Generator().manual_seed(5)
    loss = (state * torch.randn(state.shape, generator=g)).sum()
    if out is not None:
        loss = loss + (out * torch.randn(out.shape, generator=g)).sum()
    return out, state, torch.autograd.grad(loss, [x for x in inputs if x is not None and x.requires_grad])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error in norm; absolute below norm 1."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1.0)).item()


def _assert_matches(ours, ref):
    out, state, grads = ours
    ref_out, ref_state, ref_grads = ref
    # The forward runs the plain rule's operations: the same bits (prefill_attention_reuse relies on it).
    assert (out is None) == (ref_out is None)
    assert out is None or (out.dtype == ref_out.dtype and torch.equal(out, ref_out))
    assert state.dtype == torch.float32 and torch.equal(state, ref_state)
    assert len(grads) == len(ref_grads)
    for g, ref in zip(grads, ref_grads, strict=True):
        assert g.shape == ref.shape and _rel(g, ref) <= GRAD_RTOL


@pytest.mark.parametrize("length", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("initial", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("queries", [True, False], ids=["output", "state-only"])
def test_hand_backward_matches_plain_rule(length, initial, queries):
    """Outputs, final state and the gradient of every input (initial state included) equal the plain rule's, with 3
    value heads per key head; without queries (the last layer of a prompt pass), the final state and its gradients."""
    inputs = _inputs(length, initial)
    if not queries:
        inputs[0] = None
    _assert_matches(_run(hand_backward_gated_delta_rule, inputs), _run(torch_gated_delta_rule, inputs))


def test_hand_backward_batch_and_equal_heads():
    """A batch of 2 rows and as many key heads as value heads; an initial state that is no leaf (a broadcast row)."""
    inputs = _inputs(130, initial=False, k_heads=3, v_heads=3, batch=2, seed=1)
    start = torch.randn(1, 3, 8, 8, requires_grad=True)
    inputs[-1] = start.expand(2, -1, -1, -1) * 1.5
    _assert_matches(_run(hand_backward_gated_delta_rule, inputs), _run(torch_gated_delta_rule, inputs))


def test_hand_backward_partial_gradients():
    """Inputs that need no gradient get none (the segment's identity start, constant values), the others the plain
    rule's."""
    inputs = _inputs(100, initial=True, seed=2)
    inputs[2] = inputs[2].detach()
    inputs[5] = inputs[5].detach()
    _assert_matches(_run(hand_backward_gated_delta_rule, inputs), _run(torch_gated_delta_rule, inputs))


@pytest.mark.parametrize("queries", [True, False], ids=["output", "state-only"])
def test_segment_rule_through_hand_backward(queries, monkeypatch):
    """The context-parallel segments (`segment_gated_delta_rule`: values widened by `Dk` zero columns from the state
    `[0 | I]`, which needs no gradient), resumed one after the other, run the hand-written backward; their outputs,
    final state and gradients equal those of the same segments through the plain rule."""
    inputs = _inputs(150, initial=True, seed=3)
    if not queries:
        inputs[0] = None

    def segments(q, k, v, g, beta, s):
        outs = []
        for a, b in zip([0, 1, 66, 136], [1, 66, 136, 150], strict=True):
            o, carry, final, transition = segment_gated_delta_rule(
                None if q is None else q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b]
            )
            if q is not None:
                outs.append(resume_gated_delta_rule(o, carry, s))
            s = final + transition @ s
        return (torch.cat(outs, 1) if outs else None), s

    calls = []
    hand = qwen3_5.hand_backward_gated_delta_rule

    def counted(*args):
        calls.append(args[2].shape[-1])
        return hand(*args)

    monkeypatch.setattr(qwen3_5, "hand_backward_gated_delta_rule", counted)
    ours = _run(segments, inputs)
    assert calls == [16] * 4  # Dv + Dk columns, every segment
    monkeypatch.setattr(qwen3_5, "hand_backward_gated_delta_rule", torch_gated_delta_rule)
    _assert_matches(ours, _run(segments, inputs))


def test_dispatch(monkeypatch):
    """`gated_delta_rule` on CPU runs the hand-written backward when autograd records, and the plain rule (whose
    block terms are bounded in memory) without it."""
    calls = []
    for name in ("hand_backward_gated_delta_rule", "torch_gated_delta_rule"):
        fn = getattr(qwen3_5, name)
        monkeypatch.setattr(qwen3_5, name, lambda *x, fn=fn, name=name: calls.append(name) or fn(*x))
    inputs = _inputs(70, initial=True)
    gated_delta_rule(*inputs)
    assert calls == ["hand_backward_gated_delta_rule"]
    calls.clear()
    with torch.no_grad():
        gated_delta_rule(*inputs)
    gated_delta_rule(*[x.detach() for x in inputs])
    assert calls == ["torch_gated_delta_rule"] * 2


@pytest.mark.parametrize("length", [63, 200])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_hand_backward_bf16_autocast(length, dtype):
    """Under bf16 autocast (the matmuls in bf16, the state in fp32, as the plain rule runs them), with q, k, v in bf16
    (as the model's projections give them) or fp32: the output and final state are the plain rule's bits under
    autocast, and the error of every gradient against the fp32 plain rule is at most BF16_ERROR_FACTOR times the plain
    rule's own error under autocast."""
    inputs = _inputs(length, initial=True, seed=4)
    rounded = [x.detach().to(torch.bfloat16).float().requires_grad_() if i < 3 else x for i, x in enumerate(inputs)]
    exact = _run(torch_gated_delta_rule, rounded)
    low = [x.detach().to(dtype).requires_grad_() if i < 3 else x for i, x in enumerate(rounded)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _run(torch_gated_delta_rule, low)
        ours = _run(hand_backward_gated_delta_rule, low)
    assert ours[0].dtype == dtype and torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
    for mine, plain, fp32 in zip(ours[2], ref[2], exact[2], strict=True):
        assert mine.dtype == plain.dtype
        plain_error = _rel(plain, fp32)
        assert plain_error > 0  # autocast did round
        assert _rel(mine, fp32) <= BF16_ERROR_FACTOR * plain_error


def test_gradcheck_fp64():
    """`torch.autograd.gradcheck` of the autograd Function in fp64: two blocks (the second partial), two heads,
    `Dk != Dv`, with an initial state; and without queries."""
    g = torch.Generator().manual_seed(6)
    length, heads = 70, 2
    q, k = (torch.nn.functional.normalize(torch.randn(1, heads, length, 3, generator=g, dtype=torch.float64), dim=-1)
            for _ in range(2))  # fmt: skip
    v = torch.randn(1, heads, length, 4, generator=g, dtype=torch.float64)
    decay = -torch.rand(1, heads, length, generator=g, dtype=torch.float64) * 0.3
    beta = torch.rand(1, heads, length, generator=g, dtype=torch.float64)
    state = torch.randn(1, heads, 3, 4, generator=g, dtype=torch.float64)
    inputs = [x.requires_grad_() for x in (q, k, v, decay, beta, state)]
    fn = qwen3_5._DeltaRuleFunction.apply
    assert torch.autograd.gradcheck(lambda *x: fn(*x, None), inputs)
    assert torch.autograd.gradcheck(lambda *x: fn(None, *x, None)[1], inputs[1:])
