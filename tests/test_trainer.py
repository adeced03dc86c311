"""Construction checks, configuration validation and end-to-end training."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from tests.helpers import base_args, make_trainer, zero_reward
from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer
from trl_longstraw.adapters import ADAPTERS
from trl_longstraw.kv import KVCacheAdapter


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(prompt_gradient="approximate"), "prompt_gradient='approximate' is not supported"),
        (dict(prefill_chunk_size=0), "prefill_chunk_size=0 must be a positive"),
        (dict(prefill_chunk_size=-3), "prefill_chunk_size=-3 must be a positive"),
    ],
)
def test_config_rejects_invalid_values(overrides, match):
    with pytest.raises(ValueError, match=match):
        LongStrawGRPOConfig(**base_args(**overrides))


def test_config_fields_have_help():
    import dataclasses

    from trl import GRPOConfig

    own = {f.name for f in dataclasses.fields(LongStrawGRPOConfig)} - {f.name for f in dataclasses.fields(GRPOConfig)}
    assert own >= {"prompt_gradient", "prefill_chunk_size", "group_shuffle"}
    for f in dataclasses.fields(LongStrawGRPOConfig):
        if f.name in own:
            assert f.metadata.get("help"), f.name
    config = LongStrawGRPOConfig(**base_args())
    assert (config.prompt_gradient, config.prefill_chunk_size, config.group_shuffle) == ("exact", 4096, True)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(use_liger_kernel=True), "use_liger_kernel"),
        (
            dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True}),
            "use_reentrant",
        ),
    ],
)
def test_unsupported_settings_raise_at_construction(tiny_model_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        make_trainer(tiny_model_path("llama"), **overrides)


def test_reentrant_checkpointing_is_fine_in_detached_mode(tiny_model_path):
    make_trainer(
        tiny_model_path("llama"),
        prompt_gradient="detached",
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": True},
    )


def test_stock_config_is_refused(tiny_model_path):
    from trl import GRPOConfig

    with pytest.raises(ValueError, match="needs a LongStrawGRPOConfig"):
        LongStrawGRPOTrainer(str(tiny_model_path("llama")), zero_reward, GRPOConfig(**base_args()))


def test_unsupported_model_type_lists_supported(tmp_path):
    from trl_longstraw.testing import save_tiny_model

    path = save_tiny_model(tmp_path / "gpt2", "gpt2", n_embd=32, n_layer=1, n_head=2)
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported.*llama"):
        make_trainer(path)


def test_moe_router_aux_loss_is_refused(tmp_path):
    from trl_longstraw.testing import save_tiny_model

    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    path = save_tiny_model(tmp_path / "moe", "qwen3_moe", **moe)
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.0"):
        make_trainer(path, router_aux_loss_coef=0.01)
    make_trainer(path, router_aux_loss_coef=0.0)


def _count_reward(completions, **kwargs):
    """Rewards completions that contain many 'a' tokens: something a tiny model can move towards."""
    return [float(str(c).count("a")) for c in completions]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_train_two_steps_with_generation(tiny_model_path, mode):
    """`trainer.train()` end to end: generation, rewards, the LongStraw loss path and the optimizer step."""
    path = tiny_model_path("llama")
    prompts = [" ".join("key value a b c d e f g".split() * 5), " ".join("the answer is 1 2 3".split() * 7)]
    args = LongStrawGRPOConfig(
        **base_args(
            per_device_train_batch_size=4,
            num_generations=4,
            max_completion_length=6,
            max_steps=2,
            learning_rate=1e-2,
            save_strategy="no",
        ),
        prompt_gradient=mode,
        prefill_chunk_size=11,
        prefill_progress=False,
    )
    trainer = LongStrawGRPOTrainer(
        str(path), _count_reward, args, train_dataset=Dataset.from_dict({"prompt": prompts * 2})
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2
    # Each micro-batch holds one prompt, unpadded in its generation batch: the loss pass takes generation's state.
    assert all(entry["longstraw/prompt_positions"] == 0 for entry in logs)
    assert all(entry["longstraw/prompt_positions_reused"] > 0 for entry in logs)
    assert all(torch.isfinite(torch.tensor(entry["loss"])) for entry in logs)
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    # The branches attend to their own keys in both modes, so the key projections always receive gradient.
    assert "model.layers.0.self_attn.k_proj.weight" in changed


def test_shard_prompt_state_refused_for_adapters_without_it(tiny_model_path, monkeypatch):
    """An adapter that does not declare `shards_prompt_state` (e.g. one a user adds to `ADAPTERS` for a new
    architecture) keeps every record on every rank: asking for a sharded state is an error, not a no-op. Every
    built-in adapter shards."""

    class Replicating(KVCacheAdapter):
        shards_prompt_state = False

    for family in ("llama", "qwen3_5", "glm_moe_dsa"):
        make_trainer(tiny_model_path(family), shard_prompt_state=True)
    monkeypatch.setitem(ADAPTERS, "llama", Replicating)
    with pytest.raises(ValueError, match="shard_prompt_state is not supported by the 'llama' adapter"):
        make_trainer(tiny_model_path("llama"), shard_prompt_state=True)
