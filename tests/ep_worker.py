"""Worker of tests/test_expert_parallel.py: one rank of a 2-process CPU (gloo) run with expert parallelism.

Launched through `tests.helpers.torchrun` (2 processes), one case per model: `main(MODEL_PATH, BATCHES, OUT)`. The
trainer loads the MoE model itself with `expert_parallel_size=2` (transformers' `DistributedConfig(fsdp_size=2,
ep_size=2, ep_implementation="all_to_all")`: 2 of the 4 experts of each MoE layer per rank, everything else under
FSDP2), with the prompt state sharded over both ranks, and runs micro-batch `S` of `dist_worker.make_batches` (both
ranks hold the same prompts, different completions) in exact mode (also with non-reentrant gradient checkpointing, and
with LoRA) and in detached mode; then without the sharded state (the engine's data-parallel lockstep) on micro-batches
`A` (exact) and `B` (detached), where the ranks hold different prompts; then FSDP2's CPU offload runs.

Rank 0 writes to `OUT`: the full parameter gradients of each run (gathered from the DTensors), how many experts each
expert module held in every forward on each rank, each rank's local expert weights after training (to compare with
the saved model's experts `[2r, 2r+1]`), whether the reference model is expert-parallel too, and each rank's
sequence of collectives. The process group is destroyed and the process exits explicitly, as in `dist_worker.py`.
"""

from __future__ import annotations

import functools
import os
import tempfile

import torch
import torch.distributed as dist

# The log that the wrapped exchanges append to: the latest `count_expert_exchanges` call's.
_LOG: list[list] = []


def count_expert_exchanges(log: list) -> None:
    """Logs transformers' expert all-to-alls to `log` as `("ep_" + name, tensor shapes)`: its EP module binds them by
    name at import, out of reach of `dist_worker.count_collectives`. Wrapped once per process; a later call redirects
    the records to its own `log`."""
    import transformers.distributed.expert_parallel as hf_ep

    if _LOG:
        _LOG[0] = log
        return
    _LOG.append(log)

    def wrap(name, fn):
        def wrapper(*args, **kwargs):
            _LOG[0].append((f"ep_{name}", tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))))
            return fn(*args, **kwargs)

        return wrapper

    for name in ("all_to_all_single", "all_to_all_single_autograd"):
        setattr(hf_ep, name, wrap(name, getattr(hf_ep, name)))


# LoRA of the expert-parallel run and of its single-process reference.
LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["o_proj"])


