"""Worker of tests/test_shard_groups.py: one rank of a 4-process CPU (gloo) run with the prompt state sharded over
shard groups of 2 ranks (ranks 0-1 and 2-3) and the model under FSDP2 over all 4.

Launched by the test through `tests.helpers.torchrun` (4 processes), one case per model: `main(MODEL_PATH, BATCHES,
OUT)`. `BATCHES` is a `torch.save`d dict of global micro-batches (each row tagged with the rank that runs it, see
`make_group_batches`). The worker applies `fully_shard` to every decoder layer and the root and runs, through
`trainer.training_step`:

- `exact`: exact mode with non-reentrant gradient checkpointing, `G` under `set_requires_gradient_sync(False)`
  (gradient accumulation), then `H`;
- `detached`: detached mode, `G`.

The two groups hold different prompts, numbers of prompts, chunks and completions, so they run different numbers of
passes; the engine pads each group's passes to the world's agreed counts, and FSDP2 gathers and frees the layers pass
by pass. Each rank records its collectives (`dist_worker.count_collectives`) and, whenever FSDP2 gathers, how many
decoder layers are gathered (`dist_worker.probe_gathers`). Rank 0 writes the full (gathered) parameter gradients and
every rank's records to `OUT`.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

WORLD = 4
GROUP_SIZE = 2


def make_group_batches(vocab_size: int) -> dict[str, dict]:
    """Global micro-batches of 12 rows, 3 per rank; `rank` says which rank runs each row.

    `G`: group 0 (ranks 0, 1) holds two prompts of 13 and 7 tokens with 2 + 1 and 1 + 2 completions, group 1 (ranks 2,
    3) one prompt of 22 tokens with 3 + 3 completions: in chunks of 5, 2 prompts against 1, different numbers of
    prefill and reverse passes and of branch rounds. `H`: the other way round, group 0 one prompt of 17 tokens, group 1
    two of 9 and 4 tokens. Completions of 1 to 9 tokens.
    """
    from trl_longstraw.testing import random_micro_batch

    layouts = {
        # (prompt lengths, completion lengths, prompt of row, rank of row)
        "G": (
            [13, 7, 22],
            [9, 1, 5, 3, 4, 6, 2, 8, 1, 7, 1, 6],
            [0, 0, 1, 0, 1, 1, 2, 2, 2, 2, 2, 2],
            [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3],
        ),
        "H": (
            [17, 9, 4],
            [4, 2, 7, 3, 5, 1, 6, 9, 2, 1, 3, 5],
            [0, 0, 0, 0, 0, 0, 1, 1, 2, 1, 2, 2],
            [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3],
        ),
    }
    batches = {}
    for i, (key, (prompts, completions, prompt_of_row, rank_of_row)) in enumerate(layouts.items()):
        batch = random_micro_batch(prompts, completions, prompt_of_row, vocab_size, seed=40 + i, completion_width=9)
        g = torch.Generator().manual_seed(50 + i)
        batch["ref_per_token_logps"] = -torch.rand(batch["completion_ids"].shape, generator=g) * 5
        batch["rank"] = torch.tensor(rank_of_row)
        batches[key] = batch
    return batches


def main(model_path: str, batches_path: str, out_path: str) -> None:
    os.environ.setdefault("ACCELERATE_USE_CPU", "1")
    from accelerate import PartialState
    from datasets import Dataset
    from dist_worker import count_collectives, probe_gathers, rows_of, trainer_config
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from trl_longstraw import LongStrawGRPOTrainer

    PartialState()  # the process group, as the trainers' accelerator sets it up
    world, rank = dist.get_world_size(), dist.get_rank()
    assert world == WORLD, f"the shard group tests need {WORLD} processes, got {world}"
    batches = torch.load(batches_path)
    log: list = []
    count_collectives(log)
    mesh = init_device_mesh("cpu", (world,))
    config = trainer_config(
        tempfile.mkdtemp(), num_generations=8, shard_prompt_state=True, prompt_shard_group_size=GROUP_SIZE
    )
    trainer = LongStrawGRPOTrainer(
        model_path,
        lambda completions, **kw: [0.0] * len(completions),
        config,
        Dataset.from_dict({"prompt": ["a"] * 8}),
    )
    assert trainer.accelerator.num_processes == WORLD
    shards = trainer._prompt_shards
    assert shards is not None and shards.world == GROUP_SIZE
    assert dist.get_process_group_ranks(shards.group) == [r for r in range(world) if r // 2 == rank // 2]
    trainer._prepare_inputs = lambda x: x
    trainer.current_gradient_accumulation_steps = 1
    # FSDP2 applied directly: on CPU, accelerate would silently turn an FSDP config into DDP.
    fsdp = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    add_fused_lm_head(fsdp, temperature=trainer.temperature, outputs=("log_probs", "entropy"))
    for layer in fsdp.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    assert all(isinstance(p, DTensor) for p in fsdp.parameters()), "FSDP2 is not active"
    gathered, most_gathered = probe_gathers(fsdp)
    per_family: dict = {"grads": {}, "collectives": {}, "gathered": {}}
    for name, mode, micro_batches in [("exact", "exact", "GH"), ("detached", "detached", "G")]:
        start = len(log)
        fsdp.zero_grad(set_to_none=True)
        gathered.clear()
        if mode == "exact":  # as the recipes run FSDP2: recomputed layers are gathered again by FSDP2
            fsdp.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        trainer.args.prompt_gradient = mode
        for i, key in enumerate(micro_batches):
            fsdp.set_requires_gradient_sync(i == len(micro_batches) - 1)
            batch = batches[key]
            trainer.training_step(fsdp, rows_of(batch, rank), batch["num_items_in_batch"])
        fsdp.gradient_checkpointing_disable()
        assert trainer._engine(fsdp).lockstep, "the engine does not pad the groups' passes"
        assert all(isinstance(p, DTensor) for p in fsdp.parameters()), "parameters left unsharded"
        grads = {}
        for pname, p in fsdp.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grads[pname] = None if g is None else g.detach().clone()
        per_family["grads"][name] = grads
        per_family["collectives"][name] = log[start:]
        per_family["gathered"][name] = most_gathered()
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (per_family["collectives"], per_family["gathered"]))
    results = {
        "grads": per_family["grads"],
        "collectives": [e[0] for e in everyone],
        "gathered": [e[1] for e in everyone],
        "layers": len(fsdp.model.layers),
    }
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()
