"""Planner calibration: the capacity planner's item-by-item prediction next to measured peaks.

    OMP_NUM_THREADS=1 python benchmarks/calibrate_planner.py            # both parts, writes benchmarks/CALIBRATION.md
    OMP_NUM_THREADS=1 python benchmarks/calibrate_planner.py --gpu-only  # only the GPU table (seconds, no model runs)
    OMP_NUM_THREADS=1 python benchmarks/calibrate_planner.py --only qwen3_5 --sharded 8192  # 2 ranks, sharded state

GPU: every training step that the GPU check measured (`benchmarks/gpu/gpu_results.jsonl`, real-width slices of
Qwen3.6-27B, GLM-5.2 and Llama-3.1-70B on an H200, bf16 weights and gradients, no optimizer step) against the planner's
estimate of the same step: the same slice config (`benchmarks/gpu_check.py` `SLICES`), positions, group, completion
length and chunk, bf16 storage, no headroom, the optimizer state left out (the check runs no optimizer step). The
measured peak is `torch.cuda.max_memory_allocated`.

CPU: a tiny model of each family, in a fresh process each (fp32, gradient checkpointing, after a one-chunk warm-up
that allocates the parameter gradients): the engine's no-grad prefill of a prompt, then its exact-mode reverse pass
(the records' gradients set as the branches leave them). The measured figure is each phase's peak of the bytes
allocated through PyTorch's CPU allocator (the profiler's allocation events, as `max_memory_allocated` on CUDA), the
reverse's with the state and its gradients it starts with; beside it the resident set's peak growth (VmRSS sampled
every 0.2 ms; glibc returns large blocks at once, `MALLOC_MMAP_THRESHOLD_`) and their difference, the allocator's
fragmentation (negative where allocated pages are never touched). The planner's items: prompt state, its gradient
(exact mode) and chunk activations, detached mode's for the prefill, exact mode's for the reverse pass. The CPU
inventories' tensor counts (`plan.prefill_bytes`, `plan.reverse_bytes`) were read off `--trace` of the first widths
(`CPU_WIDTHS`) and of the widths in `TRACED_WIDTHS`; the `CPU_HELD_OUT` cases were measured after. The measurements
are stored in `calibration_cpu.json`; `--stored` rebuilds the tables from it with the current planner.

Sharded (`--sharded P`): the same phases on each rank of a 2-process `torchrun` launch (gloo) with the prompt state
sharded over both (`shard_prompt_state`: context-parallel rounds), measured by malloc's peak in all threads
(`malloc_peak`; the profiler misses the frees of gloo's worker threads), against the planner's per-GPU prediction of
the peak rank. `--trace FAMILY --sharded P` prints each rank's live allocations at its peaks.

Target (issue 14): every prediction within 10% of the measured peak, and never more than 5% below it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

GIB, MIB = 2**30, 2**20
TARGET_HIGH, TARGET_LOW = 0.10, 0.05

# CPU cases: tiny widths large enough that the step's tensors dominate the resident-set noise (a few MiB).
CPU_WIDTHS = {
    "llama": dict(hidden_size=256, intermediate_size=688, num_attention_heads=8, num_key_value_heads=2, head_dim=32),
    "qwen3_5": dict(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention"] * 2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
    ),
    "glm_moe_dsa": dict(
        hidden_size=256,
        intermediate_size=688,
        moe_intermediate_size=128,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=8,
        num_key_value_heads=8,
        n_routed_experts=8,
        num_experts_per_tok=2,
        kv_lora_rank=64,
        q_lora_rank=96,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        index_topk=256,
        index_head_dim=32,
        index_n_heads=4,
    ),
}
CPU_STEP = dict(P=6145, chunk=2048)
# Widths whose traces (`--trace FAMILY --widths NAME`) the inventories' counts were also read from: every width
# different, so that each live tensor's width names it (chunk 2048, P=4097).
TRACED_WIDTHS = {
    "llama-2": dict(hidden_size=256, intermediate_size=688, num_attention_heads=4, num_key_value_heads=2, head_dim=48),
    "llama-3": dict(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=48,
    ),
    "qwen3_5": dict(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention"] * 2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=48,
        linear_num_key_heads=2,
        linear_num_value_heads=6,
        linear_key_head_dim=40,
        linear_value_head_dim=24,
    ),
    "qwen3_5-one-group": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=64,
    ),
}
TRACED_STEP = dict(P=4097, chunk=2048)
# Held out: other widths, a chunk that does not divide the prompt, odd lengths. The inventories' tensor counts
# (`plan.PREFILL_RESIDUAL_TENSORS`, `plan.REVERSE_CHUNK_RESIDUALS`, ...) were read off the allocation traces of the
# `CPU_WIDTHS` and `TRACED_WIDTHS` cases; these cases were not looked at before the counts were set (but see
# benchmarks/CALIBRATION.md for the one structural fix made after: the Gated DeltaNet prefill's last group).
CPU_HELD_OUT = {
    "llama": dict(
        hidden_size=192,
        intermediate_size=1024,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=32,
    ),
    "qwen3_5": dict(
        hidden_size=192,
        intermediate_size=512,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention"] * 2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=6,
        linear_key_head_dim=32,
        linear_value_head_dim=48,
    ),
    # Measured after the DSA selection and sparse attention counts were read off the CPU_WIDTHS trace: here the
    # sparse attention's backward, not the selection, is the larger (2 indexer heads, 192 selected keys).
    "glm_moe_dsa": dict(
        hidden_size=192,
        intermediate_size=512,
        moe_intermediate_size=96,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=6,
        num_key_value_heads=6,
        n_routed_experts=4,
        num_experts_per_tok=2,
        kv_lora_rank=48,
        q_lora_rank=64,
        qk_rope_head_dim=16,
        qk_nope_head_dim=24,
        v_head_dim=24,
        index_topk=192,
        index_head_dim=24,
        index_n_heads=2,
    ),
}
CPU_HELD_OUT_STEP = dict(P=4001, chunk=1500)
# Sharded: `SHARDED_WORLD` CPU processes (gloo) with the prompt state sharded over them, the `CPU_WIDTHS` of these
# families, chunks of `SHARDED_CHUNK`, prompts of `SHARDED_P` tokens by default (context-parallel rounds of 2 chunks;
# the last round's second chunk one token short).
SHARDED_WORLD, SHARDED_CHUNK, SHARDED_P = 2, 2048, (8192, 16384)
SHARDED_FAMILIES = ("llama", "qwen3_5")
# What the prefill and the reverse pass hold beyond the weights and gradients, in the planner's terms.
PHASE_ITEMS = ("prompt state", "prompt state gradient", "chunk activations")
CPU_JSON = HERE / "calibration_cpu.json"


# ------------------------------------------------------------------------------------------------------- planner
def slice_config(model: str):
    """The text config of a GPU-check slice (`qwen3_5-slice`, ...), as `gpu_check.build_model` builds it."""
    from gpu_check import SLICES
    from transformers import AutoConfig, Qwen3_5TextConfig

    family = model.removesuffix("-slice")
    widths = dict(SLICES[family]["real"], pad_token_id=0, eos_token_id=1, bos_token_id=None)
    if family == "qwen3_5":
        return Qwen3_5TextConfig(**widths)
    return AutoConfig.for_model(family, **widths)


def predict(
    config,
    p: int,
    g: int,
    c: int,
    chunk: int,
    mode: str,
    weight_bytes: int,
    device: str = "cuda",
    gpus: int = 1,
    sharded: bool = False,
):
    """The planner's budget of one training step on one device, with `weight_bytes` weights, gradients and
    activations, and no headroom; with `sharded`, on one of `gpus` processes sharing the prompt state (replicated
    weights, as the CPU launch has them)."""
    from trl_longstraw import plan

    stats = plan.model_stats(plan.meta_model(config), config, state_dtype_bytes=weight_bytes)
    setup = plan.Setup(
        positions=p,
        completion_length=c,
        group_size=g,
        prefill_chunk_size=chunk,
        mode=mode,
        gpus=gpus,
        shard_prompt_state=sharded,
        fsdp=gpus == 1,
        gpu_memory=10**15,
        trainable_weight_bytes=weight_bytes,
        frozen_weight_bytes=weight_bytes,
        grad_bytes=weight_bytes,
        optimizer_bytes=2 * weight_bytes,
        compute_bytes=weight_bytes,
        headroom=0.0,
        device=device,
    )
    return plan.estimate(stats, setup)


def step_items(budget) -> dict[str, int]:
    """The budget's items that a step without an optimizer holds at its peak (the larger phased item only)."""
    phased = max((i for i in budget.items if i.phase), key=lambda i: i.nbytes)
    return {
        i.name: i.nbytes
        for i in budget.items
        if i.name not in ("optimizer state", "headroom") and (not i.phase or i is phased)
    }


