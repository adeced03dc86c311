"""Side-by-side benchmark of one GRPO training step: stock `trl.GRPOTrainer` against `LongStrawGRPOTrainer` in
`exact` and `detached` mode, on the same hand-built micro-batch (one prompt of P tokens, G completions of at most C
tokens; by default of ragged lengths, as completions that stop at EOS).

Each configuration runs in a fresh subprocess (`--worker`), which measures, after a warm-up step on a short prompt:

- peak step memory growth: the process's peak resident set size during the step minus its resident set size just
  before the step. The peak is the kernel's high-water mark `VmHWM` of `/proc/self/status`, reset right before the
  step by writing "5" to `/proc/self/clear_refs`; where that reset is refused, a thread samples `VmRSS` every
  millisecond instead (the JSON says which). glibc's mmap threshold is pinned low (`MALLOC_MMAP_THRESHOLD_`, 64 KiB),
  the same for every configuration, so that freed tensors leave the resident set instead of staying in malloc's heap;
- step time: the CPU time (`time.process_time`) and the wall time of `trainer.training_step`, with one torch thread.

A worker whose growth passes `--mem-limit-gib` is stopped and reported as "OOM"; one that runs past `--timeout`
seconds is reported as "timeout". The driver prints a table, writes `benchmarks/RESULTS.md`, the raw
`benchmarks/results.json` and PNG plots under `benchmarks/plots/`. benchmarks/README.md has the details.

    python benchmarks/bench_step.py            # default sweep (every family with an adapter among FAMILIES)
    python benchmarks/bench_step.py --quick    # llama, P in {2K, 8K}, G in {2, 8}
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import math
import os
import platform
import resource
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# The package is imported from this checkout, whether or not it is installed.
sys.path.insert(0, str(ROOT))
# Families the benchmark knows how to build tiny models of, in the order they are reported.
FAMILIES = ("qwen3_5", "glm_moe_dsa", "llama")
IMPLS = ("stock", "exact", "detached")
GIB = 2**30
MMAP_THRESHOLD = str(1 << 16)


# --------------------------------------------------------------------------------------------------------- worker
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _rss() -> int:
    return _status_kib("VmRSS") * 1024


class PeakRSS:
    """Peak resident set size over a block: VmHWM after a clear_refs reset, else a 1 ms sampling thread.

    The sampler also stops the process (exit code 3, after printing an OOM record) when the growth over `baseline`
    exceeds `limit` bytes, so that a configuration that does not fit never pushes the shared machine into swap or the
    kernel's OOM killer.
    """

    def __init__(self, baseline: int, limit: int, on_limit):
        self.baseline, self.limit, self.on_limit = baseline, limit, on_limit
        self.sampled_peak = baseline
        self._stop = threading.Event()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.method = "VmHWM after clear_refs=5"
            # Only the OOM guard samples then; less often, so that it costs the step little.
            self.interval = 0.005
        except OSError:
            self.method = "VmRSS sampled every 1 ms"
            self.interval = 0.001
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self):
        while not self._stop.wait(self.interval):
            rss = _rss()
            self.sampled_peak = max(self.sampled_peak, rss)
            if rss - self.baseline > self.limit:
                self.on_limit(rss - self.baseline)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def peak(self) -> int:
        if self.method.startswith("VmHWM"):
            return max(_status_kib("VmHWM") * 1024, self.sampled_peak)
        return self.sampled_peak


def _emit(record: dict) -> None:
    print("RESULT " + json.dumps(record), flush=True)


def build_trainer(
    impl: str,
    model_path: str,
    g: int,
    c: int,
    chunk: int,
    grad_ckpt: bool,
    dtype: str,
    rows_per_step: int | None = None,
    reverse_ckpt: bool = True,
    prefill_attention: bool = False,
):
    """A trainer of `impl` on the saved model, set up to call `training_step` on hand-built micro-batches.

    `rows_per_step` (default `g`) is `per_device_train_batch_size`; below `g`, gradient accumulation covers the group
    (`gradient_accumulation_steps = g / rows_per_step`), as a stock user sets it to bring memory down. `reverse_ckpt`
    is ours' `reverse_checkpointing`, `prefill_attention` its `prefill_attention_reuse` (exact mode)."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer

    common = dict(
        output_dir=tempfile.mkdtemp(prefix="bench_"),
        per_device_train_batch_size=rows_per_step or g,
        gradient_accumulation_steps=g // (rows_per_step or g),
        num_generations=g,
        max_completion_length=c,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        logging_steps=1,
        bf16=dtype == "bfloat16",
        gradient_checkpointing=grad_ckpt,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        model_init_kwargs={"dtype": dtype},
    )
    dataset = Dataset.from_dict({"prompt": ["a b c"] * g})

    def reward(completions, **kwargs):
        return [0.0] * len(completions)

    if impl == "stock":
        trainer = GRPOTrainer(model_path, reward, GRPOConfig(**common), train_dataset=dataset)
    else:
        config = LongStrawGRPOConfig(
            **common,
            prompt_gradient=impl,
            prefill_chunk_size=chunk,
            prefill_progress=False,
            reverse_checkpointing=reverse_ckpt,
            prefill_attention_reuse=prefill_attention and impl == "exact",
        )
        trainer = LongStrawGRPOTrainer(model_path, reward, config, train_dataset=dataset)
    trainer._prepare_inputs = lambda x: x
    trainer.current_gradient_accumulation_steps = 1
    if grad_ckpt:
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return trainer


