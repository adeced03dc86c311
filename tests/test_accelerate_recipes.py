"""The Accelerate configs of recipes/accelerate resolve, through `accelerate launch`'s own parsing, to the intended
setup, on one node and on several (the multi-node launch line of their comments)."""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import FullyShardedDataParallelPlugin, prepare_multi_gpu_env

RECIPES = Path(__file__).resolve().parent.parent / "recipes" / "accelerate"
MULTI_NODE = ["--num_machines", "4", "--num_processes", "32", "--machine_rank", "2"]
MULTI_NODE += ["--main_process_ip", "10.0.0.1", "--main_process_port", "29500"]


def _launch(config: str, flags: list[str]):
    parsed = launch_command_parser().parse_args(["--config_file", str(RECIPES / config), *flags, "train.py"])
    args, _, _ = _validate_launch_command(parsed)
    return args, prepare_multi_gpu_env(args)


@pytest.mark.parametrize("flags", [["--num_processes", "8"], MULTI_NODE], ids=["8-gpus", "32-gpus"])
def test_ddp_config(flags):
    args, env = _launch("ddp.yaml", flags)
    assert args.multi_gpu and not args.use_fsdp
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert args.num_processes == int(flags[flags.index("--num_processes") + 1])
    if flags is MULTI_NODE:
        assert (args.num_machines, args.machine_rank, args.main_process_ip) == (4, 2, "10.0.0.1")


@pytest.mark.parametrize("flags", [["--num_processes", "8"], MULTI_NODE], ids=["8-gpus", "32-gpus"])
def test_fsdp2_config(flags):
    args, env = _launch("fsdp2.yaml", flags)
    assert args.use_fsdp
    with mock.patch.dict(os.environ, env):
        plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is True
    # Checkpointing goes through gradient_checkpointing (non-reentrant), which exact mode needs.
    assert not plugin.activation_checkpointing
    if flags is MULTI_NODE:
        assert (args.num_machines, args.num_processes, args.machine_rank) == (4, 32, 2)


@pytest.mark.parametrize("flags", [["--num_processes", "8"], MULTI_NODE], ids=["8-gpus", "32-gpus"])
def test_fsdp2_offload_config(flags):
    """fsdp2.yaml plus FSDP2's CPUOffloadPolicy (parameters, gradients and optimizer state in host memory)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    args, env = _launch("fsdp2_offload.yaml", flags)
    assert args.use_fsdp
    with mock.patch.dict(os.environ, env):
        plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2
    assert isinstance(plugin.cpu_offload, CPUOffloadPolicy)
    assert plugin.reshard_after_forward is True and not plugin.activation_checkpointing


@pytest.mark.parametrize("flags", [["--num_processes", "8"], MULTI_NODE], ids=["8-gpus", "32-gpus"])
def test_expert_parallel_config(flags):
    """A plain multi-GPU launch: transformers shards the model (experts and FSDP2) as it loads it, so accelerate
    neither wraps it in DDP (the trainer skips the wrap for such a model) nor shards it again."""
    args, env = _launch("expert_parallel.yaml", flags)
    assert args.multi_gpu and not args.use_fsdp and not args.use_deepspeed
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert args.num_processes == int(flags[flags.index("--num_processes") + 1])
