"""Side-by-side benchmark of one whole GRPO step, generation + loss: stock `trl.GRPOTrainer` against
`LongStrawGRPOTrainer` (exact and detached), one prompt of P tokens, G completions of exactly C tokens.

Implementations: `stock` (stock's default, the G rows in one micro-batch, `per_device_train_batch_size=G`),
`stock_best` (stock's best memory setting: `per_device_train_batch_size=1` with gradient accumulation over the group,
`gradient_accumulation_steps=G`, so G `training_step` calls of one row each, the first of which generates the whole
group as TRL does), `exact` and `detached` (ours, one micro-batch of G rows). All with gradient checkpointing.

Each configuration runs in a fresh subprocess (`--worker`), which first runs a warm-up step on a 64-token prompt
(one-time allocations), then calls `trainer.training_step` on the generation batch (the prompt G times, as TRL's
dataloader hands it over), so the step generates (sampling, `min_new_tokens=C`: no completion stops early), computes
rewards and advantages, and runs the loss and its backward. Per phase it measures:

- peak resident set size: the kernel's high-water mark `VmHWM`, reset at the start of each phase by writing "5" to
  `/proc/self/clear_refs` (else a 1 ms `VmRSS` sampler, as `bench_step.py`), reported as the growth over the resident
  set just before the step and as the absolute peak of the process;
- CPU time (`time.process_time`, one torch thread) and wall time of the phase, and the load average before and after
  the step: on a shared machine wall time follows the load, CPU time much less, so ratios are taken of CPU time.

Phases: `generation` is `_generate_and_score_completions` (generation, rewards, any no-grad scoring that stock runs
there); `loss` is the rest of the step (the loss, its backward, and for LongStraw the scoring pass; for `stock_best`
all G calls). A worker whose growth passes `--mem-limit-gib` is stopped and reported as "OOM" (with the growth it
had reached); one that runs past `--timeout`, "timeout".

The driver prints a table with the stock/ours ratios, checks that ours' generation peak stays within 10% of ours' loss
peak (growth over the step's starting RSS), and writes `WHOLE_STEP.md` and `whole_step.json` to `--out`.
`--merge FILE.json` adds the records of an earlier run (another invocation's `whole_step.json`) for configurations
this run does not measure; the report names each record's run (command, date, load). With `--impls ""` nothing is
measured: the report of the merged runs alone.

    python benchmarks/bench_whole_step.py                       # tiny qwen3_5, P = 32K, G = 8, C = 128
    python benchmarks/bench_whole_step.py --family llama --P 8K,32K
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shlex
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from bench_step import (  # noqa: E402
    GIB,
    MMAP_THRESHOLD,
    PeakRSS,
    _emit,
    _rss,
    _status_kib,
    hardware,
    parse_sizes,
    run_child,
    versions,
)

IMPLS = ("stock", "stock_best", "exact", "detached")
# Ours' generation peak must stay within this fraction above ours' loss-step peak (issue 13).
GENERATION_MARGIN = 0.10


# --------------------------------------------------------------------------------------------------------- worker
def prompt_text(p: int, seed: int) -> str:
    """`p` words of the tiny models' word-level vocabulary: `p` tokens."""
    import random

    from trl_longstraw.testing import WORDS

    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(p))