def completion_lengths(g: int, c: int, completions: str) -> list[int]:
    """`full`: every completion has `c` tokens. `ragged`: evenly spread from `c` down towards `c / 2`, as completions
    that stop at EOS at different points (the longest has `c` tokens, so the padded width is `c` either way)."""
    if completions == "full":
        return [c] * g
    return [c - i * c // (2 * g) for i in range(g)]


def micro_batch(p: int, g: int, c: int, vocab: int, device, completions: str = "ragged"):
    from trl_longstraw.testing import random_micro_batch

    mb = random_micro_batch([p], completion_lengths(g, c, completions), [0] * g, vocab, seed=p)
    return {k: v.to(device) for k, v in mb.items()}


def worker(args) -> None:
    """Measures one configuration and prints one `RESULT {json}` line."""
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    record = dict(
        family=args.family,
        impl=args.impl,
        P=args.P,
        G=args.G,
        C=args.C,
        chunk=args.chunk,
        completions=args.completions,
    )
    limit = int(args.mem_limit_gib * GIB)

    trainer = build_trainer(
        args.impl,
        args.model_path,
        args.G,
        args.C,
        args.chunk,
        args.grad_ckpt,
        args.dtype,
        reverse_ckpt=args.reverse_ckpt,
        prefill_attention=args.prefill_attention,
    )
    vocab = trainer.model.config.get_text_config().vocab_size
    device = trainer.accelerator.device
    # Warm-up on a short prompt: one-time allocations (gradient buffers, thread pools, lazy inits) happen here.
    warm = micro_batch(min(args.P, 64), args.G, args.C, vocab, device, args.completions)
    trainer.training_step(trainer.model, warm, warm["num_items_in_batch"])
    trainer.model.zero_grad(set_to_none=False)
    mb = micro_batch(args.P, args.G, args.C, vocab, device, args.completions)

    import gc

    gc.collect()
    baseline = _rss()
    # A single allocation larger than the limit fails at malloc instead of being sampled too late.
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_status_kib("VmSize") * 1024 + limit + GIB, hard))

    def over_limit(growth):
        _emit({**record, "status": "OOM", "growth_bytes": growth, "note": f"growth passed {args.mem_limit_gib} GiB"})
        os._exit(3)

    try:
        with PeakRSS(baseline, limit, over_limit) as peak:
            t0, c0 = time.perf_counter(), time.process_time()
            trainer.training_step(trainer.model, mb, mb["num_items_in_batch"])
            seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    except (RuntimeError, MemoryError) as e:
        if "memory" not in str(e).lower() and not isinstance(e, MemoryError):
            raise
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        _emit({**record, "status": "OOM", "note": str(e).splitlines()[0][:200]})
        return
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    record.update(status="ok", time_s=seconds, cpu_s=cpu_seconds, growth_bytes=peak.peak() - baseline)
    record.update(rss_before=baseline, threads=torch.get_num_threads())
    record["memory_method"] = peak.method
    grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
    record["grad_norm"] = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
    metrics = trainer._metrics["train"]
    for key in ("prefill_s", "replay_s", "reverse_s", "state_gib"):
        if metrics.get(f"longstraw/{key}"):
            record[key] = metrics[f"longstraw/{key}"][-1]
    _emit(record)


