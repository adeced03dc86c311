"""The generation batch's prompts, tokenized once per prompt instead of once per row.

TRL's dataloader hands `_generate_and_score_completions` each prompt `num_generations` times in a row (its
`RepeatSampler`), and stock `GRPOTrainer._tokenize_prompts` tokenizes every row: G token lists per prompt, each a
Python list of P ints, alive from tokenization to the end of the batch's assembly, so through generation (the prefill,
the decoding and TRL's padding of the batch, while the prompt state is held for the loss pass). At a million tokens
with a real vocabulary (ids above 256 are one int object each) that is tens of MB of host memory per row, and G
tokenizer runs. `tokenize_distinct` runs the tokenizer once per run of equal consecutive prompts and gives the rows of
a run the same list. The tokenizer maps each prompt on its own (no padding, no truncation, no batch-dependent state),
so every row's ids are stock's; TRL only reads the lists (`len`, concatenation into new lists, `torch.tensor`).
Extra fields that the tokenizer returns one per prompt (e.g. `token_type_ids`) are shared the same way; prompts with
images are tokenized row by row, as stock does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Tokenized = tuple[list[list[int]], Any, dict[str, Any]]


def tokenize_distinct(tokenize: Callable[[list], Tokenized], prompts: list) -> Tokenized:
    """`tokenize(prompts)`, with the tokenizer run once per run of equal consecutive prompts.

    Args:
        tokenize: stock's `GRPOTrainer._tokenize_prompts` (bound): prompts -> `(prompt_ids, images,
            multimodal_fields)`, one list of ids per prompt.
        prompts: the generation batch's prompts (strings or conversations), one per row.
    Returns:
        What `tokenize(prompts)` returns. The rows of one run share one list of ids, and one value of each extra
        field the tokenizer returns one per prompt (e.g. `token_type_ids`). Where the prompts carry images, or a
        field is not one value per prompt (a processor's pixel values, flattened over patches), stock's call on every
        row: that case is known before tokenizing (images) or after the one call on the distinct prompts (fields),
        so the tokenizer never runs twice over the batch except in the latter, which text tokenizers do not return.
    """
    starts = [i for i, prompt in enumerate(prompts) if i == 0 or prompt != prompts[i - 1]]
    if len(starts) == len(prompts) or any(_has_images(prompts[i]) for i in starts):
        # Stock extracts each row's images from its prompt: kept as stock builds them, row by row.
        return tokenize(prompts)
    ids, images, fields = tokenize([prompts[i] for i in starts])
    if images is not None or any(not isinstance(v, list) or len(v) != len(starts) for v in fields.values()):
        return tokenize(prompts)
    runs = [end - start for start, end in zip(starts, starts[1:] + [len(prompts)], strict=True)]

    def per_row(values: list) -> list:
        return [value for value, n in zip(values, runs, strict=True) for _ in range(n)]

    return per_row(ids), images, {key: per_row(values) for key, values in fields.items()}


def _has_images(prompt) -> bool:
    """Whether stock's `_tokenize_prompts` extracts images from `prompt`: a conversation with a content part of type
    `"image"`."""
    if isinstance(prompt, str):
        return False
    return any(
        isinstance(message.get("content"), list)
        and any(isinstance(part, dict) and part.get("type") == "image" for part in message["content"])
        for message in prompt
    )