# ----------------------------------------------------------------------------------------------------------- GPU
def gpu_rows() -> tuple[list[dict], dict[tuple[str, str], list[float]]]:
    """The GPU check's steps against the planner, and per (model type, mode) the activation multiples that the
    measured peaks imply (`plan.ACTIVATION_MULTIPLES`): what the peak holds beyond the weights, gradients, prompt
    state, its gradient and (exact mode) the checkpointed layer inputs, per chunk token and matmul element."""
    from trl_longstraw import plan

    rows, implied, configs = [], {}, {}
    for line in (HERE / "gpu" / "gpu_results.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("kind") != "step" or r.get("status") != "ok":
            continue
        config = configs.setdefault(r["model"], slice_config(r["model"]))
        budget = predict(config, r["P"], r["G"], r["C"], r["chunk"], r["mode"], 2)
        items = step_items(budget)
        case = f"{r['model']} {r['mode']} P={r['P']:,} G={r['G']}"
        row = dict(case=case, measured=r["peak_gib"] * GIB, **items)
        if "reserved_peak_gib" in r:  # the GPU check records it since 2026-12-02 (none of the stored runs has it)
            row["rss"] = r["reserved_peak_gib"] * GIB
        rows.append(row)
        s = budget.stats
        peak_phase = max((i for i in budget.items if i.phase), key=lambda i: i.nbytes).name
        if peak_phase != "chunk activations" or (
            r["mode"] == "detached" and plan.prefill_bytes(s, 2, r["chunk"]) is not None
        ):
            continue  # the peak is another phase's, or the prefill is itemized (`plan.prefill_bytes`): no multiple
        held = sum(v for k, v in items.items() if k not in ("chunk activations", "branch graph"))
        beyond = r["peak_gib"] * GIB - held
        if r["mode"] == "exact":
            beyond -= r["chunk"] * s.num_layers * s.hidden_size * 2
        # Items of the chunk that the multiples do not cover: the portable path's score tiles, GLM's DSA selection.
        beyond -= plan.score_tiles(s, 2, r["chunk"], autograd=r["mode"] == "exact")
        beyond -= plan.dsa_selection_bytes(s, r["chunk"], r["P"] - 1)
        implied.setdefault((config.model_type, r["mode"]), []).append(
            beyond / (r["chunk"] * s.layer_activation_elems * 2)
        )
    return rows, implied


# ----------------------------------------------------------------------------------------------------------- CPU
def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def allocated_peak(fn) -> tuple[int, object]:
    """`(peak growth of the bytes allocated through PyTorch's CPU allocator while fn() runs, its result)`: the
    running sum of the profiler's allocation and free events (`profile_memory`), as `torch.cuda.max_memory_allocated`
    counts on CUDA. Kernels' internal buffers are included; untouched pages of an allocation count too."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    live = top = 0
    for _, n in events:
        live += n
        top = max(top, live)
    return top, out


def live_at_peak(fn, depth: int = 3) -> tuple[int, dict[tuple[str, int], int], object]:
    """`(allocated peak growth, {(allocation site, bytes): count of such allocations still live at the peak}, fn())`:
    the allocations of `fn` that make up its allocated peak, from the profiler's event tree (`with_stack`). A site is
    where the allocation was made: the phase (`FWD`, a checkpointed layer's forward `CKPT`, the backward `BWD`), the
    innermost module and the innermost `depth` frames (Python and ATen)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof:
        out = fn()
    allocations = []

    def walk(node, chain):
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            allocations.append((node.start_time_ns, f.ptr, f.alloc_size, chain))
            return
        for child in node.children:
            walk(child, (*chain, node.name))

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, ())
    allocations.sort(key=lambda a: a[0])
    live = top = 0
    at = -1
    for i, (_, _, n, _) in enumerate(allocations):
        live += n
        if live > top:
            top, at = live, i
    alive = {}
    for a in allocations[: at + 1]:
        if a[2] > 0:
            alive[a[1]] = a
        else:
            alive.pop(a[1], None)
    sites: dict[tuple[str, int], int] = {}
    for _, _, n, chain in alive.values():
        phase = "BWD" if any("run_backward" in c for c in chain) else "FWD"
        if phase == "FWD" and any("checkpoint.py" in c for c in chain):
            phase = "CKPT"
        modules = [c.removeprefix("nn.Module: ") for c in chain if c.startswith("nn.Module")]
        key = f"{phase} {modules[-1] if modules else '-'} | " + " > ".join(c[-60:] for c in chain[-depth:])
        sites[key, n] = sites.get((key, n), 0) + 1
    return top, dict(sorted(sites.items(), key=lambda kv: -kv[0][1] * kv[1])), out


def _sampled_max(read, fn) -> tuple[int, object]:
    """`(the largest read() while fn() runs, fn()'s result)`: a thread samples `read` every 0.2 ms (torch releases the
    GIL in its ops), also once before and once after."""
    top, done = [read()], threading.Event()

    def sample():
        while not done.is_set():
            top[0] = max(top[0], read())
            time.sleep(0.0002)

    thread = threading.Thread(target=sample)
    thread.start()
    try:
        out = fn()
    finally:
        done.set()
        thread.join()
    return max(top[0], read()), out


def rss_peak(fn) -> tuple[int, object]:
    """`(peak VmRSS while fn() runs, its result)`, sampled (`_sampled_max`: resetting the kernel's high-water mark is
    not allowed everywhere)."""
    return _sampled_max(lambda: _status("VmRSS"), fn)


def malloc_peak(fn) -> tuple[int, object]:
    """`(peak growth of the bytes that glibc's malloc has handed out, in every thread, while fn() runs, its result)`:
    `mallinfo2()` (small blocks in use plus mmap'd ones) sampled (`_sampled_max`). Unlike the profiler's
    allocation events (`allocated_peak`), it sees the frees made in gloo's worker threads, which drop the last
    reference to a collective's tensors at times; unlike the resident set, it counts pages never touched."""
    import ctypes

    class Mallinfo2(ctypes.Structure):
        _fields_ = [
            (name, ctypes.c_size_t)
            for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks")
            + ("fordblks", "keepcost")
        ]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Mallinfo2

    def used() -> int:
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd

    start = used()
    top, out = _sampled_max(used, fn)
    return top - start, out


def cpu_case(family: str, held_out: bool = False, trace: str | None = None, sharded: int = 0) -> list[dict]:
    """A tiny `family` model in this process: the no-grad prefill (detached mode's chunk activations) and the
    exact-mode reverse pass (its chunk activations with autograd), each against the planner's items, after a warm-up
    that allocates the parameter gradients and the allocator's pools. Each phase runs twice: once under the
    profiler (the allocated peak, the measured figure), once under the resident-set sampler (its peak; the difference
    is the allocator's fragmentation and overhead, or pages allocated but never touched when negative). With
    `trace` ("" for `CPU_WIDTHS`, or a `TRACED_WIDTHS` name), prints what each phase holds at its peak instead.

    With `sharded` (a prompt length), this process is one rank of a `torchrun` launch of `SHARDED_WORLD` CPU
    processes (gloo) with the prompt state sharded over them (`shard_prompt_state`: context-parallel prefill and
    reverse rounds, `CPU_WIDTHS` and `SHARDED_CHUNK`); each rank measures its own phases, and rank 0 returns every
    rank's rows (the others return none). A trace is then printed rank by rank."""
    import gc
    import io

    import torch
    from transformers import AutoModelForCausalLM

    from trl_longstraw.adapters import get_adapter
    from trl_longstraw.engine import Engine, PromptGroup
    from trl_longstraw.testing import tiny_config

    torch.manual_seed(0)
    widths, step = (CPU_HELD_OUT[family], CPU_HELD_OUT_STEP) if held_out else (CPU_WIDTHS[family], CPU_STEP)
    if trace:
        widths, step = TRACED_WIDTHS[trace], TRACED_STEP
    shards, rank = None, 0
    if sharded:
        import torch.distributed as dist

        from trl_longstraw.sharding import PromptShards

        dist.init_process_group("gloo")
        shards, rank = PromptShards(), dist.get_rank()
        step = dict(P=sharded, chunk=SHARDED_CHUNK)
    config = tiny_config(family, vocab_size=512, **widths).get_text_config()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    p, chunk = step["P"], step["chunk"]
    engine = Engine(model, model, get_adapter(model), chunk_size=chunk, progress=False, shards=shards)
    held = {}  # phase -> bytes of the state and its gradients that it starts with

    def run(positions: int, measure) -> tuple[int, int]:
        """`(prefill, reverse)` peaks that `measure` reads, each above the phase's start (the reverse's start holds
        the state and its gradients, allocated between the two)."""
        # The same tokens on every rank of a sharded launch (the same seed, the same draws).
        group = PromptGroup(tokens=torch.randint(3, 512, (positions,)), pad=0, rows=[0])
        gc.collect()
        prefill, state = measure(lambda: engine.prefill(group, boundaries=True))
        state.requires_grad_()  # exact mode: the records are leaves, whose gradients the branches accumulate
        held["exact"] = 0
        for records in state.records.values():
            for record in records:
                for i, t in enumerate(record or ()):
                    held["exact"] += t.nbytes
                    # GLM's indexer keys (element 1) get no gradient (trl_longstraw/glm_moe_dsa.py).
                    if not (config.model_type == "glm_moe_dsa" and i == 1):
                        t.grad = torch.ones_like(t)
                        held["exact"] += t.nbytes
        gc.collect()
        reverse, _ = measure(lambda: engine.reverse(group, state))
        return prefill, reverse

    def rss_growth(fn) -> tuple[int, object]:
        start = _status("VmRSS")
        top, out = rss_peak(fn)
        return top - start, out

    run(chunk + 1, rss_growth)  # warm-up: parameter gradients, allocator pools
    if trace is not None:
        printed = io.StringIO()

        def traced(fn) -> tuple[int, object]:
            """Prints the live allocations at the allocated peak, each with its width per chunk token (elements of
            4 bytes), which is how the planner's inventories (`plan.prefill_bytes`, `plan.reverse_bytes`) count."""
            top, sites, out = live_at_peak(fn)
            print(f"peak {top / MIB:.2f} MiB allocated, {top / chunk:.0f} B per chunk token; live:", file=printed)
            for (site, n), count in sites.items():
                if n * count >= 2**14:
                    print(f"  {count:3d} x {n / MIB:8.3f} MiB  width {n / chunk / 4:8.1f}  {site}", file=printed)
            return top, out

        run(p, traced)
        texts = [printed.getvalue()]
        if shards is not None:
            texts = [None] * shards.world
            dist.all_gather_object(texts, printed.getvalue())
        if rank == 0:
            for r, text in enumerate(texts):
                print((f"rank {r}:\n" if shards is not None else "") + text, file=sys.stderr, flush=True)
        if shards is not None:
            dist.destroy_process_group()
        return []
    allocated = dict(zip(("detached", "exact"), run(p, allocated_peak), strict=True))
    rss = dict(zip(("detached", "exact"), run(p, rss_growth), strict=True))
    rows = [
        dict(family=family, held_out=held_out, mode=mode, measured=allocated[mode], rss=rss[mode])
        for mode in ("detached", "exact")
    ]
    if shards is None:
        return rows
    # Sharded, the measured figure is malloc's peak (`malloc_peak`): the profiler misses the frees that gloo's threads
    # make, so its running sum drifts up with the number of collectives (kept beside it as `profiler`).
    malloc = dict(zip(("detached", "exact"), run(p, malloc_peak), strict=True))
    for row in rows:
        # The reverse pass starts with this rank's state and its gradients, counted in its peak.
        row.update(P=p, chunk=chunk, rank=rank, world=shards.world, held=held.get(row["mode"], 0))
        row.update(profiler=row["measured"], measured=malloc[row["mode"]])
    everyone = [None] * shards.world
    dist.all_gather_object(everyone, rows)
    dist.destroy_process_group()
    return [row for rows in everyone for row in rows] if rank == 0 else []


def cpu_config(family: str, held_out: bool):
    """The text config of a CPU case's tiny model."""
    from trl_longstraw.testing import tiny_config

    widths = CPU_HELD_OUT[family] if held_out else CPU_WIDTHS[family]
    return tiny_config(family, vocab_size=512, **widths).get_text_config()


def cpu_predicted(measurements: list[dict]) -> list[dict]:
    """The CPU measurements (`cpu_case`) against the planner's items, as table rows."""
    rows = []
    for m in measurements:
        config = cpu_config(m["family"], m["held_out"])
        step = CPU_HELD_OUT_STEP if m["held_out"] else CPU_STEP
        p, chunk = step["P"], step["chunk"]
        budget = predict(config, p, 1, 1, chunk, m["mode"], 4, device="cpu")
        items = {i.name: i.nbytes for i in budget.items if i.name in PHASE_ITEMS}
        what = "no-grad prefill" if m["mode"] == "detached" else "reverse pass"
        # The reverse pass starts with the state and its gradients allocated: the planner's items include them.
        held = 0 if m["mode"] == "detached" else items["prompt state"] + items["prompt state gradient"]
        label = "held out" if m["held_out"] else "traced"
        rows.append(
            {
                "case": f"{m['family']} tiny ({label}: H={config.hidden_size}, P={p:,}, chunk {chunk:,}), {what}",
                "measured": m["measured"] + held,
                "rss": m["rss"] + held,
                **items,
            }
        )
    return rows


def _case_env() -> dict:
    """The environment of a measuring process: one thread, and glibc returning large blocks at once (so that the
    resident set follows what is allocated)."""
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MALLOC_MMAP_THRESHOLD_="65536",
        MALLOC_TRIM_THRESHOLD_="0",
        PYTHONPATH=str(ROOT),
    )


