"""Long-context retrieval tasks with a rule-based reward: the default dataset of the recipes.

Two synthetic tasks, both with prompts whose length is chosen in tokens and an `answer` column that the reward reads
(TRL passes dataset columns to reward functions as keyword arguments):

- `longstraw/needle`: a haystack of random letters hides the needle `the value is D .` (once, or `needles` times,
  each at a uniformly random depth); the prompt ends with `what is the value ? answer :` and the answer is the digit
  `D`, the only digit of the prompt.
- `longstraw/kv-retrieval`: the whole prompt is a list of records `key <letters> value <digits> ;` with distinct
  keys, and asks for the value of one of them. Every record has a value, so the model must match the key: the task
  for real models.

Both are written in the words of the word-level tokenizer of `trl_longstraw.testing` (single letters, digits and a
few words), so with that tokenizer the prompt length in tokens is exact. With a subword tokenizer the haystack is
sized by the tokens per word measured on a sample, so the length is close to, not exactly, the target.

The reward, `retrieval_reward`, gives 1 for the right value, `FORM_CREDIT` (0.2) for a wrong digit and 0 for
anything else, so it has two levels to learn. A random
model learns only the first by RL within a demo: to answer with a digit (mean reward from about 0.08 to 0.27).
Finding the needle's digit is a retrieval circuit that GRPO, which learns only from the sampled completions that
happen to be right, did not find within 200 steps (measured on CPU, learning rates 1e-3 to 1e-2); a few dozen
supervised steps on short prompts form it, and the CPU demo starts there (`trl_longstraw.warmup`).
"""

from __future__ import annotations

import random
import string

from datasets import Dataset

TASK_NAMES = ("longstraw/needle", "longstraw/kv-retrieval")

NEEDLE_QUESTION = "what is the value ? answer :"
# Reward for an answer token that is a digit but not the right one: rewards the answer's form, so that a model that
# has not found the value yet still gets a signal towards answering with a value.
FORM_CREDIT = 0.2


def _tokens_per_word(sample: str, tokenizer) -> float:
    """Measured tokens per whitespace word of `sample`; 1 when `tokenizer` is None (tokens are words)."""
    if tokenizer is None:
        return 1.0
    return len(tokenizer(sample, add_special_tokens=False)["input_ids"]) / len(sample.split())


def _words(budget_tokens: int, tokens_per_word: float, what: str) -> int:
    words = int(budget_tokens / tokens_per_word)
    if words < 1:
        raise ValueError(f"prompt_tokens is too short to hold {what}: choose a longer prompt_tokens.")
    return words


def needle_example(prompt_tokens: int, rng: random.Random, tokenizer=None, needles: int = 1) -> dict[str, str]:
    """One `longstraw/needle` example: `{"prompt", "answer"}`, the prompt `prompt_tokens` tokens long.

    The needle `the value is D .` is written `needles` times, each at its own uniformly random depth.
    """
    digit = str(rng.randrange(10))
    needle = f"the value is {digit} ."
    fixed = " ".join([needle] * needles + [NEEDLE_QUESTION])
    fixed_tokens = round(_tokens_per_word(fixed, tokenizer) * len(fixed.split()))
    sample = " ".join(rng.choices(string.ascii_lowercase, k=min(prompt_tokens, 2048)))
    n = _words(prompt_tokens - fixed_tokens, _tokens_per_word(sample, tokenizer), "the needles and the question")
    words = rng.choices(string.ascii_lowercase, k=n)
    for cut in sorted((rng.randrange(n + 1) for _ in range(needles)), reverse=True):
        words.insert(cut, needle)
    return {"prompt": " ".join(words + [NEEDLE_QUESTION]), "answer": digit}


