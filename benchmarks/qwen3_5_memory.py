"""Peak memory of exact against detached mode on the tiny Qwen3.5 hybrid, one training step, CPU.

Each mode runs in a fresh process (peak RSS is per process): one micro-batch of one prompt of `--positions` tokens
and G completions, prefilled in chunks of `--chunk`. It reports the peak RSS of the process, its RSS just before the
training step (model, trainer and micro-batch loaded), and the step's growth over that. Exact mode keeps the
DeltaNet state at every chunk boundary and the gradient of the whole prompt state, and recomputes each chunk with
autograd in its reverse pass; the issue asks that its peak stay within 2x of detached mode's.

    python benchmarks/qwen3_5_memory.py [--positions 8192] [--chunk 1024] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def run_one(mode: str, positions: int, chunk: int, group: int, completion: int) -> dict:
    """One training step in this process; returns its memory and time."""
    import torch
    from datasets import Dataset

    from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer
    from trl_longstraw.testing import build_tokenizer, random_micro_batch, save_tiny_model

    torch.set_num_threads(1)
    path = save_tiny_model(tempfile.mkdtemp(), "qwen3_5")
    args = LongStrawGRPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=group,
        num_generations=group,
        report_to=[],
        use_cpu=True,
        prompt_gradient=mode,
        prefill_chunk_size=chunk,
        prefill_progress=False,
        loss_type="dapo",
        beta=0.0,
    )
    trainer = LongStrawGRPOTrainer(
        str(path),
        lambda completions, **kw: [0.0] * len(completions),
        args,
        train_dataset=Dataset.from_dict({"p": [1]}),
    )
    trainer._prepare_inputs = lambda x: x
    trainer.current_gradient_accumulation_steps = 1
    mb = random_micro_batch([positions], [completion] * group, [0] * group, len(build_tokenizer()), seed=0)
    before = rss_bytes()
    t0 = time.perf_counter()
    trainer.training_step(trainer.model, dict(mb), mb["num_items_in_batch"])
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"mode": mode, "peak": peak, "before": before, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--positions", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--completion", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", choices=["exact", "detached"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_one(args.child, args.positions, args.chunk, args.group, args.completion)))
        return
    results = {}
    for mode in ("detached", "exact"):
        cmd = [sys.executable, __file__, "--child", mode]
        cmd += ["--positions", str(args.positions), "--chunk", str(args.chunk)]
        cmd += ["--group", str(args.group), "--completion", str(args.completion)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results[mode] = json.loads(out.strip().splitlines()[-1])
    mib = 2**20
    rows = [
        f"| {m} | {r['peak'] / mib:.0f} | {r['before'] / mib:.0f} | {(r['peak'] - r['before']) / mib:.0f} | "
        f"{r['seconds']:.1f} |"
        for m, r in results.items()
    ]
    exact, detached = results["exact"], results["detached"]
    ratio = exact["peak"] / detached["peak"]
    growth_ratio = (exact["peak"] - exact["before"]) / max(detached["peak"] - detached["before"], 1)
    text = "\n".join(
        [
            "# Qwen3.5 hybrid: peak memory of exact against detached mode",
            "",
            f"Measured {datetime.date.today()} on {platform.machine()}, CPU, one thread, fp32, with:",
            "",
            "```",
            "python " + " ".join(sys.argv),
            "```",
            "",
            f"Tiny qwen3_5 (`trl_longstraw.testing.QWEN3_5_TINY`), one prompt of {args.positions} tokens in chunks of "
            f"{args.chunk}, G={args.group} completions of {args.completion}, loss_type=dapo, beta=0. Each mode in a "
            "fresh process.",
            "",
            "| mode | peak RSS (MiB) | RSS before the step (MiB) | growth during the step (MiB) | step (s) |",
            "|---|---|---|---|---|",
            *rows,
            "",
            f"Exact / detached: peak RSS {ratio:.2f}x, growth during the step {growth_ratio:.2f}x "
            f"(bar: peak within 2x: {'met' if ratio <= 2 else 'NOT met'}).",
            "",
        ]
    )
    if args.out:
        args.out.write_text(text)
    print(text)
    sys.exit(0 if ratio <= 2 else 3)


if __name__ == "__main__":
    main()
