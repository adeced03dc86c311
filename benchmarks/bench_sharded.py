"""The sharded prompt state on 2 CPU processes (gloo), side by side with 1 process and with plain DDP.

One exact-mode GRPO training step on the same global micro-batch: one prompt of P tokens and G completions of
ragged lengths (at most C tokens). Three setups, each in fresh processes launched with `torchrun`:

- `1 process`: the whole micro-batch on one process;
- `DDP x2`: 2 processes, G/2 completions each, every process prefills and keeps the whole prompt state;
- `sharded x2`: the same with `shard_prompt_state=True`: each process keeps half of the prompt's chunks and, with
  context-parallel passes (llama, qwen3_5; see `trl_longstraw/context_parallel.py`), runs half of each prefill and
  reverse pass's tokens.

Per process (the larger of the two ranks): the step's wall time and CPU time (`time.process_time`, which machine
contention does not inflate as it does wall time), the prefill and reverse-pass time, the tokens each decoder layer's
MLP ran in the step (forward calls, gradient-checkpointing recomputes included), the prompt state held
(`longstraw/state_gib`), and the growth of the resident set during the step (peak RSS of the step minus RSS before
it, as `bench_step.py` measures it).

Waits, from CPU time (`critical_path`): every collective of `torch.distributed` is timed on each rank, which cuts the
step into the same sequence of segments on every rank (compute up to a collective, the collective itself). The
*critical path* is the sum over segments of the largest rank's CPU time: the step's wall time on a machine where
each rank has a core of its own and a collective costs its CPU time, whatever the load. A rank's *wait* is the
critical path minus its own CPU time (the time it would spend blocked in collectives for the other rank). DDP's
gradient reduction runs in its C++ reducer, outside these marks: the last segment of the backward includes it.
The table also gives the number of collectives in the step and the wall seconds spent inside them (the larger rank's):
where wall time exceeds the critical path, that column shows how much of the gap is the collectives' own latency
(gloo between two processes of a small VM takes about a millisecond per call, and more while the other rank computes,
where NCCL takes microseconds).

Each process runs one torch thread, so the 2-process setups use the 2 cores of the machine. The driver prints a table
with the ratios to `1 process` and writes `benchmarks/SHARDED.md`.

Repeats (`--repeat N`): single runs vary by about 15% on a 2-core machine, so the driver can run every setup N times,
interleaved (all setups once, then all again: A B A B ..., fresh processes each time). Each cell then shows the median
of the N runs, and the step, CPU and critical-path columns also their spread (`median (min-max)`); the ratios to
`1 process` are ratios of medians. The memory columns (state, growth) are medians, without spread. The JSON file keeps
every run (`run` numbers them).

Priority: Linux's autogroup scheduling (`/proc/sys/kernel/sched_autogroup_enabled`) shares the CPU between sessions,
and `nice` only orders the processes inside one. `torchrun` starts each worker in a session of its own, so every
worker, in every setup, competes as one session; each sets its session's nice to its own (`_session_priority`), so
that running the driver under `nice -n -10` gives every worker of every setup the same, raised priority on a loaded
machine (otherwise each would run at the default session nice of 0 whatever the driver's nice).

    python benchmarks/bench_sharded.py                       # llama and qwen3_5, P in {8K, 32K}
    python benchmarks/bench_sharded.py --family llama --P 4096 --setup "1 process" --setup "sharded x2"
    python benchmarks/bench_sharded.py --family qwen3_5 --P 32768 --setup "1 process" --setup "sharded x2" --repeat 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

SETUPS = {"1 process": (1, False), "DDP x2": (2, False), "sharded x2": (2, True)}
GIB = 2**30


# --------------------------------------------------------------------------------------------------------- worker
def _session_priority() -> int:
    """Sets the autogroup nice of this process's session to the process's nice, when it leads its session (as
    `torchrun` workers do) and the kernel groups by session; returns the nice value in effect."""
    nice = os.nice(0)
    path = Path("/proc/self/autogroup")
    if os.getsid(0) == os.getpid() and path.exists():
        try:
            path.write_text(str(nice))
        except OSError:  # not permitted (a negative nice needs CAP_SYS_NICE): the session keeps its nice
            pass
    return nice


def worker(args) -> None:
    """One rank of one setup: a warm-up step on a short prompt, then the measured step; rank 0 prints the record."""
    import gc

    import torch
    import torch.distributed as dist
    from bench_step import PeakRSS, _rss, completion_lengths
    from datasets import Dataset

    from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer
    from trl_longstraw.testing import random_micro_batch

    nice = _session_priority()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = LongStrawGRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench_sharded_"),
        per_device_train_batch_size=args.G // world,
        num_generations=args.G,
        max_completion_length=args.C,
        report_to=[],
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        prefill_chunk_size=args.chunk,
        prefill_progress=False,
        shard_prompt_state=args.sharded,
        beta=0.0,
    )
    dataset = Dataset.from_dict({"prompt": ["a b c"] * args.G})
    trainer = LongStrawGRPOTrainer(
        args.model_path, lambda completions, **kw: [0.0] * len(completions), config, train_dataset=dataset
    )
    assert trainer.accelerator.num_processes == world, (trainer.accelerator.num_processes, world)
    assert (trainer._prompt_shards is not None) == args.sharded
    trainer._prepare_inputs = lambda x: x
    trainer.current_gradient_accumulation_steps = 1
    model = trainer.accelerator.prepare_model(trainer.model) if world > 1 else trainer.model
    rank = dist.get_rank() if dist.is_initialized() else 0
    vocab = trainer.model.config.get_text_config().vocab_size

    def local(p: int) -> dict:
        """This rank's rows of the global micro-batch (completions split evenly over the ranks)."""
        lengths = completion_lengths(args.G, args.C, "ragged")
        mb = random_micro_batch([p], lengths, [0] * args.G, vocab, seed=p)
        rows = list(range(rank, args.G, world))
        out = {k: v[rows] for k, v in mb.items() if isinstance(v, torch.Tensor) and v.ndim > 0}
        out["num_items_in_batch"] = mb["num_items_in_batch"]
        return out

    mlp_tokens = [0]
    layers = trainer.model.get_decoder().layers

    def count(module, inputs):
        mlp_tokens[0] += inputs[0].shape[0] * inputs[0].shape[1]

    hooks = [layer.mlp.register_forward_pre_hook(count) for layer in layers]
    marks, walls = _time_collectives(dist)
    warm = local(min(args.P, 2 * args.chunk + 1))
    trainer.training_step(model, warm, warm["num_items_in_batch"])
    trainer.model.zero_grad(set_to_none=False)
    batch = local(args.P)
    gc.collect()
    if world > 1:
        dist.barrier()
    baseline = _rss()
    mlp_tokens[0] = 0
    with PeakRSS(baseline, 1 << 62, lambda growth: None) as peak:
        marks.clear()
        walls.clear()
        t0, c0 = time.perf_counter(), time.process_time()
        trainer.training_step(model, batch, batch["num_items_in_batch"])
        seconds, c1 = time.perf_counter() - t0, time.process_time()
        cpu_seconds = c1 - c0
    critical, waits = critical_path([c0, *marks, c1], world, dist)
    for hook in hooks:
        hook.remove()
    metrics = trainer._metrics["train"]
    record = {
        "time_s": seconds,
        "cpu_s": cpu_seconds,
        "mlp_tokens": mlp_tokens[0] / len(layers),
        "growth_bytes": peak.peak() - baseline,
        "state_bytes": metrics["longstraw/state_gib"][-1] * GIB,
        "prefill_s": metrics["longstraw/prefill_s"][-1],
        "reverse_s": metrics["longstraw/reverse_s"][-1],
        "nice": nice,
        "critical_s": critical,
        "wait_s": max(waits),
        "collectives": len(walls),
        "collective_wall_s": sum(walls),
    }
    records = [record]
    if world > 1:
        records = [None] * world
        dist.all_gather_object(records, record)
    if rank == 0:
        print("RESULT " + json.dumps({key: max(r[key] for r in records) for key in record}), flush=True)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def _time_collectives(dist) -> tuple[list[float], list[float]]:
    """Wraps every collective of `dist` used by the step so that it appends `time.process_time()` before and after
    it to the first returned list (in the order the collectives run; the same order on every rank), and the wall
    seconds it took to the second."""
    marks: list[float] = []
    walls: list[float] = []
    names = ["all_reduce", "all_gather_single", "all_to_all_single", "broadcast", "all_gather_object", "barrier"]
    for name in names + ["all_gather", "reduce_scatter_tensor"]:
        collective = getattr(dist, name)

        def timed(*args, _collective=collective, **kwargs):
            marks.append(time.process_time())
            start = time.perf_counter()
            try:
                return _collective(*args, **kwargs)
            finally:
                walls.append(time.perf_counter() - start)
                marks.append(time.process_time())

        setattr(dist, name, timed)
    return marks, walls


