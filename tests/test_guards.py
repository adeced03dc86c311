"""Early checks: prompts beyond the RoPE window, and the memory guard before the first step."""

from __future__ import annotations

import copy
import logging
from dataclasses import replace

import pytest
from transformers import LlamaConfig

from tests.helpers import make_trainer
from trl_longstraw import guards, plan
from trl_longstraw.plan import Setup, estimate, model_stats, with_yarn
from trl_longstraw.testing import build_tokenizer, random_micro_batch, save_tiny_model

YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0}


# ------------------------------------------------------------------------------------------------------- window
def test_check_positions_unscaled_window():
    config = LlamaConfig(max_position_embeddings=32)
    assert guards.check_positions(config, 32) is None
    with pytest.raises(ValueError, match=r"33 positions .* window of 32 .*rope_type='yarn', factor=2"):
        guards.check_positions(config, 33)


def test_check_positions_scaled_window_warns():
    config = with_yarn(LlamaConfig(max_position_embeddings=32), 64)
    assert config.max_position_embeddings == 64 and plan.rope_scaled(config)
    assert guards.check_positions(config, 64) is None  # beyond the native 32, within the scaled window
    warning = guards.check_positions(config, 65)
    assert "65 positions" in warning and "window of 64" in warning and "scaled from 32" in warning


def test_check_positions_without_a_window():
    from transformers import MambaConfig

    assert guards.check_positions(MambaConfig(), 10**7) is None


def _window_batch(prompt: int = 13, completion: int = 9):
    vocab = len(build_tokenizer())
    return random_micro_batch([prompt, 7], [completion, 1, 5, 3], [0, 0, 1, 1], vocab, seed=1)


def test_trainer_refuses_prompts_beyond_an_unscaled_window(tmp_path):
    trainer = make_trainer(save_tiny_model(tmp_path, "llama", max_position_embeddings=16))
    mb = _window_batch()  # 13 + 9 = 22 positions
    with pytest.raises(ValueError, match="exceed the model's window of 16 positions"):
        trainer.training_step(trainer.model, dict(mb), mb["num_items_in_batch"])
    assert all(p.grad is None for p in trainer.model.parameters())


def test_trainer_scoring_refuses_prompts_beyond_an_unscaled_window(tmp_path):
    import torch

    trainer = make_trainer(save_tiny_model(tmp_path, "llama", max_position_embeddings=16))
    mb = _window_batch()
    ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], 1)
    mask = torch.cat([mb["prompt_mask"], mb["completion_mask"]], 1)
    with torch.no_grad(), pytest.raises(ValueError, match="exceed the model's window"):
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, mb["completion_ids"].shape[1])


def test_trainer_warns_once_beyond_a_scaled_window(tmp_path, caplog):
    path = save_tiny_model(tmp_path, "llama", max_position_embeddings=32, rope_parameters=dict(YARN))
    trainer = make_trainer(path)
    mb = _window_batch(prompt=25, completion=9)  # 34 positions: beyond the scaled window of 32
    with caplog.at_level(logging.WARNING, logger="trl_longstraw.trainer"):
        for _ in range(2):
            trainer.training_step(trainer.model, dict(mb), mb["num_items_in_batch"])
    warnings = [r for r in caplog.records if r.name == "trl_longstraw.trainer" and "RoPE window" in r.message]
    assert len(warnings) == 1
    assert "34 positions" in warnings[0].message and "scaled from 16" in warnings[0].message


def test_trainer_accepts_prompts_within_a_scaled_window(tmp_path, caplog):
    path = save_tiny_model(tmp_path, "llama", max_position_embeddings=32, rope_parameters=dict(YARN))
    trainer = make_trainer(path)
    mb = _window_batch()  # 22 positions: beyond the native 16, within the scaled 32
    with caplog.at_level(logging.WARNING, logger="trl_longstraw.trainer"):
        trainer.training_step(trainer.model, dict(mb), mb["num_items_in_batch"])
    assert not [r for r in caplog.records if r.name == "trl_longstraw.trainer"]


