"""The generation batch's prompts, tokenized once per prompt (`trl_longstraw.batch`): same batch, loss, gradients."""

from types import SimpleNamespace

import pytest
import torch
from grpo_pair import make_pair, position_reward
from transformers import TrainerCallback, set_seed
from trl import GRPOTrainer

from trl_longstraw.batch import tokenize_distinct
from trl_longstraw.testing import build_tokenizer

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


def conversation_tokenizer():
    """The tiny word-level tokenizer with a chat template (image parts rendered as one word) that also returns
    `token_type_ids`, an extra field one per prompt as some tokenizers' `apply_chat_template` returns."""
    tokenizer = build_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }} {% if m['content'] is string %}{{ m['content'] }}{% else %}"
        "{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }}{% else %}x{% endif %} {% endfor %}"
        "{% endif %} {% endfor %}{% if add_generation_prompt %}assistant{% endif %}"
    )
    tokenizer.model_input_names = ["input_ids", "token_type_ids", "attention_mask"]
    return tokenizer


def stock_tokenize(tokenizer, calls: list):
    """Stock `GRPOTrainer._tokenize_prompts` of a text-only trainer with `tokenizer`; `calls` gets the number of
    conversations of each call of the tokenizer's `apply_chat_template`."""
    apply = tokenizer.apply_chat_template

    def counted(conversation, **kwargs):
        calls.append(len(conversation))
        return apply(conversation, **kwargs)

    tokenizer.apply_chat_template = counted
    trainer = SimpleNamespace(
        _is_vlm=False,
        environment_factories=None,
        processing_class=tokenizer,
        tools=None,
        chat_template=None,
        chat_template_kwargs={},
    )
    return lambda prompts: GRPOTrainer._tokenize_prompts(trainer, prompts)


def test_tokenize_distinct_shares_extra_fields_one_call():
    """Conversations through stock's `_tokenize_prompts`, whose tokenizer returns `token_type_ids` (an extra field,
    which stock passes on as `multimodal_fields`): the tokenizer runs once, over the distinct prompts, and the ids,
    images and fields equal stock's call on every row (a second tokenization of the whole batch before)."""
    calls: list[int] = []
    tokenize = stock_tokenize(conversation_tokenizer(), calls)
    ab, hi = [{"role": "user", "content": "a b c"}], [{"role": "user", "content": "h i"}]
    prompts = [ab, ab, ab, hi, hi, ab]
    ids, images, fields = tokenize_distinct(tokenize, prompts)
    assert calls == [3]
    calls.clear()
    stock = tokenize(prompts)
    assert (ids, images, fields) == stock and list(fields) == ["token_type_ids"]
    assert ids[0] is ids[2] and fields["token_type_ids"][3] is fields["token_type_ids"][4]
    assert len({len(x) for x in ids}) == 2, "prompts of different lengths"


def test_tokenize_distinct_keeps_images_stocks():
    """Conversations with image parts, from which stock extracts each row's images: stock's one call on every row."""
    calls: list[int] = []
    tokenize = stock_tokenize(conversation_tokenizer(), calls)
    image = [{"role": "user", "content": [{"type": "image", "image": "IMG"}, {"type": "text", "text": "a b"}]}]
    prompts = [image, image, [{"role": "user", "content": "h i"}]]
    ids, images, fields = tokenize_distinct(tokenize, prompts)
    assert calls == [3]
    assert images == [["IMG"], ["IMG"], None] and ids[0] is not ids[1]
    assert (ids, images, fields) == tokenize(prompts)


def test_tokenize_distinct_falls_back_on_fields_not_one_per_prompt():
    """A field that is not one value per prompt (a processor's tensor of pixel values): stock's call on every row."""

    def tokenize(prompts):
        return [[len(p)] for p in prompts], None, {"pixel_values": torch.zeros(len(prompts) * 2, 3)}

    ids, _, fields = tokenize_distinct(tokenize, ["ab", "ab", "c"])
    assert ids == [[2], [2], [1]] and ids[0] is not ids[1] and fields["pixel_values"].shape == (6, 3)
