"""A supervised warm-up on short prompts, and the held-out accuracy that shows what GRPO then learns.

A random model cannot find the needle by RL alone within a demo: GRPO learns only from the sampled completions that
happen to be right, and a random policy answers the needle's digit 1 time in 10 by chance, with no retrieval circuit
to reinforce. So the demo (`recipes/grpo_long.py` with no arguments) first runs `supervised_warmup`: a few dozen
cross-entropy steps on the answers of *short* prompts of the same task, where a retrieval circuit forms quickly. That
circuit carries over to the demo's long prompts only in part (held-out accuracy 0.18 to 0.43 there, see
benchmarks/DEMO.md), and GRPO on the long prompts then raises it: `HeldOutAccuracy` measures it during the run,
greedily, on prompts the run never trains on.
"""

from __future__ import annotations

import torch
from datasets import Dataset
from transformers import TrainerCallback

# Key of the held-out accuracy in `trainer.state.log_history` (and every `report_to` integration).
ACCURACY_KEY = "longstraw/heldout_accuracy"


def _answer_batch(dataset: Dataset, tokenizer, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Prompt and answer ids of every row of `dataset`, left-padded: (`input_ids` (B, L), `attention_mask` (B, L),
    number of answer tokens `k`), the answer in the last `k` positions of each row.

    The answer is tokenized on its own and appended to the prompt's ids, as a sampled completion would be.

    Raises:
        ValueError: if the answers do not all have the same number of tokens.
    """
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in dataset["prompt"]]
    answers = [tokenizer(a, add_special_tokens=False)["input_ids"] for a in dataset["answer"]]
    k = len(answers[0])
    if any(len(a) != k for a in answers):
        raise ValueError("the answers of a held-out or warm-up set must all have the same number of tokens.")
    rows = [p + a for p, a in zip(prompts, answers, strict=True)]
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, width - len(row) :] = torch.tensor(row)
        attention_mask[i, width - len(row) :] = 1
    return input_ids.to(device), attention_mask.to(device), k


def _answer_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, k: int) -> torch.Tensor:
    """Logits (B, k, V) that predict the last `k` tokens of each row (the answer) from the tokens before them."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=input_ids[:, :-1],
        attention_mask=attention_mask[:, :-1],
        position_ids=position_ids[:, :-1],
        logits_to_keep=k,
    )
    return out.logits.float()


def supervised_warmup(
    model,
    tokenizer,
    dataset: Dataset,
    steps: int,
    batch_size: int,
    learning_rate: float,
    seed: int = 0,
) -> list[float]:
    """Trains `model` in place: `steps` AdamW steps of cross-entropy on the answer tokens of `dataset` (columns
    `prompt` and `answer`, every answer of the same token count), `batch_size` rows a step in a random order that is
    drawn again for each pass over the rows.

    Returns:
        The loss of each step.
    """
    device = next(model.parameters()).device
    input_ids, attention_mask, k = _answer_batch(dataset, tokenizer, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    order = torch.empty(0, dtype=torch.long)
    losses = []
    was_training = model.training
    model.train()
    for _ in range(steps):
        if len(order) < batch_size:
            order = torch.cat([order, torch.randperm(len(input_ids), generator=generator)])
        rows, order = order[:batch_size].to(device), order[batch_size:]
        logits = _answer_logits(model, input_ids[rows], attention_mask[rows], k)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), input_ids[rows, -k:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.train(was_training)
    return losses


@torch.no_grad()
def heldout_accuracy(model, tokenizer, dataset: Dataset, batch_size: int = 32) -> float:
    """Greedy exact-match accuracy of `model` on `dataset` (columns `prompt` and `answer`): the fraction of rows whose
    answer tokens are each the most likely next token given the prompt and the answer tokens before it, which is
    whether greedy decoding writes the answer."""
    device = next(model.parameters()).device
    input_ids, attention_mask, k = _answer_batch(dataset, tokenizer, device)
    was_training = model.training
    model.eval()
    right = 0
    for start in range(0, len(input_ids), batch_size):
        ids, mask = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
        predicted = _answer_logits(model, ids, mask, k).argmax(-1)
        right += int((predicted == ids[:, -k:]).all(-1).sum())
    model.train(was_training)
    return right / len(input_ids)


class HeldOutAccuracy(TrainerCallback):
    """Measures `heldout_accuracy` on `dataset` when training begins (step 0) and every `every` steps.

    Each value is logged at its step under `ACCURACY_KEY`: step 0 as its own row of `state.log_history`, later
    steps through the trainer's metrics (so `report_to` integrations get them). `history` holds every
    (step, accuracy).
    """

    def __init__(self, trainer, dataset: Dataset, every: int):
        if every < 1:
            raise ValueError(f"held-out accuracy every {every} steps: choose a positive number of steps.")
        self.trainer = trainer
        self.dataset = dataset
        self.every = every
        self.history: list[tuple[int, float]] = []

    def _measure(self, step: int) -> float:
        accuracy = heldout_accuracy(self.trainer.model, self.trainer.processing_class, self.dataset)
        self.history.append((step, accuracy))
        return accuracy

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step == 0:
            state.log_history.append({ACCURACY_KEY: self._measure(0), "step": 0})

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0 or state.global_step == state.max_steps:
            # GRPOTrainer.log averages and clears its `_metrics` at the log that follows this step.
            self.trainer._metrics["train"][ACCURACY_KEY].append(self._measure(state.global_step))
