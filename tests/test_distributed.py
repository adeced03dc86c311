"""Data parallelism (DDP, FSDP2) and the sharded prompt state, on 2 CPU processes with gloo.

One `torchrun` launch of `tests/dist_worker.py` runs every scenario for every model (see its docstring); the tests
below check its results against a single-process run of the same global batch in this process, for a tiny dense model
(llama), a tiny qwen3_5 (Gated DeltaNet + gated attention) and a tiny glm_moe_dsa (MLA + DSA + MoE).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from datasets import Dataset
from dist_worker import BATCH_TOKENS, make_batches, mlp_tokens_counted, trainer_config
from tolerances import ATTN_ATOL_FP32, DIST_GRAD_RTOL, LOGP_ATOL, SHARDED_ATTN_ATOL_FP64, SHARDED_GRAD_RTOL
from transformers import AutoConfig

from tests.helpers import torchrun
from trl_longstraw import LongStrawGRPOTrainer
from trl_longstraw.sharding import shard_group_size
from trl_longstraw.testing import build_tokenizer, save_tiny_model

pytestmark = pytest.mark.slow

FAMILIES = ["llama", "qwen3_5", "glm_moe_dsa"]
# Seconds for the whole 2-process launch (3 models); it was 400 s per model.
LAUNCH_TIMEOUT = 1200
# Scenario of the worker -> its single-process reference.
EXPECTED = {
    "ddp_exact": "exact",
    "ddp_detached": "detached",
    "fsdp2_exact": "exact",
    "fsdp2_detached": "detached",
    "sharded_exact": "sharded_exact",
    "sharded_detached": "sharded_detached",
    "sharded_held_detached": "sharded_detached",
    "sharded_unheld_detached": "sharded_detached",
    "fsdp2_sharded_exact": "sharded_exact",
    "fsdp2_grouped_sharded_detached": "detached",
    "offload_sharded_exact": "sharded_exact",
    "sharded_long_exact": "sharded_long_exact",
    "ddp_idle_rank": "idle_rank",
    "fsdp2_idle_rank": "idle_rank",
    "sharded_idle_rank": "idle_rank",
}
SCENARIOS = list(EXPECTED)
# Scenarios whose ranks run the same collectives: all but shard groups of one rank each, whose own collectives carry
# their own prompts (their FSDP2 ones match: `test_fsdp2_collectives_match_across_shard_groups`).
SAME_COLLECTIVES = [s for s in SCENARIOS if s != "fsdp2_grouped_sharded_detached"]


def _reward(completions, **kwargs):
    return [0.0] * len(completions)


@pytest.fixture(scope="module")
def models(tiny_model_path, tmp_path_factory):
    """family -> path of a tiny model with at least 3 decoder layers (so that holding 2, one running and one
    prefetched, is not holding them all)."""
    paths = {}
    for family in FAMILIES:
        path = tiny_model_path(family)
        if AutoConfig.from_pretrained(path).num_hidden_layers < 3:
            path = save_tiny_model(tmp_path_factory.mktemp(f"dist-{family}") / "model", family, num_hidden_layers=4)
        paths[family] = path
    return paths


def single_process_references(path, batches: dict) -> dict:
    """Single-process gradients of the same global batches: `{scenario: {param: grad}}`, and the logps of `S`."""
    config = trainer_config(str(Path(path) / "out"), num_generations=2)
    trainer = LongStrawGRPOTrainer(str(path), _reward, config, train_dataset=Dataset.from_dict({"prompt": ["a"] * 8}))
    trainer._prepare_inputs = lambda x: x
    trainer.current_gradient_accumulation_steps = 1

    def grads(keys: str, mode: str, checkpointing: bool = False) -> dict[str, torch.Tensor]:
        trainer.args.prompt_gradient = mode
        if checkpointing:
            trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            trainer.model.gradient_checkpointing_disable()
        trainer.model.zero_grad(set_to_none=True)
        for key in keys:  # gradient accumulation over the micro-batches
            batch = {k: v for k, v in batches[key].items() if k != "rank"}
            trainer.training_step(trainer.model, batch, batch["num_items_in_batch"])
        # None: no gradient at all (glm_moe_dsa's indexer, which runs without autograd as in stock).
        return {n: None if p.grad is None else p.grad.clone() for n, p in trainer.model.named_parameters()}

    refs = {"exact": grads("AB", "exact"), "detached": grads("B", "detached")}
    refs["sharded_exact"] = grads("S", "exact", checkpointing=True)
    refs["sharded_detached"] = grads("S", "detached")
    with mlp_tokens_counted(trainer.model) as mlp_tokens:
        refs["sharded_long_exact"] = grads("L", "exact")
    refs["mlp_tokens"] = mlp_tokens[0]
    trainer.beta = 0.0
    refs["idle_rank"] = grads("C", "exact")
    trainer.beta = config.beta
    s = batches["S"]
    with torch.no_grad():
        logps, _ = trainer._engine(trainer.model).score(
            s["prompt_ids"], s["prompt_mask"], s["completion_ids"], s["completion_mask"]
        )
    refs["sharded_logps"] = logps
    a = batches["A"]
    with torch.no_grad():
        refs["batched_logps"], _ = trainer._engine(trainer.model).score(
            a["prompt_ids"], a["prompt_mask"], a["completion_ids"], a["completion_mask"], batch_tokens=BATCH_TOKENS
        )
    return refs


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory):
    """Starts the worker on 2 processes, in one launch: every model, then the model-free `kernels` case; computes the
    single-process references while it runs. Yields `(batches, launch, references by family)`."""
    tmp = tmp_path_factory.mktemp("dist")
    batches = make_batches(len(build_tokenizer()))
    torch.save(batches, tmp / "batches.pt")
    cases = {family: ("dist_worker", [models[family], tmp / "batches.pt"]) for family in FAMILIES}
    cases["kernels"] = ("dist_worker:kernels", [])
    with torchrun("the 2-process run", cases, tmp, nproc=2, timeout=LAUNCH_TIMEOUT) as run:
        yield batches, run, {family: single_process_references(models[family], batches) for family in FAMILIES}


@pytest.fixture(scope="module", params=FAMILIES)
def launch(request, models, runs):
    """One model's case of the launch: `(family, model path, batches, launch)`."""
    return request.param, models[request.param], *runs[:2]