def build_trainer(impl: str, model_path: str, g: int, c: int, chunk: int, dtype: str):
    """A trainer of `impl` whose first `training_step` of a step generates from the batch it is given: one call per
    step (`per_device_train_batch_size=G`), or G calls of one row each for `stock_best`
    (`per_device_train_batch_size=1`, `gradient_accumulation_steps=G`, so `steps_per_generation=G`)."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer

    common = dict(
        output_dir=tempfile.mkdtemp(prefix="bench_whole_"),
        per_device_train_batch_size=1 if impl == "stock_best" else g,
        gradient_accumulation_steps=g if impl == "stock_best" else 1,
        num_generations=g,
        max_completion_length=c,
        generation_kwargs={"min_new_tokens": c},
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        logging_steps=1,
        bf16=dtype == "bfloat16",
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        model_init_kwargs={"dtype": dtype},
    )
    dataset = Dataset.from_dict({"prompt": ["a b c"] * g})

    def reward(completions, **kwargs):
        # Distinct rewards within the group: nonzero advantages, so every completion is back-propagated.
        return [float(i) for i in range(len(completions))]

    if impl.startswith("stock"):
        trainer = GRPOTrainer(model_path, reward, GRPOConfig(**common), train_dataset=dataset)
    else:
        config = LongStrawGRPOConfig(**common, prompt_gradient=impl, prefill_chunk_size=chunk, prefill_progress=False)
        trainer = LongStrawGRPOTrainer(model_path, reward, config, train_dataset=dataset)
    trainer.current_gradient_accumulation_steps = g if impl == "stock_best" else 1
    trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return trainer


def worker(args) -> None:
    """Measures one configuration and prints one `RESULT {json}` line."""
    import gc

    import torch

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    record = dict(family=args.family, impl=args.impl, P=args.P, G=args.G, C=args.C, chunk=args.chunk)
    limit = int(args.mem_limit_gib * GIB)
    trainer = build_trainer(args.impl, args.model_path, args.G, args.C, args.chunk, args.dtype)
    model = trainer.model
    model.train()
    # training_step calls per step: G for stock_best (gradient accumulation over the group), else 1.
    calls = args.G if args.impl == "stock_best" else 1
    for _ in range(calls):
        trainer.training_step(model, [{"prompt": prompt_text(64, 1)}] * args.G, None)
    model.zero_grad(set_to_none=False)
    for engine in getattr(trainer, "_engines", {}).values():
        engine.release()
    batch = [{"prompt": prompt_text(args.P, 0)}] * args.G
    gc.collect()
    baseline = _rss()
    load_before = os.getloadavg()[0]
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_status_kib("VmSize") * 1024 + limit + GIB, hard))

    def over_limit(growth):
        _emit({**record, "status": "OOM", "growth_bytes": growth, "note": f"growth passed {args.mem_limit_gib} GiB"})
        os._exit(3)

    phases: dict[str, dict] = {}
    generate = trainer._generate_and_score_completions

    def measured_generation(inputs):
        with PeakRSS(baseline, limit, over_limit) as peak:
            t0, c0 = time.perf_counter(), time.process_time()
            out = generate(inputs)
            seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
        phases["generation"] = dict(time_s=seconds, cpu_s=cpu_seconds, peak_bytes=peak.peak(), method=peak.method)
        # The loss phase starts now: a fresh high-water mark.
        phases["loss_meter"] = PeakRSS(baseline, limit, over_limit).__enter__()
        phases["loss_start"] = time.perf_counter(), time.process_time()
        return out

    trainer._generate_and_score_completions = measured_generation
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(calls):
            trainer.training_step(model, batch, None)
        total, cpu_total = time.perf_counter() - t0, time.process_time() - c0
    except (RuntimeError, MemoryError) as e:
        if "memory" not in str(e).lower() and not isinstance(e, MemoryError):
            raise
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        _emit({**record, "status": "OOM", "note": str(e).splitlines()[0][:200]})
        return
    meter = phases.pop("loss_meter")
    meter.__exit__(None, None, None)
    wall0, cpu0 = phases.pop("loss_start")
    phases["loss"] = {
        "time_s": time.perf_counter() - wall0,
        "cpu_s": time.process_time() - cpu0,
        "peak_bytes": meter.peak(),
    }
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    record.update(status="ok", time_s=total, cpu_s=cpu_total, load_before=load_before, load_after=os.getloadavg()[0])
    record.update(rss_before=baseline, memory_method=phases["generation"].pop("method"))
    for name, phase in phases.items():
        record[f"{name}_time_s"] = phase["time_s"]
        record[f"{name}_cpu_s"] = phase["cpu_s"]
        record[f"{name}_peak_bytes"] = phase["peak_bytes"]
        record[f"{name}_growth_bytes"] = phase["peak_bytes"] - baseline
    record["peak_bytes"] = max(record["generation_peak_bytes"], record["loss_peak_bytes"])
    metrics = trainer._metrics["train"]
    for key in ("prompt_positions", "prompt_positions_reused", "state_gib"):
        if metrics.get(f"longstraw/{key}"):
            record[key] = metrics[f"longstraw/{key}"][-1]
    _emit(record)


# --------------------------------------------------------------------------------------------------------- driver
def run_config(args, model_path: str, impl: str, p: int) -> dict:
    """Runs one configuration in a fresh process; returns its record (status ok / OOM / timeout / error)."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        f"--family={args.family}",
        f"--impl={impl}",
        f"--P={p}",
        f"--G={args.G}",
        f"--C={args.C}",
        f"--chunk={args.chunk}",
        f"--dtype={args.dtype}",
        f"--threads={args.threads}",
        f"--model-path={model_path}",
        f"--mem-limit-gib={args.mem_limit_gib}",
    ]
    env = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "TOKENIZERS_PARALLELISM": "false",
    }
    record = dict(family=args.family, impl=impl, P=p, G=args.G, C=args.C, chunk=args.chunk)
    return run_child(cmd, record, args.timeout, env, fmt_record)


