"""Settings that change what a step computes: dropout, torch.compile, LOMO, context parallelism, and the parts of
`Trainer.training_step` that `LongStrawGRPOTrainer.training_step` keeps (it replaces the method whole)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig

from tests.helpers import make_trainer
from tests.test_recipes import load_script
from trl_longstraw import guards
from trl_longstraw.testing import build_tokenizer, random_micro_batch, save_tiny_model

VOCAB = len(build_tokenizer())


def lora(dropout: float) -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=dropout)


@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_lora_dropout_is_refused(tiny_model_path, mode):
    from datasets import Dataset

    from tests.helpers import base_args, zero_reward
    from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer

    args = LongStrawGRPOConfig(**base_args(), prompt_gradient=mode)
    dataset = Dataset.from_dict({"prompt": ["a"] * 4})
    path = str(tiny_model_path("llama"))
    with pytest.raises(ValueError, match=r"dropout is active in .*lora_dropout\.default \(p=0\.05\).*lora_dropout=0"):
        LongStrawGRPOTrainer(path, zero_reward, args, train_dataset=dataset, peft_config=lora(0.05))
    # TRL's disable_dropout sets the LoRA dropout modules' p to 0: accepted.
    args = LongStrawGRPOConfig(**base_args(), prompt_gradient=mode, disable_dropout=True)
    LongStrawGRPOTrainer(path, zero_reward, args, train_dataset=dataset, peft_config=lora(0.05))
    args = LongStrawGRPOConfig(**base_args(), prompt_gradient=mode)
    LongStrawGRPOTrainer(path, zero_reward, args, train_dataset=dataset, peft_config=lora(0.0))


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "glm_moe_dsa"])
def test_attention_dropout_is_refused(tmp_path, family):
    """transformers applies attention_dropout functionally in training mode; TRL's disable_dropout does not touch
    it, so the message names the config field (the GLM adapter refuses it itself, first)."""
    path = save_tiny_model(tmp_path / family, family, attention_dropout=0.1)
    with pytest.raises(ValueError, match=r"attention_dropout=0\.1.*attention_dropout=0\.0"):
        make_trainer(path)
    with pytest.raises(ValueError, match="attention_dropout=0.1"):
        make_trainer(path, disable_dropout=True)


def test_reference_model_dropout_counts_in_training_mode_only():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1))
    assert guards.active_dropout(model) == ["1 (p=0.1)"]
    model.eval()
    assert guards.active_dropout(model, in_training_mode_only=True) == []
    guards.check_dropout(torch.nn.Linear(2, 2), ref_model=model)
    model.train()
    with pytest.raises(ValueError, match=r"dropout is active in 1 \(p=0\.1\)"):
        guards.check_dropout(torch.nn.Linear(2, 2), ref_model=model)


def test_recipe_defaults_lora_dropout_to_zero():
    script = load_script()
    cpu = ["--output_dir", "out", "--use_cpu", "true"]
    _, _, model_args = script.parse(["--use_peft", *cpu])
    assert model_args.use_peft and model_args.lora_dropout == 0.0
    _, _, model_args = script.parse(["--use_peft", "--lora_dropout", "0.05", *cpu])
    assert model_args.lora_dropout == 0.05


def test_torch_compile_is_refused(tiny_model_path, monkeypatch):
    # TrainingArguments(torch_compile=True) exports ACCELERATE_DYNAMO_BACKEND: restore it for the other tests.
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "NO")
    with pytest.raises(ValueError, match="torch_compile is not supported.*torch_compile=False"):
        make_trainer(tiny_model_path("llama"), torch_compile=True)


def test_compiled_model_is_refused(tiny_model_path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from tests.helpers import base_args, zero_reward
    from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer

    model = torch.compile(AutoModelForCausalLM.from_pretrained(tiny_model_path("llama")))
    tokenizer = build_tokenizer()
    with pytest.raises(ValueError, match=r"torch.compile'd model is not supported"):
        LongStrawGRPOTrainer(
            model,
            zero_reward,
            LongStrawGRPOConfig(**base_args()),
            train_dataset=Dataset.from_dict({"prompt": ["a"] * 4}),
            processing_class=tokenizer,
        )


@pytest.mark.parametrize("optim", ["lomo", "adalomo"])
def test_lomo_is_refused(tiny_model_path, optim):
    with pytest.raises(ValueError, match=f"optim='{optim}' is not supported.*inside backward"):
        make_trainer(tiny_model_path("llama"), optim=optim)


def test_context_parallelism_is_refused(tiny_model_path, monkeypatch):
    """GRPOConfig refuses cp_size/sp_size > 1 in its own parallelism_config; an accelerate config can still set it."""
    from accelerate import Accelerator, ParallelismConfig

    trainer = make_trainer(tiny_model_path("llama"))
    for sizes in (dict(cp_size=2), dict(sp_size=2)):
        monkeypatch.setattr(Accelerator, "parallelism_config", property(lambda self, s=sizes: ParallelismConfig(**s)))
        with pytest.raises(ValueError, match="context or sequence parallelism.*shard_prompt_state=True"):
            trainer._check_setup()


def test_sagemaker_model_parallelism_is_refused(tiny_model_path, monkeypatch):
    import trl_longstraw.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "is_sagemaker_mp_enabled", lambda: True)
    with pytest.raises(ValueError, match="SageMaker model parallelism"):
        make_trainer(tiny_model_path("llama"))


@pytest.mark.parametrize("steps,global_step,cleared", [(None, 0, 0), (1, 3, 1), (2, 3, 0), (2, 4, 1)])
def test_torch_empty_cache_steps(tiny_model_path, monkeypatch, steps, global_step, cleared):
    """As in Trainer.training_step: the device cache is emptied on the steps that torch_empty_cache_steps divides."""
    import trl_longstraw.trainer as trainer_module

    calls = []
    monkeypatch.setattr(trainer_module, "clear_device_cache", lambda: calls.append(1))
    trainer = make_trainer(tiny_model_path("llama"), torch_empty_cache_steps=steps, beta=0.0)
    trainer.state.global_step = global_step
    mb = random_micro_batch([5, 3], [2, 3, 1, 2], [0, 0, 1, 1], VOCAB)
    trainer.training_step(trainer.model, mb, mb["num_items_in_batch"])
    assert len(calls) == cleared
