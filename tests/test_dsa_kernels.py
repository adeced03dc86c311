"""The Triton kernels of GLM's DSA (`trl_longstraw.dsa_kernels`) against their PyTorch references in `glm_moe_dsa`,
on CPU tensors through Triton's interpreter (`TRITON_INTERPRET=1`, set in conftest.py).

Tiles are shrunk (`_small_tiles`) so that every loop of the kernels runs several times: several key windows and query
tiles in the selection, key tiles that span record chunks, several head blocks and slot tiles in the attention. Under
the interpreter half-precision products run in fp32 on the half-precision values (see `dsa_kernels._INTERPRETED`);
the casts around them are the kernels' own.
"""

from __future__ import annotations

import pytest
import torch

import trl_longstraw.dsa_kernels as dk
import trl_longstraw.glm_moe_dsa as glm
from tests.test_glm_moe_dsa import (
    CHUNK,
    FAMILY,
    _assert_same_grads,
    _config,
    _load,
    _random_selection_inputs,
    _step,
    _stock_scores,
    _trainer,
)
from tests.tolerances import ATTN_ATOL_BF16, ATTN_ATOL_FP32, LOGP_ATOL
from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer
from trl_longstraw.adapters import get_adapter
from trl_longstraw.engine import Engine
from trl_longstraw.testing import build_tokenizer, random_micro_batch


def _small_tiles(monkeypatch):
    monkeypatch.setattr(dk, "KEY_WINDOW", 8)  # windows of 8 keys; the record chunks below are 3, 5, 0, 2, 4 keys
    monkeypatch.setattr(dk, "SCORE_TILE", 32)  # 4 queries per score buffer
    monkeypatch.setattr(dk, "SCORE_KEY_BLOCK", 4)
    monkeypatch.setattr(dk, "HEAD_BLOCK", 2)
    monkeypatch.setattr(dk, "SLOT_BLOCK", 4)


def _sorted(sel: torch.Tensor) -> torch.Tensor:
    return sel.sort(dim=1).values


# ------------------------------------------------------------------------------------------------------ selection
@pytest.mark.parametrize(
    "sizes, topk, integer, dtype",
    [
        ([3, 5, 0, 2, 4, 7], 4, False, torch.float32),
        ([3, 5, 0, 2, 4, 7], 1, False, torch.float32),
        ([3, 5, 0, 2, 4, 7], 4, True, torch.float32),  # many exactly equal scores: ties at the cut-off
        ([3, 5, 0, 2, 4, 7], 9, True, torch.bfloat16),  # integers are exact in bf16, so ties stay ties
        ([3, 5, 0, 2, 4, 7], 24, True, torch.float32),  # more slots than the 21 keys: -1 in every row
        ([3, 7], 6, False, torch.float32),  # the first queries see fewer than topk keys: -1 slots in some rows
    ],
)
def test_select_topk_kernel_matches_reference(monkeypatch, sizes, topk, integer, dtype):
    _small_tiles(monkeypatch)
    q, weights, keys = _random_selection_inputs(topk, sizes, integer)
    q, keys = q.to(dtype), [k.to(dtype) for k in keys]
    query_start = sum(sizes[:-1])
    expected = glm.reference_select(glm._index_scores(q, weights, torch.cat(keys), 0.5), query_start, topk)
    got = dk.select_topk(q, weights, keys, query_start, topk, 0.5)
    assert got.dtype == torch.int64 and got.shape == expected.shape
    assert torch.equal(_sorted(got), _sorted(expected))
    assert torch.equal(_sorted(got), _sorted(glm.select_topk(q, weights, keys, query_start, topk, 0.5)))
    # The first query sees query_start + 1 keys.
    assert bool((got < 0).any()) == (topk > query_start + 1)