@pytest.fixture(scope="module")
def reference(launch, runs):
    return runs[2][launch[0]]


def _results(launch):
    family, _, _, run = launch
    return run.result(family)


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_clean_exit(launch):
    """Both ranks finish, destroy the process group and exit 0 (no abort at interpreter teardown, no traceback), and
    the model's case ran every scenario."""
    assert set(SCENARIOS) <= set(_results(launch))


@pytest.mark.timeout(LAUNCH_TIMEOUT + 120)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_gradients_match_single_process(launch, reference, scenario):
    """DDP and FSDP2 (gradient accumulation included in exact mode) and the sharded prompt state give the gradient of
    a single-process run of the same global batch, for every parameter."""
    results = _results(launch)
    expected = reference[EXPECTED[scenario]]
    got = results[scenario]
    assert set(got) == set(expected)
    assert any(ref is not None for ref in expected.values())
    # DDP and FSDP2 at the bar; the sharded state sums in more orders (see tolerances.py).
    tolerance = SHARDED_GRAD_RTOL if "sharded" in scenario else DIST_GRAD_RTOL
    for name, ref in expected.items():
        if ref is None:
            assert got[name] is None or not got[name].any(), f"{scenario}: {name} got a gradient, stock has none"
            continue
        assert got[name] is not None, f"{scenario}: no gradient for {name}"
        error = ((got[name] - ref).norm() / ref.norm()).item()
        assert error <= tolerance, f"{scenario}: {name} relative error {error:.2e}"


