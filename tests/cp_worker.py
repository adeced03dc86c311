"""Worker of tests/test_context_parallel.py: one rank of a 2-process CPU (gloo) run of the engine's exact-mode
backward with context-parallel prompt passes, in fp32 and under bf16 autocast (TRL's `bf16=True`).

Launched as `torchrun --nproc_per_node 2 tests/cp_worker.py MODEL_PATH OUT`. Every rank first runs the whole
micro-batch alone (no shards: fp32, then bf16 autocast), then its own rows with the prompt state sharded over both
ranks (fp32, bf16), whose gradients are summed over the ranks. The micro-batch: one prompt of 61 tokens in chunks
of 7 (60 prefix tokens: 4 rounds of 2 chunks of 7, then a round of 2 + 2), 2 + 2 ragged completions. Then, under
gradient checkpointing, the sharded fp32 run twice: with the reverse pass's attention reuse (each checkpoint
recompute takes its attention layer's kept output instead of exchanging and attending again) and without it, counting
fused attention forwards and all-to-alls. Rank 0 writes the gradient sets and counts to `OUT`.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.distributed as dist


def main(model_path: str, out_path: str) -> None:
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from trl_longstraw import attention, engine, sharding
    from trl_longstraw.adapters import get_adapter
    from trl_longstraw.engine import Engine
    from trl_longstraw.sharding import PromptShards
    from trl_longstraw.testing import random_micro_batch

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    assert world == 2, f"the context-parallel test needs 2 processes, got {world}"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
    adapter = get_adapter(model)
    batch = random_micro_batch([61], [3, 2, 4, 1], [0, 0, 0, 0], model.config.vocab_size, seed=3)
    g = torch.Generator().manual_seed(4)
    grad_logps = torch.randn(batch["completion_ids"].shape, generator=g) * batch["completion_mask"]
    grad_entropies = torch.randn(batch["completion_ids"].shape, generator=g) * batch["completion_mask"]

    def bf16():
        return torch.autocast("cpu", dtype=torch.bfloat16)

    def run(shards, autocast) -> dict[str, torch.Tensor]:
        rows = list(range(rank, 4, world)) if shards is not None else list(range(4))
        model.zero_grad(set_to_none=True)
        engine = Engine(model, model, adapter, chunk_size=7, shards=shards, autocast=autocast)
        if shards is not None:
            assert engine.context_parallel, "the passes are not context-parallel"
        keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
        inputs = [batch[k][rows] for k in keys]
        engine.backward(*inputs, grad_logps[rows], grad_entropies[rows], True, torch.autograd.backward)
        grads = {}
        for name, p in model.named_parameters():
            grad = torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
            if shards is not None:
                dist.all_reduce(grad)
            grads[name] = grad
        return grads

    shards = PromptShards(None)
    results = {
        "single fp32": run(None, contextlib.nullcontext),
        "single bf16": run(None, bf16),
        "sharded fp32": run(shards, contextlib.nullcontext),
        "sharded bf16": run(shards, bf16),
    }

    counts = {"kernel": 0, "all_to_all": 0}
    kernel_forward, all_to_all = attention._kernel_forward, dist.all_to_all_single

    def counted_kernel(*args):
        counts["kernel"] += 1
        return kernel_forward(*args)

    def counted_all_to_all(*args, **kwargs):
        counts["all_to_all"] += 1
        return all_to_all(*args, **kwargs)

    attention._kernel_forward = sharding._kernel_forward = counted_kernel
    dist.all_to_all_single = counted_all_to_all
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # transformers checkpoints only in training mode; the tiny models have no dropout
    results["sharded fp32 checkpointed, reuse"] = run(shards, contextlib.nullcontext)
    results["counts, reuse"] = dict(counts)
    counts.update(kernel=0, all_to_all=0)
    engine.Pass.attention_reuse = lambda self, layer_idx: None
    results["sharded fp32 checkpointed, no reuse"] = run(shards, contextlib.nullcontext)
    results["counts, no reuse"] = dict(counts)
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.torchrun_main import run

    run(main, sys.argv[1:3])
