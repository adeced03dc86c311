"""`prefix_merge_attention` against `reference_attention`: outputs and the gradients of queries, keys, values and
every prefix chunk, in fp32 and bf16, with grouped-query heads, odd chunk sizes, key blocks that split chunks, T=1.

Both implementations are checked: the fused-kernel path (CPU flash kernel here; the CUDA one is checked by
benchmarks/gpu_check.py on a GPU) and the portable einsum path, the latter also with key blocks of 3 keys."""

import pytest
import torch
from tolerances import ATTN_ATOL_BF16, ATTN_ATOL_FP32

from trl_longstraw import attention
from trl_longstraw.attention import prefix_merge_attention, reference_attention

IMPLS = ["kernel", "portable", "portable-block3"]


@pytest.fixture(params=IMPLS)
def impl(request, monkeypatch):
    """Selects the implementation; `portable-block3` splits prefix chunks and the causal self block at odd offsets."""
    monkeypatch.setattr(attention, "USE_KERNELS", request.param == "kernel")
    if request.param == "portable-block3":
        monkeypatch.setattr(attention, "KEY_BLOCK", 3)
    return request.param


def make_inputs(
    batch: int,
    q_heads: int,
    kv_heads: int,
    t: int,
    prefix_sizes: list[int],
    dim: int = 8,
    v_dim: int | None = None,
    dtype=torch.float32,
    seed: int = 0,
):
    """Random `q [B, Hq, T, D]`, `k, v [B, Hkv, T, D|Dv]` and prefix chunks `[(k_i, v_i)]` of `prefix_sizes` keys."""
    g = torch.Generator().manual_seed(seed)
    v_dim = v_dim or dim

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    q = rand(batch, q_heads, t, dim)
    k = rand(batch, kv_heads, t, dim)
    v = rand(batch, kv_heads, t, v_dim)
    prefix = [(rand(batch, kv_heads, s, dim), rand(batch, kv_heads, s, v_dim)) for s in prefix_sizes]
    return q, k, v, prefix