@pytest.mark.timeout(LAUNCH_TIMEOUT + 120)
def test_sharded_logps_match(launch, reference):
    """Each rank's scores with the sharded prompt state equal the single-process ones of its rows."""
    results = _results(launch)
    rank_of_row = launch[2]["S"]["rank"]
    for rank, logps in enumerate(results["sharded_logps"]):
        torch.testing.assert_close(logps, reference["sharded_logps"][rank_of_row == rank], rtol=0, atol=LOGP_ATOL)


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_nonfinite_raise_is_agreed_across_ranks(launch):
    """`on_nonfinite="raise"` with a non-finite loss on rank 1 only (a NaN advantage, sharded exact step): both ranks
    raise before back-propagating, rank 0 naming the other process, rank 1 the loss, with the same collectives (one
    agreement reduction after the scoring, and none of the backward's)."""
    results = _results(launch)
    (message0, calls0), (message1, calls1) = results["nonfinite"]
    assert message0 is not None and "values on another process" in message0, message0
    assert message1 is not None and "the loss (nan)" in message1, message1
    assert calls0 == calls1 and calls0[-1][0] == "all_reduce", calls0[-3:]


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_sharded_micro_batch_of_two_prompts_prefills_each_once(launch):
    """Micro-batch `S` holds 2 distinct prompts (12 and 6 prefix tokens) on both ranks of the shard group. The scoring
    pass keeps both states for the backward pass, with the trainer's hold budget (no limit on CPU) and with the memory
    guard's (free memory faked, as on GPU), which fits them: the policy runs each prefix position once per step in
    detached mode and twice in exact mode (prefill, reverse) - on each rank when the passes are replicated, once over
    the group under context parallelism. With a budget that fits neither, the state scored first is prefilled again in
    the backward pass, and each rank says so once in two steps. The gradients equal single process in every case
    (`test_gradients_match_single_process`)."""
    results = _results(launch)
    prompts = launch[2]["S"]["prompt_mask"].sum(dim=1).unique().tolist()
    prefix = sorted(int(n) - 1 for n in prompts)
    assert prefix == [6, 12]
    cp = results["context_parallel"]

    def passes(per_rank: list[list[dict[int, int]]]) -> list[tuple[int, int]]:
        """Per prompt, sorted: (its prefix positions that ran, how many times the group ran each of them)."""
        found = []
        for k in range(len(per_rank[0])):
            counts = [rank[k] for rank in per_rank]
            if cp:  # each rank runs its own chunks: the group's count is the sum
                merged = {p: sum(c.get(p, 0) for c in counts) for p in set().union(*counts)}
            else:  # replicated passes: every rank runs every position
                assert counts[0] == counts[1], counts
                merged = counts[0]
            assert len(set(merged.values())) == 1, merged
            found.append((len(merged), max(merged.values())))
        return sorted(found)

    for name, once in [("sharded_detached", 1), ("sharded_exact", 2), ("sharded_held_detached", 1)]:
        (per_rank,) = zip(*(rank[name] for rank in results["prompt_passes"]), strict=True)
        assert passes(list(per_rank)) == [(n, once) for n in prefix], name
    unheld = list(zip(*(rank["sharded_unheld_detached"] for rank in results["prompt_passes"]), strict=True))
    assert len(unheld) == 2
    for per_rank in unheld:
        found = passes(list(per_rank))
        assert [n for n, _ in found] == prefix and sorted(k for _, k in found) == [1, 2], found
    budget, to_allocate = results["hold_budget"]
    assert budget == 2**40 - to_allocate and to_allocate > 0, "the guard's budget: free memory minus the step's"
    for rank in results["hold_warnings"]:
        assert rank["sharded_held_detached"] == []
        assert len(rank["sharded_unheld_detached"]) == 1, rank["sharded_unheld_detached"]


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_sharded_state_is_split(launch):
    """Of the 12 prefix tokens of the longest prompt in chunks of 5: the context-parallel rounds (every family) are
    chunks (5, 5) then (1, 1), so each rank holds 6 tokens' records.

    Scoring keeps no chunk boundaries, so the one recurrent record per layer (qwen3_5's Gated DeltaNet) is the final
    one, which every rank keeps: `fixed` bytes on both ranks; the other families keep per-token records only
    (glm_moe_dsa: MLA rows and index keys), all sharded.
    """
    results = _results(launch)
    (rank0, rank1) = results["state_bytes"]
    unsharded = rank0["unsharded"]
    assert unsharded == rank1["unsharded"] > 0
    fixed = rank0["sharded"] + rank1["sharded"] - unsharded
    assert (0 < fixed < unsharded) if launch[0] == "qwen3_5" else (fixed == 0)
    assert (rank0["sharded"] - fixed) * 12 == (unsharded - fixed) * 6
    assert (rank1["sharded"] - fixed) * 12 == (unsharded - fixed) * 6