def set_lora_weights(model) -> None:
    """Gives the LoRA matrices of `model` the same nonzero values in every process (B is zero at PEFT's init)."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def lora_grads(model) -> dict[str, torch.Tensor | None]:
    """The gradients of the LoRA matrices of `model`, by parameter name without PEFT's prefix."""
    return {
        name.removeprefix("base_model.model."): None if p.grad is None else p.grad.detach().clone()
        for name, p in model.named_parameters()
        if "lora_" in name
    }


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

    settings = dict(
        num_generations=8,
        shard_prompt_state=True,
        expert_parallel_size=2,
        save_only_model=True,
        router_aux_loss_coef=0.0,
    )
    config = trainer_config(tempfile.mkdtemp(), **settings)
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
    count_expert_exchanges(log)

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
    shards = trainer._prompt_shards
    for name, mode, checkpointing, key in [
        ("ep_exact", "exact", False, "S"),
        ("ep_exact_checkpointing", "exact", True, "S"),
        ("ep_detached", "detached", False, "S"),
        # Without a sharded prompt state: the engine's data-parallel lockstep (uneven prompts, chunks and completions
        # per rank, padded with filler passes), in which the experts' all-to-alls meet too.
        ("ep_dp_exact", "exact", False, "A"),
        ("ep_dp_detached", "detached", False, "B"),
    ]:
        trainer._prompt_shards = shards if key == "S" else None
        trainer._engines.clear()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
        trainer.args.prompt_gradient = mode
        model.zero_grad(set_to_none=True)
        start = len(log)
        trainer.training_step(model, rows_of(batches[key], rank), batches[key]["num_items_in_batch"])
        results[name] = full_grads()
        results["collectives"][name] = log[start:]
        assert all(isinstance(p, DTensor) for p in model.parameters()), "parameters left unsharded"
    trainer._prompt_shards = shards
    trainer._engines.clear()

    # LoRA on the attention output projections of the expert-parallel model: the adapters are plain tensors beside the
    # DTensors, which transformers' Trainer broadcasts and averages itself (`_sync_replicated_trainable_parameters`,
    # called by `train()`; its hook averages after each of the engine's backward passes, which every rank runs alike).
    from peft import LoraConfig

    lora = LongStrawGRPOTrainer(
        model_path,
        reward,
        trainer_config(tempfile.mkdtemp(), **settings),
        train_dataset=Dataset.from_dict({"prompt": ["a"] * 8}),
        peft_config=LoraConfig(**LORA),
    )
    set_lora_weights(lora.model)
    lora._prepare_inputs = lambda x: x
    lora.current_gradient_accumulation_steps = 1
    lora._sync_replicated_trainable_parameters(lora.model)
    lora.args.prompt_gradient = "exact"
    start = len(log)
    lora.training_step(lora.model, rows_of(batches["S"], rank), batches["S"]["num_items_in_batch"])
    results["ep_lora_exact"] = lora_grads(lora.model)
    results["collectives"]["ep_lora_exact"] = log[start:]

    # The same exact step with FSDP2's CPU offload (`fsdp_cpu_offload`): the parameters' local shards, gradients and
    # optimizer state in host memory. On a CPU-only machine transformers' `CPUOffloadPolicy()` cannot pin memory, so
    # the worker makes it unpinned there; everything else is the production path.
    import transformers.distributed.fsdp as hf_fsdp
    from torch.distributed.fsdp import CPUOffloadPolicy

    from trl_longstraw.distributed import _param_groups, fsdp2_offloads, fsdp2_root

    hf_fsdp.CPUOffloadPolicy = functools.partial(CPUOffloadPolicy, pin_memory=torch.cuda.is_available())
    offload_config = trainer_config(tempfile.mkdtemp(), fsdp_cpu_offload=True, **settings)
    offloaded = LongStrawGRPOTrainer(
        model_path, reward, offload_config, train_dataset=Dataset.from_dict({"prompt": ["a"] * 8})
    )
    offloaded._prepare_inputs = lambda x: x
    offloaded.current_gradient_accumulation_steps = 1
    offloaded.model.gradient_checkpointing_disable()
    offloaded.args.prompt_gradient = "exact"
    start = len(log)
    offloaded.training_step(offloaded.model, rows_of(batches["S"], rank), batches["S"]["num_items_in_batch"])
    results["ep_exact_offload"] = {
        name: None if p.grad is None else p.grad.full_tensor().detach().clone()
        for name, p in offloaded.model.named_parameters()
    }
    results["collectives"]["ep_exact_offload"] = log[start:]
    fsdp_params = [fp for g in _param_groups(fsdp2_root(offloaded.model)) for fp in g.fsdp_params]
    grads = [p.grad for p in offloaded.model.parameters() if p.grad is not None]
    offload_state = {
        # What the memory guard tells the planner (`distributed.fsdp2_offloads`), offloaded and not.
        "detected": (fsdp2_offloads(offloaded.model), fsdp2_offloads(model)),
        "ep": all(fp.offload_to_cpu for fp in fsdp_params),
        "ep_devices": sorted({str(t.to_local().device) for t in [*offloaded.model.parameters(), *grads]}),
    }

    # FSDP2 as accelerate applies it (`fully_shard` on every decoder layer and the root; on CPU accelerate would turn
    # an FSDP config into DDP), with and without `CPUOffloadPolicy` (accelerate's `fsdp_offload_params: true`), in
    # both lockstep modes, layer by layer: data-parallel (the prompt state unsharded, micro-batch `A` of uneven work)
    # and sharded (the prompt state sharded over both ranks, `S`).
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    mesh = init_device_mesh("cpu", (world,))
    shards = trainer._prompt_shards
    for offload in (False, True):
        policy = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}
        fsdp = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        add_fused_lm_head(fsdp, temperature=trainer.temperature, outputs=("log_probs", "entropy"))
        for layer in fsdp.model.layers:
            fully_shard(layer, mesh=mesh, **policy)
        fully_shard(fsdp, mesh=mesh, **policy)
        tag = "_offload" if offload else ""
        for mode, key, sharded in [("data_parallel", "A", False), ("per_pass", "S", True)]:
            trainer._prompt_shards = shards if sharded else None
            trainer._engines.clear()
            trainer.args.prompt_gradient = "exact"
            fsdp.zero_grad(set_to_none=True)
            start = len(log)
            trainer.training_step(fsdp, rows_of(batches[key], rank), batches[key]["num_items_in_batch"])
            results[f"fsdp2_{mode}{tag}"] = {
                name: None if p.grad is None else p.grad.full_tensor().detach().clone()
                for name, p in fsdp.named_parameters()
            }
            results["collectives"][f"fsdp2_{mode}{tag}"] = log[start:]
        if offload:
            fsdp_params = [fp for g in _param_groups(fsdp) for fp in g.fsdp_params]
            grads = [p.grad for p in fsdp.parameters() if p.grad is not None]
            offload_state["fsdp2"] = all(fp.offload_to_cpu for fp in fsdp_params) and fsdp2_offloads(fsdp)
            offload_state["fsdp2_devices"] = sorted({str(t.to_local().device) for t in [*fsdp.parameters(), *grads]})
    trainer._prompt_shards = shards
    trainer._engines.clear()

    local = {
        name: p.to_local().detach().clone()
        for name, p in model.named_parameters()
        if name.endswith(("experts.gate_up_proj", "experts.down_proj"))
    }
    ref_local = None if trainer.ref_model is None else local_experts(trainer.ref_model)
    everyone: list = [None] * world
    dist.all_gather_object(
        everyone,
        (
            {k: sorted(v) for k, v in seen.items()},
            local_experts(model),
            local,
            ref_local,
            results["collectives"],
            offload_state,
        ),
    )
    if rank == 0:
        results["seen"] = [e[0] for e in everyone]
        results["local_experts"] = [e[1] for e in everyone]
        results["local_weights"] = [e[2] for e in everyone]
        results["ref_local_experts"] = [e[3] for e in everyone]
        results["collectives"] = [e[4] for e in everyone]
        results["offload"] = [e[5] for e in everyone]
        torch.save(results, out_path)
    dist.barrier()
