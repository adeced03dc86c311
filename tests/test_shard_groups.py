"""Prompt shard groups smaller than the world under FSDP2, on 4 CPU processes with gloo (2 groups of 2 ranks).

One `torchrun` launch of `tests/group_worker.py` runs every model (see its docstring); the tests below check its
results against a single-process run of the same global batches in this process, for a tiny dense model (llama), a
tiny qwen3_5 (Gated DeltaNet + gated attention) and a tiny glm_moe_dsa (MLA + DSA + MoE). The groups hold different
prompts, chunks and completions: the engine pads each group's passes to the world's agreed counts (fillers that do
not touch the sharded attention), so FSDP2, whose collectives span the world, gathers and frees layer by layer. The
same launch generates on the FSDP2 model in the world lockstep of generation (`generation.generate_shared`) and checks
the completions against transformers' `generate`, and runs glm_moe_dsa expert-parallel too (EP over all 4 processes,
a case of the same launch), and runs one whole `trainer.train()` step (generation + loss) with the same shard groups
under FSDP2 (tiny qwen3_5 in each mode, tiny glm_moe_dsa in exact mode: a case each).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from datasets import Dataset
from dist_worker import trainer_config
from group_worker import (
    GEN_MAX_NEW_TOKENS,
    GEN_ROWS,
    GROUP_SIZE,
    STEP_PROMPT_TOKENS,
    WORLD,
    make_group_batches,
    step_prompts,
)
from tolerances import SHARDED_GRAD_RTOL
from transformers import AutoConfig

from tests.helpers import torchrun
from trl_longstraw import LongStrawGRPOTrainer
from trl_longstraw.testing import build_tokenizer, save_tiny_model

pytestmark = pytest.mark.slow

FAMILIES = ["llama", "qwen3_5", "glm_moe_dsa"]
# The case of the expert-parallel run (glm_moe_dsa).
EP = "glm_moe_dsa_expert_parallel"
# The whole train() steps: (model, mode) of each case; the hybrid model in both modes, MLA + DSA + MoE in exact mode.
STEPS = [("qwen3_5", "exact"), ("qwen3_5", "detached"), ("glm_moe_dsa", "exact")]
# Seconds for the whole 4-process launch (3 models): 480 s on 2 cores under a load average of 20-28.
LAUNCH_TIMEOUT = 900
# Collectives that FSDP2 issues over the world (per-layer all-gathers, reduce-scatters).
FSDP2_COLLECTIVES = ("all_gather_single", "reduce_scatter_single")


@pytest.fixture(scope="module")
def models(tiny_model_path, tmp_path_factory):
    """family -> path of a tiny model with at least 3 decoder layers (so that 2 gathered are not all of them)."""
    paths = {}
    for family in FAMILIES:
        path = tiny_model_path(family)
        if AutoConfig.from_pretrained(path).num_hidden_layers < 3:
            path = save_tiny_model(tmp_path_factory.mktemp(f"groups-{family}") / "model", family, num_hidden_layers=4)
        paths[family] = path
    return paths


def single_process_gradients(path, batches: dict) -> dict:
    """Single-process gradients of the same global batches: `{"exact": ..., "detached": ...}`."""
    config = trainer_config(str(Path(path) / "out-groups"), num_generations=2)
    trainer = LongStrawGRPOTrainer(
        str(path), lambda completions, **kw: [0.0] * len(completions), config, Dataset.from_dict({"prompt": ["a"] * 8})
    )
    trainer._prepare_inputs = lambda x: x
    trainer.current_gradient_accumulation_steps = 1

    def grads(keys: str, mode: str, checkpointing: bool) -> dict[str, torch.Tensor | None]:
        trainer.args.prompt_gradient = mode
        if checkpointing:
            trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            trainer.model.gradient_checkpointing_disable()
        trainer.model.zero_grad(set_to_none=True)
        for key in keys:  # gradient accumulation over the micro-batches
            batch = {k: v for k, v in batches[key].items() if k != "rank"}
            trainer.training_step(trainer.model, batch, batch["num_items_in_batch"])
        return {n: None if p.grad is None else p.grad.clone() for n, p in trainer.model.named_parameters()}

    return {"exact": grads("GH", "exact", True), "detached": grads("G", "detached", False)}


@pytest.fixture(scope="module")
def launch(models, tmp_path_factory):
    """Starts the worker on 4 processes for every model, in one launch, and computes the single-process references
    while it runs; yields `(launch, references by family)`."""
    tmp = tmp_path_factory.mktemp("groups")
    batches = make_group_batches(len(build_tokenizer()))
    torch.save(batches, tmp / "batches.pt")
    cases = {family: ("group_worker", [models[family], tmp / "batches.pt"]) for family in FAMILIES}
    # The MoE model once more, loaded expert-parallel over all 4 processes (one expert per rank).
    cases[EP] = ("group_worker:expert_parallel", [models["glm_moe_dsa"], tmp / "batches.pt"])
    # Whole trainer.train() steps (generation + loss), FSDP2 from transformers' loading.
    for step_family, mode in STEPS:
        cases[f"whole_train_step_{step_family}_{mode}"] = ("group_worker:whole_step", [models[step_family], mode])
    with torchrun("the 4-process run", cases, tmp, nproc=WORLD, timeout=LAUNCH_TIMEOUT) as run:
        yield run, {family: single_process_gradients(models[family], batches) for family in FAMILIES}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def reference(launch, family):
    return launch[1][family]


@pytest.mark.timeout(LAUNCH_TIMEOUT + 180)
@pytest.mark.parametrize("scenario", ["exact", "detached"])
def test_gradients_match_single_process(launch, reference, family, scenario):
    """With 2 shard groups of 2 ranks under FSDP2 over 4 (gradient accumulation in exact mode), every parameter's
    gradient equals the single-process one of the same global batch; no rank hangs although the groups hold different
    numbers of prompts, chunks and completions. glm_moe_dsa also loaded expert-parallel over all 4 processes
    (transformers' EP, one expert per rank, never gathered; the EP group spans both shard groups)."""
    runs = {"fsdp2": launch[0].result(family)["grads"][scenario]}
    if family == "glm_moe_dsa":
        runs["expert_parallel"] = launch[0].result(EP)["grads"][scenario]
        assert launch[0].result(EP)["experts"] == [[1]] * WORLD, "experts were gathered"
    expected = reference[scenario]
    assert any(ref is not None for ref in expected.values())
    for run, got in runs.items():
        assert set(got) == set(expected)
        for name, ref in expected.items():
            if ref is None:  # no gradient at all (glm_moe_dsa's indexer, which runs without autograd as in stock)
                assert got[name] is None or not got[name].any(), f"{run} {scenario}: {name} got a gradient"
                continue
            assert got[name] is not None, f"{run} {scenario}: no gradient for {name}"
            error = ((got[name] - ref).norm() / ref.norm()).item()
            assert error <= SHARDED_GRAD_RTOL, f"{run} {scenario}: {name} relative error {error:.2e}"


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize("scenario", ["exact", "detached"])
def test_fsdp2_gathers_layer_by_layer(launch, family, scenario):
    """Parameters stay DTensors (asserted in the worker) and, whenever FSDP2 gathers a parameter group on any rank, at
    most 2 of the 3 or 4 decoder layers (the running one and one prefetched) are gathered or being gathered, and at
    most 2 hold unsharded parameters: the whole model is never gathered."""
    results = launch[0].result(family)
    assert results["layers"] >= 3
    for rank, per_rank in enumerate(results["gathered"]):
        probes, held, unsharded = per_rank[scenario]
        assert probes > 0, f"rank {rank}: FSDP2 gathered nothing"
        assert held <= 2 and unsharded <= 2, f"rank {rank}: {held} layers gathered, {unsharded} unsharded"


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize("scenario", ["exact", "detached"])
def test_collectives_meet(launch, family, scenario):
    """Every rank of the world issues the same FSDP2 collectives (shapes and order); the ranks of each shard group
    issue the same collectives altogether, their sharded attention's among them (the fillers that pad a group to
    the other's passes add none)."""
    per_rank = launch[0].result(family)["collectives"]
    assert len(per_rank) == WORLD
    world_level = [[c for c in log[scenario] if c[0] in FSDP2_COLLECTIVES] for log in per_rank]
    assert all(log == world_level[0] for log in world_level)
    assert set(FSDP2_COLLECTIVES) <= {name for name, _ in world_level[0]}
    for first in range(0, WORLD, GROUP_SIZE):
        group = [per_rank[r][scenario] for r in range(first, first + GROUP_SIZE)]
        assert all(log == group[0] for log in group), f"the ranks of the group from {first} differ"
        assert f"all_to_all_single@{GROUP_SIZE}" in {name for name, _ in group[0]}
    # The groups run different prompts, so their own collectives differ.
    assert per_rank[0][scenario] != per_rank[GROUP_SIZE][scenario]


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_generation_in_world_lockstep(launch, family):
    """Shared-prompt generation with 2 shard groups of 2 under FSDP2 over 4 processes: greedy completions equal
    transformers' `generate` on each rank's rows, which the groups decode from different prompts (group 0 two of 13
    and 7 tokens, left-padded; group 1 one of 22; chunks of 5) with rows ending at different steps: rank 0's after 1
    token while rank 1 steps on in their branch rounds, group 0's within 3 while group 1's run to the maximum (group 0
    runs filler steps), and group 1 has no second prompt (filler prefills and steps). Parameters stay DTensors, and
    every rank issues the same FSDP2 collectives. Offering the states to an exact-mode loss pass as in training
    (prefilled with chunk boundaries after each prompt's left padding in the batch) gives the same completions. The
    same holds for glm_moe_dsa loaded expert-parallel over all 4 processes (the experts' all-to-alls meet too)."""
    _check_generation(launch[0].result(family)["generation"])
    if family == "glm_moe_dsa":
        _check_generation(launch[0].result(EP)["generation"])


def _check_generation(per_rank: list[dict]) -> None:
    assert len(per_rank) == WORLD
    for rank, result in enumerate(per_rank):
        assert result["got"] == result["expected"], f"rank {rank}: completions differ from generate's"
        assert result["dtensors"], f"rank {rank}: parameters left unsharded"
        assert len(result["got"]) == len(GEN_ROWS[rank])
        assert result["offered"] == result["expected"], f"rank {rank}: completions with offers differ"
    # (left padding, length) of each offered prompt: group 0 pads its 7-token prompt to the 13 of the other.
    assert [result["offers"] for result in per_rank] == [[(6, 7), (0, 13)]] * 2 + [[(0, 22)]] * 2
    lengths = [[len(c) for c in result["got"]] for result in per_rank]
    # The schedule the docstring describes (EOS tokens chosen by the worker's `rank_eos`).
    assert lengths[0] == [1, 1, 1]
    assert max(lengths[1]) <= 3 and len(set(lengths[1])) > 1
    assert max(lengths[2]) <= 5 and lengths[3] == [GEN_MAX_NEW_TOKENS] * 3
    world_level = [[c for c in result["collectives"] if c[0] in FSDP2_COLLECTIVES] for result in per_rank]
    assert world_level[0] and all(log == world_level[0] for log in world_level)


def merged_batch(batches: list[dict], pad: int) -> dict:
    """One micro-batch of every rank's rows: prompts left-padded, completions right-padded to the widest rank's."""
    out = {}
    for key in batches[0]:
        parts = [b[key] for b in batches]
        if parts[0].ndim == 0:  # the global token count, the same on every rank
            out[key] = parts[0]
            continue
        if parts[0].ndim == 2:
            width = max(t.shape[1] for t in parts)
            fill = pad if key.endswith("_ids") else 0
            left = key.startswith("prompt")
            parts = [
                torch.nn.functional.pad(t, (width - t.shape[1], 0) if left else (0, width - t.shape[1]), value=fill)
                for t in parts
            ]
        out[key] = torch.cat(parts)
    return out


@pytest.mark.timeout(LAUNCH_TIMEOUT + 120)
@pytest.mark.parametrize("step_family,mode", STEPS)
def test_whole_train_step_matches_single_process(launch, models, step_family, mode):
    """One whole `trainer.train()` step, TRL's defaults otherwise (`beta=0`, `num_iterations=1`), in exact mode with
    gradient checkpointing and in detached mode (tiny qwen3_5; tiny glm_moe_dsa in exact mode), 2 shard groups of 2
    under FSDP2 over 4 processes (`fully_shard` on every decoder layer and the root by transformers' distributed
    loading; parameters DTensors before and after): each group generates 8 completions of its own prompt (13 and 22
    tokens, chunks of 5) with the trainer's decoder in the world lockstep, the loss pass takes those prompt states
    (prefilling none), and every parameter's gradient just before the optimizer step equals the single-process
    gradient of the same completions (every rank's micro-batch as one)."""
    result = launch[0].result(f"whole_train_step_{step_family}_{mode}")
    layers = AutoConfig.from_pretrained(models[step_family]).num_hidden_layers
    for rank, setup in enumerate(result["setup"]):
        assert setup["dtensors"] and setup["dtensors_after"], f"rank {rank}: parameters left unsharded"
        assert setup["layers_sharded"] == [True] * (layers + 1), f"rank {rank}: {setup['layers_sharded']}"
        first = rank - rank % GROUP_SIZE
        assert setup["shard_group"] == list(range(first, first + GROUP_SIZE))
        assert setup["shared_generation"] and setup["lockstep"] == [True], setup
        # The loss pass prefilled nothing: it took the whole prompt's state (all but the last token) from generation.
        assert setup["loss_pass_positions"] == [0, STEP_PROMPT_TOKENS[rank // GROUP_SIZE] - 1], setup
    tokenizer = build_tokenizer()
    prompts = [tokenizer(text=p)["input_ids"] for p in step_prompts()]
    batches = result["batches"]
    for rank, batch in enumerate(batches):
        # Each group holds its own prompt (unpadded), 4 of its 8 completions per rank, none empty.
        assert batch["prompt_ids"].tolist() == [prompts[rank // GROUP_SIZE]] * 4, f"rank {rank}"
        assert bool(batch["prompt_mask"].all()) and bool((batch["completion_mask"].sum(1) >= 1).all())
    assert any(bool(batch["advantages"].ne(0).any()) for batch in batches)
    merged = merged_batch(batches, tokenizer.pad_token_id)
    # `num_generations` does not enter the loss of a given micro-batch (its advantages are the 4-process run's).
    config = trainer_config(
        str(Path(models[step_family]) / "out-step"), num_generations=2, beta=0.0, prompt_gradient=mode
    )
    trainer = LongStrawGRPOTrainer(
        str(models[step_family]),
        lambda completions, **kw: [0.0] * len(completions),
        config,
        Dataset.from_dict({"prompt": ["a"] * 8}),
    )
    trainer._prepare_inputs = lambda x: x
    trainer.current_gradient_accumulation_steps = 1
    if mode == "exact":
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trainer.training_step(trainer.model, merged, merged["num_items_in_batch"])
    expected = {n: p.grad for n, p in trainer.model.named_parameters()}
    got = result["grads"]
    assert set(got) == set(expected)
    assert any(ref is not None for ref in expected.values())
    for name, ref in expected.items():
        if ref is None:  # no gradient at all (glm_moe_dsa's indexer, which runs without autograd as in stock)
            assert got[name] is None or not got[name].any(), f"{name} got a gradient"
            continue
        assert got[name] is not None, f"no gradient for {name}"
        error = ((got[name] - ref).norm() / ref.norm()).item()
        assert error <= SHARDED_GRAD_RTOL, f"{name} relative error {error:.2e}"
