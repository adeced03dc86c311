"""Expert parallelism through transformers (`expert_parallel_size`): settings checks, and 2-process CPU (gloo) runs
of a tiny glm_moe_dsa and a tiny qwen3_moe (4 experts per MoE layer, 2 per rank) with the prompt state sharded over
both ranks, and in data parallelism (no sharded state, different prompts per rank), against single-process gradients
of the same global batch: stock `GRPOTrainer` in exact mode, the single-process engine in detached mode."""

from __future__ import annotations

import tempfile
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType
from datasets import Dataset
from dist_worker import make_batches, trainer_config
from ep_worker import LORA, lora_grads, set_lora_weights
from peft import LoraConfig
from tolerances import SHARDED_GRAD_RTOL
from transformers import AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer

from tests.helpers import torchrun
from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer
from trl_longstraw.expert_parallel import (
    check_args,
    check_loaded,
    check_model_config,
    distributed_config,
    local_experts,
    num_experts,
    prepare,
)
from trl_longstraw.testing import build_tokenizer, save_tiny_model, tiny_config

# Seconds for the one 2-process launch of both workers for both families (it was 300 s per family for
# tests/ep_worker.py and 600 s for tests/ep_generate_worker.py, which took 5 min under a load average of 30).
LAUNCH_TIMEOUT = 1800
RUNS = ["ep_exact", "ep_exact_checkpointing", "ep_detached", "ep_lora_exact", "ep_dp_exact", "ep_dp_detached"]
FAMILIES = ["glm_moe_dsa", "qwen3_moe"]
# Run with FSDP2's CPU offload -> the same run without it.
OFFLOADED = {
    "ep_exact_offload": "ep_exact",
    "fsdp2_data_parallel_offload": "fsdp2_data_parallel",
    "fsdp2_per_pass_offload": "fsdp2_per_pass",
}
# Tiny qwen3_moe: 4 experts (2 per token) in both layers, as the tiny glm_moe_dsa's MoE layers.
QWEN3_MOE_TINY = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, router_aux_loss_coef=0.0)


def _reward(completions, **kwargs):
    return [0.0] * len(completions)


@pytest.fixture(scope="module")
def models(tiny_model_path, tmp_path_factory):
    """family -> path of its tiny model (4 experts per MoE layer)."""
    qwen3_moe = save_tiny_model(tmp_path_factory.mktemp("ep-qwen3_moe") / "model", "qwen3_moe", **QWEN3_MOE_TINY)
    return {"glm_moe_dsa": tiny_model_path("glm_moe_dsa"), "qwen3_moe": qwen3_moe}


def _stock_batch(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k != "rank"}


def single_process_references(path, batches: dict) -> dict:
    """Single-process gradients of the same global micro-batches: `{run: {param: grad or None}}`."""
    settings = dict(
        per_device_train_batch_size=4,
        max_completion_length=9,
        report_to=[],
        use_cpu=True,
        beta=0.1,
        loss_type="dapo",
        bf16=False,
        num_generations=2,
    )
    dataset = Dataset.from_dict({"prompt": ["a"] * 8})

    def grads(trainer, checkpointing: bool = False, key: str = "S") -> dict[str, torch.Tensor | None]:
        trainer._prepare_inputs = lambda x: x
        trainer.current_gradient_accumulation_steps = 1
        if checkpointing:
            trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            trainer.model.gradient_checkpointing_disable()
        trainer.model.zero_grad(set_to_none=True)
        batch = _stock_batch(batches[key])
        trainer.training_step(trainer.model, batch, batch["num_items_in_batch"])
        return {n: None if p.grad is None else p.grad.clone() for n, p in trainer.model.named_parameters()}

    stock_args = GRPOConfig(output_dir=tempfile.mkdtemp(), **settings)
    stock = GRPOTrainer(str(path), _reward, stock_args, train_dataset=dataset)
    refs = {"ep_exact": grads(stock), "ep_exact_checkpointing": grads(stock, checkpointing=True)}
    refs["ep_dp_exact"] = grads(stock, key="A")
    stock = GRPOTrainer(str(path), _reward, stock_args, train_dataset=dataset, peft_config=LoraConfig(**LORA))
    set_lora_weights(stock.model)
    grads(stock)
    refs["ep_lora_exact"] = lora_grads(stock.model)
    ours = LongStrawGRPOTrainer(
        str(path), _reward, trainer_config(tempfile.mkdtemp(), num_generations=2), train_dataset=dataset
    )
    ours.args.prompt_gradient = "detached"
    refs["ep_detached"] = grads(ours)
    refs["ep_dp_detached"] = grads(ours, key="B")
    return refs