# --------------------------------------------------------------------------------------------------------- driver
def run_config(args, model_paths, family, impl, p, g, chunk, completions="ragged", timeout=None) -> dict:
    """Runs one configuration in a fresh process; returns its record (status ok / OOM / timeout / error)."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        f"--family={family}",
        f"--impl={impl}",
        f"--P={p}",
        f"--G={g}",
        f"--C={args.C}",
        f"--chunk={chunk}",
        f"--completions={completions}",
        f"--dtype={args.dtype}",
        f"--threads={args.threads}",
        f"--model-path={model_paths[family]}",
        f"--mem-limit-gib={args.mem_limit_gib}",
    ] + ([] if args.grad_ckpt else ["--no-grad-ckpt"])
    env = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "TOKENIZERS_PARALLELISM": "false",
    }
    record = dict(family=family, impl=impl, P=p, G=g, C=args.C, chunk=chunk, completions=completions)
    timeout = timeout or args.timeout
    return run_child(cmd, record, timeout, env, fmt_record)


def run_child(cmd: list[str], record: dict, timeout: float, env: dict, fmt) -> dict:
    """Runs one measurement in a fresh process (`worker`, which prints a `RESULT {json}` line) and returns its record,
    or `record` with the failure (timeout, OOM kill, error); prints it with `fmt` and adds the wall time."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        record.update(status="timeout", note=f"> {timeout:.0f} s wall")
    else:
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if lines:
            record = json.loads(lines[-1][len("RESULT ") :])
        elif proc.returncode in (-9, 137):
            record.update(status="OOM", note="killed (SIGKILL)")
        else:
            record.update(status="error", note=(proc.stderr.strip().splitlines() or ["?"])[-1][:300])
    record["wall_s"] = time.perf_counter() - t0
    print(" ", fmt(record), flush=True)
    return record


def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB / 4 else f"{n / 2**20:.1f} MiB"


def fmt_record(r: dict) -> str:
    head = f"{r['family']:<12} {r['impl']:<9} P={r['P']:<7} G={r['G']:<2} chunk={r['chunk']:<5} {r['completions']:<6}"
    if r["status"] != "ok":
        return f"{head} {r['status']} {r.get('note', '')}"
    return (
        f"{head} growth {fmt_bytes(r['growth_bytes']):>10}  cpu {r['cpu_s']:7.2f} s  wall {r['time_s']:7.2f} s  "
        f"(process {r['wall_s']:.0f} s)"
    )


def ok(r) -> bool:
    return r is not None and r["status"] == "ok"


def lookup(records, **key):
    for r in records:
        if all(r.get(k) == v for k, v in key.items()):
            return r
    return None


def sweep_plan(args, families) -> list[tuple[str, str, int, int, int, str]]:
    """(family, impl, P, G, chunk, completions): the P sweep at G=p_sweep_G and the G sweep at P=g_sweep_P with
    `args.completions`; at (g_sweep_P, p_sweep_G), ours with the other chunk sizes and, with `--extra-full`, every
    implementation with full-length completions."""
    plan = []
    head = (args.g_sweep_P, args.p_sweep_G)
    for family in families:
        for impl in args.impls:
            ps = args.stock_P if impl == "stock" else args.ours_P
            plan += [(family, impl, p, args.p_sweep_G, args.chunk, args.completions) for p in ps]
            plan += [(family, impl, args.g_sweep_P, g, args.chunk, args.completions) for g in args.G_list]
            if impl != "stock":
                plan += [(family, impl, *head, c, args.completions) for c in args.extra_chunks]
            if args.extra_full and args.completions != "full":
                plan.append((family, impl, *head, args.chunk, "full"))
    return list(dict.fromkeys(plan))


def budget_estimate(records, family, impl, g, chunk, completions, budget) -> dict | None:
    """What the runs of one implementation at this G say about the largest P whose growth fits `budget` bytes.

    `fits` is the largest P measured within the budget and `fails` the smallest measured over it (or that ran out of
    memory). The estimate `P` interpolates between the two runs that bracket the budget, as a power law (stock's
    mask makes its growth superlinear), or, when every run fits, extrapolates the last two runs linearly (our growth
    is a fixed part plus a per-token part)."""
    mine = [
        r
        for r in records
        if r["family"] == family
        and r["impl"] == impl
        and r["G"] == g
        and r["chunk"] == chunk
        and r["completions"] == completions
    ]
    runs = sorted({r["P"]: r["growth_bytes"] for r in mine if ok(r)}.items())
    fits = max((p for p, growth in runs if growth <= budget), default=None)
    over = [p for p, growth in runs if growth > budget] + [r["P"] for r in mine if r["status"] == "OOM"]
    fails = min(over, default=None)
    out = dict(fits=fits, fails=fails, largest_measured=runs[-1][0] if runs else None)
    above = [(p, growth) for p, growth in runs if growth > budget]
    below = [(p, growth) for p, growth in runs if growth <= budget]
    if below and above:
        (p0, g0), (p1, g1) = below[-1], above[0]
        k = math.log(g1 / g0) / math.log(p1 / p0)
        out.update(P=int(p0 * (budget / g0) ** (1 / k)), kind=f"interpolated between P={p0} and P={p1}")
    elif len(runs) >= 2 and not above:
        # Our growth is affine in P only once the prompt fills a whole chunk (the chunk's activations are the fixed
        # part): extrapolate from runs longer than one chunk when there are two.
        full = [(p, growth) for p, growth in runs if p > chunk]
        (p0, g0), (p1, g1) = (full if len(full) >= 2 else runs)[-2:]
        slope = (g1 - g0) / (p1 - p0)
        if slope <= 0:
            return out
        caveat = "" if len(full) >= 2 or impl == "stock" else f"; P={p0} is within one chunk, so this is low"
        out.update(
            P=int(p1 + (budget - g1) / slope),
            slope=slope,
            kind=f"extrapolated linearly from P={p0} and P={p1}, not measured{caveat}",
        )
    return out


