"""Expert parallelism (EP) for MoE models (`glm_moe_dsa`, `qwen3_moe`), through transformers' own distributed API.

With `expert_parallel_size: E > 1`, the trainer loads the policy (and the reference model) with
`from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=W, ep_size=E, ep_implementation="all_to_all"))`
on `W` processes. transformers then applies the model's own `base_model_ep_plan`: each expert module's weights
(`gate_up_proj`, `down_proj`, `[num_experts, ...]`) are sharded on the expert dimension over an EP group of `E`
ranks, so a rank holds `num_experts / E` whole experts, and the experts' forward sends each (token, expert) pair to
the rank that holds the expert and brings the result back (two all-to-alls per MoE layer, differentiable). Every
other parameter (attention, router, shared experts, norms, embeddings, head) is put under FSDP2 (`fully_shard`) over
all `W` ranks; experts are put under FSDP2 over the `W / E` ranks that hold the same experts (none to shard with when
`E = W`), with their gradient divided by `W` like the others'. Experts are never all-gathered across the EP group.

Why transformers' EP and not our own: the plan, the sharded loading (each rank reads only its experts), the token
exchange, the gradient scaling and the saving (`save_pretrained` gathers the full state dict) are the model
library's, maintained with the models; the engine only has to run the model's layers in an order the collectives
accept.

How it fits the engine's passes. The experts' all-to-alls are collectives of the EP group inside every MoE layer's
forward and backward, so every rank must run the same passes in the same order, which the engine already does for
per-layer FSDP2 in two ways (`Engine.lockstep`), both of which FSDP2 then gathers layer by layer:

- the prompt state sharded over all processes (`shard_prompt_state=True`, `prompt_shard_group_size: 0`): the ranks
  run the prefill and reverse passes in context-parallel rounds (`context_parallel`: each rank its own chunk, GLM's
  MLA + DSA and Qwen3-MoE alike) and branches in rounds (a rank short of completions runs a zero-weight one-token
  branch), so each rank routes its own tokens: the all-to-all's own use case. Only a prompt's last remainder of
  fewer tokens than ranks runs as a *replicated* pass, in which every rank sends the same tokens to the experts (an
  expert's rank computes them once per rank of the group); in the backward each rank returns its own share of the
  output gradient (the engine's replicated passes back-propagate per-rank shares), and the expert's gradient sums
  the shares, as the data-parallel reduction does for every other parameter;
- without a sharded state, the data-parallel lockstep: the ranks agree on the number of passes of each kind per
  prompt and pad theirs with one-token filler passes, each of which runs the MoE layers and their all-to-alls too;
- with shard groups smaller than the world, both: each group runs its own sharded lockstep, padded with the same
  fillers to the world's pass counts. transformers forms EP groups of consecutive ranks (rank `r` holds the experts
  of EP rank `r mod E`), so an EP group is a shard group, lies inside one, or spans several (tested on 4 processes
  with shard groups of 2 and `E = 4`: `tests/test_shard_groups.py`); the replicated passes' per-rank shares of an
  expert's gradient add up over the EP group as over a shard group.

transformers' `ep_implementation="all_reduce"` (every rank runs its own experts on a batch the EP group shares,
outputs summed) would fit the replicated passes without the duplicate expert compute, but not branch rounds,
context-parallel rounds or the data-parallel passes, where the ranks hold different tokens; transformers also accepts
it only when the EP group is a tensor-parallel group (`ep_size == tp_size`), which the engine does not use. So the
trainer always asks for `"all_to_all"`.

Host memory (`fsdp_cpu_offload: true`): transformers' `DistributedConfig(fsdp_cpu_offload=True)`, i.e. FSDP2's
`CPUOffloadPolicy` on every `fully_shard` (experts included): the sharded parameters, their gradients and the
optimizer state stay in host memory and the optimizer step runs on the CPU; FSDP2 copies each shard to the device
when it gathers it. The engine's gathering is unchanged, and so are the gradients (tested bit for bit).

Checkpoints: transformers cannot save the optimizer state of a model sharded at load time, so `save_only_model=True`
(or `save_strategy="no"`) is required; the weights are gathered and saved whole.
"""

from __future__ import annotations

from typing import Any

import torch

# The only implementation that is right for branch rounds, where the ranks of an EP group hold different tokens.
EP_IMPLEMENTATION = "all_to_all"
# Config attributes that hold the number of routed experts, by model family.
_EXPERT_COUNT_ATTRIBUTES = ("n_routed_experts", "num_experts", "num_local_experts")


def num_experts(config) -> int | None:
    """The number of routed experts per MoE layer of `config` (its text config), or None for a dense model."""
    config = config.get_text_config()
    for name in _EXPERT_COUNT_ATTRIBUTES:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def distributed_config(world_size: int, ep_size: int, cpu_offload: bool = False) -> dict[str, Any]:
    """The `distributed_config` of `from_pretrained` (as a dict, so that the training arguments stay serializable):
    FSDP2 over all `world_size` processes, with `CPUOffloadPolicy` if `cpu_offload`, and the experts spread over EP
    groups of `ep_size` ranks."""
    return {
        "fsdp_size": world_size,
        "ep_size": ep_size,
        "ep_implementation": EP_IMPLEMENTATION,
        "fsdp_cpu_offload": cpu_offload,
    }