def cpu_measurements(only: list[str] | None = None) -> list[dict]:
    """Every CPU case (or those of the families `only`), each in a fresh process (run side by side: each measures
    only itself)."""
    env = _case_env()
    cases = [(family, []) for family in CPU_WIDTHS] + [(family, ["--held-out"]) for family in CPU_HELD_OUT]
    cases = [(family, flags) for family, flags in cases if not only or family in only]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--case", family, *flags],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for family, flags in cases
    ]
    rows = []
    for (family, flags), proc in zip(cases, procs, strict=True):
        stdout, stderr = proc.communicate()
        if proc.returncode:
            raise RuntimeError(f"{family}: {stderr[-2000:]}")
        rows += json.loads(stdout.strip().splitlines()[-1])
        print(f"  {family} {flags}: {[round(r['measured'] / MIB, 1) for r in rows[-2:]]} MiB", file=sys.stderr)
    return rows


def _when() -> dict:
    """When a measurement was taken: UTC time, load average and this process's nice value (the launched cases
    inherit it), for the provenance lines."""
    return dict(time=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), load_average=os.getloadavg(), nice=os.nice(0))


def _command(nice: int | None) -> str:
    """The measuring command's prefix, with the nice value it ran at where one was recorded and not 0."""
    return "OMP_NUM_THREADS=1 " + (f"nice -n {nice} " if nice else "") + "python benchmarks/calibrate_planner.py"