def predicted_wall(last: dict, p: int) -> float:
    """Wall seconds of our step at `p` from its run at a shorter prompt: prefill and reverse pass grow as P^2
    (attention over the prompt), the branch replays as P."""
    r = p / last["P"]
    quadratic = last.get("prefill_s", 0.0) + last.get("reverse_s", 0.0)
    return quadratic * r * r + last.get("replay_s", 0.0) * r + (last["time_s"] - quadratic - last.get("replay_s", 0.0))


def run_plan(args, model_paths, plan) -> dict:
    """Runs the plan's configurations, `args.jobs` at a time. Ours' P sweeps run as chains, shortest P first, and a
    P whose predicted wall time (`predicted_wall`) exceeds the timeout is recorded as skipped instead of run. Stock
    is always run: past the memory guard it fails at once, which says more than a prediction."""
    chains: dict[tuple, list] = {}
    for item in plan:
        family, impl, p, g, chunk, completions = item
        key = (family, impl, g, chunk, completions) if impl != "stock" else item
        chains.setdefault(key, []).append(item)

    def run_chain(items):
        out, last = {}, None
        for item in sorted(items, key=lambda x: x[2]):
            note = None
            if last is not None and last["status"] == "timeout":
                note = f"P={last['P']} already ran past the timeout"
            elif last is not None and ok(last) and predicted_wall(last, item[2]) > args.timeout:
                note = f"predicted {predicted_wall(last, item[2]):.0f} s > timeout {args.timeout:.0f} s"
            if note:
                family, impl, p, g, chunk, completions = item
                out[item] = dict(
                    family=family,
                    impl=impl,
                    P=p,
                    G=g,
                    C=args.C,
                    chunk=chunk,
                    completions=completions,
                    status="skipped",
                    note=note,
                    wall_s=0.0,
                )
                print(" ", fmt_record(out[item]), flush=True)
                continue
            out[item] = last = run_config(args, model_paths, *item)
        return out

    # Longest first (stock, then ours' longest chains), so that the last job to finish is a short one.
    order = sorted(chains.values(), key=lambda c: (c[0][1] != "stock", -max(x[2] * x[3] for x in c)))
    by_key = {}
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for done in pool.map(run_chain, order):
            by_key.update(done)
    return by_key


def budget_estimates(records, families, args) -> list[dict]:
    """`budget_estimate` of every family and implementation, at the P sweep's G and the main chunk size."""
    out = []
    for family in families:
        for impl in args.impls:
            b = budget_estimate(
                records, family, impl, args.p_sweep_G, args.chunk, args.completions, args.budget_gib * GIB
            )
            if b:
                out.append(dict(family=family, impl=impl, **b))
    return out


def largest_fitting(args, model_paths, family, impl, budget_gib, start, stop, cache: dict) -> list[dict]:
    """Direct search: doubling P from `start` (up to `stop`) while the step fits `budget_gib` of growth (halving
    instead if `start` does not fit), then `--bisect-steps` bisections. Runs already in `cache` (keyed like
    `sweep_plan`'s items) are reused. Returns the records it used."""
    budget = budget_gib * GIB

    def run(p):
        key = (family, impl, p, args.p_sweep_G, args.chunk, args.completions)
        if key not in cache:
            cache[key] = run_config(args, model_paths, *key, timeout=args.search_timeout)
        return cache[key]

    good, bad, used, p = None, None, [], start
    while p <= stop:
        r = run(p)
        used.append(r)
        if not (ok(r) and r["growth_bytes"] <= budget):
            bad = p
            break
        good, p = p, p * 2
    # The first probe already over the budget: halve down to 256 tokens until one fits.
    p = start // 2
    while good is None and p >= 256:
        r = run(p)
        used.append(r)
        if ok(r) and r["growth_bytes"] <= budget:
            good = p
        else:
            bad, p = p, p // 2
    for _ in range(args.bisect_steps if bad and good else 0):
        mid = (good + bad) // 2 // 256 * 256
        if mid in (good, bad):
            break
        r = run(mid)
        used.append(r)
        good, bad = (mid, bad) if ok(r) and r["growth_bytes"] <= budget else (good, mid)
    print(f"  search {family}/{impl}: fits {good}, fails {bad}", flush=True)
    return used


def hardware() -> str:
    model = platform.processor() or "?"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next(
            (line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name:")), model
        )
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, Linux {platform.release()}, Python {platform.python_version()}"


def versions() -> str:
    import torch
    import transformers
    import trl

    return f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}"


