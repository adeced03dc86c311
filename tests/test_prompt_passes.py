"""Done-when (a): how many times one full training step runs each distinct prompt, per model.

A full step with beta > 0 and num_iterations = 2 generates, scores old-policy log-probs, scores reference log-probs
and computes the loss. Each prompt position is counted every time a model's backbone runs it: the prompt tokens of
the two prompts are all distinct and the prompts have equal length (no padding), so a token at a position before the
last prompt token identifies one position of one prompt. Stock runs every prompt G times in each of the four passes.
"""

import pytest
import torch
from grpo_pair import make_pair
from peft import LoraConfig
from transformers import TrainerCallback

# Seven tokens each, no token shared: positions 0..5 (prompt[:-1]) of each prompt are counted.
PROMPTS = ["a b c d e f g", "h i j k l m n"]
G = 3


class PositionCounter:
    """Counts, per token id, how often a backbone runs it at a position before the last prompt token."""

    def __init__(self, backbone, prompt_length: int):
        self.prompt_length = prompt_length
        self.counts: dict[int, int] = {}
        self.handle = backbone.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        positions = kwargs.get("position_ids")
        if positions is None:  # stock's scoring forward, without a cache: positions 0..T-1 of the unpadded rows
            positions = torch.arange(input_ids.shape[1])[None]
        positions = positions.expand_as(input_ids)
        for token, position in zip(input_ids.flatten().tolist(), positions.flatten().tolist(), strict=True):
            if position < self.prompt_length - 1:
                self.counts[token] = self.counts.get(token, 0) + 1


def passes(counter: PositionCounter, prompt_tokens: list[list[int]]) -> list[int]:
    """Per prompt, how many times each of its counted positions ran (they must agree within a prompt)."""
    result = []
    for tokens in prompt_tokens:
        per_position = {counter.counts.get(t, 0) for t in tokens[:-1]}
        assert len(per_position) == 1, per_position
        result.append(per_position.pop())
    return result


class Snapshot(TrainerCallback):
    """Records the counters after each optimizer step."""

    def __init__(self, counters, prompt_tokens):
        self.counters, self.prompt_tokens, self.steps = counters, prompt_tokens, []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append({name: passes(c, self.prompt_tokens) for name, c in self.counters.items()})
        for c in self.counters.values():
            c.counts.clear()


def run(trainer, separate_ref: bool):
    tokens = [trainer.processing_class(text=p)["input_ids"] for p in PROMPTS]
    assert len({len(t) for t in tokens}) == 1 and not set(tokens[0]) & set(tokens[1])
    length = len(tokens[0])
    policy = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    counters = {"policy": PositionCounter(policy.base_model, length)}
    if separate_ref:
        counters["ref"] = PositionCounter(trainer.ref_model.base_model, length)
    snapshot = Snapshot(counters, tokens)
    trainer.add_callback(snapshot)
    trainer.train()
    return snapshot.steps


def settings(**overrides):
    # One generation batch = both prompts (2 x G rows), split into 2 micro-batches of one group each; with
    # gradient_accumulation_steps=2 one optimizer step consumes the whole generation batch once (iteration 1),
    # the next one again (iteration 2). Old-policy log-probs are needed: 2 % (2 * 2) != 0.
    base = dict(
        prompts=PROMPTS,
        beta=0.1,
        num_iterations=2,
        num_generations=G,
        per_device_train_batch_size=G,
        gradient_accumulation_steps=2,
        max_steps=2,
        max_completion_length=4,
        shuffle_dataset=False,
    )
    base.update(overrides)
    return base


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_prompt_passes_separate_reference_model(tiny_model_path, mode):
    stock, ours = make_pair(
        tiny_model_path("llama"), longstraw={"prompt_gradient": mode, "prefill_chunk_size": 4}, **settings()
    )
    ours_steps = run(ours, separate_ref=True)
    stock_steps = run(stock, separate_ref=True)
    extra = 1 if mode == "exact" else 0
    models = 2
    # Step 1: generation + loss (policy; old-policy log-probs come from the loss pass) and reference scoring.
    assert ours_steps[0] == {"policy": [2 + extra] * 2, "ref": [1, 1]}
    assert ours_steps[0]["policy"][0] + ours_steps[0]["ref"][0] <= 1 + models + extra
    # Step 2 (second iteration over the same completions): the loss pass only.
    assert ours_steps[1] == {"policy": [1 + extra] * 2, "ref": [0, 0]}
    # Stock: G times in each pass (generation, old log-probs, loss; reference).
    assert stock_steps[0] == {"policy": [3 * G] * 2, "ref": [G, G]}
    assert stock_steps[1] == {"policy": [G] * 2, "ref": [0, 0]}


@pytest.mark.slow
def test_prompt_passes_peft_reference_is_the_same_model(tiny_model_path):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    stock, ours = make_pair(
        tiny_model_path("llama"), peft_config=lora, longstraw={"prompt_gradient": "exact"}, **settings()
    )
    ours_steps = run(ours, separate_ref=False)
    stock_steps = run(stock, separate_ref=False)
    # One network runs generation, the reference (adapters disabled), the loss and the exact reverse pass.
    assert ours_steps[0] == {"policy": [4, 4]}
    assert stock_steps[0] == {"policy": [4 * G] * 2}
