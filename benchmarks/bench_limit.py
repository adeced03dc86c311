"""One GRPO step against the limit and against stock's best memory setting, side by side in one run.

Per completion kind (`ragged`: lengths spread from C down towards C/2, as completions that stop at EOS; `full`: every
completion has C tokens) it measures, each configuration in a fresh process after a warm-up on a 64-token prompt:

- `limit`: one no-grad forward of the prompt alone (`model(prompt_ids[1, P], logits_to_keep=1)` under
  `torch.no_grad()`): what a step cannot beat, since it has to read the prompt through the model at least once;
- `exact`, `detached`: `LongStrawGRPOTrainer.training_step` on one micro-batch of one prompt and G completions;
- `stock_best`: stock `GRPOTrainer` at its best memory setting, `per_device_train_batch_size=1` with gradient
  accumulation over the group (G `training_step` calls of one row each, every row carrying its own completion
  length, so no padding) and gradient checkpointing;
- `stock`: stock `GRPOTrainer` at its default, all G rows in one micro-batch (ragged rows are padded and need an
  attention mask).

Memory is the process's peak resident set size during the step (`VmHWM` reset by `clear_refs` right before it, or a
1 ms sampler; see bench_step.py) and its growth over the resident set just before the step; time is the CPU time of
the step with one torch thread (wall time beside it). The ratios in `LIMIT.md` are of records of this one run. The
report is rewritten after every configuration, so a run cut short keeps what it measured.

    python benchmarks/bench_limit.py                      # tiny qwen3_5, P=32K, G=8, C=128: ragged and full
    python benchmarks/bench_limit.py --P 8K --completions ragged --skip stock
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import gc
import json
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_step  # noqa: E402
from bench_step import GIB, MMAP_THRESHOLD, ROOT, PeakRSS, _emit, _rss, _status_kib, fmt_bytes, ok  # noqa: E402

IMPLS = ("limit", "exact", "detached", "stock_best", "stock")
OURS = ("exact", "detached")
# The targets: (ours, against, key, at most this ratio).
TARGETS = (
    ("detached", "limit", "cpu_s", 1.3),
    ("exact", "limit", "cpu_s", 4.5),
    ("exact", "stock_best", "growth_bytes", 1 / 8),
    ("exact", "stock_best", "cpu_s", 1 / 4),
)


# --------------------------------------------------------------------------------------------------------- worker
def _measure(record: dict, limit_gib: float, step) -> dict:
    """Runs `step()` once under the peak-RSS meter and the memory guard; returns `record` with the figures."""
    gc.collect()
    baseline = _rss()
    limit = int(limit_gib * GIB)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_status_kib("VmSize") * 1024 + limit + GIB, hard))

    def over_limit(growth):
        _emit({**record, "status": "OOM", "growth_bytes": growth, "note": f"growth passed {limit_gib} GiB"})
        os._exit(3)

    try:
        with PeakRSS(baseline, limit, over_limit) as peak:
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    except (RuntimeError, MemoryError) as e:
        if "memory" not in str(e).lower() and not isinstance(e, MemoryError):
            raise
        return {**record, "status": "OOM", "note": str(e).splitlines()[0][:200]}
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    high = peak.peak()
    return {
        **record,
        "status": "ok",
        "time_s": seconds,
        "cpu_s": cpu_seconds,
        "growth_bytes": high - baseline,
        "rss_before": baseline,
        "memory_method": peak.method,
    }


def rows_of(mb: dict) -> list[dict]:
    """The group's rows as micro-batches of one row each, every completion cut to its own length (no padding), the
    group's `num_items_in_batch` kept, as gradient accumulation over the group sees them."""
    rows = []
    for r in range(mb["prompt_ids"].shape[0]):
        n = int(mb["completion_mask"][r].sum())
        row = {k: v[r : r + 1] for k, v in mb.items() if k != "num_items_in_batch"}
        row["completion_ids"], row["completion_mask"] = row["completion_ids"][:, :n], row["completion_mask"][:, :n]
        rows.append({**row, "num_items_in_batch": mb["num_items_in_batch"]})
    return rows