# ------------------------------------------------------------------------------------------------- memory guard
@pytest.fixture(scope="module")
def qwen_stats():
    config = plan.preset_config("qwen3.6-27b")
    return model_stats(plan.meta_model(config), config)


def test_check_memory_passes_when_it_fits(qwen_stats):
    budget = estimate(qwen_stats, Setup(positions=200_000, gpus=8, gpu_memory=96 * 10**9))
    guards.check_memory(budget, free_bytes=budget.to_allocate)


def test_check_memory_stops_with_numbers_and_suggestions(qwen_stats):
    setup = Setup(positions=2_100_000, mode="exact", gpus=8, gpu_memory=96 * 10**9)
    budget = estimate(qwen_stats, setup)
    free = budget.to_allocate - 1
    with pytest.raises(ValueError) as info:
        guards.check_memory(budget, free_bytes=free)
    message = str(info.value)
    assert f"needs about {plan._size(budget.to_allocate)} more per GPU" in message
    assert f"only {plan._size(free)} is free" in message
    for line in ("prompt state gradient", "branch graph", "chunk activations", "optimizer state"):
        assert line in message
    fixes = ("prompt_gradient='detached'", "shard_prompt_state=True", "prefill_chunk_size=", "GPUs", "memory_guard")
    for fix in fixes:
        assert fix in message
    assert "2,100,000 prompt positions" in message


def test_check_memory_suggestions_judge_against_free_memory(qwen_stats):
    """A change is called fitting exactly when its own bytes to allocate fit the free memory."""
    setup = Setup(positions=1_000_000, mode="exact", gpus=8, gpu_memory=141 * 10**9)
    budget = estimate(qwen_stats, setup)
    detached = estimate(qwen_stats, replace(setup, mode="detached"))
    assert detached.to_allocate < budget.to_allocate
    for free, verdict in ((detached.to_allocate, "(fits)"), (detached.to_allocate - 1, "(does not fit)")):
        lines = plan.suggestions(budget, free)
        (line,) = [s for s in lines if s.startswith("prompt_gradient='detached'")]
        needs = plan._size(detached.to_allocate)
        assert line == f"prompt_gradient='detached' (biased gradient): needs {needs} {verdict}"


def test_runtime_budget_counts_the_live_model(tiny_model_path):
    trainer = make_trainer(tiny_model_path("llama"), prefill_chunk_size=5, prompt_gradient="detached")
    model = trainer.model
    budget = guards.runtime_budget(model, trainer.args, 13, 4, gpus=1, fsdp=False, gpu_memory=10**9)
    params = sum(p.numel() for p in model.parameters())
    weights = [i for i in budget.items if i.name == "weights"][0]
    assert weights.resident and weights.nbytes == params * 4  # fp32 tiny model, replicated
    assert [i.nbytes for i in budget.items if i.name == "optimizer state"] == [params * 8]
    assert budget.setup.completion_length == 9  # max_completion_length, the worst case of later steps
    assert (budget.setup.mode, budget.setup.prefill_chunk_size, budget.setup.group_size) == ("detached", 5, 2)
    assert budget.setup.compute_bytes == 4
    assert budget.to_allocate == budget.peak - params * 4


