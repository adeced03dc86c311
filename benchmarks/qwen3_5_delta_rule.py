"""Backward cost of the gated delta rule against sequence length: stock's torch fallback against ours.

Stock `torch_chunk_gated_delta_rule` (transformers, used when flash-linear-attention is missing) indexes its inputs
block by block and writes each block's output in place into one buffer; autograd makes both a full-length gradient
buffer per block, so its backward is quadratic in the length. `trl_longstraw.qwen3_5.torch_gated_delta_rule` is the
same algorithm with `unbind`/`stack`. CPU seconds (one thread) of forward and backward of one tiny layer-sized call
(4 heads of dim 16, fp32), best of two.

    python benchmarks/qwen3_5_delta_rule.py [--lengths 1024 2048 ...] [--stock-max 16384] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from pathlib import Path

import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

from trl_longstraw.qwen3_5 import torch_gated_delta_rule


def stock(q, k, v, g, beta):
    return torch_chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)


def timed(fn, length: int, heads: int = 4, dim: int = 16) -> tuple[float, float]:
    """(forward, backward) CPU seconds, best of two."""
    best = (float("inf"), float("inf"))
    for seed in range(2):
        gen = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(1, length, heads, dim, generator=gen).requires_grad_() for _ in range(3))
        g = (-torch.rand(1, length, heads, generator=gen) * 0.1).requires_grad_()
        beta = torch.rand(1, length, heads, generator=gen).requires_grad_()
        t0 = time.process_time()
        out, state = fn(q, k, v, g, beta)
        t1 = time.process_time()
        (out.sum() + state.sum()).backward()
        t2 = time.process_time()
        best = (min(best[0], t1 - t0), min(best[1], t2 - t1))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--stock-max", type=int, default=32768, help="longest length run through stock")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for length in args.lengths:
        ours = timed(torch_gated_delta_rule, length)
        ref = timed(stock, length) if length <= args.stock_max else None
        ref_cells = f"{ref[0]:.3f} | {ref[1]:.3f}" if ref else "- | -"
        rows.append(f"| {length} | {ref_cells} | {ours[0]:.3f} | {ours[1]:.3f} |")
        print(rows[-1], flush=True)
    text = "\n".join(
        [
            "# Gated delta rule: backward cost against length",
            "",
            f"Measured {datetime.date.today()} on {platform.machine()}, CPU, one thread, fp32, with:",
            "",
            "```",
            "python " + " ".join(sys.argv),
            "```",
            "",
            "One call with 4 heads of dim 16; CPU seconds, best of two.",
            "",
            "| length | stock forward | stock backward | ours forward | ours backward |",
            "|---|---|---|---|---|",
            *rows,
            "",
        ]
    )
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