def check_args(args, world_size: int) -> None:
    """The settings expert parallelism needs, before anything is loaded. `args` is a `LongStrawGRPOConfig`.

    Raises:
        ValueError: naming the fix, when the EP size does not divide the processes, or checkpoints would need the
            optimizer state.
    """
    ep = args.expert_parallel_size
    if ep <= 1:
        return
    if world_size % ep:
        raise ValueError(
            f"expert_parallel_size={ep} must divide the number of processes ({world_size}): e.g. the GPUs of a node "
            f"(8), or all {world_size} processes."
        )
    if args.save_strategy != "no" and not args.save_only_model:
        raise ValueError(
            "expert_parallel_size > 1 loads the model sharded by transformers, which cannot checkpoint its optimizer "
            "state: set save_only_model=True (checkpoints then hold the gathered weights, without the optimizer "
            "state to resume from) or save_strategy='no'."
        )
    kwargs = args.model_init_kwargs or {}
    given = kwargs.get("distributed_config") if isinstance(kwargs, dict) else None
    expected = distributed_config(world_size, ep, args.fsdp_cpu_offload)
    if given is not None:
        given = given if isinstance(given, dict) else given.to_dict()
        if any(given.get(key) != value for key, value in expected.items()):
            raise ValueError(
                f"model_init_kwargs['distributed_config']={given} does not match expert_parallel_size={ep} and "
                f"fsdp_cpu_offload={args.fsdp_cpu_offload} on {world_size} processes: remove distributed_config from "
                "model_init_kwargs (the trainer sets it)."
            )


def check_model_config(config, ep_size: int) -> None:
    """Raises ValueError, naming the fix, if `config`'s model has no expert-parallel plan or `ep_size` does not divide
    its number of experts."""
    if ep_size <= 1:
        return
    experts = num_experts(config)
    plan = getattr(config.get_text_config(), "base_model_ep_plan", None)
    if experts is None or not plan:
        raise ValueError(
            f"expert_parallel_size={ep_size}: model_type {config.model_type!r} has no experts to spread (transformers "
            "defines no base_model_ep_plan for it). Set expert_parallel_size=1; MoE families with a plan include "
            "glm_moe_dsa and qwen3_moe."
        )
    if experts % ep_size:
        raise ValueError(
            f"expert_parallel_size={ep_size} must divide the {experts} experts of each MoE layer: pick a divisor of "
            f"{experts}."
        )


def model_init_kwargs(args, world_size: int, kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """`kwargs` (by default `args.model_init_kwargs`) with the `distributed_config` that loads a model
    expert-parallel over `world_size` processes (TRL loads the policy given by name and the reference model with
    `args.model_init_kwargs`)."""
    kwargs = dict((args.model_init_kwargs if kwargs is None else kwargs) or {})
    kwargs["distributed_config"] = distributed_config(world_size, args.expert_parallel_size, args.fsdp_cpu_offload)
    return kwargs


def check_loaded(model: torch.nn.Module, ep_size: int, cpu_offload: bool = False, role: str = "model") -> None:
    """Raises ValueError if `model` (a `PreTrainedModel`) was not loaded expert-parallel over `ep_size` ranks with
    the all-to-all implementation, and with FSDP2's CPU offload if `cpu_offload` (e.g. an instance built without
    `distributed_config`)."""
    config = getattr(model.config, "distributed_config", None)
    loaded = getattr(model, "is_distributed_loading_by_transformers", False) and config is not None
    if loaded and config.fsdp_cpu_offload != cpu_offload:
        raise ValueError(
            f"fsdp_cpu_offload={cpu_offload}, but the {role} was loaded with "
            f"DistributedConfig(fsdp_cpu_offload={config.fsdp_cpu_offload}): load it with the same setting, or pass "
            "the model's name or path and let the trainer load it."
        )
    if not loaded or config.ep_size != ep_size or config.ep_implementation != EP_IMPLEMENTATION:
        raise ValueError(
            f"expert_parallel_size={ep_size}, but the {role} was not loaded expert-parallel over {ep_size} ranks: "
            "pass the model's name or path and let the trainer load it, or load it with from_pretrained(..., "
            f"distributed_config=DistributedConfig(fsdp_size=<processes>, ep_size={ep_size}, "
            f'ep_implementation="{EP_IMPLEMENTATION}")).'
        )


def local_experts(model: torch.nn.Module) -> dict[str, int]:
    """Number of experts each expert module of `model` holds on this rank, by module name (`num_experts / E` under
    expert parallelism, all of them otherwise)."""
    counts = {}
    for name, module in model.named_modules():
        weight = getattr(module, "gate_up_proj", None)
        if isinstance(weight, torch.Tensor) and weight.ndim == 3:
            local = weight.to_local() if hasattr(weight, "to_local") else weight
            counts[name] = local.shape[0]
    return counts


def prepare(model: str | torch.nn.Module, args) -> None:
    """Before `GRPOTrainer` loads anything: checks the model (a name or path, or the loaded causal LM under its
    wrappers) against `expert_parallel_size` and sets the `distributed_config` with which TRL loads the policy (given
    by name) and the reference model."""
    from accelerate.utils import DistributedType

    if args.distributed_state.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise ValueError(
            "expert_parallel_size > 1: transformers shards the model at load time (FSDP2 and the experts), so "
            "accelerate must not shard it again: launch with recipes/accelerate/expert_parallel.yaml (a plain "
            "multi-GPU launch), not an FSDP or DeepSpeed accelerate config."
        )
    if isinstance(model, str):
        from transformers import AutoConfig

        kwargs = args.model_init_kwargs or {}
        remote = kwargs.get("trust_remote_code", args.trust_remote_code)
        config = AutoConfig.from_pretrained(model, revision=kwargs.get("revision"), trust_remote_code=remote)
        check_model_config(config, args.expert_parallel_size)
    else:
        check_loaded(model, args.expert_parallel_size, args.fsdp_cpu_offload)
    if isinstance(model, str) or args.beta != 0.0:  # what TRL loads with them: the policy by name, the reference
        args.model_init_kwargs = model_init_kwargs(args, args.world_size)