def critical_path(marks: list[float], world: int, dist) -> tuple[float, list[float]]:
    """`(critical path, waits per rank)` in CPU seconds from this rank's `marks` (the step's start, each collective's
    entry and exit, the step's end; see the module docstring). Collective (one all-gather of Python objects, run with
    the original function): every rank calls it after the step."""
    segments = [b - a for a, b in zip(marks[:-1], marks[1:], strict=True)]
    if world == 1:
        return sum(segments), [0.0]
    everyone: list = [None] * world
    dist.all_gather_object(everyone, segments)
    if len({len(e) for e in everyone}) != 1:
        raise RuntimeError(f"the ranks ran different numbers of collectives: {[len(e) for e in everyone]}")
    critical = sum(max(column) for column in zip(*everyone, strict=True))
    return critical, [critical - sum(e) for e in everyone]


# --------------------------------------------------------------------------------------------------------- driver
def run(args, model_path: str, family: str, setup: str, p: int) -> dict:
    processes, sharded = SETUPS[setup]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    command += [__file__, "--worker", "--model-path", model_path, "--P", str(p), "--G", str(args.G)]
    command += ["--C", str(args.C), "--chunk", str(args.chunk)] + (["--sharded"] if sharded else [])
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env["MALLOC_MMAP_THRESHOLD_"] = str(1 << 16)  # freed tensors leave the resident set, as in bench_step.py
    load_before = os.getloadavg()[0]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode or not lines:
        raise RuntimeError(f"{family} {setup} P={p} failed:\n{(result.stdout + result.stderr)[-3000:]}")
    record = {"family": family, "setup": setup, "P": p, **json.loads(lines[-1][len("RESULT ") :])}
    record["load"] = [load_before, os.getloadavg()[0]]
    print(
        f"{family:8} {setup:11} P={p:>6}: {record['time_s']:7.2f} s ({record['cpu_s']:7.2f} s CPU), "
        f"state {record['state_bytes'] / 2**20:8.1f} MiB, step growth {record['growth_bytes'] / 2**20:8.1f} MiB, "
        f"nice {record['nice']}, load {record['load'][0]:.1f} -> {record['load'][1]:.1f}",
        flush=True,
    )
    return record


