"""CPU threads: the tiny recipe run with torch's default intra-op threads (one per core) against one thread.

    OMP_NUM_THREADS= python benchmarks/cpu_threads.py [--steps 4] [--repeats 2] [--out benchmarks/CPU_THREADS.md]

Each case is a fresh `python -m trl_longstraw.cli grpo --config recipes/configs/tiny_cpu.yaml` process (so the
thread count is set before torch starts), with `OMP_NUM_THREADS` set to the number of cores (torch's default) or 1;
the cases alternate, `--repeats` times, and the table gives each run's `train_runtime` (training only, not start-up)
and the ratio of the medians, measured side by side in one run (timings on a shared machine are noisy).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(threads: int, steps: int, output_dir: Path) -> float:
    """`train_runtime` in seconds of one tiny recipe run with `threads` intra-op threads."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "trl_longstraw.cli", "grpo", "--config", "recipes/configs/tiny_cpu.yaml"]
    command += ["--max_steps", str(steps), "--num_prompts", "8", "--output_dir", str(output_dir)]
    command += ["--prefill_progress", "false", "--disable_tqdm", "true"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return float(re.search(r"'train_runtime': '([0-9.]+)'", result.stdout).group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=None, help="write the results (Markdown) here")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    times: dict[int, list[float]] = {cores: [], 1: []}
    for repeat in range(args.repeats):
        for threads in (cores, 1):
            seconds = run(threads, args.steps, ROOT / "outputs" / f"cpu-threads-{threads}")
            times[threads].append(seconds)
            print(f"repeat {repeat}: {threads} thread(s): {seconds:.1f} s", flush=True)
    default, one = statistics.median(times[cores]), statistics.median(times[1])
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    command = f"python benchmarks/cpu_threads.py --steps {args.steps} --repeats {args.repeats}"
    lines = [
        "# CPU threads: the tiny recipe with one intra-op thread per core (torch's default) against one",
        "",
        f"`{command}` on {datetime.date.today()}: {cores} cores, load average {load} at the end (a shared machine).",
        f"Each run: {args.steps} steps of `recipes/configs/tiny_cpu.yaml` (384-token prompts, 8 completions), "
        "`train_runtime` in seconds.",
        "",
        "| OMP_NUM_THREADS | runs (s) | median (s) |",
        "|---|---|---|",
        f"| {cores} (default) | {', '.join(f'{t:.1f}' for t in times[cores])} | {default:.1f} |",
        f"| 1 | {', '.join(f'{t:.1f}' for t in times[1])} | {one:.1f} |",
        "",
        f"One thread is {default / max(one, 1e-9):.1f}x faster on this machine.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
