"""Checks at construction that name the fix: the prompt column and its type, prompts against the RoPE window, and
reward functions against their weights (issue 16)."""

from __future__ import annotations

import pytest
from datasets import Dataset

from tests.helpers import base_args, zero_reward
from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer, guards
from trl_longstraw.testing import save_tiny_model

YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0}


def build(path, dataset, reward_funcs=zero_reward, **overrides):
    return LongStrawGRPOTrainer(
        str(path), reward_funcs, LongStrawGRPOConfig(**base_args(**overrides)), train_dataset=dataset
    )


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", max_position_embeddings=16)


def test_dataset_without_prompt_column_fails_at_construction(tiny_path):
    dataset = Dataset.from_dict({"question": ["a b"] * 4, "answer": ["1"] * 4})
    with pytest.raises(ValueError, match=r"no 'prompt' column \(its columns: question, answer\).*rename_column"):
        build(tiny_path, dataset)


@pytest.mark.parametrize("prompt", [3, [1, 2], []], ids=["int", "list of ints", "empty conversation"])
def test_prompt_of_the_wrong_type_fails_at_construction(tiny_path, prompt):
    with pytest.raises(ValueError, match="'prompt' column holds .* a string, or a conversation"):
        build(tiny_path, Dataset.from_dict({"prompt": [prompt] * 4}))


def test_text_and_conversational_prompts_pass():
    guards.check_prompt_column(Dataset.from_dict({"prompt": ["a b c"] * 2}))
    guards.check_prompt_column(Dataset.from_dict({"prompt": [[{"role": "user", "content": "a"}]] * 2}))
    guards.check_prompt_column(None)


def test_prompts_beyond_an_unscaled_window_fail_at_construction(tiny_path):
    """9 prompt tokens + 9 completion tokens > 16 positions: refused before any generation, with the YAML route."""
    prompts = ["a b"] * 3 + ["a b c d e f g h i"]
    with pytest.raises(ValueError, match=r"18 positions .* window of 16.*model_init_kwargs: \{max_position_embeddi"):
        build(tiny_path, Dataset.from_dict({"prompt": prompts}))
    build(tiny_path, Dataset.from_dict({"prompt": ["a b c d e f g"] * 4}))  # 7 + 9 = 16 fits


def test_the_yaml_route_lifts_the_window_check(tiny_path):
    """The fix the message names: `model_init_kwargs` with YaRN, as a recipe config's YAML gives it."""
    kwargs = {"max_position_embeddings": 32, "rope_parameters": dict(YARN)}
    trainer = build(tiny_path, Dataset.from_dict({"prompt": ["a b c d e f g h i"] * 4}), model_init_kwargs=kwargs)
    assert trainer.model.config.max_position_embeddings == 32


def test_longest_prompts_samples_big_datasets():
    prompts = [f"{'x' * (i % 97)}" for i in range(10_000)]
    longest = guards.longest_prompts(Dataset.from_dict({"prompt": prompts}), count=2, sample=5_000)
    assert len(longest) == 2 and all(len(p) >= 90 for p in longest)
    assert guards.longest_prompts(Dataset.from_dict({"prompt": ["ab", "abcd", "a"]})) == ["abcd", "ab"]


def test_reward_weights_must_match_the_functions(tiny_path):
    dataset = Dataset.from_dict({"prompt": ["a"] * 4})
    with pytest.raises(ValueError, match=r"2 weights \[1.0, 0.0\] for 1 reward function\(s\) \(zero_reward\).*"):
        build(tiny_path, dataset, reward_weights=[1.0, 0.0])
    build(tiny_path, dataset, reward_funcs=[zero_reward, zero_reward], reward_weights=[1.0, 0.0])


@pytest.mark.parametrize(
    "family, overrides",
    [
        ("mistral", {"sliding_window": 8}),
        ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    ],
    ids=["mistral", "qwen3 sliding layers"],
)
def test_sliding_window_fails_at_construction(tmp_path, family, overrides):
    """A sliding window is refused when the trainer is built (it failed at the first step's first forward), with the
    fix for windows every sequence fits in; the same model without the window builds."""
    path = save_tiny_model(tmp_path / family, family, **overrides)
    dataset = Dataset.from_dict({"prompt": ["a b"] * 4})
    with pytest.raises(ValueError, match=r"sliding window of 8 tokens .* sliding_window=None .* trl.GRPOTrainer"):
        build(path, dataset)
    build(path, dataset, model_init_kwargs={"sliding_window": None})