def size(n) -> str:
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB / 4 else f"{n / 2**20:.1f} MiB"


def fmt_record(r: dict) -> str:
    head = f"{r['family']:<12} {r['impl']:<10} P={r['P']:<7} G={r['G']:<2} C={r['C']:<4}"
    if r["status"] != "ok":
        growth = f" (growth {size(r['growth_bytes'])})" if r.get("growth_bytes") else ""
        return f"{head} {r['status']} {r.get('note', '')}{growth}"
    return (
        f"{head} generation {size(r['generation_growth_bytes']):>10} cpu {r['generation_cpu_s']:7.1f} s  "
        f"loss {size(r['loss_growth_bytes']):>10} cpu {r['loss_cpu_s']:7.1f} s  peak RSS {size(r['peak_bytes'])}"
    )


def cell(r: dict | None, phase: str) -> str:
    if r is None:
        return ""
    if r["status"] != "ok":
        return r["status"] + (f" ({r['note']})" if r.get("note") else "")
    return f"{size(r[f'{phase}_growth_bytes'])} / {r[f'{phase}_cpu_s']:.1f} s ({r[f'{phase}_time_s']:.0f} s)"


def growth(r: dict) -> int:
    """The step's peak growth: the larger of its phases'."""
    return max(r["generation_growth_bytes"], r["loss_growth_bytes"])


def ok(r: dict | None) -> bool:
    return r is not None and r["status"] == "ok"


def report(args, records: list[dict], runs: list[dict]) -> list[str]:
    def get(impl, p):
        return next((r for r in records if r["impl"] == impl and r["P"] == p), None)

    lines = [
        "# Whole GRPO step (generation + loss): stock against LongStraw",
        "",
        f"Machine: {hardware()}; {versions()}. One torch thread per process. The machine is shared with other",
        "sessions: wall times follow its load, so ratios are of CPU time (`time.process_time` of the worker).",
        "",
        "Runs (each record names its run in the table's last column):",
        "",
    ]
    for i, run in enumerate(runs, 1):
        lines.append(f"{i}. `{run['command']}` ({run['date']}{', ' + run['note'] if run.get('note') else ''})")
    lines += [
        "",
        f"Tiny random `{args.family}` (trl_longstraw.testing), {args.dtype}, gradient checkpointing, G = {args.G},",
        f"C = {args.C} (sampling with `min_new_tokens = C`), prefill chunk {args.chunk}. `stock`: stock's default, G",
        "rows in one micro-batch; `stock_best`: `per_device_train_batch_size=1`, gradient accumulation over G rows.",
        "Each cell: peak RSS growth over the process's RSS before the step / CPU time (wall time) of the phase; each",
        "configuration in a fresh process after a 64-token warm-up step (benchmarks/bench_whole_step.py explains the",
        "method). Load: the 1-minute load average of the 2-core machine before / after the step.",
        "",
        "| P | impl | generation | loss | whole step CPU (wall) | peak RSS (process) | prompt positions prefilled / "
        "reused by the loss pass | load | run |",
        "|---:|---|---|---|---:|---:|---|---|---:|",
    ]
    for p in args.P:
        for impl in IMPLS:
            r = get(impl, p)
            if r is None:
                continue
            whole = f"{r['cpu_s']:.1f} s ({r['time_s']:.0f} s)" if ok(r) else ""
            peak = size(r["peak_bytes"]) if ok(r) else ""
            reused = (
                f"{r.get('prompt_positions', 0):.0f} / {r.get('prompt_positions_reused', 0):.0f}"
                if ok(r) and not impl.startswith("stock")
                else ""
            )
            load = f"{r['load_before']:.1f} / {r['load_after']:.1f}" if "load_before" in r else ""
            lines.append(
                f"| {p:,} | {impl} | {cell(r, 'generation')} | {cell(r, 'loss')} | {whole} | {peak} | {reused} | "
                f"{load} | {r.get('run', '')} |"
            )
    lines += ["", "Ratios, stock / ours (the step's peak growth; the step's CPU time):", ""]
    lines += ["| P | ours | against | peak growth | CPU time |", "|---:|---|---|---:|---:|"]
    for p in args.P:
        for impl in ("exact", "detached"):
            ours = get(impl, p)
            if not ok(ours):
                continue
            for against in ("stock", "stock_best"):
                theirs = get(against, p)
                if theirs is None:
                    continue
                if ok(theirs):
                    cells = f"{growth(theirs) / growth(ours):.1f}x | {theirs['cpu_s'] / ours['cpu_s']:.1f}x"
                else:
                    cells = f"{against} {theirs['status']} | "
                lines.append(f"| {p:,} | {impl} | {against} | {cells} |")
    lines += [
        "",
        f"Target: ours' generation peak within {GENERATION_MARGIN:.0%} of ours' loss-step peak (growth):",
        "",
    ]
    for p in args.P:
        for impl in ("exact", "detached"):
            r = get(impl, p)
            if not ok(r):
                continue
            gen, loss = r["generation_growth_bytes"], r["loss_growth_bytes"]
            verdict = "met" if gen <= (1 + GENERATION_MARGIN) * loss else "NOT met"
            lines.append(
                f"- P = {p:,}, {impl}: generation {size(gen)}, loss {size(loss)}, ratio {gen / loss:.2f}: {verdict}"
            )
    return lines