def test_select_topk_kernel_ties_go_to_the_earlier_key_and_nan_raises(monkeypatch):
    _small_tiles(monkeypatch)
    q, weights = torch.ones(1, 1, 1), torch.ones(1, 1)
    keys = [torch.tensor([[1.0], [2.0], [1.0]]), torch.tensor([[1.0], [1.0]])]
    got = dk.select_topk(q, weights, keys, query_start=4, topk=3, scale=1.0)
    assert sorted(got[0].tolist()) == [0, 1, 2]
    # -0.0 and +0.0 are one score: the earlier key wins (weights of both signs times ReLU zeros give -0.0).
    zero_keys = [torch.tensor([[-1.0], [-1.0], [1.0]])]
    got = dk.select_topk(torch.ones(1, 2, 1), torch.tensor([[1.0, -1.0]]), zero_keys, 2, 2, 1.0)
    assert sorted(got[0].tolist()) == [0, 1]
    q, weights, keys = _random_selection_inputs(0, [4, 3])
    weights[1, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        dk.select_topk(q, weights, keys, query_start=4, topk=2, scale=1.0)


@pytest.mark.parametrize("integer", [False, True], ids=["distinct", "ties"])
def test_decode_selection_kernel_matches_reference(monkeypatch, integer):
    """A decoding step of 3 rows: the kernels' selection (row by row over the prompt's chunks and the row's tail)
    equals `decode_select_topk`'s PyTorch path."""
    _small_tiles(monkeypatch)
    q, weights, keys = _random_selection_inputs(3, [3, 5, 2, 3], integer)
    tails = torch.randn(3, 4, 4, generator=torch.Generator().manual_seed(1))
    tails = tails.round() if integer else tails
    monkeypatch.setattr(dk, "ON_CPU", False)
    expected = glm.decode_select_topk(q, weights, keys[:-1], tails, 4, 0.5)
    monkeypatch.setattr(dk, "ON_CPU", True)
    calls, select = [], dk.select_topk
    monkeypatch.setattr(dk, "select_topk", lambda *args: calls.append(1) or select(*args))
    got = glm.decode_select_topk(q, weights, keys[:-1], tails, 4, 0.5)
    assert len(calls) == 3, "the kernels ran, one launch per row"
    assert torch.equal(_sorted(got), _sorted(expected))


# ----------------------------------------------------------------------------------------------- sparse attention
@pytest.mark.parametrize("dtype, atol", [(torch.float32, ATTN_ATOL_FP32), (torch.bfloat16, ATTN_ATOL_BF16)])
def test_sparse_attention_kernel_matches_reference(monkeypatch, dtype, atol):
    _small_tiles(monkeypatch)
    g = torch.Generator().manual_seed(0)
    sizes, heads, rank, rope, topk = [4, 6, 3, 5], 3, 7, 4, 6
    q = torch.randn(sizes[-1], heads, rank + rope, generator=g).to(dtype).requires_grad_()
    kv_parts = [torch.randn(n, rank + rope, generator=g).to(dtype).requires_grad_() for n in sizes]
    kv_parts[2].requires_grad_(False)  # a record chunk that needs no gradient
    query_start = sum(sizes[:-1])
    sel = glm.reference_select(torch.randn(sizes[-1], sum(sizes), generator=g), query_start, topk)
    sel[sel.ge(0) & sel.lt(sizes[0])] = -1  # no query reads the first part; some rows have empty slots
    sel[2] = -1  # a query with no key at all: zero output, log-sum-exp -inf
    grad_out = torch.randn(sizes[-1], heads, rank, generator=g)
    grad_lse = torch.randn(sizes[-1], heads, generator=g)
    leaves = [q, kv_parts[0], kv_parts[1], kv_parts[3]]

    def run(function):
        out, lse = function.apply(0.3, rank, sel, q, *kv_parts)
        loss = (out.float() * grad_out).sum() + (lse.masked_fill(lse == float("-inf"), 0) * grad_lse).sum()
        return out, lse, torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True)

    ref_out, ref_lse, ref_grads = run(glm._SparseLatentAttention)
    out, lse, grads = run(dk.SparseLatentAttention)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert torch.equal(lse[2], torch.full((heads,), float("-inf"))) and out[2].abs().sum() == 0
    torch.testing.assert_close(out.float(), ref_out.float(), atol=atol, rtol=0)
    torch.testing.assert_close(lse, ref_lse.float(), atol=atol, rtol=0)
    assert ref_grads[1].abs().sum() == 0 and grads[1].abs().sum() == 0
    for got, want in zip(grads, ref_grads, strict=True):
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)


# -------------------------------------------------------------------------------------------------- in the model
@pytest.mark.slow
def test_glm_through_kernels_matches_stock_and_reference_gradients(tiny_model_path, monkeypatch, tmp_path):
    """The tiny GLM with the kernels dispatched (as on CUDA): log-probs equal stock's, and an exact-mode training
    step's gradients equal those of the PyTorch path."""
    path = tiny_model_path(FAMILY)
    mb = random_micro_batch([11, 6], [4, 1, 3, 2, 3], [0, 1, 0, 1, 0], len(build_tokenizer()), seed=1)
    calls = {"select": 0, "attend": 0}
    select, attend = dk.select_topk, dk.SparseLatentAttention.apply

    def counted_select(*args):
        calls["select"] += 1
        return select(*args)

    def counted_attend(*args):
        calls["attend"] += 1
        return attend(*args)

    monkeypatch.setattr(dk, "select_topk", counted_select)
    monkeypatch.setattr(dk.SparseLatentAttention, "apply", counted_attend)
    model = _load(path)
    ref_logps, _ = _stock_scores(model, mb)
    engine = Engine(model, model, get_adapter(model), chunk_size=CHUNK)
    monkeypatch.setattr(dk, "ON_CPU", True)
    with torch.no_grad():
        logps, _ = engine.score(mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], mb["completion_mask"])
    torch.testing.assert_close(logps, ref_logps, atol=LOGP_ATOL, rtol=0)
    assert calls["select"] > 0 and calls["attend"] > 0

    args = _config(LongStrawGRPOConfig, tmp_path, prefill_chunk_size=CHUNK, prompt_gradient="exact")
    trainer = _trainer(LongStrawGRPOTrainer, path, args)
    _, grads = _step(trainer, mb)
    monkeypatch.setattr(dk, "ON_CPU", False)
    _, ref_grads = _step(trainer, mb)
    _assert_same_grads(grads, ref_grads)


@pytest.mark.slow
def test_decoding_through_the_kernels_equals_generate(tiny_model_path, monkeypatch):
    """Shared-prompt greedy decoding of a tiny glm_moe_dsa with the kernels serving the selection and the sparse
    attention (prompt records and the rows' tails as parts) follows `generate` step by step."""
    from test_generation import assert_same_steps, stock_and_ours

    from tests.grpo_pair import make_pair

    _, ours = make_pair(
        tiny_model_path(FAMILY), generation_kwargs={"do_sample": False}, longstraw={"prefill_chunk_size": 3}
    )
    monkeypatch.setattr(dk, "ON_CPU", True)
    launches = []
    select, attention = dk.select_topk, dk.SparseLatentAttention

    class CountedAttention(attention):
        @staticmethod
        def forward(ctx, *args):
            launches.append("attention")
            return attention.forward(ctx, *args)

    monkeypatch.setattr(dk, "select_topk", lambda *args: launches.append("select") or select(*args))
    monkeypatch.setattr(dk, "SparseLatentAttention", CountedAttention)
    steps = stock_and_ours(ours, "a b c d e f g h i j k", pad=3, rows=2, max_new_tokens=5, do_sample=False)
    assert_same_steps(*steps)
    assert {"select", "attention"} <= set(launches), "the kernels served the decoding"