def limit_worker(args) -> None:
    """One no-grad forward of the prompt alone, logits for its last token only."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    record = dict(family=args.family, impl="limit", P=args.P, G=args.G, C=args.C, completions=args.completions)
    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=getattr(torch, args.dtype))
    vocab = model.config.get_text_config().vocab_size
    prompt = bench_step.micro_batch(args.P, 1, args.C, vocab, "cpu")["prompt_ids"]

    def forward(ids):
        with torch.no_grad():
            model(input_ids=ids, use_cache=False, logits_to_keep=1)

    forward(prompt[:, -64:])
    _emit({**_measure(record, args.mem_limit_gib, lambda: forward(prompt)), "threads": torch.get_num_threads()})


def stock_best_worker(args) -> None:
    """Stock at per_device_train_batch_size=1: G training steps of one row each, measured together."""
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    record = dict(family=args.family, impl="stock_best", P=args.P, G=args.G, C=args.C, completions=args.completions)
    trainer = bench_step.build_trainer(
        "stock", args.model_path, args.G, args.C, args.chunk, args.grad_ckpt, args.dtype, rows_per_step=1
    )
    trainer.current_gradient_accumulation_steps = args.G
    vocab = trainer.model.config.get_text_config().vocab_size
    warm = rows_of(bench_step.micro_batch(min(args.P, 64), args.G, args.C, vocab, "cpu", args.completions))[0]
    trainer.training_step(trainer.model, warm, warm["num_items_in_batch"])
    trainer.model.zero_grad(set_to_none=False)
    rows = rows_of(bench_step.micro_batch(args.P, args.G, args.C, vocab, "cpu", args.completions))

    def step():
        for row in rows:
            trainer.training_step(trainer.model, row, row["num_items_in_batch"])

    _emit({**_measure(record, args.mem_limit_gib, step), "threads": torch.get_num_threads()})


# --------------------------------------------------------------------------------------------------------- driver
def split_label(label: str, chunk: int) -> tuple[str, int]:
    """`exact@1024` -> ("exact", 1024): ours at another prefill_chunk_size than `--chunk`; a plain name keeps it."""
    impl, _, other = label.partition("@")
    return impl, int(other) if other else chunk


def run_config(args, model_path: str, label: str, completions: str) -> dict:
    """One configuration in a fresh process; its record (status ok / OOM / timeout / error)."""
    impl, chunk = split_label(label, args.chunk)
    script = HERE / ("bench_limit.py" if impl in ("limit", "stock_best") else "bench_step.py")
    cmd = [sys.executable, str(script), "--worker", f"--family={args.family}", f"--impl={impl}", f"--P={args.P}"]
    cmd += [f"--G={args.G}", f"--C={args.C}", f"--chunk={chunk}", f"--completions={completions}"]
    cmd += [f"--dtype={args.dtype}", f"--threads={args.threads}", f"--model-path={model_path}"]
    cmd += [f"--mem-limit-gib={args.mem_limit_gib}"] + ([] if args.reverse_ckpt else ["--no-reverse-ckpt"])
    cmd += ["--prefill-attention-reuse"] if args.prefill_attention else []
    env = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "TOKENIZERS_PARALLELISM": "false",
    }
    record = dict(family=args.family, impl=label, P=args.P, G=args.G, C=args.C, completions=completions)
    if impl in OURS:
        record["chunk"] = chunk
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        record.update(status="timeout", note=f"> {args.timeout:.0f} s wall")
    else:
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if lines:
            record = {**json.loads(lines[-1][len("RESULT ") :]), "impl": label, "completions": completions}
        elif proc.returncode in (-9, 137):
            record.update(status="OOM", note="killed (SIGKILL)")
        else:
            record.update(status="error", note=(proc.stderr.strip().splitlines() or ["?"])[-1][:300])
    record["wall_s"] = time.perf_counter() - t0
    print(f"  {label:<13} {completions:<6} {cell(record)}", flush=True)
    return record


def labels(args) -> list[str]:
    """The implementations run, in report order; ours also at each `--more-chunks` size (`exact@1024`)."""
    out = []
    for impl in IMPLS:
        if impl not in args.skip:
            out.append(impl)
            out += [f"{impl}@{c}" for c in args.more_chunks if impl in OURS and f"{impl}@{c}" not in args.skip]
    return out


def plan(args) -> list[tuple[str, str]]:
    """(label, completions) in report order: the limit once (it has no completions), then per completion kind ours
    before stock's, cheapest first. `run_order` starts the slowest first."""
    impls = labels(args)
    out = [("limit", "none")] if "limit" in impls else []
    return out + [(i, c) for c in args.completions for i in impls if i != "limit"]