def cell(r) -> str:
    if r is None:
        return ""
    if not ok(r):
        return r["status"]
    return f"{fmt_bytes(r['growth_bytes'])} / {r['cpu_s']:.2f} s ({r['time_s']:.1f} s)"


def ratio(a, b, key) -> str:
    if not (ok(a) and ok(b)) or b[key] <= 0:
        return ""
    return f"{a[key] / b[key]:.1f}x"


def table(records, family, chunk, completions, stock_chunk=None) -> list[str]:
    """Markdown rows: one per (P, G) with stock / exact / detached and the stock-over-ours ratios. Stock has no chunk
    size; its records are looked up under `stock_chunk` (the main chunk size it was run with)."""
    mine = [r for r in records if r["family"] == family and r["completions"] == completions]
    keys = sorted({(r["P"], r["G"]) for r in mine if r["chunk"] == chunk})
    rows = [
        "| P | G | stock | exact | detached | memory stock/exact | memory stock/detached | time stock/exact | "
        "time stock/detached |",
        "|---:|---:|---|---|---|---:|---:|---:|---:|",
    ]
    for p, g in keys:
        s = lookup(mine, impl="stock", P=p, G=g, chunk=stock_chunk or chunk)
        e, d = (lookup(mine, impl=i, P=p, G=g, chunk=chunk) for i in IMPLS[1:])
        rows.append(
            f"| {p} | {g} | {cell(s)} | {cell(e)} | {cell(d)} | {ratio(s, e, 'growth_bytes')} | "
            f"{ratio(s, d, 'growth_bytes')} | {ratio(s, e, 'cpu_s')} | {ratio(s, d, 'cpu_s')} |"
        )
    return rows


