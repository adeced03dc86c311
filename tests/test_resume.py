"""Checkpoint/resume and determinism of end-to-end `trainer.train()` runs with generation, on CPU.

A resumed run must give exactly (bitwise) the losses and gradients of the uninterrupted run, including when it
resumes between two generations, and two runs with one seed must give identical trajectories.
"""

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

import trl_longstraw.trainer as trainer_module
from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer
from trl_longstraw.trainer import GENERATION_STATE_NAME

# Gradient accumulation 2 and a generation every 4 micro-batches of 2 rows: with 6 prompts, an epoch is one
# generation of 4 prompts. checkpoint-1 falls between two generations, checkpoint-2 right before one and at the
# start of epoch 1 (whose order TRL's RepeatSampler alone would not reproduce on resume).
MAX_STEPS = 3
# Each mode runs with the other group_shuffle setting, so both input paths are resumed.
MODES = [("exact", True), ("detached", False)]


def reward(completions, **kwargs):
    """Rule-based and varied enough that groups rarely tie (ties would zero the advantages)."""
    return [sum((i + 1) * ord(ch) for i, ch in enumerate(c)) % 101 / 10 for c in completions]


class Recorder(TrainerCallback):
    """Every parameter gradient right before each optimizer step."""

    def __init__(self):
        self.grads = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})


def train(model_path, output_dir, mode, group_shuffle, resume=None):
    """Runs (or resumes) the reference run; returns the loss of each micro-batch and the gradients of each step."""
    config = LongStrawGRPOConfig(
        output_dir=str(output_dir),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        steps_per_generation=4,
        num_generations=2,
        max_completion_length=5,
        max_steps=MAX_STEPS,
        save_steps=1,
        learning_rate=1e-2,  # large, so that a step taken from the wrong state shows
        beta=0.1,
        seed=7,
        prompt_gradient=mode,
        group_shuffle=group_shuffle,
        prefill_chunk_size=3,
        prefill_progress=False,
        report_to=[],
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        disable_tqdm=True,
    )
    prompts = ["a b c d e", "key value is the", "what is the answer ?", "1 2 3 4 5 6 7", "x y z", "the 9 of"]
    recorder = Recorder()
    trainer = LongStrawGRPOTrainer(
        str(model_path), reward, config, train_dataset=Dataset.from_dict({"prompt": prompts}), callbacks=[recorder]
    )
    losses = []
    training_step = trainer.training_step

    def recording_step(*args):
        loss = training_step(*args)
        losses.append(loss.item())
        return loss

    trainer.training_step = recording_step
    trainer.train(resume_from_checkpoint=resume)
    return losses, recorder.grads


@pytest.fixture(scope="module", params=MODES, ids=[mode for mode, _ in MODES])
def reference(request, tiny_model_path, tmp_path_factory):
    mode, group_shuffle = request.param
    output_dir = tmp_path_factory.mktemp(f"run-{mode}")
    losses, grads = train(tiny_model_path("llama"), output_dir, mode, group_shuffle)
    assert len(losses) == 2 * MAX_STEPS and len(grads) == MAX_STEPS
    # Not vacuous: every step moves the weights.
    assert all(sum(g.norm() for g in step.values()) > 0 for step in grads)
    return mode, group_shuffle, output_dir, losses, grads


def assert_same(got, expected):
    (losses, grads), (ref_losses, ref_grads) = got, expected
    assert losses == ref_losses
    assert len(grads) == len(ref_grads)
    for step, ref_step in zip(grads, ref_grads, strict=True):
        assert step.keys() == ref_step.keys()
        for name, ref in ref_step.items():
            assert torch.equal(step[name], ref), name


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", [1, 2], ids=["between-generations", "at-generation-and-epoch"])
def test_resume_gives_the_uninterrupted_steps(reference, checkpoint, tiny_model_path, tmp_path):
    mode, group_shuffle, output_dir, losses, grads = reference
    folder = output_dir / f"checkpoint-{checkpoint}"
    assert (folder / GENERATION_STATE_NAME.format(0)).is_file()
    resumed = train(tiny_model_path("llama"), tmp_path, mode, group_shuffle, resume=str(folder))
    assert_same(resumed, (losses[2 * checkpoint :], grads[checkpoint:]))


@pytest.mark.slow
def test_same_seed_same_trajectory(reference, tiny_model_path, tmp_path):
    mode, group_shuffle, _, losses, grads = reference
    assert_same(train(tiny_model_path("llama"), tmp_path, mode, group_shuffle), (losses, grads))


# ----------------------------------------------------------------------------------------------- unit checks
@pytest.fixture(scope="module")
def trainer(tiny_model_path, tmp_path_factory):
    config = LongStrawGRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("unit")),
        per_device_train_batch_size=2,
        num_generations=2,
        report_to=[],
        use_cpu=True,
        seed=5,
    )
    prompts = [str(i) for i in range(9)]
    return LongStrawGRPOTrainer(
        str(tiny_model_path("llama")), reward, config, train_dataset=Dataset.from_dict({"prompt": prompts})
    )


def epoch_order(dataloader, epoch):
    dataloader.set_epoch(epoch)
    return [example["prompt"] for batch in dataloader for example in batch]


def test_resumed_epoch_has_the_uninterrupted_order(trainer):
    uninterrupted = trainer.get_train_dataloader()
    orders = [epoch_order(uninterrupted, epoch) for epoch in range(3)]
    assert orders[0] != orders[1] != orders[2]
    # A fresh dataloader, as after a resume, entering epoch 2 directly.
    assert epoch_order(trainer.get_train_dataloader(), 2) == orders[2]


def test_generation_buffer_round_trip(trainer, tmp_path, monkeypatch):
    warnings = []
    monkeypatch.setattr(trainer_module.logger, "warning", warnings.append)
    buffer = [{"prompt_ids": torch.arange(6).view(2, 3), "num_items_in_batch": torch.tensor(4.0)}] * 2
    trainer._step, trainer._buffered_inputs = 5, buffer
    trainer._save_rng_state(str(tmp_path))
    trainer._step, trainer._buffered_inputs = 0, None
    trainer._load_rng_state(str(tmp_path))
    assert trainer._step == 5 and not warnings
    assert all(torch.equal(a[k], b[k]) for a, b in zip(trainer._buffered_inputs, buffer, strict=True) for k in a)

    # A buffer saved under another batch layout would be split differently: it is not resumed.
    trainer._step, trainer._buffered_inputs = 0, None
    monkeypatch.setattr(trainer.args, "gradient_accumulation_steps", 4)
    trainer._load_rng_state(str(tmp_path))
    assert (trainer._step, trainer._buffered_inputs) == (0, None)
    assert "saved with" in warnings[-1] and "regenerating completions" in warnings[-1]

    # A checkpoint without the file (e.g. written by GRPOTrainer) resumes as GRPOTrainer does.
    (tmp_path / GENERATION_STATE_NAME.format(0)).unlink()
    trainer._load_rng_state(str(tmp_path))
    assert (trainer._step, trainer._buffered_inputs) == (0, None)
    assert "not found" in warnings[-1]
