"""Worker of tests/test_expert_parallel.py: one rank of a 2-process CPU (gloo) run with expert parallelism.

Launched by the test with `torchrun --nproc_per_node 2 tests/ep_worker.py MODEL_PATH BATCHES OUT`. The trainer loads
the MoE model itself with `expert_parallel_size=2` (transformers' `DistributedConfig(fsdp_size=2, ep_size=2,
ep_implementation="all_to_all")`: 2 of the 4 experts of each MoE layer per rank, everything else under FSDP2), with
the prompt state sharded over both ranks, and runs micro-batch `S` of `dist_worker.make_batches` (both ranks hold the
same prompts, different completions) in exact mode (also with non-reentrant gradient checkpointing) and in detached
mode.

Rank 0 writes to `OUT`: the full parameter gradients of each run (gathered from the DTensors), how many experts each
expert module held in every forward on each rank, each rank's local expert weights after training (to compare with
the saved model's experts `[2r, 2r+1]`), whether the reference model is expert-parallel too, and each rank's
sequence of collectives. The process group is destroyed and the process exits explicitly, as in `dist_worker.py`.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist


def main(model_path: str, batches_path: str, out_path: str) -> None:
    os.environ.setdefault("ACCELERATE_USE_CPU", "1")
    from datasets import Dataset
    from dist_worker import count_collectives, rows_of, trainer_config
    from torch.distributed.tensor import DTensor

    from trl_longstraw import LongStrawGRPOTrainer
    from trl_longstraw.expert_parallel import local_experts

    batches = torch.load(batches_path)

    def reward(completions, **kwargs):
        return [0.0] * len(completions)

    config = trainer_config(
        tempfile.mkdtemp(),
        num_generations=8,
        shard_prompt_state=True,
        expert_parallel_size=2,
        save_only_model=True,
        router_aux_loss_coef=0.0,
    )
    trainer = LongStrawGRPOTrainer(model_path, reward, config, train_dataset=Dataset.from_dict({"prompt": ["a"] * 8}))
    world, rank = dist.get_world_size(), dist.get_rank()
    assert world == 2, f"the expert-parallel test needs 2 processes, got {world}"
    assert trainer._prompt_shards is not None and trainer._prompt_shards.world == 2
    model = trainer.model
    assert all(isinstance(p, DTensor) for p in model.parameters()), "FSDP2/EP is not active on every parameter"
    trainer._prepare_inputs = lambda x: x
    trainer.current_gradient_accumulation_steps = 1
    log: list = []
    count_collectives(log)

    # Experts each expert module holds while it runs: 2 of 4 if they are never gathered across the EP group.
    seen: dict[str, set[int]] = {}

    def watch(name):
        def hook(module, args):
            weight = module.gate_up_proj
            local = weight.to_local() if isinstance(weight, DTensor) else weight
            seen.setdefault(name, set()).add(local.shape[0])

        return hook

    expert_modules = [name for name in local_experts(model)]
    for name in expert_modules:
        model.get_submodule(name).register_forward_pre_hook(watch(name))

    def full_grads() -> dict[str, torch.Tensor | None]:
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad
            if isinstance(g, DTensor):
                g = g.full_tensor()
            grads[name] = None if g is None else g.detach().clone()
        return grads

    results: dict = {"collectives": {}}
    for name, mode, checkpointing in [
        ("ep_exact", "exact", False),
        ("ep_exact_checkpointing", "exact", True),
        ("ep_detached", "detached", False),
    ]:
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
        trainer.args.prompt_gradient = mode
        model.zero_grad(set_to_none=True)
        start = len(log)
        trainer.training_step(model, rows_of(batches["S"], rank), batches["S"]["num_items_in_batch"])
        results[name] = full_grads()
        results["collectives"][name] = log[start:]
        assert all(isinstance(p, DTensor) for p in model.parameters()), "parameters left unsharded"

    local = {
        name: p.to_local().detach().clone()
        for name, p in model.named_parameters()
        if name.endswith(("experts.gate_up_proj", "experts.down_proj"))
    }
    ref_local = None if trainer.ref_model is None else local_experts(trainer.ref_model)
    everyone: list = [None] * world
    dist.all_gather_object(
        everyone,
        ({k: sorted(v) for k, v in seen.items()}, local_experts(model), local, ref_local, results["collectives"]),
    )
    if rank == 0:
        results["seen"] = [e[0] for e in everyone]
        results["local_experts"] = [e[1] for e in everyone]
        results["local_weights"] = [e[2] for e in everyone]
        results["ref_local_experts"] = [e[3] for e in everyone]
        results["collectives"] = [e[4] for e in everyone]
        torch.save(results, out_path)
    dist.barrier()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    code = 0
    try:
        main(*sys.argv[1:4])
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        if dist.is_initialized():
            dist.destroy_process_group()
    # Explicit exit: gloo FSDP runs can abort while the interpreter tears down after passing.
    os._exit(code)
