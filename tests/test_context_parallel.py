"""Context-parallel prompt passes: the round plan (`trl_longstraw.context_parallel.plan_rounds`), and the engine's
exact-mode gradients on 2 processes in fp32 and bf16 autocast (tests/cp_worker.py). The trainer-level 2-process runs
(gradients, logps, collectives, MLP tokens) are in tests/test_distributed.py."""

from __future__ import annotations

import pytest
import torch
from tolerances import BF16_ERROR_FACTOR, SHARDED_ATTN_ATOL_FP64, SHARDED_GRAD_RTOL

from tests.helpers import torchrun
from trl_longstraw.context_parallel import plan_rounds
from trl_longstraw.testing import save_tiny_model

FAMILIES = ["llama", "qwen3_5", "glm_moe_dsa"]
# Seconds for the whole 2-process launch (3 models); it was 680 s per model.
LAUNCH_TIMEOUT = 1500


@pytest.mark.parametrize(
    ("n", "chunk", "world", "expected"),
    [
        (0, 5, 2, []),
        (1, 5, 2, [[(0, 1)]]),  # fewer tokens than ranks: one replicated pass
        (6, 5, 2, [[(0, 3), (3, 6)]]),  # a short round splits evenly
        (12, 5, 2, [[(0, 5), (5, 10)], [(10, 11), (11, 12)]]),
        (11, 5, 2, [[(0, 5), (5, 10)], [(10, 11)]]),
        (10, 2, 3, [[(0, 2), (2, 4), (4, 6)], [(6, 8), (8, 9), (9, 10)]]),  # the first ranks take the odd tokens
        (9, 4, 1, [[(0, 4)], [(4, 8)], [(8, 9)]]),
    ],
)
def test_plan_rounds(n, chunk, world, expected):
    assert plan_rounds(n, chunk, world) == expected


@pytest.mark.parametrize("world", [2, 3, 8])
@pytest.mark.parametrize("n", [1, 7, 64, 1000, 1031])
def test_plan_rounds_cover_the_prefix(n, world):
    """Passes follow each other without gap; a round has one non-empty chunk per rank, of at most the chunk size."""
    rounds = plan_rounds(n, 64, world)
    bounds = [b for r in rounds for b in r]
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    for r in rounds:
        assert len(r) in (1, world)
        assert all(0 < end - start <= 64 for start, end in r)


# A qwen3_5 whose last layer is a gated-attention layer, as Qwen3.6-27B's (the tiny one ends with a DeltaNet).
ATTENTION_LAST = "qwen3_5 attention last"