def breakdown(records, family) -> list[str]:
    """Where our step goes: engine phase times and the growth beyond the prompt state."""
    rows = [
        "| impl | P | G | chunk | completions | prefill s | branch replays s | reverse s | prompt state | growth | "
        "growth - state |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(records, key=lambda r: (r["impl"], r["completions"], r["chunk"], r["P"], r["G"])):
        if r["family"] != family or r["impl"] == "stock" or not ok(r):
            continue
        state = r.get("state_gib", 0) * GIB
        rows.append(
            f"| {r['impl']} | {r['P']} | {r['G']} | {r['chunk']} | {r['completions']} | {r.get('prefill_s', 0):.2f} | "
            f"{r.get('replay_s', 0):.2f} | {r.get('reverse_s', 0):.2f} | {fmt_bytes(state)} | "
            f"{fmt_bytes(r['growth_bytes'])} | {fmt_bytes(r['growth_bytes'] - state)} |"
        )
    return rows


def targets(records, budgets, family, args) -> list[str]:
    """The issue's must-show checks, evaluated on this run's records."""
    p, g_lo, g_hi, chunk = args.g_sweep_P, min(args.G_list), max(args.G_list), args.chunk
    records = [r for r in records if r["completions"] == args.completions]
    s, e, d = (lookup(records, family=family, impl=i, P=p, G=g_hi, chunk=chunk) for i in IMPLS)
    lines = []

    def check(name, a, b, key, goal):
        if key == "growth_bytes" and a and a["status"] == "OOM" and ok(b):
            # Stock stopped at the guard: its growth exceeded the limit, so the ratio is at least limit / ours.
            bound = args.mem_limit_gib * GIB / b[key]
            verdict = "MET" if bound >= goal else "NOT SHOWN"
            lines.append(
                f"- {name}: >= {bound:.0f}x (stock passed the {args.mem_limit_gib:g} GiB guard; target >= {goal}x): "
                f"{verdict}"
            )
            return
        if not (ok(a) and ok(b)):
            lines.append(f"- {name}: not measured (a configuration did not finish), target >= {goal}x")
            return
        value = a[key] / b[key]
        lines.append(f"- {name}: {value:.1f}x (target >= {goal}x): {'MET' if value >= goal else 'NOT MET'}")

    check(f"peak step memory growth, stock/exact, P={p}, G={g_hi}", s, e, "growth_bytes", 20)
    check(f"peak step memory growth, stock/detached, P={p}, G={g_hi}", s, d, "growth_bytes", 30)
    check(f"step time (CPU), stock/exact, P={p}, G={g_hi}", s, e, "cpu_s", 4)
    check(f"step time (CPU), stock/detached, P={p}, G={g_hi}", s, d, "cpu_s", 15)
    for impl in ("exact", "detached"):
        lo, hi = (lookup(records, family=family, impl=impl, P=p, G=g, chunk=chunk) for g in (g_lo, g_hi))
        if ok(lo) and ok(hi):
            inc = hi["growth_bytes"] / lo["growth_bytes"] - 1
            lines.append(
                f"- {impl}: G={g_lo} -> G={g_hi} changes the peak step memory growth by {inc * 100:+.1f}% "
                f"({fmt_bytes(lo['growth_bytes'])} -> {fmt_bytes(hi['growth_bytes'])}; target <= +5%): "
                f"{'MET' if inc <= 0.05 else 'NOT MET'}"
            )
    est = {b["impl"]: b for b in budgets if b["family"] == family}
    stock = est.get("stock") or {}
    for impl in ("exact", "detached"):
        mine = est.get(impl) or {}
        if not stock.get("fails") or not mine.get("P"):
            lines.append(f"- largest prompt within {args.budget_gib} GiB growth, {impl}/stock: not measured")
            continue
        x = mine["P"] / stock["fails"]
        lines.append(
            f"- largest prompt within {args.budget_gib} GiB growth (G={args.p_sweep_G}), {impl}/stock: "
            f"{mine['P']:,} ({mine['kind']}) / {stock['fails']:,} (stock's smallest P measured over the budget, an "
            f"upper bound of its largest) = {x:.0f}x (target >= 16x): {'MET' if x >= 16 else 'NOT MET'}"
        )
        if mine.get("fits"):
            y = mine["fits"] / stock["fails"]
            lines.append(
                f"  - measured only: {impl} ran within the budget at P={mine['fits']:,}, {y:.1f}x stock's bound"
            )
    return lines


def plots(records, families, out_dir: Path, args) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for family in families:
        rs = [
            r
            for r in records
            if r["family"] == family and ok(r) and r["chunk"] == args.chunk and r["completions"] == args.completions
        ]
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
        for impl, marker in zip(IMPLS, "osd", strict=True):
            by_p = sorted(
                (r["P"], r["growth_bytes"] / GIB, r["cpu_s"])
                for r in rs
                if r["impl"] == impl and r["G"] == args.p_sweep_G
            )
            by_g = sorted(
                (r["G"], r["growth_bytes"] / GIB) for r in rs if r["impl"] == impl and r["P"] == args.g_sweep_P
            )
            if by_p:
                axes[0].plot([x[0] for x in by_p], [x[1] for x in by_p], marker=marker, label=impl)
                axes[2].plot([x[0] for x in by_p], [x[2] for x in by_p], marker=marker, label=impl)
            if by_g:
                axes[1].plot([x[0] for x in by_g], [x[1] for x in by_g], marker=marker, label=impl)
        axes[0].axhline(args.budget_gib, color="gray", ls=":", label=f"{args.budget_gib} GiB budget")
        axes[0].set(xscale="log", yscale="log", xlabel="prompt tokens P", ylabel="peak step memory growth (GiB)")
        axes[0].set_title(f"memory vs P (G={args.p_sweep_G}, C={args.C})")
        axes[1].set(yscale="log", xlabel="completions per prompt G", ylabel="peak step memory growth (GiB)")
        axes[1].set_xticks(args.G_list)
        axes[1].set_title(f"memory vs G (P={args.g_sweep_P}, C={args.C})")
        axes[2].set(xscale="log", yscale="log", xlabel="prompt tokens P", ylabel="step CPU time (s)")
        axes[2].set_title(f"step time vs P (G={args.p_sweep_G}, C={args.C})")
        sizes = sorted(set(args.stock_P) | set(args.ours_P))
        for ax in (axes[0], axes[2]):
            ax.set_xticks(sizes, [f"{p / 1024:g}K" for p in sizes])
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        for ax in axes:
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
        fig.suptitle(f"tiny {family}: stock GRPOTrainer vs LongStrawGRPOTrainer (timeouts and OOM not drawn)")
        fig.tight_layout()
        path = out_dir / f"{family}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    return paths


def default_families() -> list[str]:
    from trl_longstraw.adapters import ADAPTERS

    return [f for f in FAMILIES if f in ADAPTERS]


def parse_sizes(text: str) -> list[int]:
    out = []
    for part in filter(None, (x.strip().upper() for x in text.split(","))):
        out.append(int(float(part[:-1]) * 1024) if part.endswith("K") else int(part))
    return out


def report(args, families, records, budgets, raw) -> list[str]:
    from trl_longstraw.adapters import ADAPTERS

    md = [
        "# Benchmark results: one GRPO training step, stock vs trl_longstraw",
        "",
        "Generated by `benchmarks/bench_step.py`; `benchmarks/README.md` says what is measured and how.",
        "",
        f"- command: `{raw['command']}`",
        f"- date: {raw['date']}; the sweep took {raw['elapsed_s'] / 60:.1f} min; load average at the end "
        f"{raw['load_average']} (other jobs shared the machine when it exceeds the cores)",
        f"- hardware: {raw['hardware']}; {raw['versions']}; {args.threads} torch thread(s) per configuration",
        f"- setup: one prompt of P tokens and G completions of at most C={args.C} tokens ({args.completions}: "
        f"{completion_lengths(args.p_sweep_G, args.C, args.completions)} at G={args.p_sweep_G}); {args.dtype}; "
        f"gradient checkpointing {'on (non-reentrant, as GRPOConfig defaults)' if args.grad_ckpt else 'off'}; "
        f"prefill_chunk_size {args.chunk} unless stated; per configuration a fresh process, a timeout of "
        f"{args.timeout:.0f} s (wall) and a stop at {args.mem_limit_gib} GiB growth (OOM); {args.jobs} "
        "configuration(s) at a time",
        "- cells: peak step memory growth / step CPU time (wall time in parentheses). Ratios are stock over ours; "
        "time ratios use CPU time, which other jobs on the shared machine disturb far less than wall time",
    ]
    missing = [f for f in FAMILIES if f not in ADAPTERS]
    if missing:
        md.append(f"- families without an adapter in this checkout, not run: {', '.join(missing)}")
    for family in families:
        md += ["", f"## tiny {family}", "", f"{args.completions} completions:", ""]
        md += [*table(records, family, args.chunk, args.completions), ""]
        md += [f"![{family}](plots/{family}.png)", ""]
        for c in args.extra_chunks:
            md += [f"Ours with prefill_chunk_size={c} ({args.completions} completions; stock as above):", ""]
            md += [*table(records, family, c, args.completions, args.chunk), ""]
        if args.extra_full and args.completions != "full":
            md += ["Full-length completions (no padding, so stock's attention needs no mask):", ""]
            md += [*table(records, family, args.chunk, "full"), ""]
        md += ["### Where our step goes", "", *breakdown(records, family), ""]
        md += [f"### Largest prompt within {args.budget_gib} GiB of growth (G={args.p_sweep_G})", ""]
        for b in (x for x in budgets if x["family"] == family):
            line = f"- {b['impl']}: measured within the budget up to P={b['fits']}, over it from P={b['fails']}"
            if b.get("P"):
                line += f"; estimate P ~ {b['P']:,} ({b['kind']})"
            if b.get("slope"):
                line += f", growth {b['slope']:.0f} B per prompt token"
            md.append(line)
        md += ["", "### The issue's must-show targets", "", *targets(records, budgets, family, args)]
    return md


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--impl", choices=IMPLS, default="exact", help=argparse.SUPPRESS)
    parser.add_argument("--P", type=int, default=8192, help=argparse.SUPPRESS)
    parser.add_argument("--G", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument(
        "--family", default=None, help="comma-separated model families (default: FAMILIES with an adapter)"
    )
    parser.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset of stock,exact,detached")
    parser.add_argument("--stock-P", default="2K,8K,32K", help="prompt lengths of the P sweep for stock")
    parser.add_argument("--ours-P", default="2K,8K,32K,64K", help="prompt lengths of the P sweep for ours")
    parser.add_argument("--G-list", default="2,4,8", help="group sizes of the G sweep")
    parser.add_argument("--p-sweep-G", type=int, default=8, help="G of the P sweep")
    parser.add_argument("--g-sweep-P", default="8K", help="P of the G sweep")
    parser.add_argument("--C", type=int, default=128, help="completion tokens per row")
    parser.add_argument("--chunk", type=int, default=4096, help="prefill_chunk_size of ours (library default)")
    parser.add_argument("--extra-chunks", default="", help="other prefill_chunk_size values run at the G-sweep P")
    parser.add_argument(
        "--completions",
        default="ragged",
        choices=["ragged", "full"],
        help="completion lengths: spread from C down to C/2 (as EOS ends them), or all C",
    )
    parser.add_argument(
        "--no-extra-full",
        dest="extra_full",
        action="store_false",
        help="skip the full-length-completion runs at the G-sweep P",
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads per configuration (see README)")
    parser.add_argument("--jobs", type=int, default=2, help="configurations run at once, each in its own process")
    parser.add_argument("--no-grad-ckpt", dest="grad_ckpt", action="store_false", help="disable gradient ckpt")
    parser.add_argument(
        "--no-reverse-ckpt", dest="reverse_ckpt", action="store_false", help="ours with reverse_checkpointing=False"
    )
    parser.add_argument(
        "--prefill-attention-reuse",
        dest="prefill_attention",
        action="store_true",
        help="ours (exact) with prefill_attention_reuse=True",
    )
    parser.add_argument("--timeout", type=float, default=400, help="wall seconds per configuration")
    parser.add_argument("--mem-limit-gib", type=float, default=6, help="growth at which a configuration is stopped")
    parser.add_argument("--budget-gib", type=float, default=2.0, help="growth budget of the largest-prompt estimate")
    parser.add_argument(
        "--search",
        default="stock",
        choices=["none", "stock", "all"],
        help="which implementations get a direct search for the largest prompt within the budget (ours: slow)",
    )
    parser.add_argument("--search-timeout", type=float, default=None, help="wall seconds per search run (--timeout)")
    parser.add_argument("--bisect-steps", type=int, default=2, help="bisection steps of --search")
    parser.add_argument("--quick", action="store_true", help="a few minutes: llama, P in {2K, 8K}, G in {2, 8}")
    parser.add_argument("--out", default=str(HERE), help="folder of RESULTS.md, results.json and plots/")
    parser.add_argument("--replot", action="store_true", help="rewrite RESULTS.md and plots from --out's results.json")
    args = parser.parse_args(argv)

    if args.worker:
        args.family = args.family or "llama"
        return worker(args)
    if args.replot:
        return replot(Path(args.out))

    if args.quick:
        args.family = args.family or "llama"
        args.stock_P, args.ours_P, args.G_list, args.extra_chunks = "2K,8K", "2K,8K", "2,8", ""
        args.extra_full, args.search = False, "none"
    from trl_longstraw.adapters import ADAPTERS
    from trl_longstraw.testing import save_tiny_model

    families = args.family.split(",") if args.family else default_families()
    for f in families:
        if f not in ADAPTERS:
            raise SystemExit(
                f"no adapter for {f!r} in trl_longstraw.adapters.ADAPTERS: choose among {sorted(ADAPTERS)}"
            )
    args.impls = args.impls.split(",")
    args.stock_P, args.ours_P = parse_sizes(args.stock_P), parse_sizes(args.ours_P)
    args.G_list, args.g_sweep_P = [int(g) for g in args.G_list.split(",")], parse_sizes(args.g_sweep_P)[0]
    args.extra_chunks = parse_sizes(args.extra_chunks)
    args.search_timeout = args.search_timeout or args.timeout

    command = " ".join(["python benchmarks/bench_step.py", *(shlex.quote(a) for a in (argv or sys.argv[1:]))])
    started = datetime.datetime.now().astimezone()
    date = f"{started:%Y-%m-%d %H:%M %Z}"
    print(f"{command}\n{date}; {hardware()}; {versions()}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench_models_"))
    model_paths = {f: str(save_tiny_model(tmp / f, f)) for f in families}

    plan = sweep_plan(args, families)
    print(f"{len(plan)} configurations, {args.jobs} at a time", flush=True)
    by_key = run_plan(args, model_paths, plan)
    records = [by_key[x] for x in plan]
    cache = dict(zip(plan, records, strict=True))
    searched = {"none": (), "stock": ("stock",), "all": tuple(args.impls)}[args.search]
    for family in families:
        for impl in (i for i in args.impls if i in searched):
            largest_fitting(args, model_paths, family, impl, args.budget_gib, 2048, 1 << 21, cache)
    extra = [r for key, r in cache.items() if key not in set(plan)]
    records += extra
    budgets = budget_estimates(records, families, args)
    elapsed = (datetime.datetime.now().astimezone() - started).total_seconds()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    raw = dict(
        command=command,
        date=date,
        hardware=hardware(),
        versions=versions(),
        elapsed_s=elapsed,
        load_average=", ".join(f"{x:.1f}" for x in os.getloadavg()),
        args={k: v for k, v in vars(args).items() if k not in ("worker", "impl", "P", "G", "model_path")},
        records=records,
        budgets=budgets,
    )
    (out / "results.json").write_text(json.dumps(raw, indent=1) + "\n")
    pngs = plots(records, families, out / "plots", args)
    md = report(args, families, records, budgets, raw)
    (out / "RESULTS.md").write_text("\n".join(md) + "\n")
    print("\n" + "\n".join(md[md.index("") + 1 :]))
    print(f"\nwrote {out / 'RESULTS.md'}, {out / 'results.json'}, {', '.join(str(p) for p in pngs)}")


def replot(folder: Path) -> None:
    """Rewrites `RESULTS.md` and the plots of `folder` from its `results.json`, without measuring anything."""
    raw = json.loads((folder / "results.json").read_text())
    args = argparse.Namespace(**raw["args"])
    families = list(dict.fromkeys(r["family"] for r in raw["records"]))
    plots(raw["records"], families, folder / "plots", args)
    budgets = budget_estimates(raw["records"], families, args)
    md = report(args, families, raw["records"], budgets, raw)
    (folder / "RESULTS.md").write_text("\n".join(md) + "\n")
    print(f"rewrote {folder / 'RESULTS.md'} and {folder / 'plots'} from {folder / 'results.json'}")


if __name__ == "__main__":
    main()