def run(fn, q, k, v, prefix, grad_out, prefix_grad: bool = True):
    """`fn`'s output and the gradients of `q, k, v` and each prefix tensor under `sum(out * grad_out)`."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    prefix = [tuple(x.detach().clone().requires_grad_(prefix_grad) for x in kv) for kv in prefix]
    out = fn(q, k, v, prefix, q.shape[-1] ** -0.5)
    leaves = [q, k, v] + [x for kv in prefix for x in kv if x.requires_grad]
    grads = torch.autograd.grad((out.float() * grad_out.float()).sum(), leaves)
    return out, grads, prefix


def assert_close(actual, expected, atol, what):
    err = (actual.float() - expected.float()).abs().max().item()
    assert err <= atol, f"{what}: max abs error {err:.3g} > {atol}"


CASES = [
    # (batch, q_heads, kv_heads, T, prefix chunk sizes)
    pytest.param(1, 4, 2, 7, [5, 1, 13], id="gqa-odd-chunks"),
    pytest.param(2, 6, 2, 9, [3, 11], id="gqa3-batch2"),
    pytest.param(1, 4, 4, 5, [7], id="mha"),
    pytest.param(1, 4, 1, 6, [2, 9, 1, 4], id="mqa"),
    pytest.param(1, 4, 2, 1, [5, 1, 13], id="T1"),
    pytest.param(1, 4, 2, 1, [], id="T1-no-prefix"),
    pytest.param(1, 4, 2, 11, [], id="no-prefix"),
]


@pytest.mark.parametrize("batch,q_heads,kv_heads,t,sizes", CASES)
def test_matches_reference_fp32(impl, batch, q_heads, kv_heads, t, sizes):
    q, k, v, prefix = make_inputs(batch, q_heads, kv_heads, t, sizes)
    grad_out = torch.randn(batch, q_heads, t, v.shape[-1])
    out, grads, _ = run(prefix_merge_attention, q, k, v, prefix, grad_out)
    ref, ref_grads, _ = run(reference_attention, q, k, v, prefix, grad_out)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert_close(out, ref, ATTN_ATOL_FP32, "output")
    names = ["q", "k", "v"] + [f"prefix[{i // 2}].{'kv'[i % 2]}" for i in range(2 * len(sizes))]
    assert len(grads) == len(ref_grads) == len(names)
    for name, grad, ref_grad in zip(names, grads, ref_grads, strict=True):
        assert grad.shape == ref_grad.shape, name
        # With a single key the softmax is constant: only v has a gradient.
        if t + sum(sizes) > 1 or name == "v":
            assert ref_grad.abs().max() > 0, f"{name}: reference gradient is zero, the test would not see an error"
        assert_close(grad, ref_grad, ATTN_ATOL_FP32, f"grad {name}")


@pytest.mark.parametrize("batch,q_heads,kv_heads,t,sizes", CASES)
def test_matches_reference_bf16(impl, batch, q_heads, kv_heads, t, sizes):
    """bf16 inputs: ours (fp32 accumulation) against the exact fp32 math on the same rounded inputs."""
    q, k, v, prefix = make_inputs(batch, q_heads, kv_heads, t, sizes, dtype=torch.bfloat16)
    grad_out = torch.randn(batch, q_heads, t, v.shape[-1]).to(torch.bfloat16)
    out, grads, _ = run(prefix_merge_attention, q, k, v, prefix, grad_out)
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    up = [x.float() for x in (q, k, v)]
    ref, ref_grads, _ = run(reference_attention, *up, [tuple(x.float() for x in kv) for kv in prefix], grad_out)
    assert_close(out, ref, ATTN_ATOL_BF16, "output")
    for i, (grad, ref_grad) in enumerate(zip(grads, ref_grads, strict=True)):
        assert_close(grad, ref_grad, ATTN_ATOL_BF16, f"grad #{i}")


def test_value_dim_differs_from_key_dim(impl):
    # MLA-style heads: values narrower than queries/keys.
    q, k, v, prefix = make_inputs(1, 4, 2, 6, [4, 7], dim=12, v_dim=5)
    grad_out = torch.randn(1, 4, 6, 5)
    out, grads, _ = run(prefix_merge_attention, q, k, v, prefix, grad_out)
    ref, ref_grads, _ = run(reference_attention, q, k, v, prefix, grad_out)
    assert out.shape == (1, 4, 6, 5)
    assert_close(out, ref, ATTN_ATOL_FP32, "output")
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        assert_close(grad, ref_grad, ATTN_ATOL_FP32, "grad")


def test_strided_inputs(impl):
    """Inputs laid out as the model makes them: `[B, T, H, D]` memory viewed as `[B, H, T, D]`."""
    q, k, v, prefix = make_inputs(1, 6, 2, 7, [5, 9])

    def strided(x):
        return x.transpose(1, 2).contiguous().transpose(1, 2)

    q, k, v = strided(q), strided(k), strided(v)
    prefix = [(strided(pk), strided(pv)) for pk, pv in prefix]
    assert not prefix[0][0].is_contiguous() and prefix[0][0].stride(-1) == 1
    grad_out = torch.randn(1, 6, 7, 8)
    out, grads, _ = run(prefix_merge_attention, q, k, v, prefix, grad_out)
    ref, ref_grads, _ = run(reference_attention, q, k, v, prefix, grad_out)
    assert_close(out, ref, ATTN_ATOL_FP32, "output")
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        assert_close(grad, ref_grad, ATTN_ATOL_FP32, "grad")


def test_detached_prefix_gets_no_gradient_and_same_other_grads(impl):
    """Detached mode: prefix tensors without requires_grad get none; q, k, v grads are unchanged."""
    q, k, v, prefix = make_inputs(1, 4, 2, 5, [3, 8])
    grad_out = torch.randn(1, 4, 5, 8)
    _, grads, detached_prefix = run(prefix_merge_attention, q, k, v, prefix, grad_out, prefix_grad=False)
    _, ref_grads, _ = run(reference_attention, q, k, v, prefix, grad_out, prefix_grad=False)
    assert len(grads) == 3
    assert all(x.grad is None for kv in detached_prefix for x in kv)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        assert_close(grad, ref_grad, ATTN_ATOL_FP32, "grad")


def test_mixed_prefix_grad(impl):
    """Only the chunk that requires grad gets one (the reverse pass reads earlier chunks as leaves)."""
    q, k, v, prefix = make_inputs(1, 4, 2, 4, [3, 6])
    q.requires_grad_()
    live = tuple(x.clone().requires_grad_() for x in prefix[1])
    out = prefix_merge_attention(q, k, v, [prefix[0], live], 8**-0.5)
    gq, gk, gv = torch.autograd.grad(out.sum(), [q, *live])
    rq, live_ref = q.detach().clone().requires_grad_(), tuple(x.detach().clone().requires_grad_() for x in live)
    ref = reference_attention(rq, k, v, [prefix[0], live_ref], 8**-0.5)
    rgq, rgk, rgv = torch.autograd.grad(ref.sum(), [rq, *live_ref])
    for a, b in ((gq, rgq), (gk, rgk), (gv, rgv)):
        assert_close(a, b, ATTN_ATOL_FP32, "grad")


def test_gradcheck_fp64(monkeypatch):
    monkeypatch.setattr(attention, "KEY_BLOCK", 2)
    q, k, v, prefix = make_inputs(1, 4, 2, 3, [3, 1], dim=4, dtype=torch.float64)
    flat = [q, k, v] + [x for kv in prefix for x in kv]
    flat = [x.requires_grad_() for x in flat]

    def fn(q, k, v, *p):
        return prefix_merge_attention(q, k, v, list(zip(p[0::2], p[1::2], strict=True)), 0.5)

    assert torch.autograd.gradcheck(fn, flat)


def test_no_prefix_copy_saved_for_backward(impl):
    """The autograd graph saves the prefix tensors themselves, not a concatenated or head-repeated copy."""
    q, k, v, prefix = make_inputs(1, 8, 2, 4, [64, 64])
    prefix = [tuple(x.requires_grad_() for x in kv) for kv in prefix]
    q.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        prefix_merge_attention(q, k, v, prefix, 0.5)
    prefix_ptrs = {x.data_ptr() for kv in prefix for x in kv}
    big = [x for x in saved if x.numel() >= 64 * 8 and x.data_ptr() not in prefix_ptrs]
    assert not big, f"tensors of prefix size saved besides the prefix itself: {[tuple(x.shape) for x in big]}"


@pytest.mark.parametrize(
    "dtype,v_dim,use_kernels,expected",
    [
        (torch.float32, 8, True, "_KernelPrefixMergeAttention"),
        (torch.bfloat16, 8, True, "_KernelPrefixMergeAttention"),
        (torch.float64, 8, True, "_PrefixMergeAttention"),
        (torch.float32, 5, True, "_PrefixMergeAttention"),
        (torch.float32, 8, False, "_PrefixMergeAttention"),
    ],
)
def test_dispatch(monkeypatch, dtype, v_dim, use_kernels, expected):
    """The kernel path runs where it applies on CPU, the portable one elsewhere."""
    monkeypatch.setattr(attention, "USE_KERNELS", use_kernels)
    q, k, v, prefix = make_inputs(1, 4, 2, 3, [2], v_dim=v_dim, dtype=dtype)
    out = prefix_merge_attention(q.requires_grad_(), k, v, prefix, 0.5)
    assert type(out.grad_fn).__name__ == expected + "Backward"


def test_rejects_unknown_cuda_backend(monkeypatch):
    monkeypatch.setattr(attention, "CUDA_BACKEND", "efficient")
    q, k, v, prefix = make_inputs(1, 4, 2, 3, [2])
    with pytest.raises(ValueError, match="CUDA_BACKEND='efficient'"):
        prefix_merge_attention(q, k, v, prefix, 0.5)


def test_rejects_heads_not_multiple():
    q, k, v, prefix = make_inputs(1, 3, 2, 2, [1])
    with pytest.raises(ValueError, match="multiple of key heads"):
        prefix_merge_attention(q, k, v, prefix, 1.0)


def test_prefix_of_batch_one_is_shared_by_every_row(impl):
    """Shared-prompt decoding and batched scoring pass prompt chunks of batch 1 with B rows of queries: the result
    equals the reference with the prefix repeated for every row, under both implementations."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(3, 4, 5, 8, generator=g)
    k, v = torch.randn(3, 2, 5, 8, generator=g), torch.randn(3, 2, 5, 8, generator=g)
    prefix = [(torch.randn(1, 2, n, 8, generator=g), torch.randn(1, 2, n, 8, generator=g)) for n in (7, 3)]
    expanded = [(pk.expand(3, -1, -1, -1), pv.expand(3, -1, -1, -1)) for pk, pv in prefix]
    out = prefix_merge_attention(q, k, v, prefix, 0.3)
    torch.testing.assert_close(out, reference_attention(q, k, v, expanded, 0.3), atol=ATTN_ATOL_FP32, rtol=0)


