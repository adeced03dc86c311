"""Data parallelism for the engine: DDP and FSDP2 with no hangs, whatever work each rank holds.

The engine back-propagates many times per micro-batch (once per completion, then once per prompt chunk in exact mode),
and ranks hold different numbers of prompts, completions and tokens. A collective in a pass would leave a rank with
more passes waiting forever for a partner, unless every rank runs the same passes:

- DDP runs *collective-free* while the engine works: the engine calls the module inside the wrapper, never the
  wrapper itself, so DDP neither broadcasts buffers nor arms its gradient hooks (they only fire after a forward
  through the wrapper). At the end of a micro-batch the gradients are all-reduced explicitly, in buckets, and
  averaged over the ranks, as DDP does; skipped when the micro-batch runs under `no_sync` (gradient accumulation),
  exactly like DDP.
- FSDP2 (`fully_shard`) per pass (`fsdp2_gathered`): every rank of the world runs the same passes in the same order,
  so FSDP2 gathers, frees and reduce-scatters layer by layer as it was designed to. Either the prompt state is
  sharded over every process (its passes are lockstep by construction), or the ranks agree on the number of passes
  of each kind per prompt slot (`agree_pass_counts`, one all-reduce over the world per engine call) and pad theirs
  with one-token filler passes: without a sharded state (the engine's *data-parallel lockstep*), or with shard groups
  smaller than the world, where each group runs its own lockstep (its sharded attention's collectives stay inside
  the group) and the fillers, which never touch the sharded attention, pad it to the other groups' passes. Only the
  root's own parameters (embeddings, final norm, head) stay gathered for the engine call; the *sync pass* reduces
  their gradient.

A micro-batch that must synchronize ends, under FSDP2, with one *sync pass*: a one-token forward and backward through
the root with weight zero, identical on every rank, under the reduction settings the caller had (so `no_sync`, HSDP's
`set_requires_all_reduce(False)` and mixed-precision reduce dtypes are honoured), with
`reduce_scatter_unused_params` so that every rank reduce-scatters the same parameters; it costs one token of compute.

All make the result equal to the single-process gradient of the global batch up to float summation order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

# Bucket size of the explicit DDP all-reduce, DDP's own default.
ALLREDUCE_BUCKET_BYTES = 25 * 2**20


def _fsdp_module_class():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6 has no public FSDP2
        return None
    return FSDPModule


def fsdp2_root(model: torch.nn.Module) -> torch.nn.Module | None:
    """The outermost `fully_shard` module of `model` (itself or a submodule), or None."""
    cls = _fsdp_module_class()
    if cls is None:
        return None
    return next((m for m in model.modules() if isinstance(m, cls)), None)


def agree_pass_counts(counts: list[tuple[int, int, int]], slots: int, device) -> list[tuple[int, int, int]]:
    """The pass counts every rank of the world runs in one engine call of the world lockstep (data-parallel, or
    across shard groups smaller than the world).

    One all-reduce (max) of a `[slots, 3]` tensor: every rank passes the same `slots` (the rows of its micro-batch,
    an upper bound on its prompts; TRL gives every process the same number of rows).

    Args:
        counts: for each prompt this rank runs, in its order, `(prefill passes, branch passes, reverse passes)`
            (chunks or context-parallel rounds; a sharded group's branch rounds).
        slots: at least `len(counts)` on every rank.
        device: where the collective's tensor lives (the backend's device).

    Returns:
        For each slot `k` up to the last one in which some rank runs a pass, the largest counts of any rank's `k`-th
        prompt (zeros for a rank without one).
    """
    if len(counts) > slots:
        raise RuntimeError(f"{len(counts)} prompts do not fit the {slots} slots of the pass-count agreement")
    table = torch.zeros(slots, 3, dtype=torch.int64, device=device)
    if counts:
        table[: len(counts)] = torch.tensor(counts, dtype=torch.int64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    agreed = [tuple(row) for row in table.tolist()]
    while agreed and not any(agreed[-1]):
        agreed.pop()
    return agreed


def branch_model(model: torch.nn.Module) -> torch.nn.Module:
    """What the engine calls for a branch: the module inside a DDP wrapper (so DDP issues nothing), else `model`."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def allreduce_gradients(params: list[torch.nn.Parameter], group=None) -> None:
    """Averages the `.grad` of `params` over the ranks of `group`, as DDP's reducer does.

    Every rank must pass the same parameters in the same order. A parameter without a gradient on some rank but with
    one elsewhere gets zeros there first; one without a gradient on every rank keeps `None` (one small all-reduce of
    flags decides). Gradients are reduced in buckets of at most `ALLREDUCE_BUCKET_BYTES` per dtype.
    """
    world = dist.get_world_size(group)
    if not params:
        return
    device = params[0].device
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=device)
    dist.all_reduce(has, op=dist.ReduceOp.MAX, group=group)
    live = []
    for p, h in zip(params, has.tolist(), strict=True):
        if not h:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if p.grad.is_sparse:
            raise ValueError("sparse gradients are not supported under DDP by trl_longstraw: use dense embeddings")
        live.append(p)
    buckets: dict[tuple, list[list[torch.nn.Parameter]]] = {}
    for p in live:
        key = (p.grad.dtype, p.grad.device)
        runs = buckets.setdefault(key, [[]])
        if runs[-1] and sum(q.grad.numel() * q.grad.element_size() for q in runs[-1]) >= ALLREDUCE_BUCKET_BYTES:
            runs.append([])
        runs[-1].append(p)
    for runs in buckets.values():
        for bucket in runs:
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            dist.all_reduce(flat, group=group)
            flat.div_(world)
            offset = 0
            for p in bucket:
                n = p.grad.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n