@pytest.mark.timeout(LAUNCH_TIMEOUT + 120)
def test_context_parallel_splits_mlp_tokens(launch, reference):
    """Exact mode, a 202-token prompt and 2 + 2 short completions (`L`): with context-parallel passes each rank runs
    at most 55% of the single-process step's tokens through the MLPs (glm_moe_dsa: the dense MLP and the MoE layers),
    as the prefill and the reverse pass split in two and the branches split by rank."""
    results = _results(launch)
    for rank, tokens in enumerate(results["mlp_tokens"]):
        share = tokens / reference["mlp_tokens"]
        assert share <= 0.55, f"rank {rank} ran {share:.1%} of the single-process MLP tokens"


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_sharded_prompt_passes_skip_the_last_layers_outputs(launch):
    """With the prompt state sharded, context-parallel or not (shard groups of one rank run replicated chunks, padded
    by the world's lockstep fillers), under DDP and FSDP2, exact and detached: no rank computes the last decoder
    layer's mixer output in a prompt pass (its attention, DSA selection and latent attention, or Gated DeltaNet's
    output), which nothing reads, while the other layers do there and the last layer does in the branches
    (`mixer_outputs_counted` in the worker). The gradients still equal one process's
    (`test_gradients_match_single_process`)."""
    results = _results(launch)
    for rank, per_rank in enumerate(results["mixer_outputs"]):
        assert set(per_rank) == {
            "sharded_exact",
            "sharded_detached",
            "sharded_long_exact",
            "fsdp2_sharded_exact",
            "fsdp2_grouped_sharded_detached",
        }
        for scenario, counts in per_rank.items():
            assert counts["prompt last"] == 0, f"rank {rank}, {scenario}: {counts}"
            assert counts["prompt earlier"] > 0 and counts["branch last"] > 0, f"rank {rank}, {scenario}: {counts}"


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize(
    "scenario",
    ["fsdp2_exact", "fsdp2_detached", "fsdp2_idle_rank", "fsdp2_sharded_exact", "fsdp2_grouped_sharded_detached"],
)
def test_fsdp2_gathers_layer_by_layer(launch, scenario):
    """FSDP2 really shards, and gathers each decoder layer for its pass and frees it: whenever it gathers a parameter
    group, at most 2 of the model's 3 or 4 decoder layers (the running one and one prefetched) are gathered or being
    gathered, and at most 2 hold unsharded parameters (the others are DTensor shards). In the data-parallel
    lockstep (uneven prompts, chunks and completions per rank; an idle rank), with the prompt state sharded over
    every rank, and sharded over groups of one rank each (each group pads its passes to the world's agreed counts);
    gathering the whole model once per call would hold every layer."""
    results = _results(launch)
    layers = AutoConfig.from_pretrained(launch[1]).num_hidden_layers
    assert layers >= 3
    for rank, per_rank in enumerate(results["gathered"]):
        probes, held, unsharded = per_rank[scenario]
        assert probes > 0, f"rank {rank}: FSDP2 gathered nothing"
        assert held <= 2 and unsharded <= 2, f"rank {rank}: {held} layers gathered, {unsharded} unsharded of {layers}"


