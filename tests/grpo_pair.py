"""Builds a stock `GRPOTrainer` and a `LongStrawGRPOTrainer` on the same tiny model and settings, and compares them."""

from __future__ import annotations

import tempfile

import torch
from datasets import Dataset
from tolerances import GRAD_RTOL
from trl import GRPOConfig, GRPOTrainer

from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer

# Prompts of the word-level test tokenizer. With the seed-0 tiny llama, greedy decoding ends some of them with EOS
# at the first step, some midway and some not at all, so EOS handling and truncation are both exercised.
PROMPTS = ["a b c d e", "h i j k l m n", "x", "key value is 3", "what is the answer ?", "f g"]


def length_reward(completions, **kwargs):
    """A deterministic reward that separates completions of one group: their length in characters."""
    return [float(len(c)) for c in completions]


def position_reward(completions, **kwargs):
    """Length plus the row's position in the batch, so that even identical (greedy) completions of one group get
    different rewards and nonzero advantages. Stock and LongStraw score the generation batch in the same order."""
    return [float(len(c) + i % 3) for i, c in enumerate(completions)]


def base_config(**overrides) -> dict:
    config = dict(
        output_dir=tempfile.mkdtemp(),
        report_to=[],
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        save_strategy="no",
        num_generations=3,
        per_device_train_batch_size=3,
        max_completion_length=7,
        beta=0.1,
        seed=0,
    )
    config.update(overrides)
    return config


def make_pair(
    path,
    prompts: list[str] | None = None,
    peft_config=None,
    longstraw: dict | None = None,
    reward=length_reward,
    **overrides,
) -> tuple[GRPOTrainer, LongStrawGRPOTrainer]:
    """Stock and LongStraw trainers with identical settings (and identical adapter weights under PEFT)."""
    dataset = Dataset.from_dict({"prompt": prompts or PROMPTS})
    config = base_config(**overrides)
    stock = GRPOTrainer(str(path), reward, GRPOConfig(**config), train_dataset=dataset, peft_config=peft_config)
    extra = {"prefill_chunk_size": 2, "prefill_progress": False, **(longstraw or {})}
    ours_config = LongStrawGRPOConfig(**config, **extra)
    ours = LongStrawGRPOTrainer(str(path), reward, ours_config, train_dataset=dataset, peft_config=peft_config)
    if peft_config is not None:
        ours.model.load_state_dict(stock.model.state_dict())
    return stock, ours


def generation_inputs(prompts: list[str], num_generations: int) -> list[dict]:
    """The generation batch the dataloader hands to `_generate_and_score_completions`: each prompt G times."""
    return [{"prompt": p} for p in prompts for _ in range(num_generations)]


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(reference: dict[str, torch.Tensor], ours: dict[str, torch.Tensor], rtol: float = GRAD_RTOL):
    """Same set of parameters with a gradient, and each within `rtol` relative error in norm."""
    assert set(reference) == set(ours), set(reference) ^ set(ours)
    assert reference, "no parameter received a gradient"
    for name, ref in reference.items():
        err = ((ours[name] - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        assert err <= rtol, f"{name}: relative gradient error {err:.3g} > {rtol}"