COLUMNS = ["time_s", "cpu_s", "prefill_s", "reverse_s", "mlp_tokens", "state_bytes", "growth_bytes"]
COLUMNS += ["critical_s", "wait_s", "collectives", "collective_wall_s"]
SPREAD = ("time_s", "cpu_s", "critical_s")  # the columns shown with their spread when there are repeats


def summarize(runs: list[dict]) -> dict:
    """The median of each figure over the repeated runs of one cell, its `(min, max)` under `spread` (the table shows
    those of `SPREAD`), and the number of runs."""
    summary = {key: statistics.median(r[key] for r in runs) for key in COLUMNS}
    summary["spread"] = {key: (min(r[key] for r in runs), max(r[key] for r in runs)) for key in COLUMNS}
    summary["runs"] = len(runs)
    return summary


def table(records: list[dict], family: str, setups: list[str]) -> list[str]:
    """The markdown table of one family: one row per (P, setup), medians over the runs of each cell (see the module
    docstring), ratios to the `1 process` row's medians."""

    def get(setup, p):
        runs = [r for r in records if r["family"] == family and r["setup"] == setup and r["P"] == p]
        return summarize(runs)

    def fig(r, key):
        low, high = r["spread"][key]
        return f"{r[key]:.2f}" + (f" ({low:.2f}-{high:.2f})" if r["runs"] > 1 and key in SPREAD else "")

    lines = [
        f"### {family}",
        "",
        "| P | setup | step s | step CPU s | prefill s | reverse s | MLP tokens per layer | prompt state MiB "
        "| step RSS growth MiB | state vs 1 process | growth vs 1 process | time vs 1 process | CPU vs 1 process "
        "| critical path CPU s | wait CPU s | critical path vs 1 process CPU | collectives | wall s in collectives |",
        "|" + " --- |" * 18,
    ]
    for p in sorted({r["P"] for r in records if r["family"] == family}):
        one = get("1 process", p)
        for setup in setups:
            r = get(setup, p)
            lines.append(
                f"| {p:,} | {setup} | {fig(r, 'time_s')} | {fig(r, 'cpu_s')} | {r['prefill_s']:.2f} "
                f"| {r['reverse_s']:.2f} | {r['mlp_tokens']:,.0f} | {r['state_bytes'] / 2**20:.1f} "
                f"| {r['growth_bytes'] / 2**20:.1f} | {r['state_bytes'] / one['state_bytes']:.2f}x "
                f"| {r['growth_bytes'] / one['growth_bytes']:.2f}x | {r['time_s'] / one['time_s']:.2f}x "
                f"| {r['cpu_s'] / one['cpu_s']:.2f}x | {fig(r, 'critical_s')} | {r['wait_s']:.2f} "
                f"| {r['critical_s'] / one['cpu_s']:.2f}x | {r['collectives']:,.0f} | {r['collective_wall_s']:.2f} |"
            )
    return lines + [""]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument("--sharded", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--family", action="append", help="tiny model family (repeatable); default llama, qwen3_5")
    parser.add_argument("--P", type=int, action="append", help="prompt tokens (repeatable); default 8192, 32768")
    parser.add_argument("--G", type=int, default=4, help="completions of the prompt (even)")
    parser.add_argument("--C", type=int, default=16, help="longest completion")
    parser.add_argument("--chunk", type=int, default=1024, help="prefill_chunk_size")
    parser.add_argument("--setup", action="append", choices=list(SETUPS), help="setups (repeatable); default all")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per launch")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each setup, interleaved; medians reported")
    parser.add_argument("--out", default=str(HERE / "SHARDED.md"), help="results file")
    args = parser.parse_args(argv)
    if args.worker:
        args.P = args.P[0]
        worker(args)
        return

    from trl_longstraw.testing import save_tiny_model

    families = args.family or ["llama", "qwen3_5"]
    setups = [setup for setup in SETUPS if setup in (args.setup or SETUPS)]
    if "1 process" not in setups:
        parser.error("the ratios need the '1 process' setup")
    sizes = args.P or [8192, 32768]
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            path = str(save_tiny_model(Path(tmp) / family, family))
            for p in sizes:
                for repeat in range(args.repeat):  # interleaved: every setup once per repeat
                    for setup in setups:
                        records.append({**run(args, path, family, setup, p), "run": repeat})
    command = "python benchmarks/bench_sharded.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    lines = [
        "# Sharded prompt state on 2 CPU processes",
        "",
        f"Generated by `{command.strip()}` on {datetime.date.today().isoformat()}, {os.cpu_count()} CPU cores, "
        f"gloo, one torch thread per process, load average {os.getloadavg()[0]:.1f} at the end (wall times under "
        "contention are noisy; CPU times much less so). One exact-mode step, one prompt of P tokens, "
        f"G={args.G} completions (at most {args.C} tokens, ragged), prefill chunks of {args.chunk}, tiny random "
        "models (`trl_longstraw.testing`). Per process: the larger of the two ranks. See the script's docstring."
        + (
            f" {args.repeat} runs of each setup, interleaved: medians, and (min-max) for the step, CPU and critical "
            "path; ratios of medians."
            if args.repeat > 1
            else ""
        ),
        "",
    ]
    for family in families:
        lines += table(records, family, setups)
    Path(args.out).write_text("\n".join(lines))
    (Path(args.out).with_suffix(".json")).write_text(json.dumps(records, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
