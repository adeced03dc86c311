"""The generation batch's prompts, tokenized once per prompt (`trl_longstraw.batch`): same batch, loss, gradients."""

import pytest
import torch
from grpo_pair import make_pair, position_reward
from transformers import TrainerCallback, set_seed
from trl import GRPOTrainer

from trl_longstraw.batch import tokenize_distinct

# Prompts of 7, 4 and 1 tokens: the rows of the shorter ones are left-padded in the batch.
PROMPTS = ["a b c d e f g", "h i j k", "x"]


class Record(TrainerCallback):
    """Per optimizer step: the generation batch's prompts and the batch TRL assembled from them, the prompt ids
    `_generate_single_turn` received, and the gradients just before the update."""

    def __init__(self, trainer):
        self.trainer, self.batches, self.prompts, self.prompt_ids, self.grads = trainer, [], [], [], []
        generate_and_score, single_turn = trainer._generate_and_score_completions, trainer._generate_single_turn

        def recorded_batch(inputs):
            self.prompts.append([x["prompt"] for x in inputs])
            out = generate_and_score(inputs)
            self.batches.append({k: v.clone() for k, v in out.items() if isinstance(v, torch.Tensor)})
            return out

        def recorded_ids(prompt_ids, *args, **kwargs):
            self.prompt_ids.append(prompt_ids)
            return single_turn(prompt_ids, *args, **kwargs)

        trainer._generate_and_score_completions = recorded_batch
        trainer._generate_single_turn = recorded_ids

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        named = self.trainer.model.named_parameters()
        self.grads.append({n: p.grad.detach().clone() for n, p in named if p.grad is not None})


@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_prompts_tokenized_once_give_the_same_steps(tiny_model_path, mode):
    """Two `train()` steps of two prompts of different lengths (left-padded rows) per generation batch: with each
    prompt tokenized once and its rows sharing the ids, every batch tensor, logged loss and gradient is bitwise what
    the same trainer gives with stock's row-by-row tokenization, and the prompt ids are stock `GRPOTrainer`'s."""
    runs = {}
    for name in ("stock tokenization", "ours"):
        stock, ours = make_pair(
            tiny_model_path("qwen3_5"),
            prompts=PROMPTS,
            longstraw={"prompt_gradient": mode, "prefill_chunk_size": 3},
            reward=position_reward,
            per_device_train_batch_size=6,
            num_generations=3,
            max_steps=2,
            beta=0.0,
            seed=0,
        )
        if name == "stock tokenization":
            ours._tokenize_prompts = lambda prompts, ours=ours: GRPOTrainer._tokenize_prompts(ours, prompts)
        record = Record(ours)
        ours.add_callback(record)
        set_seed(0)
        ours.train()
        runs[name] = (record, [e["loss"] for e in ours.state.log_history if "loss" in e])
    before, after = runs["stock tokenization"][0], runs["ours"][0]
    assert runs["ours"][1] == runs["stock tokenization"][1] and len(runs["ours"][1]) == 2
    assert len(after.batches) == len(before.batches) == 2
    for ref, got in zip(before.batches, after.batches, strict=True):
        assert ref.keys() == got.keys()
        for key in ref:
            assert torch.equal(ref[key], got[key]), key
        mask = got["prompt_mask"]
        assert len(set(mask.sum(dim=1).tolist())) == 2 and not mask[:, 0].all(), "rows of different left padding"
    for ref, got in zip(before.grads, after.grads, strict=True):
        assert ref.keys() == got.keys() and ref
        assert all(torch.equal(ref[n], got[n]) for n in ref)
    for ids_before, ids_after in zip(before.prompt_ids, after.prompt_ids, strict=True):
        assert ids_after == ids_before
        # The rows of a prompt share its list (consecutive in the batch, as TRL's RepeatSampler gives them).
        assert len({id(ids) for ids in ids_after}) == 2 and len({id(ids) for ids in ids_before}) == 6
    # And stock GRPOTrainer's tokenization of the same rows.
    for prompts, ids in zip(after.prompts, after.prompt_ids, strict=True):
        assert ids == stock._tokenize_prompts(prompts)[0]


def test_tokenize_distinct_runs_the_tokenizer_once_per_run():
    calls = []

    def tokenize(prompts):
        calls.append(list(prompts))
        return [[len(p), *map(ord, p)] for p in prompts], None, {}

    prompts = ["ab", "ab", "ab", "c", "ab", "ab", "c"]
    ids, images, fields = tokenize_distinct(tokenize, prompts)
    assert calls == [["ab", "c", "ab", "c"]]
    assert ids == tokenize(prompts)[0] and images is None and fields == {}
    assert ids[0] is ids[1] is ids[2] and ids[4] is ids[5] and ids[3] is not ids[6]
    # No repeated row: one call on every row, as stock.
    calls.clear()
    assert tokenize_distinct(tokenize, ["ab", "c"])[0] == [[2, 97, 98], [1, 99]] and calls == [["ab", "c"]]


def test_tokenize_distinct_keeps_per_row_fields_stocks():
    """A processor that returns per-row fields (a multimodal one): stock's call on every row."""

    def tokenize(prompts):
        return [[len(p)] for p in prompts], None, {"token_type_ids": [[0] for _ in prompts]}

    ids, _, fields = tokenize_distinct(tokenize, ["ab", "ab", "c"])
    assert ids == [[2], [2], [1]] and ids[0] is not ids[1] and fields == {"token_type_ids": [[0], [0], [0]]}