def sharded_measurements(families: list[str], sizes: list[int]) -> list[dict]:
    """The sharded CPU cases (`cpu_case` with `sharded`) of `families` at prompt lengths `sizes`, one `torchrun`
    launch of `SHARDED_WORLD` processes each, one after the other (each rank measures itself; both ranks of a launch
    share the machine's cores): every rank's rows, each with the launch's time and load."""
    env = _case_env()
    rows = []
    for family in families:
        for p in sizes:
            when = _when()
            command = [*_torchrun(), __file__, "--case", family, "--sharded", str(p)]
            result = subprocess.run(command, env=env, capture_output=True, text=True)
            if result.returncode:
                raise RuntimeError(f"{family} sharded P={p}: {(result.stdout + result.stderr)[-3000:]}")
            fresh = json.loads(result.stdout.strip().splitlines()[-1])
            rows += [dict(m, **when) for m in fresh]
            print(f"  {family} sharded P={p}: {[round(m['measured'] / MIB, 1) for m in fresh]} MiB", file=sys.stderr)
    return rows


def _torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(SHARDED_WORLD)]


def sharded_predicted(measurements: list[dict]) -> list[dict]:
    """The sharded CPU measurements against the planner's per-rank items, one row per launch and phase: the larger
    rank's measured peak (the reverse pass's with the state and its gradients it starts with)."""
    rows = []
    for key in dict.fromkeys((m["family"], m["P"], m["mode"]) for m in measurements):
        ranks = sorted((m for m in measurements if (m["family"], m["P"], m["mode"]) == key), key=lambda m: m["rank"])
        family, p, mode = key
        chunk, world = ranks[0]["chunk"], ranks[0]["world"]
        config = cpu_config(family, False)
        budget = predict(config, p, 1, 1, chunk, mode, 4, device="cpu", gpus=world, sharded=True)
        items = {i.name: i.nbytes for i in budget.items if i.name in PHASE_ITEMS}
        peaks = [m["measured"] + m["held"] for m in ranks]
        top = max(range(len(ranks)), key=peaks.__getitem__)
        what = "no-grad prefill" if mode == "detached" else "reverse pass"
        others = ", ".join(f"rank {r}: {peaks[r] / MIB:.2f}" for r in range(len(ranks)) if r != top)
        profiler = (ranks[top].get("profiler", ranks[top]["measured"]) + ranks[top]["held"]) / MIB
        rows.append(
            {
                "case": f"{family} tiny, {world} ranks (P={p:,}, chunk {chunk:,}), {what}: rank {top} ({others}; "
                f"profiler {profiler:.2f})",
                "measured": peaks[top],
                "rss": ranks[top]["rss"] + ranks[top]["held"],
                **items,
            }
        )
    return rows