def test_reuse_in_checkpoint_recompute_is_exact(monkeypatch):
    """Under non-reentrant gradient checkpointing, the recompute takes the kept output and log-sum-exp instead of
    attending again (the exact-mode reverse pass's `reuse`): the same output and bitwise the same gradients of the
    queries, keys, values and every prefix chunk, with half the kernel forwards."""
    from torch.utils.checkpoint import checkpoint

    q, k, v, prefix = make_inputs(1, 4, 2, 7, [5, 1, 13])
    grad_out = torch.randn(1, 4, 7, 8, generator=torch.Generator().manual_seed(1))
    calls = []
    forward = attention._kernel_forward
    monkeypatch.setattr(attention, "_kernel_forward", lambda *a: calls.append(1) or forward(*a))

    def layer(reuse):
        def fn(q, k, v, prefix, scale):
            flat = [x for kv in prefix for x in kv]

            def body(q, k, v, *flat):
                # Work before and after the attention, as in a decoder layer, so the recompute has inputs to redo.
                slot = None if reuse is None else (reuse if not reuse or body.ran else None)
                body.ran = True
                pairs = list(zip(flat[0::2], flat[1::2], strict=True))
                return prefix_merge_attention(q * 2, k.exp(), v, pairs, scale, reuse=slot).tanh()

            body.ran = False
            return checkpoint(body, q, k, v, *flat, use_reentrant=False)

        return fn

    out_ref, grads_ref, _ = run(layer(None), q, k, v, prefix, grad_out)
    plain = len(calls)
    calls.clear()
    reuse = {}
    out, grads, _ = run(layer(reuse), q, k, v, prefix, grad_out)
    assert len(calls) * 2 == plain and reuse == {}
    assert torch.equal(out, out_ref)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_ref, strict=True))