@pytest.fixture(scope="module")
def launch(tiny_model_path, tmp_path_factory):
    """tests/cp_worker.py on 2 processes for every model, in one launch, and its fp32 runs alone for the qwen3_5 whose
    last layer attends (`ATTENTION_LAST`)."""
    cases = {family: ("cp_worker", [tiny_model_path(family)]) for family in FAMILIES}
    layer_types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    last = save_tiny_model(tmp_path_factory.mktemp("attention-last"), "qwen3_5", layer_types=layer_types)
    cases[ATTENTION_LAST] = ("cp_worker:attention_last", [last])
    with torchrun("the 2-process run", cases, tmp_path_factory.mktemp("cp"), nproc=2, timeout=LAUNCH_TIMEOUT) as run:
        yield run


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize("family", FAMILIES)
def test_context_parallel_gradients_fp32_and_bf16(launch, family):
    """Exact-mode gradients of the engine with context-parallel prompt passes on 2 processes (tests/cp_worker.py):
    in fp32 equal to one process's (SHARDED_GRAD_RTOL); under bf16 autocast, each parameter's error against the fp32
    single process at most BF16_ERROR_FACTOR times the bf16 single process's own error. llama and qwen3_5, under
    gradient checkpointing: the reverse pass's recompute reuses each attention layer's output, bitwise the gradients
    of recomputing it, with fewer fused attention forwards and exchanges.

    glm_moe_dsa (two left-padded prompts of 61 and 38 tokens, chunks of 7): its DSA indexer gets no gradient, as in
    stock (it runs without autograd), in every run; and the round's selection and latent attention alone equal their
    single-process references in fp64 (`dsa_round_errors`: the same key sets, ties included; outputs and gradients
    within SHARDED_ATTN_ATOL_FP64)."""
    runs = launch.result(family)
    reference = runs["single fp32"]

    def error(grads: dict, name: str) -> float:
        return ((grads[name] - reference[name]).norm() / reference[name].norm()).item()

    for name, ref in reference.items():
        if ".indexer." in name:  # glm_moe_dsa's indexer runs without autograd, as in stock
            grads = [run for key, run in runs.items() if key not in ("dsa round errors", "mixer outputs")]
            assert not any(run[name].any() for run in grads), name
            continue
        assert ref.any(), f"{name} got no gradient"
        assert error(runs["sharded fp32"], name) <= SHARDED_GRAD_RTOL, name
        low, ours = error(runs["single bf16"], name), error(runs["sharded bf16"], name)
        assert 0 < ours <= BF16_ERROR_FACTOR * low, f"{name}: bf16 error {ours:.2e}, one process's {low:.2e}"
        if family == "glm_moe_dsa":
            continue
        reused, recomputed = runs["sharded fp32 checkpointed, reuse"], runs["sharded fp32 checkpointed, no reuse"]
        assert torch.equal(reused[name], recomputed[name]), name
        assert error(reused, name) <= SHARDED_GRAD_RTOL, name
    if family != "glm_moe_dsa":
        with_reuse, without = runs["counts, reuse"], runs["counts, no reuse"]
        assert 0 < with_reuse["kernel"] < without["kernel"], (with_reuse, without)
        assert 0 < with_reuse["all_to_all"] < without["all_to_all"], (with_reuse, without)
        # The ranks' attention work in the prompt's rounds is balanced: in each of the 4 full rounds of chunks of 7,
        # rank 0 attends 3 of rank 1's queries to its chunk and rank 1 the other 4 (21 and 28 pairs per query head,
        # layer and pass), so rank 1 does 929 pairs against rank 0's 901 (1.031x). With rank 0 attending all 7 (the
        # key owner alone), it did 1.25x rank 1's.
        pairs = runs["pairs per rank"]
        assert max(pairs) <= 1.04 * min(pairs), pairs
    if family == "glm_moe_dsa":
        for rank, errors in enumerate(runs["dsa round errors"]):
            assert any("dprefix" in key for key in errors) and any("ties" in key for key in errors), rank
            for key, error in errors.items():
                assert error <= SHARDED_ATTN_ATOL_FP64, f"rank {rank}: {key} error {error:.2e}"


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize("case", [*FAMILIES, ATTENTION_LAST])
def test_sharded_prompt_passes_skip_the_last_layers_outputs(launch, case):
    """The last decoder layer of a prompt pass computes its records alone under the sharded state too, with
    context-parallel rounds and with replicated chunks (every rank runs every chunk): no rank computes its mixer
    output there (attention, DSA selection and latent attention, Gated DeltaNet's output), while the other layers do
    and the last layer does in the branches (`dist_worker.mixer_outputs_counted`). The exact-mode gradients of both
    equal one process's (SHARDED_GRAD_RTOL): the records are those the collective path stores."""
    runs = launch.result(case)
    reference = runs["single fp32"]
    for run in ("sharded fp32", "sharded fp32 replicated"):
        for name, ref in reference.items():
            if ".indexer." in name:  # glm_moe_dsa's indexer runs without autograd, as in stock
                assert not runs[run][name].any(), (run, name)
                continue
            assert ref.any(), f"{name} got no gradient"
            error = ((runs[run][name] - ref).norm() / ref.norm()).item()
            assert error <= SHARDED_GRAD_RTOL, f"{run}: {name} relative error {error:.2e}"
    for rank, per_run in enumerate(runs["mixer outputs"]):
        assert {"single fp32", "sharded fp32", "sharded fp32 replicated"} <= set(per_run)
        for run, counts in per_run.items():
            assert counts["prompt last"] == 0, f"rank {rank}, {run}: {counts}"
            assert counts["prompt earlier"] > 0 and counts["branch last"] > 0, f"rank {rank}, {run}: {counts}"