# -------------------------------------------------------------------------------------------------------- report
def table(rows: list[dict], unit: int, unit_name: str) -> tuple[list[str], list[float]]:
    names = []
    for row in rows:
        names += [k for k in row if k not in ("case", "measured", "step_s", "rss") and k not in names]
    resident = any("rss" in row for row in rows)
    head = ["case", *names, "predicted", "measured", "predicted / measured"]
    if resident:
        head += ["held by the allocator (RSS; CUDA: reserved)", "fragmentation"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ratios = []
    for row in rows:
        predicted = sum(row.get(n, 0) for n in names)
        ratio = predicted / row["measured"]
        ratios.append(ratio)
        ok = "" if 1 - TARGET_LOW <= ratio <= 1 + TARGET_HIGH else " (outside the target)"
        cells = [row["case"], *(f"{row.get(n, 0) / unit:.2f}" for n in names)]
        cells += [f"{predicted / unit:.2f}", f"{row['measured'] / unit:.2f}", f"{ratio:.3f}{ok}"]
        if resident:
            cells += [f"{row['rss'] / unit:.2f}", f"{(row['rss'] - row['measured']) / row['measured']:+.1%}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.insert(0, f"Item columns and totals in {unit_name}.\n")
    return lines, ratios


HAND_NOTES = "## Notes by hand"


def hand_notes(path: Path) -> list[str]:
    """The lines of `path` from its `HAND_NOTES` heading to its end (notes written by hand, which a rewrite of the file
    from the template keeps), or none."""
    lines = path.read_text().split("\n") if path.exists() else []
    return lines[lines.index(HAND_NOTES) :] if HAND_NOTES in lines else []


def sharded_section(measurements: list[dict]) -> list[str]:
    """CALIBRATION.md's section of the sharded CPU rows (`sharded_measurements`)."""
    lines, ratios = table(sharded_predicted(measurements), MIB, "MiB")
    md = [
        f"## CPU, sharded: {SHARDED_WORLD} processes (gloo), tiny models, the prompt state sharded over them",
        "",
        f"`CPU_WIDTHS` as above (fp32), chunks of {SHARDED_CHUNK:,}, `shard_prompt_state`: context-parallel prefill",
        "and reverse rounds of one chunk per rank. Each rank measures its own phases: the peak of the bytes that",
        "malloc has handed out in all its threads (`malloc_peak`, sampled; the reverse pass's with the state and",
        "gradients it starts with, as this rank holds them). The profiler's allocated peak, which the single-process",
        "rows use, is in the case: it misses the frees made in gloo's worker threads, so it drifts up with the number",
        "of collectives (by 10 to 25 MiB here, and more at 16K than at 8K, where the resident set does not grow). The",
        "row is the larger rank's, the other's in the case. The planner's items are its per-GPU",
        f"prediction of a sharded setup over {SHARDED_WORLD} GPUs, the peak rank's: a later rank of a qwen3_5 round",
        "runs the delta rule on values widened by Dk columns (`plan.prefill_bytes` and `plan.reverse_bytes` with",
        "`widened`).",
        "",
    ]
    launches = {}
    for m in measurements:
        launches.setdefault((m["family"], m["time"], tuple(m["load_average"]), m.get("nice")), []).append(m["P"])
    for (family, when, load, nice), sizes in launches.items():
        flags = "".join(f" --sharded {p}" for p in dict.fromkeys(sizes))
        md.append(
            f"- {family}: measured by `{_command(nice)} --only {family}{flags}` at {when} "
            f"(load average {', '.join(f'{x:.1f}' for x in load)})."
        )
    md += ["", *lines, ""]
    md.append(
        f"Within the target: {sum(1 - TARGET_LOW <= r <= 1 + TARGET_HIGH for r in ratios)} of {len(ratios)}; "
        f"predicted / measured from {min(ratios):.3f} to {max(ratios):.3f}."
    )
    md += [
        "",
        "Notes:",
        "- The prefill rows are within the target: the attention layers' exchange of a round",
        "  (`plan.context_parallel_exchange`, counted from the code at the moments the traces show as peaks) goes",
        "  beside the gated MLP's phase, and the widened Gated DeltaNet phase (`plan.prefill_bytes` with `widened`)",
        "  is the other candidate; at these widths the exchange's phase is the larger on both families.",
        "- The reverse pass: a qwen3_5 rank peaks in the MLP backward beside the widened delta rule's graph (traced),",
        "  an attention layer's exchange in its own backward; the planner takes the larger of the two phases. llama,",
        "  whose layers are all attention, peaks at the exchange in an attention layer's backward, beside that",
        "  layer's graph and its own gradients (`plan.reverse_exchange_bytes`, counted from `--trace llama --sharded",
        "  8192`: the MLP's tensors of that layer are gone by then; counting them, as the planner did before, gave",
        "  1.187 / 1.118). On CUDA the multiples take the exchange and the widening as a sum.",
        "- Measured after main's change that makes sharded prompt passes compute the last layer's records alone",
        "  (97b1479). Before it, both qwen3_5 ranks also held the last layer's recomputed query side in the reverse",
        "  pass (about 14 MiB here, traced), and the prefill's exchange peaked in the last layer.",
        "- Rank 1 (the later rank: the widened rule) peaks 7 MiB above rank 0 in the qwen3_5 reverse pass, the",
        "  prefill 4 to 5 MiB; the planner reports the later rank.",
        "- The peaks do not drift with the prompt length beyond the state (8K to 16K: the state's 4 MiB per rank, and",
        "  its gradient in the reverse pass), unlike the profiler's figures.",
    ]
    return [*md, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu-only", action="store_true")
    parser.add_argument("--case", metavar="FAMILY", help=argparse.SUPPRESS)
    parser.add_argument("--held-out", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--trace",
        metavar="FAMILY",
        help="print what a tiny FAMILY model's prefill and reverse pass hold at their allocated peaks, by allocating "
        "call (llama, qwen3_5, glm_moe_dsa); nothing is written",
    )
    parser.add_argument(
        "--widths",
        choices=sorted(TRACED_WIDTHS),
        default="",
        help="with --trace: the widths of TRACED_WIDTHS (default: the CPU case's)",
    )
    parser.add_argument("--out", default=str(HERE / "CALIBRATION.md"))
    parser.add_argument(
        "--only",
        metavar="FAMILY",
        action="append",
        choices=sorted(CPU_WIDTHS),
        help=f"measure only this family's CPU rows (repeatable) and replace them in {CPU_JSON.name}, each with its "
        "own time and load; the other rows stay as stored",
    )
    parser.add_argument(
        "--stored",
        action="store_true",
        help=f"take the CPU measurements from {CPU_JSON.name} (written by the last full run) instead of measuring",
    )
    parser.add_argument(
        "--sharded",
        metavar="P",
        type=int,
        action="append",
        help=f"measure the sharded CPU rows ({SHARDED_WORLD} processes, gloo) of {', '.join(SHARDED_FAMILIES)} (or "
        f"the --only families) at prompt length P (repeatable) and replace them in {CPU_JSON.name}; the "
        "single-process rows stay as stored. With --trace: trace each rank of such a launch at P",
    )
    args = parser.parse_args()
    sharded = args.sharded[0] if args.sharded else 0
    if args.case:
        rows = cpu_case(args.case, args.held_out, sharded=sharded)
        if rows or not sharded:  # sharded: rank 0 prints every rank's rows
            print(json.dumps(rows), flush=True)
        return
    if args.trace:
        if sharded and "RANK" not in os.environ:  # launch the ranks
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
            subprocess.run([*_torchrun(), __file__, *sys.argv[1:]], env=env, check=True)
            return
        cpu_case(args.trace, trace=args.widths, sharded=sharded)
        return
    command = _command(os.nice(0)) + (" --gpu-only" if args.gpu_only else "")
    command += " --stored" if args.stored and not args.gpu_only else ""
    command += "".join(f" --only {family}" for family in args.only or ()) if not args.stored else ""
    command += "".join(f" --sharded {p}" for p in args.sharded or ()) if not args.stored else ""
    md = [
        "# Planner calibration",
        "",
        f"Written by `{command}` at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. The planner's prediction of",
        "each item next to the measured peak; target: within 10% of it and never more than 5% below (issue 14). See",
        "the script's docstring for what is measured and how.",
        "",
        "## GPU: the GPU check's steps (H200, bf16, real-width slices; measured 2026-11-30)",
        "",
    ]
    rows, implied = gpu_rows()
    lines, gpu = table(rows, GIB, "GiB")
    md += lines
    from trl_longstraw.plan import activation_multiples

    md += [
        "",
        "Activation multiples that the measured peaks imply (per chunk token and matmul element, in the compute",
        "dtype; `plan.ACTIVATION_MULTIPLES` holds the largest, rounded up to 0.05):",
        "",
        "| model type | mode | implied, min to max | planner |",
        "|---|---|---|---|",
    ]
    for (model_type, mode), values in implied.items():
        planner = activation_multiples(model_type)[0 if mode == "detached" else 1]
        md.append(f"| {model_type} | {mode} | {min(values):.3f} to {max(values):.3f} | {planner} |")
    md += [
        "",
        f"Within the target: {sum(1 - TARGET_LOW <= r <= 1 + TARGET_HIGH for r in gpu)} of {len(gpu)}; "
        f"predicted / measured from {min(gpu):.3f} to {max(gpu):.3f}.",
        "",
    ]
    if not args.gpu_only:
        md += [
            f"## CPU: tiny models, a fresh process each (fp32, a {CPU_STEP['P']:,}-token prompt in chunks of "
            f"{CPU_STEP['chunk']:,}): the no-grad prefill and the exact-mode reverse pass",
            "",
        ]
        if args.stored:
            stored = json.loads(CPU_JSON.read_text())
        elif args.sharded:
            stored = json.loads(CPU_JSON.read_text())
            families = args.only or list(SHARDED_FAMILIES)
            fresh = sharded_measurements(families, args.sharded)
            again = {(m["family"], m["P"]) for m in fresh}
            kept = [m for m in stored.get("sharded", []) if (m["family"], m["P"]) not in again]
            stored["sharded"] = sorted(
                kept + fresh, key=lambda m: (list(CPU_WIDTHS).index(m["family"]), m["P"], m["mode"], m["rank"])
            )
            CPU_JSON.write_text(json.dumps(stored, indent=1) + "\n")
        elif args.only:
            stored = json.loads(CPU_JSON.read_text())
            when = _when()
            fresh = [dict(m, **when) for m in cpu_measurements(args.only)]
            kept = [m for m in stored["measurements"] if m["family"] not in args.only]
            order = [(f, h) for h in (False, True) for f in CPU_WIDTHS]  # the full run's order
            stored["measurements"] = sorted(kept + fresh, key=lambda m: order.index((m["family"], m["held_out"])))
            CPU_JSON.write_text(json.dumps(stored, indent=1) + "\n")
        else:
            stored = dict(_when(), measurements=cpu_measurements())
            CPU_JSON.write_text(json.dumps(stored, indent=1) + "\n")
        lines, cpu = table(cpu_predicted(stored["measurements"]), MIB, "MiB")
        load = ", ".join(f"{x:.1f}" for x in stored["load_average"])
        md += [
            f"Measured by `{_command(stored.get('nice'))}` at "
            f"{stored['time']} (load average {load} on 2 cores; allocated bytes do not depend on the load),",
            f"stored in `{CPU_JSON.name}`; the predictions are the current planner's (`--stored`).",
        ]
        for family in CPU_WIDTHS:
            again = {
                m["time"]: (m["load_average"], m.get("nice"))
                for m in stored["measurements"]
                if m["family"] == family and "time" in m
            }
            for when, (load, nice) in again.items():
                md.append(
                    f"The {family} rows were measured again by `{_command(nice)} --only {family}` at {when} "
                    f"(load average {', '.join(f'{x:.1f}' for x in load)})."
                )
        md += [
            "",
            "Dense models have CPU inventories, each tensor counted from `--trace` (`CPU_WIDTHS` and",
            "`TRACED_WIDTHS` in the script; the held-out rows were not traced): the no-grad prefill",
            "(`plan.prefill_bytes`: residual tensors, the gated MLP's transients or the Gated DeltaNet fallback's",
            "projections and its fp32 work tensors per group of blocks) and the exact-mode reverse pass",
            "(`plan.reverse_bytes`, on CPU only: the chunk's residuals and records, and layer L-2's graph with",
            "its MLP gradients; the last layer computes its records alone in the prompt passes). The CUDA",
            "reverse pass and MoE models keep the activation multiples calibrated on the GPU rows above;",
            "glm_moe_dsa's DSA selection and sparse attention have a CPU inventory beside them (`plan.dsa_bytes`:",
            "the larger of the two, each tensor counted from traces). Measured figure: PyTorch's allocated peak;",
            "resident set and fragmentation beside it (the resident set misses pages never touched). The memory",
            "guard does not run on CPU.",
            "",
        ]
        md += lines
        md += [
            "",
            f"Within the target: {sum(1 - TARGET_LOW <= r <= 1 + TARGET_HIGH for r in cpu)} of {len(cpu)}; "
            f"predicted / measured from {min(cpu):.3f} to {max(cpu):.3f}.",
            "",
            "Notes:",
            "- Out of sample: the held-out rows' widths were never traced. One structural fix was made after the",
            "  held-out qwen3_5 prefill was first seen (1.329): the Gated DeltaNet prefill's last group of blocks may",
            "  be shorter than the others (`plan.delta_rule_prefill_bytes` takes the largest over the real groups);",
            "  no count was changed for it. The reverse-pass rows (llama 1.013, qwen3_5 1.047 held out) and the llama",
            "  prefill were predicted before being measured. tests/test_plan.py checks both inventories at a third",
            "  set of widths (H=96, three delta-rule groups).",
            "- qwen3_5's reverse inventory was traced again (`--trace qwen3_5`, at `CPU_WIDTHS` and `--widths",
            "  qwen3_5`) after its delta rule got the hand-written backward (`qwen3_5._DeltaRuleFunction`): what it",
            "  saves (`plan.delta_rule_saved_bytes`, checked byte for byte against its saved tensors in",
            "  tests/test_plan.py) and what the layer keeps around it (`plan.REVERSE_DELTA_RULE`), in place of the",
            "  plain rule's autograd inventory. Reverse pass 1.075 / 1.065 -> 1.001 / 1.002 (traced / held out), the",
            "  sharded rows 1.082 / 1.077 -> 1.012 / 1.011 (with 3 gate tensors of the last attention layer, then",
            "  live at the peak). The prompt passes then stopped running the last layer's attention output projection",
            "  (`Engine._records_only`), which freed its query projection, gate and gated output (qwen3_5's reverse",
            "  peaks 136.66 -> 126.66 and 82.33 -> 76.84 MiB), and the planner stopped counting the gate tensors.",
            "- The prompt passes now compute the last layer's records alone (no MLP, final norm or attention output:",
            "  `Engine._records_only`). The llama and qwen3_5 rows were measured again after that change (reverse",
            "  pass: llama 112.4 -> 73.9 MiB, qwen3_5 195.3 -> 152.6 MiB). The reverse inventory lost the last",
            "  layer's dead graph. The prefill's MLP peak moved to an earlier layer, where the chunk's records of a",
            "  last attention layer are not written yet (and, with two layers, the layer's input is the embeddings):",
            "  read off new traces (`--trace llama`, `--trace llama --widths llama-3`) after the llama prefill rows",
            "  were seen outside the target (1.108 traced, 1.118 held out; 0.999 and 1.078 with the new count).",
            "- glm_moe_dsa: its rows were 0.853 and 0.896 (436.8 and 508.4 MiB measured). Both peaks were in the DSA",
            "  top-k merge (`glm_moe_dsa._keep_topk`), which built full-width copies of every candidate: fp32 scores",
            "  and a copy, int64 key numbers, the tie mask's int64 cast and cumsum, two bool masks (34 bytes per",
            "  candidate). The merge now holds the block's scores and a keep mask (the cut-off from the block's own",
            "  top k, tie ranks in int32 slices, the kept values gathered from the running set and the block): the",
            "  same selection bitwise. The indexer tile is scaled in place, and the sparse attention frees each block",
            "  before building the next and copies routed rows in slices. The peaks fell to 268.7 and 365.3 MiB, then",
            "  to 261.2 and 308.1 MiB once the prompt passes stopped running the last layer's attention and MLP",
            "  (main, `Pass.outputs_unread`): the prefill's peak is the indexer tile, the reverse's the sparse",
            "  attention's backward.",
            "- On CPU the planner counts these two from the code (`plan.dsa_selection_bytes`,",
            "  `plan.sparse_attention_bytes`). The counts were read off `--trace glm_moe_dsa` and off traces of",
            "  `select_topk` and `sparse_latent_attention` alone at other widths (within 0.1% there, up to +5% where",
            "  a tie-rank slice is the peak; tests/test_plan.py checks both at two more widths).",
            "- The rest of a GLM layer uses CPU multiples (`plan.CPU_ACTIVATION_MULTIPLES`: 0.5 no grad, 0.7 with",
            "  autograd), fitted on the traced rows (implied 0.29 and 0.66; the held-out rows imply 0.45 and 0.58).",
            "  The CUDA multiples (2.0 with autograd) were fitted on GPU steps that still ran the last layer, and",
            "  gave 1.20 on the traced reverse row. tests/test_plan.py checks the whole GLM prediction at a third set",
            "  of widths (H=96, 2 indexer heads, top-k 64): 1.050 and 1.057.",
            "- On CUDA the selection term and the multiples that the GPU rows were fitted with are unchanged, so the",
            "  GPU table did not move. Those runs predate these changes (and the Triton kernels now used on CUDA), so",
            "  it errs high there.",
            "- The held-out GLM widths (2 indexer heads, top-k 192: there the sparse attention is the larger) were",
            "  first measured against an intermediate count (1.080 and 1.050). The merge's count was then reduced",
            "  after two more copies were removed, and the attention's forward was counted as the larger of its",
            "  gather and its scores, both from the isolated traces. They were measured again after main's",
            "  last-layer change, and then the CPU multiples were fitted with both traced and held-out rows in view.",
            "",
        ]
        if stored.get("sharded"):
            md += sharded_section(stored["sharded"])
    md += hand_notes(Path(args.out))
    Path(args.out).write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