@pytest.fixture(scope="module")
def ep_launch(models, tmp_path_factory):
    """Starts one launch on 2 processes: tests/ep_worker.py (cases `train-FAMILY`) and tests/ep_generate_worker.py
    (cases `generate-FAMILY`) for every family; computes the single-process references while it runs. Yields
    `(batches, launch, references by family)`."""
    tmp = tmp_path_factory.mktemp("ep")
    batches = make_batches(len(build_tokenizer()))
    torch.save(batches, tmp / "batches.pt")
    cases = {f"train-{family}": ("ep_worker", [models[family], tmp / "batches.pt"]) for family in FAMILIES}
    cases |= {f"generate-{family}": ("ep_generate_worker", [models[family]]) for family in FAMILIES}
    with torchrun("the 2-process run", cases, tmp, nproc=2, timeout=LAUNCH_TIMEOUT) as run:
        yield batches, run, {family: single_process_references(models[family], batches) for family in FAMILIES}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def launch(family, models, ep_launch):
    """tests/ep_worker.py's case for one family: `(model path, batches, results)`."""
    batches, run, _ = ep_launch
    return models[family], batches, run.result(f"train-{family}")


@pytest.fixture(scope="module")
def reference(family, ep_launch):
    return ep_launch[2][family]


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT + 120)
@pytest.mark.parametrize("run", RUNS)
def test_expert_parallel_gradients_match_single_process(launch, reference, run):
    """Every parameter's gradient, experts included (gathered from the ranks for the comparison only), equals the
    single-process one of the same global batch: stock GRPOTrainer's in exact mode (with and without gradient
    checkpointing, and with LoRA adapters on the attention outputs, whose gradients the Trainer averages itself), the
    unsharded engine's in detached mode."""
    got, expected = launch[2][run], reference[run]
    assert set(got) == set(expected)
    if run == "ep_lora_exact":
        assert expected and all(g is not None for g in expected.values())
    else:
        assert any(".experts." in name and g is not None for name, g in expected.items())
    for name, ref in expected.items():
        if ref is None:  # the DSA indexer, which runs without autograd as in stock
            assert got[name] is None or not got[name].any(), f"{run}: {name} got a gradient, stock has none"
            continue
        assert got[name] is not None, f"{run}: no gradient for {name}"
        error = ((got[name] - ref).norm() / ref.norm()).item()
        assert error <= SHARDED_GRAD_RTOL, f"{run}: {name} relative error {error:.2e}"


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_experts_are_never_gathered(launch):
    """Each rank holds 2 of the 4 experts of every MoE layer, in every forward (none gathers the EP group's experts),
    in the reference model too; rank r's are experts 2r and 2r+1 of the model loaded whole, unchanged by training."""
    path, _, results = launch
    model = AutoModelForCausalLM.from_pretrained(str(path))
    assert set(local_experts(model).values()) == {4}
    whole = dict(model.named_parameters())
    for rank in range(2):
        assert results["local_experts"][rank] == dict.fromkeys(local_experts(model), 2)
        assert results["ref_local_experts"][rank] == results["local_experts"][rank]
        assert results["seen"][rank] == dict.fromkeys(local_experts(model), [2])
        for name, local in results["local_weights"][rank].items():
            torch.testing.assert_close(local, whole[name].detach()[2 * rank : 2 * rank + 2], rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize("run", sorted(set(RUNS) | set(OFFLOADED) | set(OFFLOADED.values())))
def test_collectives_equal_across_ranks(launch, run):
    """Both ranks issue the same collectives in the same order, the experts' all-to-alls (of counts, tokens forward
    and token gradients backward) included under EP; those carry each rank's own number of routed tokens, so only
    their order is compared, the other collectives' shapes too."""

    def calls(per_rank):
        return [(name, None if name.startswith("ep_") else shapes) for name, shapes in per_rank[run]]

    rank0, rank1 = (calls(per_rank) for per_rank in launch[2]["collectives"])
    assert rank0 == rank1
    names = {name for name, _ in rank0}
    assert (
        {"ep_all_to_all_single", "ep_all_to_all_single_autograd"} <= names
        if run.startswith("ep_")
        else (not any(name.startswith("ep_") for name in names))
    )


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize("run", list(OFFLOADED))
def test_cpu_offload_gradients_identical(launch, run):
    """FSDP2's CPUOffloadPolicy (`fsdp_cpu_offload` under expert parallelism; accelerate's `fsdp_offload_params`
    otherwise, in the engine's data-parallel and sharded lockstep) gives bit for bit the gradients and the collectives
    of the same step without it."""
    results = launch[2]
    ours, kept = results[run], results[OFFLOADED[run]]
    assert set(ours) == set(kept)
    assert any(g is not None for g in kept.values())
    for name, g in kept.items():
        assert (g is None and ours[name] is None) or torch.equal(ours[name], g), name
    for per_rank in results["collectives"]:
        assert per_rank[run] == per_rank[OFFLOADED[run]]


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_cpu_offload_is_active(launch):
    """Every FSDP2 parameter of the offloaded models (transformers' EP loading with `fsdp_cpu_offload`, and
    `fully_shard` with `CPUOffloadPolicy`) is offloaded, and the local shards and their gradients are on the CPU
    after the step (on a CPU-only machine every tensor is, so the flag is what tells the runs apart there)."""
    for per_rank in launch[2]["offload"]:
        assert per_rank == {
            "detected": (True, False),
            "ep": True,
            "ep_devices": ["cpu"],
            "fsdp2": True,
            "fsdp2_devices": ["cpu"],
        }


# ------------------------------------------------------------------------------------------------- settings checks
def _args(**overrides) -> LongStrawGRPOConfig:
    settings = dict(
        output_dir=tempfile.mkdtemp(),
        report_to=[],
        use_cpu=True,
        per_device_train_batch_size=4,
        num_generations=4,
        expert_parallel_size=2,
        shard_prompt_state=True,
        save_only_model=True,
    )
    settings.update(overrides)
    return LongStrawGRPOConfig(**settings)


def test_expert_parallel_size_must_be_positive():
    with pytest.raises(ValueError, match="expert_parallel_size=0 must be a positive"):
        _args(expert_parallel_size=0)


def test_fsdp_cpu_offload_without_expert_parallelism_refused():
    """Under accelerate's FSDP2 the offload is accelerate's own setting: the message names it."""
    with pytest.raises(ValueError, match="fsdp_offload_params: true"):
        _args(expert_parallel_size=1, fsdp_cpu_offload=True)


@pytest.mark.parametrize(
    ("overrides", "world", "match"),
    [
        ({"expert_parallel_size": 3}, 4, "must divide the number of processes"),
        ({"save_only_model": False}, 2, "save_only_model=True"),
        ({"model_init_kwargs": {"distributed_config": {"ep_size": 2}}}, 2, "remove distributed_config"),
        ({"model_init_kwargs": {"distributed_config": distributed_config(4, 2)}}, 2, "remove distributed_config"),
    ],
)
def test_check_args_refuses(overrides, world, match):
    with pytest.raises(ValueError, match=match):
        check_args(_args(**overrides), world)


def test_check_args_accepts():
    check_args(_args(), 2)
    check_args(_args(prompt_shard_group_size=4, expert_parallel_size=2), 4)  # the group of all 4 processes
    check_args(_args(save_only_model=False, save_strategy="no"), 2)
    check_args(_args(shard_prompt_state=False), 2)  # the data-parallel lockstep
    check_args(_args(model_init_kwargs={"distributed_config": distributed_config(2, 2)}), 2)  # the recipe's
    check_args(_args(expert_parallel_size=1, shard_prompt_state=False, save_only_model=False), 2)
    check_args(_args(prompt_shard_group_size=2, expert_parallel_size=4), 4)  # tests/test_shard_groups.py runs it


def test_check_model_config():
    vocab = len(build_tokenizer())
    glm, qwen = tiny_config("glm_moe_dsa", vocab), tiny_config("qwen3_moe", vocab, num_experts=8)
    assert (num_experts(glm), num_experts(qwen)) == (4, 8)
    check_model_config(glm, 4)
    check_model_config(qwen, 8)
    with pytest.raises(ValueError, match="must divide the 4 experts"):
        check_model_config(glm, 8)
    with pytest.raises(ValueError, match="has no experts to spread"):
        check_model_config(tiny_config("llama", vocab), 2)
    assert distributed_config(8, 4) == {
        "fsdp_size": 8,
        "ep_size": 4,
        "ep_implementation": "all_to_all",
        "fsdp_cpu_offload": False,
    }
    assert distributed_config(8, 8, cpu_offload=True)["fsdp_cpu_offload"] is True


def test_model_not_loaded_expert_parallel_refused(tiny_model_path):
    """A model instance built without `distributed_config` cannot be spread after the fact: the message says how."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path("glm_moe_dsa"))
    with pytest.raises(ValueError, match="was not loaded expert-parallel over 2 ranks"):
        check_loaded(model, 2)


def test_trainer_checks_before_loading(tiny_model_path):
    """The trainer checks the settings against the processes before it loads anything (one process here)."""
    with pytest.raises(ValueError, match="expert_parallel_size=2 must divide the number of processes \\(1\\)"):
        LongStrawGRPOTrainer(
            str(tiny_model_path("glm_moe_dsa")), _reward, _args(), train_dataset=Dataset.from_dict({"prompt": ["a"]})
        )


@pytest.mark.parametrize("kind", [DistributedType.FSDP, DistributedType.DEEPSPEED])
def test_accelerate_sharding_refused(kind):
    """transformers shards an expert-parallel model as it loads it: an accelerate config that would shard it again is
    refused before anything is loaded, naming the launch config to use."""
    args = SimpleNamespace(distributed_state=SimpleNamespace(distributed_type=kind))
    with pytest.raises(ValueError, match="recipes/accelerate/expert_parallel.yaml"):
        prepare("unused", args)


def test_model_init_kwargs_for_trl(tiny_model_path):
    """TRL loads the policy given by name, and the reference model, with `args.model_init_kwargs`: the trainer adds
    the distributed_config to them (and checks the model's experts first); a policy instance with beta = 0 needs
    none."""
    args = SimpleNamespace(
        distributed_state=SimpleNamespace(distributed_type=DistributedType.MULTI_GPU),
        model_init_kwargs={"dtype": "float32"},
        trust_remote_code=False,
        expert_parallel_size=2,
        fsdp_cpu_offload=False,
        world_size=4,
        beta=0.0,
    )
    prepare(str(tiny_model_path("glm_moe_dsa")), args)
    assert args.model_init_kwargs == {"dtype": "float32", "distributed_config": distributed_config(4, 2)}
    args.expert_parallel_size = 8
    with pytest.raises(ValueError, match="must divide the 4 experts"):
        prepare(str(tiny_model_path("glm_moe_dsa")), args)


# ------------------------------------------------------------------------------------------- generation under EP
@pytest.fixture(scope="module")
def generate_launch(family, ep_launch):
    """tests/ep_generate_worker.py's case for one family: every rank's results."""
    return ep_launch[1].result(f"generate-{family}")


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize("mode", ["sharded", "data_parallel"])
def test_expert_parallel_generation_equals_generate(generate_launch, mode):
    """Under expert parallelism (every decoding forward runs the experts' all-to-alls over both ranks), the trainer's
    shared-prompt generation gives single-process transformers' greedy `generate` token for token, with the prompt
    state sharded over both ranks and in data parallelism (2 and 3 distinct prompts per rank, of 1 to 13 tokens in
    chunks of 3, left-padded). Rank 0's rows end steps before rank 1's: both ranks run the same decoding forwards and
    collectives (no hang); in data parallelism the rank with less to do runs filler prefills and steps."""
    ranks = [result["generation"][mode] for result in generate_launch]
    for rank, result in enumerate(ranks):
        assert result["got"] == result["expected"], f"rank {rank}"
        assert result["lockstep"] == (mode == "data_parallel")
    # Ragged: rank 0's rows all end before rank 1's longest.
    assert max(map(len, ranks[0]["expected"])) < max(map(len, ranks[1]["expected"]))
    assert ranks[0]["forwards"] == ranks[1]["forwards"]
    assert ranks[0]["collectives"] == ranks[1]["collectives"]
    names = {name for name, _ in ranks[0]["collectives"]}
    assert {"ep_all_to_all_single", "all_reduce"} <= names
    if mode == "data_parallel":
        assert ranks[0]["fillers"] > 0, "rank 0 finished first: it should step on with fillers"
    else:
        assert ranks[0]["fillers"] == ranks[1]["fillers"] == 0  # the shard group steps its own rows in lockstep


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_expert_parallel_train_step_generates_once_per_prompt(generate_launch):
    """A whole `train()` step under expert parallelism (beta = 0, num_iterations = 1) generates through the shared-
    prompt path: each prompt position is embedded once in generation (stock: once per completion), summed over the
    ranks. Without a sharded state (one prompt per rank, 11 and 5 tokens), the loss pass takes generation's state:
    once per prompt and step in detached mode, twice in exact mode. With the sharded state, in the GLM-5.2 config's
    shape (exact mode, LoRA, gradient checkpointing), every rank runs each prefill and reverse chunk (or its own
    chunks under context parallelism), and the loss pass prefills again unless it took generation's state
    (`longstraw/prompt_positions_reused`), then runs the reverse pass."""
    steps = [result["train"] for result in generate_launch]

    def summed(run: str, part: str) -> list[set[int]]:
        per_prompt = zip(*(rank[run][part] for rank in steps), strict=True)
        return [{sum(counts) for counts in zip(*ranks, strict=True)} for ranks in per_prompt]

    for run in ("dp_detached", "dp_exact", "sharded"):
        assert all(rank[run]["global_step"] == 1 for rank in steps)
    assert summed("dp_detached", "generation") == [{1}, {1}]
    assert summed("dp_detached", "step") == [{1}, {1}]
    assert summed("dp_exact", "step") == [{2}, {2}]
    assert all(rank["dp_detached"]["reused"] > 0 for rank in steps)
    ranks_per_position = 1 if steps[0]["sharded"]["context_parallel"] else 2
    assert summed("sharded", "generation") == [{ranks_per_position}]
    loss_prefills = 0 if steps[0]["sharded"]["reused"] > 0 else 1
    assert summed("sharded", "step") == [{ranks_per_position * (1 + loss_prefills + 1)}]