def kv_example(prompt_tokens: int, rng: random.Random, tokenizer=None, value_digits: int = 1) -> dict[str, str]:
    """One `longstraw/kv-retrieval` example: `{"prompt", "answer"}`, the prompt `prompt_tokens` tokens long.

    Keys are runs of `k` letters, with `k` large enough that the keys of a prompt use at most a quarter of the 26**k
    possible ones; values are `value_digits` digits, one word each. The prompt starts with `.` words to make up the
    length that whole records leave over.
    """
    k = 1
    while 26**k < 4 * (prompt_tokens // (3 + k + value_digits) + 1):
        k += 1
    record_words = 3 + k + value_digits  # key <k letters> value <digits> ;

    def key() -> str:
        return " ".join(rng.choice(string.ascii_lowercase) for _ in range(k))

    def value() -> str:
        return " ".join(str(rng.randrange(10)) for _ in range(value_digits))

    sample = " ".join(f"key {key()} value {value()} ;" for _ in range(64))
    question_words = 9 + k  # what is the value of key <k letters> ? answer :
    per_word = _tokens_per_word(sample, tokenizer)
    words = _words(prompt_tokens - round(question_words * per_word), per_word, "one key-value record")
    n = words // record_words
    if n < 1:
        raise ValueError(f"prompt_tokens={prompt_tokens} cannot hold one key-value record: choose a longer prompt.")
    keys: dict[str, str] = {}
    while len(keys) < n:
        keys.setdefault(key(), value())
    asked = rng.choice(list(keys))
    records = [f"key {name} value {val} ;" for name, val in keys.items()]
    padding = ["."] * (words - n * record_words)
    question = f"what is the value of key {asked} ? answer :"
    return {"prompt": " ".join(padding + records + [question]), "answer": keys[asked]}


def load_task_dataset(
    name: str,
    num_prompts: int,
    prompt_tokens: int,
    tokenizer=None,
    seed: int = 0,
    conversational: bool = False,
    needles: int = 1,
) -> Dataset:
    """A `datasets.Dataset` of `num_prompts` examples of task `name` with columns `prompt` and `answer`.

    Args:
        name: one of `TASK_NAMES`.
        prompt_tokens: length of each prompt in tokens of `tokenizer` (exact for the word-level tokenizer of
            `trl_longstraw.testing`, or when `tokenizer` is None and tokens are whitespace words).
        conversational: wrap each prompt as a one-message user conversation, for chat models.
        needles: `longstraw/needle` only: how many times the needle is written, at independent random depths.

    Raises:
        ValueError: for an unknown task name, listing the known ones, or `needles` set for another task.
    """
    rng = random.Random(seed)
    if needles < 1 or (needles != 1 and name != "longstraw/needle"):
        raise ValueError(f"needles={needles} is for the longstraw/needle task only and must be >= 1.")
    if name == "longstraw/needle":
        rows = [needle_example(prompt_tokens, rng, tokenizer, needles) for _ in range(num_prompts)]
    elif name == "longstraw/kv-retrieval":
        rows = [kv_example(prompt_tokens, rng, tokenizer) for _ in range(num_prompts)]
    else:
        raise ValueError(f"unknown task {name!r}: the tasks shipped with trl_longstraw are {', '.join(TASK_NAMES)}.")
    if conversational:
        rows = [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows]
    return Dataset.from_list(rows)


def _answer_words(completion, n: int) -> list[str]:
    """The first `n` words of a completion's answer, without trailing punctuation, padded with `""` to `n`.

    The completion is in TRL's standard (str) or conversational (list of messages) format; a reasoning block
    `<think>...</think>` before the answer is skipped.
    """
    if not isinstance(completion, str):
        completion = " ".join(message["content"] for message in completion if message.get("role") == "assistant")
    words = [w.strip(".,;:!") for w in completion.rsplit("</think>", 1)[-1].split()[:n]]
    return words + [""] * (n - len(words))


def retrieval_reward(completions: list, answer: list[str], **kwargs) -> list[float]:
    """Rule-based reward of the retrieval tasks, in [0, 1], read off the first words of each completion.

    The answer has `k` words (one digit each). Each of the completion's first `k` whitespace-separated words scores
    1 if it equals the answer's word there, `FORM_CREDIT` if it is a digit (a value, but the wrong one), 0 otherwise;
    the reward is their mean. Trailing punctuation of a word is ignored, so `7.` counts as `7`.
    """
    rewards = []
    for completion, want in zip(completions, answer, strict=True):
        want_words = want.split()
        got = _answer_words(completion, len(want_words))
        scores = [1.0 if g == w else FORM_CREDIT if g.isdigit() else 0.0 for g, w in zip(got, want_words, strict=True)]
        rewards.append(sum(scores) / len(scores))
    return rewards


def exact_match_reward(completions: list, answer: list[str], **kwargs) -> list[float]:
    """1 when the completion's first words are exactly the answer, else 0: the accuracy, for logging or training."""
    return [
        1.0 if _answer_words(completion, len(want.split())) == want.split() else 0.0
        for completion, want in zip(completions, answer, strict=True)
    ]