def run_order(todo: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Stock's best setting first (by far the slowest), stock's default last (it fails at once or runs as long),
    ours and the limit in report order between, so that a run of several jobs at once ends soonest."""
    return sorted(todo, key=lambda key: {"stock_best": 0, "stock": 2}.get(key[0], 1))


def cell(r: dict | None) -> str:
    if r is None:
        return "pending"
    if not ok(r):
        return f"{r['status']} {r.get('note', '')}".strip()
    peak = r["rss_before"] + r["growth_bytes"] if r.get("rss_before") else None
    return f"{fmt_bytes(peak)} (+{fmt_bytes(r['growth_bytes'])}) / {r['cpu_s']:.2f} s ({r['time_s']:.1f} s)"


def fraction(a: dict | None, b: dict | None, key: str) -> float | None:
    if a is None or b is None or not (ok(a) and ok(b)) or b[key] <= 0:
        return None
    return a[key] / b[key]


def fmt_ratio(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}x"


def table(records: dict, completions: str) -> list[str]:
    """Rows of one completion kind: each implementation's cell and its ratios to the limit and to stock's best."""
    lim = records.get(("limit", "none"))
    best = records.get(("stock_best", completions))
    rows = [
        "| implementation | chunk | peak RSS (+ step growth) / CPU time (wall) | time / limit | growth / stock best "
        "| time / stock best |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for label in [impl for impl in IMPLS if impl not in OURS] + sorted(
        {k[0] for k in records if k[0].partition("@")[0] in OURS}, key=lambda x: (x.partition("@")[0] != "exact", x)
    ):
        key = ("limit", "none") if label == "limit" else (label, completions)
        if key not in records:
            continue
        r = records[key]
        rows.append(
            f"| {label.partition('@')[0]} | {r.get('chunk', '')} | {cell(r)} | {fmt_ratio(fraction(r, lim, 'cpu_s'))} "
            f"| {fmt_ratio(fraction(r, best, 'growth_bytes'))} | {fmt_ratio(fraction(r, best, 'cpu_s'))} |"
        )
    rows[2:] = sorted(rows[2:], key=lambda row: IMPLS.index(row.split(" | ")[0][2:]))
    return rows


def verdicts(records: dict, completions: str) -> list[str]:
    """The issue's targets for ours at `--chunk`, then at each other chunk size measured."""
    lines = []
    others = sorted({k[0].partition("@")[2] for k in records if "@" in k[0]}, key=int)
    for suffix in ["", *others]:
        lines += _verdicts(records, completions, suffix)
    return lines


def _verdicts(records: dict, completions: str, suffix: str) -> list[str]:
    lines = []
    for ours, other, key, goal in TARGETS:
        label = f"{ours}@{suffix}" if suffix else ours
        if suffix and (label, completions) not in records:
            continue
        r = records.get((label, completions))
        o = records.get((other, "none" if other == "limit" else completions))
        x = fraction(r, o, key)
        what = "time" if key == "cpu_s" else "step growth"
        at = f" (chunk {suffix})" if suffix else ""
        name = f"{ours}{at} {what} / {other.replace('_', ' ')} {what}"
        if x is None:
            lines.append(f"- {name}: not measured (a configuration did not finish); target <= {goal:.3g}")
        else:
            lines.append(f"- {name}: {x:.3f} (target <= {goal:.3g}): {'MET' if x <= goal else 'NOT MET'}")
    return lines


def report(args, raw: dict, records: dict) -> list[str]:
    lengths = {c: bench_step.completion_lengths(args.G, args.C, c) for c in args.completions}
    chunks = ", ".join(str(c) for c in [args.chunk, *args.more_chunks])
    md = [
        "# One GRPO step against the limit and against stock's best memory setting",
        "",
        "Generated by `benchmarks/bench_limit.py` (its docstring and `benchmarks/README.md` say what is measured).",
        "",
        f"- command: `{raw['command']}`",
        f"- date: {raw['date']}; {raw['status']}; load average {raw['load_average']} (2 cores shared with other "
        "jobs when it exceeds 2)",
        f"- machine: {raw['hardware']}; {raw['versions']}; {args.threads} torch thread(s) per configuration, "
        f"{args.jobs} configuration(s) at a time",
        f"- work: tiny {args.family}, one prompt of P={args.P} tokens, G={args.G} completions of at most C={args.C} "
        f"tokens ({'; '.join(f'{c}: {v}' for c, v in lengths.items())}); {args.dtype}; gradient checkpointing on "
        f"(non-reentrant); ours with prefill_chunk_size {chunks} (the chunk column), reverse_checkpointing "
        f"{args.reverse_ckpt}, prefill_attention_reuse {args.prefill_attention} (exact); a fresh process per "
        f"configuration, a "
        f"timeout of {args.timeout:.0f} s wall and a stop at {args.mem_limit_gib:g} GiB growth (OOM)",
        "- limit: one no-grad forward of the prompt alone (logits of its last token only); stock_best: "
        "per_device_train_batch_size=1, gradient accumulation over the G rows (G training_step calls, measured "
        "together), gradient checkpointing; stock: its default, the G rows in one padded micro-batch",
        "- cells: the process's peak resident set during the step (+ its growth over the resident set before the "
        "step) / CPU time of the step (wall time). Time ratios use CPU time, which other jobs disturb far less "
        "than wall time",
    ]
    for completions in args.completions:
        md += ["", f"## {completions} completions", "", *table(records, completions), ""]
        md += ["The issue's targets on this run:", "", *verdicts(records, completions)]
    return md


def write(args, raw: dict, records: dict, out: Path) -> None:
    raw = {**raw, "load_average": ", ".join(f"{x:.1f}" for x in os.getloadavg())}
    raw["records"] = list(records.values())
    (out / "LIMIT.json").write_text(json.dumps(raw, indent=1) + "\n")
    (out / "LIMIT.md").write_text("\n".join(report(args, raw, records)) + "\n")


def parse_size(text: str) -> int:
    return bench_step.parse_sizes(text)[0]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--impl", choices=IMPLS, default="limit", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument("--family", default="qwen3_5", help="tiny model family (trl_longstraw.testing)")
    parser.add_argument("--P", default="32K", help="prompt tokens")
    parser.add_argument("--G", type=int, default=8, help="completions per prompt")
    parser.add_argument("--C", type=int, default=128, help="completion tokens at most")
    parser.add_argument("--completions", default="ragged,full", help="comma-separated subset of ragged,full")
    parser.add_argument("--skip", default="", help="comma-separated implementations not to run (`detached@1024`)")
    parser.add_argument("--chunk", type=int, default=4096, help="prefill_chunk_size of ours (library default)")
    parser.add_argument(
        "--no-reverse-ckpt", dest="reverse_ckpt", action="store_false", help="ours with reverse_checkpointing=False"
    )
    parser.add_argument(
        "--prefill-attention-reuse",
        dest="prefill_attention",
        action="store_true",
        help="ours (exact) with prefill_attention_reuse=True",
    )
    parser.add_argument("--more-chunks", default="", help="comma-separated other prefill_chunk_size values of ours")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads per configuration")
    parser.add_argument("--jobs", type=int, default=2, help="configurations run at once")
    parser.add_argument("--timeout", type=float, default=1800, help="wall seconds per configuration")
    parser.add_argument("--mem-limit-gib", type=float, default=6, help="growth at which a configuration is stopped")
    parser.add_argument("--out", default=str(HERE), help="folder of LIMIT.md and LIMIT.json")
    args = parser.parse_args(argv)
    args.P = parse_size(str(args.P))
    args.grad_ckpt = True

    if args.worker:
        if args.impl == "limit":
            return limit_worker(args)
        return stock_best_worker(args)
    from trl_longstraw.testing import save_tiny_model

    args.completions = [c for c in args.completions.split(",") if c]
    args.skip = [s for s in args.skip.split(",") if s]
    args.more_chunks = [int(c) for c in args.more_chunks.split(",") if c]
    command = " ".join(["python benchmarks/bench_limit.py", *(shlex.quote(a) for a in (argv or sys.argv[1:]))])
    date = f"{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}"
    raw = dict(command=command, date=date, hardware=bench_step.hardware(), versions=bench_step.versions())
    print(f"{command}\n{date}; {raw['hardware']}; {raw['versions']}", flush=True)
    model_path = str(save_tiny_model(Path(tempfile.mkdtemp(prefix="bench_limit_")) / args.family, args.family))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    todo = plan(args)
    records: dict = {}
    started = time.perf_counter()
    write(args, {**raw, "status": "running"}, records, out)
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(run_config, args, model_path, i, c): (i, c) for i, c in run_order(todo)}
        for future in concurrent.futures.as_completed(futures):
            records[futures[future]] = future.result()
            done = f"{len(records)} of {len(todo)} configurations after {(time.perf_counter() - started) / 60:.1f} min"
            write(args, {**raw, "status": done}, records, out)
    records = {key: records[key] for key in todo}
    write(args, {**raw, "status": f"the run took {(time.perf_counter() - started) / 60:.1f} min"}, records, out)
    print("\n".join(report(args, json.loads((out / "LIMIT.json").read_text()), records)))


if __name__ == "__main__":
    main()