def test_runtime_budget_passes_expert_parallelism_and_offload(tiny_model_path):
    """The guard tells the planner what the run does: experts split over `expert_parallel_size` GPUs, FSDP2's CPU
    offload, boundary states in host memory; each lowers the device peak of a 2-GPU FSDP2 step of a tiny GLM-5."""
    trainer = make_trainer(tiny_model_path("glm_moe_dsa"), prefill_chunk_size=5, router_aux_loss_coef=0.0)
    args = copy.copy(trainer.args)

    def budget(offload: bool = False, **overrides):
        for key, value in overrides.items():
            setattr(args, key, value)
        return guards.runtime_budget(trainer.model, args, 13, 4, gpus=2, fsdp=True, gpu_memory=10**9, offload=offload)

    plain = budget()
    assert (plain.setup.expert_parallel, plain.setup.ep_size, plain.setup.offload) == (False, 0, False)
    ep = budget(expert_parallel_size=2)
    assert (ep.setup.expert_parallel, ep.setup.ep_size) == (True, 2)
    assert ep.peak < plain.peak
    offloaded = budget(expert_parallel_size=1, offload=True)
    assert offloaded.setup.offload and offloaded.peak < plain.peak
    assert budget(offload_boundary_states=True).setup.offload_boundary_states


def test_trainer_memory_guard_stops_the_first_step(tiny_model_path, monkeypatch):
    calls = []

    def tiny_device(device):
        calls.append(device)
        return 1024, 80 * 10**9

    monkeypatch.setattr(guards, "device_free_memory", tiny_device)
    trainer = make_trainer(tiny_model_path("llama"), prefill_chunk_size=5)
    mb = _window_batch()
    with pytest.raises(ValueError, match="only 1.00 KiB is free(.|\n)*memory_guard=False"):
        trainer.training_step(trainer.model, dict(mb), mb["num_items_in_batch"])
    assert all(p.grad is None for p in trainer.model.parameters())  # stopped before any work
    assert len(calls) == 1


def test_trainer_memory_guard_checks_once_and_lets_fitting_runs_through(tiny_model_path, monkeypatch):
    calls = []

    def roomy_device(device):
        calls.append(device)
        return 10**12, 10**12

    monkeypatch.setattr(guards, "device_free_memory", roomy_device)
    trainer = make_trainer(tiny_model_path("llama"), prefill_chunk_size=5)
    mb = _window_batch()
    for _ in range(2):
        trainer.training_step(trainer.model, dict(mb), mb["num_items_in_batch"])
    assert len(calls) == 1
    assert any(p.grad is not None for p in trainer.model.parameters())


def test_trainer_memory_guard_runs_before_the_first_generation(tiny_model_path, monkeypatch):
    """With a training dataset, the guard checks the dataset's longest prompt before generating (the planner's step
    includes the decode tail), and sets what is left free as the engines' hold budget."""
    from grpo_pair import generation_inputs, make_pair

    free = []
    monkeypatch.setattr(guards, "device_free_memory", lambda device: (free[-1], 80 * 10**9))
    _, ours = make_pair(tiny_model_path("llama"), prompts=["a b c d e f g", "h i"], max_completion_length=4)
    generated = []
    ours._generate_and_score_completions = lambda inputs: generated.append(inputs)
    free.append(1024)
    with pytest.raises(ValueError, match="only 1.00 KiB is free"):
        ours.training_step(ours.model, generation_inputs(["h i"], 3), None)
    assert not generated
    _, ours = make_pair(tiny_model_path("llama"), prompts=["a b c d e f g", "h i"], max_completion_length=4)
    free.append(10**12)
    budget = guards.runtime_budget(ours.model, ours.args, 7, 4, gpus=1, fsdp=False, gpu_memory=80 * 10**9)
    ours._check_memory(ours.model, 7, 4)
    assert ours.memory_estimate["positions"] == 7
    assert ours._hold_budget == 10**12 - budget.to_allocate


def test_trainer_memory_guard_can_be_disabled(tiny_model_path, monkeypatch):
    monkeypatch.setattr(guards, "device_free_memory", lambda device: (1024, 80 * 10**9))
    trainer = make_trainer(tiny_model_path("llama"), prefill_chunk_size=5, memory_guard=False)
    mb = _window_batch()
    trainer.training_step(trainer.model, dict(mb), mb["num_items_in_batch"])
    assert any(p.grad is not None for p in trainer.model.parameters())


def test_device_free_memory_is_none_off_gpu():
    import torch

    assert guards.device_free_memory(torch.device("cpu")) is None
