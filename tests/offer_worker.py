"""Worker of tests/test_prompt_passes.py's 2-process test: one prefill per step with the prompt state sharded over 2
CPU processes (gloo, `shard_prompt_state=True`, one shard group of both).

Launched through `tests.helpers.torchrun` (2 processes), one case per model: `main(MODEL_PATH, OUT)`. Each rank runs
`trainer.train()` for 2 optimizer steps with TRL's defaults otherwise (`beta=0`, `num_iterations=1`): G = 4 completions
per prompt, 2 on each rank, so both ranks hold the same prompt, one per step: 7 tokens, then 4, padded to a multiple of
8 (left padding 1, then 4), so generation places them after their padding. Greedy decoding and a reward that depends on
the row give every run the same completions and nonzero advantages. Runs, on each rank:

- `detached` and `exact`, with generation's states offered to the loss pass (the default);
- `exact` with the offer turned off (`_offer_boundaries` returns None): the loss pass prefills the prompt itself,
  which is the sharded path tested against the single-process gradient in tests/test_distributed.py.

Each run records, per optimizer step, how many times the policy's backbone ran each prompt position on this rank
(hooks as in tests/test_prompt_passes.py), the gradient of every parameter before the optimizer step, and the
`longstraw/prompt_positions(_reused)` it logged. Rank 0 writes every rank's results to `OUT`.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

PROMPTS = ["a b c d e f g", "h i j k"]
PAD_TO = 8


def main(model_path: str, out_path: str) -> None:
    os.environ.setdefault("ACCELERATE_USE_CPU", "1")
    from datasets import Dataset
    from test_prompt_passes import PositionCounter, prompt_positions
    from transformers import TrainerCallback, set_seed

    from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer

    def reward(completions, **kwargs):
        # Differs between the rows of a group (greedy completions are identical), the same on every run.
        return [float(len(c) + i % 3) for i, c in enumerate(completions)]

    class Record(TrainerCallback):
        def __init__(self, trainer, counter):
            self.trainer, self.counter = trainer, counter
            self.grads, self.counts = [], []

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            named = self.trainer.model.named_parameters()
            self.grads.append({n: p.grad.detach().clone() for n, p in named if p.grad is not None})

        def on_step_end(self, args, state, control, **kwargs):
            # Per token, not per prompt: under context parallelism each rank runs its own chunks of a pass.
            self.counts.append(dict(self.counter.counts))
            self.counter.counts.clear()

    def run(mode: str, offers: bool) -> dict:
        config = LongStrawGRPOConfig(
            output_dir=tempfile.mkdtemp(),
            report_to=[],
            use_cpu=True,
            bf16=False,
            logging_steps=1,
            save_strategy="no",
            seed=0,
            beta=0.0,
            num_iterations=1,
            num_generations=4,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=1,
            max_steps=2,
            max_completion_length=4,
            shuffle_dataset=False,
            pad_to_multiple_of=PAD_TO,
            generation_kwargs={"do_sample": False},
            prompt_gradient=mode,
            prefill_chunk_size=4,
            prefill_progress=False,
            shard_prompt_state=True,
        )
        trainer = LongStrawGRPOTrainer(
            model_path, reward, config, train_dataset=Dataset.from_dict({"prompt": PROMPTS})
        )
        assert dist.get_world_size() == 2, f"the sharded offer test needs 2 processes, got {dist.get_world_size()}"
        assert trainer._prompt_shards is not None and trainer._prompt_shards.world == 2
        assert trainer._shared_generation, "generation should decode against the sharded prompt state"
        if not offers:
            trainer._offer_boundaries = lambda engine: None
        tokens = [trainer.processing_class(text=p)["input_ids"] for p in PROMPTS]
        # Each prompt is alone in its generation batch, left-padded to a multiple of PAD_TO.
        positions: dict[int, set[int]] = {}
        for ts in tokens:
            positions |= prompt_positions([ts], width=-(-len(ts) // PAD_TO) * PAD_TO)
        counter = PositionCounter(trainer.model.base_model, positions)
        record = Record(trainer, counter)
        trainer.add_callback(record)
        set_seed(0)
        trainer.train()
        engine = trainer._engine(trainer.model)
        logs = [entry for entry in trainer.state.log_history if "loss" in entry]
        return {
            "counts": record.counts,
            "grads": record.grads,
            "prompt_positions": [entry["longstraw/prompt_positions"] for entry in logs],
            "prompt_positions_reused": [entry["longstraw/prompt_positions_reused"] for entry in logs],
            "context_parallel": engine.context_parallel,
            "tokens": tokens,
            "pads": [-(-len(ts) // PAD_TO) * PAD_TO - len(ts) for ts in tokens],
        }

    mine = {
        "detached": run("detached", offers=True),
        "exact": run("exact", offers=True),
        "exact_no_offer": run("exact", offers=False),
    }
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        torch.save(everyone, out_path)
    dist.barrier()