def finish_ddp(model: torch.nn.Module) -> None:
    """End of a micro-batch under DDP: average the gradients unless the wrapper is in `no_sync`.

    Raises:
        ValueError: if a DDP communication hook is registered (the explicit all-reduce would bypass it).
    """
    if not isinstance(model, DistributedDataParallel):
        return
    if getattr(model, "_comm_hooks", None):
        raise ValueError(
            "DDP communication hooks (e.g. DistributedDataParallelKwargs(comm_hook=...)) are not applied by "
            "LongStrawGRPOTrainer, which all-reduces gradients itself once per micro-batch: remove the comm hook."
        )
    if model.require_backward_grad_sync:
        allreduce_gradients([p for p in model.module.parameters() if p.requires_grad], model.process_group)


# ------------------------------------------------------------------------------------------------------------ FSDP2
def _param_groups_of(module) -> list:
    """The FSDP parameter groups of `module` itself, not of its FSDP submodules. FSDP2 exposes no public accessor."""
    state = module._get_fsdp_state()
    return getattr(state, "_fsdp_param_groups", None) or [g for g in [state._fsdp_param_group] if g is not None]


def _param_groups(root) -> Iterator:
    """Every FSDP parameter group under `root`, in module order."""
    cls = _fsdp_module_class()
    for module in root.modules():
        if isinstance(module, cls):
            yield from _param_groups_of(module)


_GROUP_FLAGS = ("post_forward_mesh_info", "reshard_after_backward", "reduce_grads", "all_reduce_grads")


@contextlib.contextmanager
def fsdp2_gathered(model: torch.nn.Module, sync_pass: Callable[[], None] | None = None):
    """Runs the engine's passes of the block under FSDP2 pass by pass, then reduces the gradients they accumulated.

    Only the root module's own parameters (embeddings, final norm, head: the prefill and reverse pass call the
    backbone, not the root) stay gathered for the block; every other module is all-gathered and resharded by FSDP2
    around each pass and reduce-scatters its gradient after each backward (unless the caller turned gradient sync
    off), so a rank never holds more than a couple of layers' parameters and gradients. That issues collectives in
    every pass: the caller guarantees that every rank of the FSDP mesh runs the same passes, of the same kinds in the
    same order (the sharded prompt state's lockstep over every process, or the engine's lockstep over the world with
    `agree_pass_counts`).

    With `sync_pass` (a callable running one zero-weight forward and backward through the root), the gradients the
    block accumulated unreduced are then reduced with the caller's reduction settings, if those ask for a reduction.
    Nothing happens without an FSDP2 module.
    """
    root = fsdp2_root(model)
    if root is None:
        yield
        return
    # The root must be lazily initialized as the root before a decoder layer runs on its own, or that layer would
    # claim the root role (FSDP2 picks the first module to run forward).
    root._get_fsdp_state()._lazy_init()
    groups = list(_param_groups(root))
    saved = [{name: getattr(g, name) for name in _GROUP_FLAGS + ("reduce_scatter_unused_params",)} for g in groups]
    # A MoE expert unused on one rank still joins every reduce-scatter, so the ranks' collectives match.
    for g in groups:
        g.reduce_scatter_unused_params = True
    try:
        for g in _param_groups_of(root):
            g.post_forward_mesh_info = None  # no reshard after forward
            g.reshard_after_backward = False
            g.reduce_grads = False
            g.all_reduce_grads = False
        root.unshard()
        yield
        if sync_pass is not None and any(s["reduce_grads"] for s in saved):
            for g, s in zip(groups, saved, strict=True):
                g.reduce_grads = s["reduce_grads"]
                g.all_reduce_grads = s["all_reduce_grads"]
            sync_pass()
    finally:
        for g, s in zip(groups, saved, strict=True):
            for name, value in s.items():
                setattr(g, name, value)
        root.reshard()


def fsdp2_reshard(model: torch.nn.Module) -> None:
    """Reshards every FSDP2 module of `model`, after passes without a backward (generation).

    A module that keeps its parameters gathered after its forward for the backward that follows
    (`reshard_after_forward=False`, e.g. the final norm and LM head that transformers groups under expert parallelism)
    would otherwise stay gathered through the reward computation. Nothing happens without an FSDP2 module.
    """
    cls = _fsdp_module_class()
    if cls is None:
        return
    for module in model.modules():
        if isinstance(module, cls):
            module.reshard()


def fsdp2_offloads(model: torch.nn.Module) -> bool:
    """Whether FSDP2 keeps the shards of `model`'s parameters in host memory (`CPUOffloadPolicy`: accelerate's
    `fsdp_offload_params`, or `DistributedConfig(fsdp_cpu_offload=True)` under expert parallelism)."""
    root = fsdp2_root(model)
    return root is not None and any(p.offload_to_cpu for g in _param_groups(root) for p in g.fsdp_params)
