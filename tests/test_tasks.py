"""The long-context tasks of trl_longstraw.tasks and their rule-based rewards."""

import random
import string

import pytest

from trl_longstraw.tasks import (
    FORM_CREDIT,
    TASK_NAMES,
    exact_match_reward,
    kv_example,
    load_task_dataset,
    needle_example,
    retrieval_reward,
)
from trl_longstraw.testing import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def n_tokens(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.unk_token_id not in ids, "the task wrote a word outside the word-level vocabulary"
    return len(ids)


@pytest.mark.parametrize("length", [23, 64, 383, 1001])
@pytest.mark.parametrize("needles", [1, 3])
def test_needle_prompt_has_exact_length_and_one_kind_of_digit(tokenizer, length, needles):
    for seed in range(5):
        example = needle_example(length, random.Random(seed), tokenizer, needles=needles)
        assert n_tokens(tokenizer, example["prompt"]) == length
        digits = [w for w in example["prompt"].split() if w.isdigit()]
        assert digits == [example["answer"]] * needles
        assert example["prompt"].count(f"the value is {example['answer']} .") == needles
        assert example["prompt"].endswith("what is the value ? answer :")


def test_needle_depth_covers_the_whole_haystack(tokenizer):
    rng = random.Random(0)
    depths = []
    for _ in range(200):
        words = needle_example(200, rng, tokenizer)["prompt"].split()
        depths.append(words.index("value") / len(words))
    assert min(depths) < 0.05 and max(depths) > 0.9


def test_needle_too_short_raises(tokenizer):
    with pytest.raises(ValueError, match="prompt_tokens"):
        needle_example(12, random.Random(0), tokenizer)


@pytest.mark.parametrize("length", [20, 64, 383, 5003])
def test_kv_prompt_has_exact_length_and_one_answer(tokenizer, length):
    for seed in range(3):
        example = kv_example(length, random.Random(seed), tokenizer)
        prompt = example["prompt"]
        assert n_tokens(tokenizer, prompt) == length
        body, question = prompt.rsplit(";", 1)
        asked = question.split("key", 1)[1].split("?")[0].strip()
        records = [r.strip().lstrip(". ").split(" value ") for r in body.split(";")]
        keys = [k.removeprefix("key ").strip() for k, _ in records]
        assert len(keys) == len(set(keys)), "keys must be distinct"
        assert dict((k.removeprefix("key ").strip(), v.strip()) for k, v in records)[asked] == example["answer"]
        assert all(c in string.ascii_lowercase for c in asked.split())


def test_kv_multi_digit_values(tokenizer):
    example = kv_example(300, random.Random(1), tokenizer, value_digits=3)
    assert n_tokens(tokenizer, example["prompt"]) == 300
    assert len(example["answer"].split()) == 3 and all(w.isdigit() for w in example["answer"].split())


class TwoTokensPerWord:
    """A stand-in subword tokenizer: every word is two tokens."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [0, 0] * len(text.split())}


@pytest.mark.parametrize("make", [needle_example, kv_example])
def test_subword_tokenizer_is_sized_by_measurement(make):
    example = make(2000, random.Random(0), TwoTokensPerWord())
    assert abs(2 * len(example["prompt"].split()) - 2000) <= 20


@pytest.mark.parametrize("name", TASK_NAMES)
def test_load_task_dataset(tokenizer, name):
    dataset = load_task_dataset(name, num_prompts=4, prompt_tokens=50, tokenizer=tokenizer, seed=3)
    assert dataset.column_names == ["prompt", "answer"] and len(dataset) == 4
    again = load_task_dataset(name, num_prompts=4, prompt_tokens=50, tokenizer=tokenizer, seed=3)
    assert dataset["prompt"] == again["prompt"], "a seed gives the same dataset"
    chat = load_task_dataset(name, num_prompts=2, prompt_tokens=50, tokenizer=tokenizer, conversational=True)
    assert chat[0]["prompt"][0]["role"] == "user" and isinstance(chat[0]["prompt"][0]["content"], str)


def test_load_task_dataset_rejects_unknown_settings(tokenizer):
    with pytest.raises(ValueError, match="longstraw/needle"):
        load_task_dataset("longstraw/nope", 1, 50, tokenizer)
    with pytest.raises(ValueError, match="needles"):
        load_task_dataset("longstraw/kv-retrieval", 1, 50, tokenizer, needles=2)


def test_retrieval_reward_single_digit():
    completions = ["7", "7 <eos>", "7.", "3", "x", "", " 7 5", "value 7"]
    rewards = retrieval_reward(completions, ["7"] * len(completions))
    assert rewards == [1.0, 1.0, 1.0, FORM_CREDIT, 0.0, 0.0, 1.0, 0.0]


def test_retrieval_reward_multi_digit_partial_credit():
    rewards = retrieval_reward(["1 2 3", "1 9 x", "1", "4 5 6 7"], ["1 2 3"] * 4)
    assert rewards == pytest.approx([1.0, (1 + FORM_CREDIT) / 3, 1 / 3, 3 * FORM_CREDIT / 3])


def test_rewards_read_conversations_and_skip_reasoning():
    chat = [[{"role": "assistant", "content": "<think>the key is q, so 1?</think> 4"}]]
    assert retrieval_reward(chat, ["4"]) == [1.0]
    assert exact_match_reward(chat, ["4"]) == [1.0]
    assert exact_match_reward(["4 2", "5", "<think>4</think>"], ["4 2", "4", "4"]) == [1.0, 0.0, 0.0]