@pytest.mark.timeout(LAUNCH_TIMEOUT + 120)
def test_fsdp2_batched_scoring(launch, reference):
    """Scoring under FSDP2 with branches packed into batches (llama; one branch per pass for the other families), the
    ranks holding different numbers of prompts, chunks and batches: each rank's log-probs equal the single-process
    ones of its rows, with the same collectives on both ranks and at most 2 decoder layers gathered."""
    results = _results(launch)
    rank_of_row = launch[2]["A"]["rank"]
    for rank, logps in enumerate(results["batched_logps"]):
        torch.testing.assert_close(logps, reference["batched_logps"][rank_of_row == rank], rtol=0, atol=LOGP_ATOL)
    rank0, rank1 = (per_rank["fsdp2_batched_scoring"] for per_rank in results["collectives"])
    assert rank0 == rank1 and "all_gather_single" in {name for name, _ in rank0}
    for per_rank in results["gathered"]:
        assert per_rank["fsdp2_batched_scoring"][1] <= 2


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_fsdp2_collectives_match_across_shard_groups(launch):
    """Shard groups of one rank each, holding different prompts, chunks and completions: both ranks issue the same
    FSDP2 collectives (per-layer all-gathers and reduce-scatters) with the same shapes in the same order (their
    sharded attention's collectives, in groups of one, carry their own prompts)."""
    results = _results(launch)
    fsdp2 = ("all_gather_single", "reduce_scatter_single")
    world_level = [
        [c for c in per_rank["fsdp2_grouped_sharded_detached"] if c[0] in fsdp2] for per_rank in results["collectives"]
    ]
    assert world_level[0] == world_level[1]
    assert set(fsdp2) <= {name for name, _ in world_level[0]}


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_offloaded_boundaries_identical_sharded(launch):
    """With the prompt state sharded over 2 ranks, boundaries offloaded to host memory give bit for bit the gradients
    and the collectives of the device-kept ones (each owner restores its boundary before broadcasting it)."""
    results = _results(launch)
    ours, kept = results["offload_sharded_exact"], results["sharded_exact"]
    assert set(ours) == set(kept)
    for name, g in kept.items():
        assert (g is None and ours[name] is None) or torch.equal(ours[name], g), name
    for per_rank in results["collectives"]:
        assert per_rank["offload_sharded_exact"] == per_rank["sharded_exact"]


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_sharded_boundaries_follow_chunk_owners(launch):
    """Exact mode keeps chunk boundaries: after the prefill of the 12-token prefix (chunks of 5, 5, 1, 1 in two
    context-parallel rounds), each recurrent layer's records of chunks 0 to 2 are on their owners only (chunk c on
    rank c % 2), and the final one (chunk 3) is on both ranks."""
    results = _results(launch)
    family, path = launch[:2]
    layer_types = AutoConfig.from_pretrained(path).layer_types if family == "qwen3_5" else []
    deltanets = {i for i, t in enumerate(layer_types) if t == "linear_attention"}
    for rank, held in enumerate(results["boundaries"]):
        assert set(held) == deltanets
        for layer, chunks in held.items():
            assert chunks == ([0, 2, 3] if rank == 0 else [1, 3]), f"rank {rank}, layer {layer}: holds {chunks}"


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_boundary_broadcast_mixed_dtypes(runs):
    """`broadcast_boundary` on a bf16 conv tail and an fp32 state per layer (one buffer per dtype), in a process group
    object: each rank receives the boundary it does not own (2 layers x 2 tensors) bit for bit, as leaves that require
    grad."""
    results = runs[1].result("kernels")
    for rank, (received, problems) in enumerate(results["boundary_broadcast"]):
        assert received == 4 and not problems, f"rank {rank}: received {received} tensors; {problems}"


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_sharded_attention_fp64(runs):
    """`sharded_prefix_attention` equals `prefix_merge_attention` over the whole prefix, and glm_moe_dsa's sharded
    DSA selection and latent attention their unsharded references (the same keys selected, ties included), outputs
    and gradients; each prefix chunk's gradient reaches its owner whole (`sharded_dsa_errors` in the worker)."""
    results = runs[1].result("kernels")
    for rank, errors in enumerate(results["attention_errors"]):
        assert any("dprefix" in key for key in errors), f"rank {rank} owns no chunk"
        assert any("selection" in key for key in errors), f"rank {rank}: no DSA check ran"
        assert any(key.startswith("fp32/") for key in errors), f"rank {rank}: no fp32 (fused kernel) check ran"
        for key, error in errors.items():
            tolerance = ATTN_ATOL_FP32 if key.startswith("fp32/") else SHARDED_ATTN_ATOL_FP64
            assert error <= tolerance, f"rank {rank}: {key} max error {error:.2e}"


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize("scenario", SAME_COLLECTIVES)
def test_collectives_equal_across_ranks(launch, scenario):
    """Despite uneven work (different prompts, chunk counts, completions and lengths per rank), both ranks issue the
    same collectives with the same shapes in the same order; the DDP wrapper never runs forward (checked in the
    worker)."""
    results = _results(launch)
    rank0, rank1 = (per_rank[scenario] for per_rank in results["collectives"])
    assert rank0 == rank1
    names = {name for name, _ in rank0}
    if scenario.startswith("ddp"):
        assert "all_reduce" in names  # the explicit gradient all-reduce
    if scenario.startswith("fsdp2"):
        assert {"all_gather_single", "reduce_scatter_single"} <= names
    if "sharded" in scenario:
        assert {"all_gather_single", "all_to_all_single"} <= names
    # The exact-mode reverse pass broadcasts the recurrent boundary at the start of every context-parallel round but
    # the first, from its owner: one fp32 buffer per round transition. In `S`, the prefix of 12 tokens runs in two
    # rounds (chunks of 5, 5, then 1, 1), that of 6 in one (3, 3); in `C`, 10 and 7 tokens in one round each.
    transitions = {"sharded_exact": 1, "fsdp2_sharded_exact": 1, "offload_sharded_exact": 1, "sharded_long_exact": 20}
    expected = transitions.get(scenario, 0) if launch[0] == "qwen3_5" else 0
    assert [name for name, _ in rank0].count("broadcast") == expected


@pytest.mark.parametrize(
    ("world", "requested", "generations", "rows", "expected"),
    [(2, 0, 8, 4, 2), (8, 4, 8, 2, 4), (8, 0, 16, 1, 8), (8, 2, 4, 1, 2), (8, 3, 24, 1, None), (2, 0, 4, 4, None)],
)
def test_shard_group_size(world, requested, generations, rows, expected):
    """The shard group must divide the processes, and one prompt's completions must cover the group."""
    if expected is None:
        with pytest.raises(ValueError, match="prompt_shard_group_size"):
            shard_group_size(world, requested, generations, rows)
    else:
        assert shard_group_size(world, requested, generations, rows) == expected