def merge(records: list[dict], runs: list[dict], earlier: dict) -> None:
    """Adds to `records` the records of `earlier` (a `whole_step.json`) for configurations not in `records`, and
    their runs to `runs`, renumbering each record's `run`."""
    theirs = earlier.get("runs") or [{"command": earlier["command"], "date": earlier["date"]}]
    numbers = {}
    for r in earlier["records"]:
        if any(m["impl"] == r["impl"] and m["P"] == r["P"] for m in records):
            continue
        run = r.get("run", 1)
        if run not in numbers:
            runs.append(theirs[run - 1])
            numbers[run] = len(runs)
        records.append({**r, "run": numbers[run]})


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument("--impl", default="exact", help=argparse.SUPPRESS)
    parser.add_argument("--family", default="qwen3_5")
    parser.add_argument("--P", default="32K", help="prompt lengths, comma-separated (K = 1024)")
    parser.add_argument("--G", type=int, default=8)
    parser.add_argument("--C", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=1024, help="prefill_chunk_size")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--mem-limit-gib", type=float, default=6.0, help="stop a worker whose growth passes this")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per configuration")
    parser.add_argument("--out", default=str(HERE), help="folder for WHOLE_STEP.md and whole_step.json")
    parser.add_argument(
        "--merge", action="append", default=[], help="an earlier run's whole_step.json: its records join the report"
    )
    args = parser.parse_args(argv)
    if args.worker:
        args.P = int(args.P)
        return worker(args)

    from trl_longstraw.testing import save_tiny_model

    args.P = parse_sizes(args.P)
    # `--impls ""` measures nothing: the report of the `--merge`d runs alone.
    args.impls = [impl for impl in args.impls.split(",") if impl]
    command = " ".join(["python benchmarks/bench_whole_step.py", *(shlex.quote(a) for a in (argv or sys.argv[1:]))])
    date = f"{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}"
    runs, records = [], []
    if args.impls:
        runs.append({"command": command, "date": date})
        tmp = Path(tempfile.mkdtemp(prefix="bench_whole_models_"))
        model_path = str(save_tiny_model(tmp / args.family, args.family))
        records = [{**run_config(args, model_path, impl, p), "run": 1} for p in args.P for impl in args.impls]
    for path in args.merge:
        merge(records, runs, json.loads(Path(path).read_text()))
    args.P = sorted({r["P"] for r in records})
    lines = report(args, records, runs)
    print("\n".join(lines))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "WHOLE_STEP.md").write_text("\n".join(lines) + "\n")
    (out / "whole_step.json").write_text(json.dumps({"runs": runs, "records": records}, indent=1) + "\n")


if __name__ == "__main__":
    main()
