"""The GPU check's Python stages (driven by `benchmarks/gpu_check.sh`; see benchmarks/README.md).

Stages, each run as its own process under a time limit:

- `env`: versions and device; the fused-kernel path of `prefix_merge_attention` (on CUDA each SDPA backend that
  returns the log-sum-exp: FlashAttention-2 and cuDNN) against the portable path and the plain reference on the
  device (bf16, grouped-query heads, several prefix chunks, T=1, every gradient), timed; the fastest exact backend is
  used by the model stages; a tiny model's exact-mode gradients against stock `GRPOTrainer` on the device (fp32).
- `whole_step --model NAME`: whole GRPO steps through `trainer.train()` on the slice (issue 13): generation with our
  decoder against the prompt state, then the loss pass, which takes generation's state (exact mode, G=8, C=128
  sampled tokens, one optimizer step). A doubling search over P as in `model`, keeping a fifth of the budget for stock
  `GRPOTrainer`'s step at the smallest P, run if predicted to fit. Per step: generation, loss and whole-step time,
  each phase's peak memory (reset at its start) and growth, the generation / loss peak ratio (target <= 1.1), and the
  prefills per distinct prompt, hook-counted on the backbone (one per step, shared by generation and loss).
- `kernels`: the CUDA kernels against their PyTorch references at real widths, for correctness and time: the Triton
  DSA selection and sparse MLA (`trl_longstraw.dsa_kernels`, GLM-5's widths) and flash-linear-attention's Gated
  DeltaNet rule and causal conv (Qwen3.6-27B's widths; the torch paths when fla is not installed).
- `model --model NAME`: a real-width slice of a model (`SLICES`), in bf16. For `detached` and `exact` mode, a
  doubling search over prompt positions (G=8, C=128) up to `--max-positions`, each step timed, with its peak memory
  (`torch.cuda.max_memory_allocated`) and growth over the memory held before the step; the search stops when the
  next step is predicted to overrun the stage's time budget, or on OOM. Then peak memory at G=2 against G=8, and the
  capacity planner's prediction (`python -m trl_longstraw.plan`) where the planner exists.
- `bf16`: mixed precision end to end: `trainer.train()` under TRL's default `bf16=True` (autocast over fp32 weights),
  exact mode, ours against stock `GRPOTrainer`, each measured against stock fp32 on the same completions
  (`tests/precision.py`), with the criterion of `tolerances.BF16_ERROR_FACTOR`: a tiny llama, a tiny Qwen3.5 and a
  real-width Llama-3.1-70B layer (`BF16_SLICE`: the fused flash-attention path on CUDA).
- `summary`: `gpu_results.md` from `gpu_results.jsonl`.

Every measurement is appended to `$OUT/gpu_results.jsonl` as soon as it is taken, so a stage that is stopped
leaves what it measured. `--device cpu --tiny` runs the same code with tiny widths on CPU (a test runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import re
import runpy
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(HERE))  # bench_whole_step

GIB = 2**30
MAX_POSITIONS = 2_100_000

# Real widths of each model, fewer layers. Counts that are not widths may be cut too (GLM's routed experts: 256 would
# not fit one GPU; each expert keeps its real width). `tiny` replaces the widths for `--tiny`.
SLICES = {
    "qwen3_5": dict(
        name="Qwen3.6-27B slice: 8 layers (6 Gated DeltaNet, 2 full attention), real widths",
        family="qwen3_5",
        real=dict(
            vocab_size=248320,
            hidden_size=5120,
            intermediate_size=17408,
            num_hidden_layers=8,
            layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
            num_attention_heads=24,
            num_key_value_heads=4,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=48,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            max_position_embeddings=1 << 22,
            tie_word_embeddings=False,
        ),
        tiny=dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention"] * 2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            max_position_embeddings=1 << 22,
            tie_word_embeddings=False,
        ),
    ),
    "glm_moe_dsa": dict(
        name="GLM-5.2 slice: 8 layers (3 dense, 5 MoE with 16 of 256 routed experts), MLA + DSA, real widths",
        family="glm_moe_dsa",
        real=dict(num_hidden_layers=8, n_routed_experts=16, max_position_embeddings=1 << 22),
        tiny=dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            num_attention_heads=4,
            num_key_value_heads=4,
            n_routed_experts=4,
            num_experts_per_tok=2,
            kv_lora_rank=32,
            q_lora_rank=48,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            index_topk=64,
            index_head_dim=16,
            index_n_heads=2,
            max_position_embeddings=1 << 22,
        ),
    ),
    "llama": dict(
        name="Llama-3.1-70B slice: 4 layers, real widths (generic KV-cache adapter)",
        family="llama",
        real=dict(
            vocab_size=128256,
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=4,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=1 << 22,
            tie_word_embeddings=False,
        ),
        tiny=dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=1 << 22,
            tie_word_embeddings=False,
        ),
    ),
}


# The real-width model of the bf16 stage: one layer of Llama-3.1-70B's widths (64/8 heads of dim 128: the fused
# kernel's shapes), the test tokenizer's vocabulary. fp32 weights, as loaded from a path: 3.4 GB.
BF16_SLICE = {k: v for k, v in SLICES["llama"]["real"].items() if k != "vocab_size"} | dict(num_hidden_layers=1)


# ------------------------------------------------------------------------------------------------------- plumbing
class Results:
    """Appends one JSON object per line to `path`, flushed at once, and echoes a short line."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, **record) -> None:
        record.setdefault("time", time.strftime("%Y-%m-%d %H:%M:%S"))
        with open(self.path, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        short = {k: v for k, v in record.items() if k not in ("planner_output", "time")}
        print("RESULT", json.dumps(short, default=str)[:600], flush=True)


def watchdog(seconds: float, results: Results, stage: str) -> None:
    """Ends the process after `seconds`, leaving a record, so that the next stage still runs."""

    def fire():
        results.add(kind="stage_timeout", stage=stage, seconds=seconds)
        os._exit(124)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()


class Memory:
    """Peak and current memory of the device: the CUDA allocator's, or on CPU the process's resident set."""

    def __init__(self, device: str):
        self.device = device

    def _status(self, field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

    def sync(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()

    def reset_peak(self) -> None:
        import torch

        self.sync()
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")

    def current(self) -> int:
        import torch

        self.sync()
        return torch.cuda.memory_allocated() if self.device == "cuda" else self._status("VmRSS")

    def peak(self) -> int:
        import torch

        self.sync()
        return torch.cuda.max_memory_allocated() if self.device == "cuda" else self._status("VmHWM")


def rel_err(a, b) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------------------------------- env stage
def _rand(generator, device: str, *shape):
    import torch

    return torch.randn(*shape, generator=generator, device=device, dtype=torch.float32).to(torch.bfloat16)


def _attend_and_grad(fn, q, k, v, prefix, grad_out, upcast: bool, device: str):
    """`fn(q, k, v, prefix)` on fresh leaves (fp32 copies with `upcast`); output, all gradients, seconds, grad_fn."""
    import torch

    leaves = [x.detach().clone().float() if upcast else x.detach().clone() for x in (q, k, v)]
    pre = [tuple(x.detach().clone().float() if upcast else x.detach().clone() for x in kv) for kv in prefix]
    flat = leaves + [x for kv in pre for x in kv]
    for x in flat:
        x.requires_grad_(True)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn(*leaves, pre, q.shape[-1] ** -0.5)
    grads = torch.autograd.grad((out.float() * grad_out.float()).sum(), flat)
    if device == "cuda":
        torch.cuda.synchronize()
    return out, grads, time.perf_counter() - t0, type(out.grad_fn).__name__


def attention_check(device: str, tiny: bool, results: Results) -> str | None:
    """The kernel path (on CUDA each SDPA backend of `attention.CUDA_BACKENDS`, all of which return the log-sum-exp)
    and the portable path of `prefix_merge_attention` against `reference_attention` on `device`.

    Returns the fastest backend whose output and every gradient are within the bf16 relative tolerance of the table
    in every case (`"cpu"` for the CPU kernel), or None when none is."""
    import torch
    from tolerances import ATTN_RTOL_BF16

    from trl_longstraw import attention

    # (Hq, Hkv, D, T, prefix chunk sizes): Qwen3.6 full attention (24/4, 256) as a branch and as a prefill chunk,
    # Llama-70B-like (64/8, 128) at T=1, and MHA.
    cases = [(24, 4, 256, 128, [4096, 1000, 77]), (24, 4, 256, 2048, [2048, 333]), (64, 8, 128, 1, [3000, 5])]
    cases.append((8, 8, 64, 97, [513]))
    if tiny:
        cases = [(4, 2, 16, 9, [13, 5]), (4, 2, 16, 1, [7]), (4, 4, 16, 5, [3])]
    backends = attention.CUDA_BACKENDS if device == "cuda" else ("cpu",)
    paths = [("kernel", backend) for backend in backends] + [("portable", None)]
    totals = {backend: 0.0 for backend in backends}  # fwd+bwd seconds over the cases; None once one fails
    for hq, hkv, d, t, sizes in cases:
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v, grad_out = (_rand(g, device, 1, h, t, d) for h in (hq, hkv, hkv, hq))
        prefix = [(_rand(g, device, 1, hkv, s, d), _rand(g, device, 1, hkv, s, d)) for s in sizes]

        def run(fn, upcast, inputs=(q, k, v, prefix, grad_out)):
            return _attend_and_grad(fn, *inputs, upcast=upcast, device=device)

        ref, ref_grads, _, _ = run(attention.reference_attention, upcast=True)
        for path, backend in paths:
            attention.USE_KERNELS = path == "kernel"
            if device == "cuda" and backend is not None:
                attention.CUDA_BACKEND = backend
            try:
                run(attention.prefix_merge_attention, upcast=False)  # warm-up (kernel selection, allocator)
                out, grads, seconds, fn = run(attention.prefix_merge_attention, upcast=False)
                errs = [float((out.detach().float() - ref.detach()).abs().max())] + [
                    float((a.float() - b).abs().max()) for a, b in zip(grads, ref_grads, strict=True)
                ]
                rels = [rel_err(out, ref)] + [rel_err(a, b) for a, b in zip(grads, ref_grads, strict=True)]
                ok = max(rels) <= ATTN_RTOL_BF16
                error = None
            except Exception as e:  # a kernel refusing these shapes is a finding, not a crash of the check
                ok, errs, rels, seconds, fn, error = False, [], [], None, None, f"{type(e).__name__}: {e}"[:300]
            finally:
                attention.USE_KERNELS = True
                attention.CUDA_BACKEND = "flash"
            if backend is not None and totals[backend] is not None:
                totals[backend] = totals[backend] + seconds if ok else None
            results.add(
                kind="attention_check",
                path=path,
                backend=backend,
                function=fn,
                case=dict(Hq=hq, Hkv=hkv, D=d, T=t, prefix=sizes),
                max_abs_err=max(errs) if errs else None,
                max_rel_err=max(rels) if rels else None,
                rel_tolerance=ATTN_RTOL_BF16,
                ok=ok,
                seconds_fwd_bwd=seconds,
                error=error,
            )
    exact = {backend: total for backend, total in totals.items() if total is not None}
    choice = min(exact, key=exact.get) if exact else None
    results.add(kind="attention_backend", choice=choice, seconds_fwd_bwd=totals, default="flash")
    return choice


def e2e_check(device: str, results: Results) -> None:
    """A tiny llama's exact-mode loss and gradients against stock GRPOTrainer's, on `device`, in fp32."""
    import torch
    from datasets import Dataset
    from tolerances import GRAD_RTOL
    from trl import GRPOConfig, GRPOTrainer

    from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer
    from trl_longstraw.testing import build_tokenizer, random_micro_batch, save_tiny_model

    path = save_tiny_model(tempfile.mkdtemp(prefix="gpu_check_tiny_"), "llama")
    common = dict(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=9,
        report_to=[],
        use_cpu=device == "cpu",
        beta=0.1,
        loss_type="bnpo",
        bf16=False,
    )
    ds = Dataset.from_dict({"prompt": ["a b c"] * 4})

    def reward(completions, **kwargs):
        return [0.0] * len(completions)

    stock = GRPOTrainer(str(path), reward, GRPOConfig(**common), train_dataset=ds)
    ours = LongStrawGRPOTrainer(
        str(path),
        reward,
        LongStrawGRPOConfig(**common, prefill_chunk_size=5, prefill_progress=False),
        train_dataset=ds,
    )
    mb = random_micro_batch([13, 7, 1], [9, 1, 5, 3], [0, 1, 0, 2], len(build_tokenizer()), seed=1)
    mb["ref_per_token_logps"] = -torch.rand(mb["completion_ids"].shape) * 5
    mb = {k: v.to(stock.accelerator.device) for k, v in mb.items()}
    out = []
    for t in (stock, ours):
        t._prepare_inputs = lambda x: x
        t.current_gradient_accumulation_steps = 1
        t.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        loss = t.training_step(t.model, dict(mb), mb["num_items_in_batch"])
        out.append((loss, {n: p.grad for n, p in t.model.named_parameters() if p.grad is not None}))
    (l1, g1), (l2, g2) = out
    worst = max(rel_err(g2[n], g1[n]) for n in g1)
    results.add(
        kind="e2e_check",
        what="tiny llama fp32, exact mode vs stock GRPOTrainer (bnpo, beta=0.1, gradient checkpointing)",
        device=str(stock.accelerator.device),
        loss_diff=float((l1 - l2).abs()),
        worst_grad_rel_err=worst,
        missing_grads=sorted(set(g1) - set(g2)),
        tolerance=GRAD_RTOL,
        ok=worst <= GRAD_RTOL and set(g1) == set(g2),
    )


def stage_env(args, results: Results) -> None:
    import torch
    import transformers
    import trl

    info = dict(
        kind="env",
        python=sys.version.split()[0],
        torch=torch.__version__,
        cuda=torch.version.cuda,
        transformers=transformers.__version__,
        trl=trl.__version__,
        device=args.device,
    )
    if args.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=props.total_memory / GIB, sm=f"{props.major}.{props.minor}")
    for name in ("accelerate", "peft", "datasets"):
        with contextlib.suppress(Exception):
            info[name] = __import__(name).__version__
    from trl_longstraw.adapters import ADAPTERS

    info["adapters"] = sorted(ADAPTERS)
    info["planner"] = planner_available()
    results.add(**info)
    backend = attention_check(args.device, args.tiny, results)
    (Path(args.out) / "kernel_ok").write_text("0" if backend is None else "1")
    (Path(args.out) / "attention_backend").write_text(backend or "")
    try:
        e2e_check(args.device, results)
    except Exception as e:
        results.add(kind="e2e_check", ok=False, error=f"{type(e).__name__}: {e}"[:500])


# ------------------------------------------------------------------------------------------------- kernels stage
def timed(fn, device: str, repeat: int = 3):
    """`(result of the last call, median seconds of `repeat` calls)`, after one warm-up call (Triton compiles then).
    `--tiny` times one call: its CPU times are no measurement, only a test of this script."""
    import torch

    fn()
    times, out = [], None
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return out, sorted(times)[len(times) // 2]


@contextlib.contextmanager
def dsa_kernels_off():
    """glm_moe_dsa's PyTorch reference path for the block, even on CUDA."""
    try:
        from trl_longstraw import dsa_kernels
    except ImportError:  # no Triton: the reference runs anyway
        yield
        return
    dsa_kernels.USE_KERNELS = False
    try:
        yield
    finally:
        dsa_kernels.USE_KERNELS = True


def _grads_of(function, inputs: list, grad_outs: list, leaves: list[int]):
    """`function(*inputs)`'s outputs and the gradients of `sum(out * grad_out)` with respect to `inputs[i]`, i in
    `leaves` (fresh leaves each call)."""
    import torch

    xs = [x.detach().clone().requires_grad_(i in leaves) if torch.is_tensor(x) else x for i, x in enumerate(inputs)]
    outs = function(*xs)
    loss = sum((o.float() * g.float()).sum() for o, g in zip(outs, grad_outs, strict=True) if g is not None)
    return outs, torch.autograd.grad(loss, [xs[i] for i in leaves], allow_unused=True, materialize_grads=True)


def _rel_errors(names, got, want) -> dict[str, float]:
    return {name: rel_err(a, b) for name, a, b in zip(names, got, want, strict=True)}


def dsa_check(device: str, tiny: bool, results: Results) -> None:
    """Triton DSA kernels (`trl_longstraw.dsa_kernels`) against `glm_moe_dsa`'s PyTorch reference at GLM-5's widths:
    the selection (random bf16 inputs, and integer inputs with many exact ties) and sparse MLA forward and backward
    (bf16 against an fp32 reference), each timed against the reference on the same bf16 inputs."""
    import torch
    from tolerances import ATTN_RTOL_BF16

    from trl_longstraw import glm_moe_dsa as glm

    try:
        from trl_longstraw import dsa_kernels
    except ImportError as e:
        results.add(kind="dsa_check", part="import", ok=False, error=f"{type(e).__name__}: {e}"[:300])
        return
    dsa_kernels.ON_CPU = device == "cpu"  # CPU: Triton's interpreter (TRITON_INTERPRET=1, set by main)
    g = torch.Generator(device=device).manual_seed(0)
    repeat = 1 if tiny else 3
    bf16 = torch.bfloat16

    # Selection: S queries of a prefill chunk after two record chunks; GLM-5's indexer (32 heads of 128, top 2048).
    s, chunks, heads, dim, topk = (6, [7, 5], 2, 16, 4) if tiny else (2048, [16384, 16384], 32, 128, 2048)
    sizes, query_start = chunks + [s], sum(chunks)
    total = query_start + s
    for case in ("random", "ties"):
        if case == "ties":  # integers: every score exact, many equal at the cut-off
            q = torch.randint(-2, 3, (s, heads, dim), generator=g, device=device).to(bf16)
            weights = torch.randint(0, 3, (s, heads), generator=g, device=device).float()
            keys = [torch.randint(-2, 3, (n, dim), generator=g, device=device).to(bf16) for n in sizes]
            scale = 1.0
        else:
            q = torch.randn(s, heads, dim, generator=g, device=device).to(bf16)
            weights = torch.randn(s, heads, generator=g, device=device) * heads**-0.5
            keys = [torch.randn(n, dim, generator=g, device=device).to(bf16) for n in sizes]
            scale = dim**-0.5
        args = (q, weights, keys, query_start, topk, scale)
        try:
            with dsa_kernels_off():
                ref, ref_s = timed(lambda args=args: glm.select_topk(*args), device, repeat)
            got, got_s = timed(lambda args=args: dsa_kernels.select_topk(*args), device, repeat)
            chosen = torch.zeros(s, total + 1, dtype=torch.bool, device=device)
            chosen.scatter_(1, torch.where(ref >= 0, ref, total), True)
            found = chosen.gather(1, torch.where(got >= 0, got, total)) & (got >= 0)
            recall = float(found.sum() / (ref >= 0).sum())
            same = float((got.sort(dim=1).values == ref.sort(dim=1).values).all(dim=1).float().mean())
            # Exact scores: the same selection row for row; float scores: summation order may flip near-ties.
            ok, error = (same == 1.0) if case == "ties" else recall >= 0.999, None
        except Exception as e:
            ok, recall, same, ref_s, got_s, error = False, None, None, None, None, f"{type(e).__name__}: {e}"[:400]
        results.add(
            kind="dsa_check",
            part="selection",
            case=dict(inputs=case, S=s, chunks=chunks, heads=heads, dim=dim, topk=topk),
            rows_identical=same,
            recall=recall,
            ok=ok,
            seconds_reference=ref_s,
            seconds_kernel=got_s,
            error=error,
        )

    # Sparse MLA: GLM-5's 64 heads, latent 512, rope 64, top 2048; some empty slots.
    s, chunks, heads, rank, rope, topk = (
        (5, [6, 4], 3, 16, 8, 6) if tiny else (1024, [16384, 16384], 64, 512, 64, 2048)
    )
    sizes, query_start = chunks + [s], sum(chunks)
    total = query_start + s
    q = torch.randn(s, heads, rank + rope, generator=g, device=device).to(bf16)
    kv = [torch.randn(n, rank + rope, generator=g, device=device).to(bf16) for n in sizes]
    future = torch.arange(total, device=device)[None] > torch.arange(query_start, total, device=device)[:, None]
    noise = torch.rand(s, total, generator=g, device=device).masked_fill(future, -1.0)
    sel = noise.topk(topk, dim=1).indices
    sel[: s // 2, topk - topk // 4 :] = -1  # empty slots in half the rows
    grad_out = torch.randn(s, heads, rank, generator=g, device=device)
    grad_lse = torch.randn(s, heads, generator=g, device=device)
    leaves = list(range(3, 4 + len(sizes)))  # q and every kv part

    def fwd_bwd(function, xs):
        def attend(*args):
            out, lse = function.apply(*args)
            return out, lse.masked_fill(lse == float("-inf"), 0.0)

        return _grads_of(attend, xs, [grad_out, grad_lse], leaves)

    inputs = [0.3, rank, sel, q, *kv]
    names = ["out", "lse", "grad q"] + [f"grad kv{i}" for i in range(len(sizes))]
    try:
        with dsa_kernels_off():
            fp32 = [x.float() if torch.is_tensor(x) and x.is_floating_point() else x for x in inputs]
            ref_outs, ref_grads = fwd_bwd(glm._SparseLatentAttention, fp32)
            _, ref_s = timed(lambda: fwd_bwd(glm._SparseLatentAttention, inputs), device, repeat)
        (outs, grads), got_s = timed(lambda: fwd_bwd(dsa_kernels.SparseLatentAttention, inputs), device, repeat)
        errors = _rel_errors(names, [*outs, *grads], [*ref_outs, *ref_grads])
        ok, error = max(errors.values()) <= ATTN_RTOL_BF16, None
    except Exception as e:
        errors, ok, ref_s, got_s, error = {}, False, None, None, f"{type(e).__name__}: {e}"[:400]
    results.add(
        kind="dsa_check",
        part="sparse MLA fwd+bwd",
        case=dict(S=s, chunks=chunks, heads=heads, rank=rank, rope=rope, topk=topk),
        rel_errors=errors,
        rel_tolerance=ATTN_RTOL_BF16,
        ok=ok,
        seconds_reference=ref_s,
        seconds_kernel=got_s,
        error=error,
    )


def gdn_check(device: str, tiny: bool, results: Results) -> None:
    """qwen3_5's Gated DeltaNet kernels at Qwen3.6-27B's widths: `gated_delta_rule` and `causal_conv` (fla's kernels
    when installed) in bf16 against the torch references in fp32, from an initial state and a conv history, with the
    gradients of every input; each timed against the torch path on the same bf16 inputs."""
    import torch
    from tolerances import ATTN_RTOL_BF16

    from trl_longstraw import qwen3_5

    fla = dict(delta_rule=qwen3_5.fla_chunk_gated_delta_rule is not None, conv=qwen3_5.fla_causal_conv1d is not None)
    g = torch.Generator(device=device).manual_seed(0)
    bf16 = torch.bfloat16
    t, hk, hv, d = (37, 2, 4, 16) if tiny else (4096, 16, 48, 128)
    repeat = 1 if tiny else 3

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, device=device) * scale

    q, k = randn(1, t, hk, d), randn(1, t, hk, d)
    v = randn(1, t, hv, d)
    gate = -torch.rand(1, t, hv, generator=g, device=device) * 0.3
    beta = torch.rand(1, t, hv, generator=g, device=device)
    state = randn(1, hv, d, d, scale=0.1)
    grad_out, grad_state = randn(1, t, hv, d), randn(1, hv, d, d)
    # Stock passes q, k, v and beta in the model dtype, g in fp32; the state is fp32.
    low = [q.to(bf16), k.to(bf16), v.to(bf16), gate, beta.to(bf16), state]
    high = [q, k, v, gate, beta, state]
    names = ["out", "state"] + [f"grad {n}" for n in ("q", "k", "v", "g", "beta", "state")]
    cases = [("delta rule", qwen3_5.gated_delta_rule, qwen3_5.torch_gated_delta_rule, low, high, grad_out, grad_state)]

    channels, width = 2 * hk * d + hv * d, 4
    x, weight, history = randn(1, t, channels), randn(channels, 1, width, scale=0.5), randn(1, channels, width - 1)
    grad_conv = randn(1, t, channels)
    conv_low = [x.to(bf16), weight.to(bf16), None, "silu", history.to(bf16)]
    conv_high = [x, weight, None, "silu", history]
    cases.append(("causal conv", qwen3_5.causal_conv, qwen3_5.torch_causal_conv, conv_low, conv_high, grad_conv, None))
    for name, fast, reference, low_inputs, high_inputs, grad_a, grad_b in cases:
        leaves = [i for i, x in enumerate(low_inputs) if torch.is_tensor(x)]

        def fwd_bwd(function, inputs, grad_a=grad_a, grad_b=grad_b, leaves=leaves):
            def outputs(*xs):
                out = function(*xs)
                return out if isinstance(out, tuple) else (out,)

            return _grads_of(outputs, inputs, [grad_a, grad_b][: 2 if grad_b is not None else 1], leaves)

        try:
            ref_outs, ref_grads = fwd_bwd(reference, high_inputs)
            (outs, grads), got_s = timed(lambda fn=fast, xs=low_inputs: fwd_bwd(fn, xs), device, repeat)
            _, ref_s = timed(lambda fn=reference, xs=low_inputs: fwd_bwd(fn, xs), device, repeat)
            labels = names if name == "delta rule" else ["out", "grad x", "grad weight", "grad history"]
            errors = _rel_errors(labels, [*outs, *grads], [*ref_outs, *ref_grads])
            ok, error = max(errors.values()) <= ATTN_RTOL_BF16, None
        except Exception as e:
            errors, ok, ref_s, got_s, error = {}, False, None, None, f"{type(e).__name__}: {e}"[:400]
        results.add(
            kind="gdn_check",
            part=name,
            fla=fla,
            case=dict(T=t, Hk=hk, Hv=hv, D=d),
            rel_errors=errors,
            rel_tolerance=ATTN_RTOL_BF16,
            ok=ok,
            seconds_torch=ref_s,
            seconds_kernel=got_s,
            error=error,
        )


def stage_kernels(args, results: Results) -> None:
    dsa_check(args.device, args.tiny, results)
    gdn_check(args.device, args.tiny, results)


# ---------------------------------------------------------------------------------------------------- bf16 stage
def bf16_case(device: str, label: str, path, results: Results, **overrides) -> bool:
    """Stock fp32, stock bf16 and ours bf16 through `train()` on the model at `path` (exact mode, prompts of 3 to 14
    tokens in chunks of 4, left-padded); records the errors and whether ours' are within the factor of stock's."""
    import gc

    import torch
    from precision import errors, run
    from tolerances import BF16_ERROR_FACTOR, LOSS_ATOL

    common = dict(use_cpu=device == "cpu", **overrides)
    runs = {}
    for name, kind, bf16 in (
        ("stock fp32", "stock", False),
        ("stock bf16", "stock", True),
        ("ours bf16", "ours", True),
    ):
        t0 = time.perf_counter()
        completions = runs["stock fp32"]["completions"] if runs else None
        out = run(path, kind, "exact", completions, bf16=bf16, **common)
        del out["trainer"]  # free the models before the next run
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        out["seconds"] = time.perf_counter() - t0
        runs[name] = out
    ours, stock = (errors(runs[name], runs["stock fp32"]) for name in ("ours bf16", "stock bf16"))
    f = BF16_ERROR_FACTOR
    ok = (
        ours["logps"] <= f * stock["logps"]
        and ours["loss"] <= f * max(stock["loss"], LOSS_ATOL)
        and ours["grad"] <= f * stock["grad"]
        and all(err <= f * stock["groups"][group] for group, err in ours["groups"].items())
    )
    worst = max(ours["groups"], key=lambda group: ours["groups"][group] / stock["groups"][group])
    results.add(
        kind="bf16_check",
        model=label,
        what="exact mode, bf16 autocast over fp32 weights, vs stock fp32 on the same completions",
        device=device,
        **{
            f"{key}_err_{who}": err[key]
            for key in ("logps", "loss", "grad")
            for who, err in (("ours", ours), ("stock", stock))
        },
        worst_group=worst,
        worst_group_err_ours=ours["groups"][worst],
        worst_group_err_stock=stock["groups"][worst],
        factor=f,
        ok=ok,
        seconds={name: r["seconds"] for name, r in runs.items()},
    )
    return ok


def stage_bf16(args, results: Results) -> None:
    from trl_longstraw.testing import save_tiny_model

    root = Path(tempfile.mkdtemp(prefix="gpu_check_bf16_"))
    cases = [("llama-tiny", "llama", {}), ("qwen3_5-tiny", "qwen3_5", {})]
    if args.tiny:  # the same code path on CPU, the slice's widths made tiny
        cases.append(
            (
                "llama-70b-layer-tiny",
                "llama",
                dict(
                    BF16_SLICE,
                    hidden_size=64,
                    intermediate_size=128,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    head_dim=16,
                ),
            )
        )
    else:
        cases.append(("llama-70b-layer", "llama", BF16_SLICE))
    for label, family, widths in cases:
        try:
            path = save_tiny_model(root / label, family, **widths)
            # The slice without a reference model (beta=0): one copy of its weights per trainer.
            bf16_case(args.device, label, path, results, **({"beta": 0.0} if "70b" in label else {}))
        except Exception as e:
            results.add(kind="bf16_check", model=label, ok=False, error=f"{type(e).__name__}: {e}"[:500])


# --------------------------------------------------------------------------------------------------- model stage
def adapter_key(family: str) -> str | None:
    """The ADAPTERS key serving `family`'s causal LM, or None when this checkout has no adapter for it."""
    from trl_longstraw.adapters import ADAPTERS

    keys = {"qwen3_5": ("qwen3_5_text", "qwen3_5"), "glm_moe_dsa": ("glm_moe_dsa",), "llama": ("llama",)}[family]
    return next((k for k in keys if k in ADAPTERS), None)


def build_model(family: str, widths: dict, device: str, dtype):
    """The causal LM of `family` with `widths`, random weights, on `device`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if family == "qwen3_5":
        # The text-only causal LM (model_type qwen3_5_text), as the slice has no vision tower.
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        config = Qwen3_5TextConfig(**widths, pad_token_id=0, eos_token_id=1, bos_token_id=None)
        cls = Qwen3_5ForCausalLM
    else:
        config = AutoConfig.for_model(family, **widths, pad_token_id=0, eos_token_id=1, bos_token_id=None)
        cls = AutoModelForCausalLM
    torch.manual_seed(0)
    # Weights are created and initialised on the device, directly in `dtype`.
    with torch.device(device):
        if cls is AutoModelForCausalLM:
            return cls.from_config(config, dtype=dtype)
        return cls._from_config(config, dtype=dtype)


def planner_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("trl_longstraw.plan") is not None


def run_planner(config_dir: str, positions: int, mode: str, group: int, completion: int, chunk: int, gpu_gb: float):
    """`python -m trl_longstraw.plan ...` for one GPU, run in this process (no second import of torch). Asks for
    bf16 storage and no headroom, as this check runs (bf16 weights and gradients, no optimizer step); falls back to
    the basic arguments if the planner does not know those. Returns its arguments, exit code, output and the parsed
    budget (GiB per item)."""
    basic = ["--model", config_dir, "--positions", str(positions), "--gpus", "1", "--gpu-memory", f"{gpu_gb:.0f}GB"]
    basic += ["--mode", mode, "--group-size", str(group), "--completion-length", str(completion)]
    extra = ["--prefill-chunk-size", str(chunk), "--precision", "bf16", "--headroom", "0"]
    for argv in (basic + extra, basic):
        code, text = _run_module("trl_longstraw.plan", argv)
        if code != 2:  # 2: argparse refused an argument
            break
    budget = parse_budget(text)
    out = dict(planner_args=" ".join(argv), planner_exit=code, planner_output=text[-4000:], planner_budget=budget)
    if "peak" in budget:
        out["planner_peak_gib"] = budget["peak"]
        held = sum(budget.get(k, 0.0) for k in ("weights", "gradients", "optimizer state", "headroom"))
        # What the step adds to the weights and gradients: comparable with the measured growth.
        out["planner_growth_gib"] = budget["peak"] - held
        out["planner_step_peak_gib"] = budget["peak"] - budget.get("optimizer state", 0.0) - budget.get("headroom", 0)
    return out


def _run_module(module: str, argv: list[str]) -> tuple[int, str]:
    """`python -m module argv...` in this process: its exit code and its output."""
    buf, code, saved = io.StringIO(), 0, sys.argv
    sys.argv = [module, *argv]
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            runpy.run_module(module, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception as e:
        buf.write(f"\nplanner failed: {type(e).__name__}: {e}")
        code = -1
    finally:
        sys.argv = saved
    return code, buf.getvalue()


UNITS = {"B": 1 / 2**30, "KiB": 1 / 2**20, "MiB": 1 / 2**10, "GiB": 1.0, "TiB": 2**10}


def parse_budget(text: str) -> dict[str, float]:
    """The planner's budget lines (`  name   12.34 GiB  detail`) as `{name: GiB}`, `peak` included."""
    budget = {}
    for line in text.splitlines():
        m = re.match(r"^  (\S.*?)\s{2,}([\d.]+) (B|KiB|MiB|GiB|TiB)\b", line)
        if m:
            budget[m.group(1).strip()] = float(m.group(2)) * UNITS[m.group(3)]
    return budget


def _visible_pairs(first: int, n: int, cap: int | None = None) -> float:
    """(query, key) pairs of `n` queries at positions `first..`, each seeing the keys up to itself, at most `cap`."""
    if cap is None or first + n <= cap:
        return n * first + n * (n + 1) / 2
    if first >= cap:
        return n * cap
    below = cap - first  # queries that see fewer than `cap` keys
    return below * first + below * (below + 1) / 2 + (n - below) * cap


class FlopModel:
    """Model FLOPs of the step's phases (the useful work; recomputation is not counted), for tokens/s and model FLOPs
    utilisation (MFU). Per token, 2 FLOPs per active weight of the decoder layers (routed experts at their routing
    fraction); attention per (query, visible key) pair: 4 Hq D for dense attention, 2 H (2 R + Dr) per selected key
    and 2 Hi Di per scored key for MLA with DSA; about 6 Hv Dk Dv per token for a Gated DeltaNet layer (the state's
    read, correction and update). A prefill is one forward over the prompt; the replays are forward and backward
    (3x) of the completions at context P, with the LM head; the reverse pass is the prompt's backward (2x the prefill).
    """

    def __init__(self, model, family: str):
        config = model.config.get_text_config()
        self.family, self.config = family, config
        routed = getattr(config, "num_experts_per_tok", 1) / max(1, getattr(config, "n_routed_experts", 1) or 1)
        self.linear = 0.0
        for name, param in model.named_parameters():
            if param.dim() < 2 or "embed_tokens" in name or "lm_head" in name:
                continue
            self.linear += 2 * param.numel() * (routed if ".experts." in name else 1.0)
        self.head = 2 * config.hidden_size * config.vocab_size

    def attention(self, first: int, n: int) -> float:
        c = self.config
        pairs = _visible_pairs(first, n)
        if self.family == "glm_moe_dsa":
            indexers = sum(kind == "full" for kind in c.indexer_types)
            selected = _visible_pairs(first, n, c.index_topk)
            mla = 2 * c.num_attention_heads * (2 * c.kv_lora_rank + c.qk_rope_head_dim)
            return c.num_hidden_layers * selected * mla + indexers * pairs * 2 * c.index_n_heads * c.index_head_dim
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        dense = 4 * c.num_attention_heads * head_dim * pairs
        if self.family == "qwen3_5":
            kinds = c.layer_types[: c.num_hidden_layers]
            state = 6 * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * n
            return kinds.count("full_attention") * dense + kinds.count("linear_attention") * state
        return c.num_hidden_layers * dense

    def step(self, p: int, lengths: list[int]) -> dict[str, float]:
        prefill = self.linear * p + self.attention(0, p)
        replay = sum(3 * ((self.linear + self.head) * n + self.attention(p, n)) for n in lengths)
        return dict(flops_prefill=prefill, flops_replay=replay, flops_reverse=2 * prefill)


class Step:
    """One trainer over the slice; `measure(mode, P, G)` runs and times one training step."""

    def __init__(self, args, model, tokenizer, memory: Memory, results: Results, label: str):
        from datasets import Dataset

        from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer

        config = LongStrawGRPOConfig(
            output_dir=tempfile.mkdtemp(prefix="gpu_check_"),
            per_device_train_batch_size=8,
            num_generations=8,
            max_completion_length=args.C,
            report_to=[],
            use_cpu=args.device == "cpu",
            prefill_chunk_size=args.chunk,
            prefill_progress=False,
            # GRPOConfig's default on GPU (autocast to bf16 over bf16 weights); the CPU test runs fp32 without it.
            bf16=args.device == "cuda",
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )

        def reward(completions, **kwargs):
            return [0.0] * len(completions)

        dataset = Dataset.from_dict({"prompt": ["a b c"] * 8})
        self.trainer = LongStrawGRPOTrainer(model, reward, config, train_dataset=dataset, processing_class=tokenizer)
        self.trainer._prepare_inputs = lambda x: x
        self.trainer.current_gradient_accumulation_steps = 1
        self.trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.args, self.memory, self.results, self.label = args, memory, results, label
        self.vocab = model.config.vocab_size
        self.flops = FlopModel(model, SLICES[args.model]["family"])

    def measure(self, mode: str, p: int, g: int, phase: str = "search", record: bool = True) -> dict:
        import torch

        from trl_longstraw.testing import random_micro_batch

        c = self.args.C
        lengths = [c - i * c // (2 * g) for i in range(g)]  # ragged, as in bench_step.py
        mb = random_micro_batch([p], lengths, [0] * g, self.vocab, seed=p)
        mb = {k: v.to(self.args.device) for k, v in mb.items()}
        self.trainer.args.prompt_gradient = mode
        out = dict(kind="step", phase=phase, model=self.label, mode=mode, P=p, G=g, C=c, chunk=self.args.chunk)
        out.update(self.flops.step(p, lengths), completion_tokens=sum(lengths))
        self.trainer.model.zero_grad(set_to_none=False)
        before = self.memory.current()
        self.memory.reset_peak()
        t0 = time.perf_counter()
        try:
            self.trainer.training_step(self.trainer.model, mb, mb["num_items_in_batch"])
            self.memory.sync()
            out.update(status="ok", step_s=time.perf_counter() - t0)
        except torch.OutOfMemoryError as e:
            out.update(status="OOM", step_s=time.perf_counter() - t0, error=str(e).splitlines()[0][:200])
        out.update(peak_gib=self.memory.peak() / GIB, before_gib=before / GIB)
        out["growth_gib"] = out["peak_gib"] - out["before_gib"]
        if self.args.device == "cuda":
            # The caching allocator's reserved peak: its excess over the allocated peak is the fragmentation that
            # benchmarks/calibrate_planner.py reports beside the planner's items.
            out["reserved_peak_gib"] = torch.cuda.max_memory_reserved() / GIB
        metrics = self.trainer._metrics["train"]
        for key in ("prefill_s", "replay_s", "reverse_s", "state_gib"):
            if metrics.get(f"longstraw/{key}") and out["status"] == "ok":
                out[key] = metrics[f"longstraw/{key}"][-1]
        del mb
        self.cleanup()
        if record:
            self.results.add(**out)
        return out

    def cleanup(self) -> None:
        import torch

        for engine in self.trainer._engines.values():
            engine.release()
        gc.collect()
        if self.args.device == "cuda":
            torch.cuda.empty_cache()


def search(
    measure: Callable[[int], dict], label: str, mode: str, start: int, stop: int, deadline: float, results: Results
) -> list[dict]:
    """Doubling search over P, each step run and recorded by `measure(P)`; stops at `stop`, when a step's status is
    not "ok" (OOM), or when the next step is predicted to end after `deadline` (its time extrapolated from the last
    two steps' growth factor, at least 2x, at most 4x). `label` and `mode` name the search in its `search_end`."""
    runs, p = [], start
    while p <= stop:
        if runs:
            last = runs[-1]["step_s"]
            factor = min(4.0, max(2.0, last / runs[-2]["step_s"])) if len(runs) > 1 else 4.0
            if time.monotonic() + last * factor > deadline:
                results.add(kind="search_end", model=label, mode=mode, reason="time cap", next_P=p)
                break
        r = measure(p)
        if r["status"] != "ok":
            results.add(kind="search_end", model=label, mode=mode, reason=r["status"], at_P=p)
            break
        runs.append(r)
        p = min(p * 2, stop) if p < stop else stop + 1
    else:
        results.add(kind="search_end", model=label, mode=mode, reason="reached max positions")
    return runs


def use_env_findings(args) -> None:
    """The attention path of the env stage's findings: the portable path (and chunks of at most 4096) if no kernel
    path passed, else on CUDA the fastest exact SDPA backend."""
    from trl_longstraw import attention

    kernel_flag = Path(args.out) / "kernel_ok"
    if kernel_flag.exists() and kernel_flag.read_text() == "0":
        attention.USE_KERNELS = False
        # The portable path's fp32 score tile is [Hq, chunk, KEY_BLOCK]: keep it near 1.6 GB at real widths.
        args.chunk = min(args.chunk, 4096)
        print("the kernel check failed: measuring with the portable attention path, chunk 4096", flush=True)
    backend_file = Path(args.out) / "attention_backend"
    if args.device == "cuda" and backend_file.exists() and backend_file.read_text() in attention.CUDA_BACKENDS:
        attention.CUDA_BACKEND = backend_file.read_text()  # the fastest exact one of the env stage


def stage_model(args, results: Results) -> None:
    import torch

    from trl_longstraw import attention
    from trl_longstraw.testing import build_tokenizer

    t_start = time.monotonic()
    deadline = t_start + args.budget_s
    spec = SLICES[args.model]
    label = args.model + ("-tiny" if args.tiny else "-slice")
    key = adapter_key(spec["family"])
    if key is None:
        print(f"MISSING: no {args.model} adapter in trl_longstraw.adapters.ADAPTERS in this checkout; skipped")
        results.add(kind="model_missing", model=label, reason=f"no adapter for {args.model} in this checkout")
        return
    use_env_findings(args)
    widths = spec["tiny" if args.tiny else "real"]
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    t0 = time.monotonic()
    model = build_model(spec["family"], widths, args.device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    config_dir = Path(tempfile.mkdtemp(prefix="gpu_check_cfg_")) / label
    model.config.save_pretrained(config_dir)
    memory = Memory(args.device)
    results.add(
        kind="model",
        model=label,
        description=spec["name"],
        params=n_params,
        build_s=time.monotonic() - t0,
        kernels=attention.USE_KERNELS,
        attention_backend=attention.CUDA_BACKEND,
        chunk=args.chunk,
        adapter=key,
        weights_gib=memory.current() / GIB if args.device == "cuda" else None,
    )
    step = Step(args, model, build_tokenizer(), memory, results, label)
    # Warm-up: kernels, allocator pools and the parameters' .grad buffers, which then count in "before".
    for mode in ("detached", "exact"):
        step.measure(mode, args.start // 4, 8, phase="warmup", record=False)

    gpu_gb = torch.cuda.get_device_properties(0).total_memory / 1e9 if args.device == "cuda" else 16.0
    largest = {}
    for i, mode in enumerate(("detached", "exact")):
        # Split what is left between the two searches, keeping a quarter for the G comparison and the planner.
        share = (deadline - time.monotonic()) * (0.4 if i == 0 else 0.6)
        runs = search(
            lambda p, mode=mode: step.measure(mode, p, 8),
            label,
            mode,
            args.start,
            args.max_positions,
            time.monotonic() + share,
            results,
        )
        if runs:
            largest[mode] = runs[-1]
    if "exact" in largest:
        # G=2 vs G=8 at the largest exact P whose step was short enough to run twice more in the time left.
        exact = [r for r in search_records(results, label, "exact") if r["status"] == "ok"]
        left = deadline - time.monotonic()
        fit = [r for r in exact if 2.5 * r["step_s"] < left]
        if fit:
            p = fit[-1]["P"]
            g2 = step.measure("exact", p, 2, phase="group")
            g8 = step.measure("exact", p, 8, phase="group")
            results.add(
                kind="group_compare",
                model=label,
                P=p,
                peak_gib_G2=g2["peak_gib"],
                peak_gib_G8=g8["peak_gib"],
                growth_gib_G2=g2["growth_gib"],
                growth_gib_G8=g8["growth_gib"],
                step_s_G2=g2.get("step_s"),
                step_s_G8=g8.get("step_s"),
            )
    # The slice's kernels against their references on the smallest detached step: fla for qwen3_5, the Triton DSA
    # kernels for glm_moe_dsa (on CPU both sides run the references).
    first = [r for r in search_records(results, label, "detached") if r["status"] == "ok"][:1]
    if (
        first
        and spec["family"] in ("qwen3_5", "glm_moe_dsa")
        and 2.5 * first[0]["step_s"] < deadline - time.monotonic()
    ):
        with reference_kernels(spec["family"]):
            step.measure("detached", first[0]["P"], 8, phase="reference kernels")
    if planner_available():
        for mode, r in largest.items():
            for p in (r["P"], 2**21):
                pred = run_planner(str(config_dir), p, mode, 8, args.C, args.chunk, gpu_gb)
                measured = dict(
                    measured_P=r["P"], measured_peak_gib=r["peak_gib"], measured_growth_gib=r["growth_gib"]
                )
                results.add(kind="planner", model=label, mode=mode, P=p, **measured, **pred)
    else:
        results.add(kind="planner", model=label, status="trl_longstraw.plan not in this checkout")


@contextlib.contextmanager
def reference_kernels(family: str):
    """The PyTorch references instead of the CUDA kernels for the block: the torch Gated DeltaNet rule and conv for
    qwen3_5 (as without fla), the DSA reference for glm_moe_dsa."""
    from trl_longstraw import qwen3_5

    saved = qwen3_5.fla_chunk_gated_delta_rule, qwen3_5.fla_causal_conv1d
    if family == "qwen3_5":
        qwen3_5.fla_chunk_gated_delta_rule = qwen3_5.fla_causal_conv1d = None
    try:
        with dsa_kernels_off() if family == "glm_moe_dsa" else contextlib.nullcontext():
            yield
    finally:
        qwen3_5.fla_chunk_gated_delta_rule, qwen3_5.fla_causal_conv1d = saved


def search_records(results: Results, label: str, mode: str) -> list[dict]:
    records = [json.loads(line) for line in results.path.read_text().splitlines() if line.strip()]
    return [
        r
        for r in records
        if r.get("kind") == "step" and r["model"] == label and r["mode"] == mode and r.get("phase") == "search"
    ]


# ---------------------------------------------------------------------------------------------- whole-step stage
class PromptPasses:
    """Counts the prompt positions that the backbone runs, per phase of the step and grad mode, with a forward
    pre-hook, as tests/test_prompt_passes.py does: each position below `limit` (P - 1: every prompt position but the
    last, which the completions' replay runs) of a row counts once. It counts positions, not tokens as that test
    does: this stage's prompt is random words whose tokens repeat, and it is the step's only prompt, unpadded, so
    nothing else runs at those positions (completions run at P and after). Counts stay on the device until read."""

    def __init__(self, backbone):
        self.limit = 1
        self.phase: str | None = None  # "generation", "loss", or None: not counting
        self.positions: dict[tuple[str, bool], object] = {}
        self.handle = backbone.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs) -> None:
        import torch

        if self.phase is None:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        rows_and_width = tuple((ids if ids is not None else kwargs["inputs_embeds"]).shape[:2])
        positions = kwargs.get("position_ids")
        if positions is None:  # generate() may pass the cache positions only; a forward without a cache, neither
            positions = kwargs.get("cache_position")
        if positions is None:
            positions = torch.arange(rows_and_width[1])
        if positions.dim() == 3:  # multimodal RoPE streams [k, B, T]: the first is the text position
            positions = positions[0]
        counted = (positions < self.limit).expand(rows_and_width).sum()
        key = (self.phase, torch.is_grad_enabled())
        self.positions[key] = self.positions.get(key, 0) + counted

    def passes(self, prompts: int) -> dict[str, float]:
        """Passes over each of `prompts` distinct prompts, per phase and grad mode: `generation_no_grad`,
        `loss_no_grad` (prefills), `loss_grad` (exact mode's reverse pass; stock's loss forward)."""
        out = {f"{phase}_{mode}": 0.0 for phase in ("generation", "loss") for mode in ("no_grad", "grad")}
        for (phase, grad), n in self.positions.items():
            out[f"{phase}_{'grad' if grad else 'no_grad'}"] += int(n) / self.limit / prompts
        return out


class WholeStep:
    """Whole GRPO steps through `trainer.train()` on one model: per step a fresh trainer (ours in exact mode, or stock
    `GRPOTrainer`), one optimizer step over a dataset of one prompt of P tokens, G = 8 sampled completions of C tokens
    (`min_new_tokens = C`), gradient checkpointing, GRPOConfig's bf16 autocast on CUDA.

    Phases: `generation` is `_generate_and_score_completions` (generation and rewards), `loss` the rest of
    `training_step` (ours: scoring, loss, backward and the reverse pass). Each phase's peak is measured from a reset
    at its start (`torch.cuda.max_memory_allocated`; on CPU the resident set's high-water mark), its growth over the
    memory held when the step's generation starts (weights; the loss phase's growth includes the parameters'
    gradients, which Trainer frees after each optimizer step); `step_s` is the whole `train()` call (dataloader and
    optimizer step included). Ours' loss pass also resets the CUDA peak when it starts scoring, after a few small
    allocations.
    """

    def __init__(self, args, model, tokenizer, memory: Memory, results: Results, label: str):
        self.args, self.model, self.tokenizer, self.memory, self.results = args, model, tokenizer, memory, results
        self.label, self.g = label, 8
        self.counter = PromptPasses(model.base_model)

    def trainer(self, impl: str, p: int):
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer

        from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer

        common = dict(
            output_dir=tempfile.mkdtemp(prefix="gpu_check_whole_"),
            per_device_train_batch_size=self.g,
            num_generations=self.g,
            max_completion_length=self.args.C,
            generation_kwargs={"min_new_tokens": self.args.C},
            max_steps=1,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            use_cpu=self.args.device == "cpu",
            bf16=self.args.device == "cuda",
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )

        def reward(completions, **kwargs):
            # Distinct rewards within the group: nonzero advantages, so every completion is back-propagated.
            return [float(i) for i in range(len(completions))]

        from bench_whole_step import prompt_text

        dataset = Dataset.from_dict({"prompt": [prompt_text(p, seed=p)]})
        if impl == "stock":
            config = GRPOConfig(**common)
            return GRPOTrainer(self.model, reward, config, train_dataset=dataset, processing_class=self.tokenizer)
        config = LongStrawGRPOConfig(
            **common, prompt_gradient=impl, prefill_chunk_size=self.args.chunk, prefill_progress=False
        )
        return LongStrawGRPOTrainer(self.model, reward, config, train_dataset=dataset, processing_class=self.tokenizer)

    def measure(self, impl: str, p: int, phase: str = "search", record: bool = True) -> dict:
        """One `train()` step of `impl` ("exact" or "stock") at P = `p`; its record (status ok, OOM or error)."""
        import torch
        from transformers import PrinterCallback

        out = dict(kind="whole_step", phase=phase, model=self.label, impl=impl, P=p, G=self.g, C=self.args.C)
        out["chunk"] = None if impl == "stock" else self.args.chunk
        trainer = self.trainer(impl, p)
        trainer.remove_callback(PrinterCallback)  # its metrics dict per step: noise in the check's log
        generate, train_step, marks = trainer._generate_and_score_completions, trainer.training_step, {}

        def generation(inputs):
            self.counter.phase = "generation"
            marks["before"] = self.memory.current()
            self.memory.reset_peak()
            t0 = time.perf_counter()
            batch = generate(inputs)
            self.memory.sync()
            marks["generation_s"], marks["generation_peak"] = time.perf_counter() - t0, self.memory.peak()
            marks["lengths"] = batch["completion_mask"].sum(1).tolist()
            marks["prompt_tokens"] = batch["prompt_mask"].sum(1).tolist()
            marks["prompts"] = int(torch.unique(batch["prompt_ids"], dim=0).shape[0])
            self.counter.phase = "loss"
            self.memory.reset_peak()
            marks["loss_start"] = time.perf_counter()
            return batch

        def training_step(model, inputs, num_items_in_batch):
            loss = train_step(model, inputs, num_items_in_batch)
            self.memory.sync()
            marks["loss_s"], marks["loss_peak"] = time.perf_counter() - marks["loss_start"], self.memory.peak()
            self.counter.phase = None
            metrics = trainer._metrics["train"]  # before train() logs (and clears) them
            for key in (
                "prefill_s",
                "replay_s",
                "reverse_s",
                "state_gib",
                "prompt_positions",
                "prompt_positions_reused",
            ):
                if metrics.get(f"longstraw/{key}"):
                    marks[key] = metrics[f"longstraw/{key}"][-1]
            return loss

        trainer._generate_and_score_completions, trainer.training_step = generation, training_step
        self.counter.limit, self.counter.phase = p - 1, None
        self.counter.positions.clear()
        t0 = time.perf_counter()
        try:
            trainer.train()
            self.memory.sync()
            out.update(status="ok", step_s=time.perf_counter() - t0)
        except torch.OutOfMemoryError as e:
            out.update(status="OOM", step_s=time.perf_counter() - t0, error=str(e).splitlines()[0][:200])
        except Exception as e:  # a finding of the device run (e.g. the memory guard's refusal), not a crash of it
            import traceback

            traceback.print_exc()
            out.update(status="error", step_s=time.perf_counter() - t0, error=f"{type(e).__name__}: {e}"[:500])
        finally:
            self.counter.phase = None
        out.update(self.figures(marks))
        if out["status"] == "ok":
            out.update(self.counter.passes(marks["prompts"]))
            out["prefills_per_prompt"] = out["generation_no_grad"] + out["loss_no_grad"]
        self.cleanup(trainer)
        if record:
            self.results.add(**out)
        return out

    def figures(self, marks: dict) -> dict:
        """The record's measured figures from the phases' `marks` (those of the phases that ran)."""
        out = {key: marks[key] for key in ("generation_s", "loss_s", "prompts") if key in marks}
        out.update({key: marks[key] for key in marks if key.startswith(("prefill", "replay", "reverse", "state"))})
        out.update({key: marks[key] for key in ("prompt_positions", "prompt_positions_reused") if key in marks})
        if "lengths" in marks:
            lengths = marks["lengths"]
            out.update(completion_min=min(lengths), completion_max=max(lengths), completion_tokens=sum(lengths))
            out["prompt_tokens"] = max(marks["prompt_tokens"])
        if "before" in marks:
            out["before_gib"] = marks["before"] / GIB
        for phase in ("generation", "loss"):
            if f"{phase}_peak" in marks:
                out[f"{phase}_peak_gib"] = marks[f"{phase}_peak"] / GIB
                out[f"{phase}_growth_gib"] = (marks[f"{phase}_peak"] - marks["before"]) / GIB
        if "loss_peak" in marks:
            out["peak_ratio"] = marks["generation_peak"] / marks["loss_peak"]
            growth = out["loss_growth_gib"]
            out["growth_ratio"] = out["generation_growth_gib"] / growth if growth > 0 else None
        return out

    def cleanup(self, trainer) -> None:
        import torch

        for engine in getattr(trainer, "_engines", {}).values():
            engine.release()
        trainer.accelerator.free_memory()  # the optimizer and its state
        trainer.optimizer = trainer.lr_scheduler = None
        self.model.zero_grad(set_to_none=True)
        gc.collect()
        if self.args.device == "cuda":
            torch.cuda.empty_cache()


def stage_whole_step(args, results: Results) -> None:
    """Whole steps (generation + loss) of ours in exact mode through `trainer.train()`: a doubling search over P from
    `--start` for the largest P the stage's time allows (a fifth of it kept for stock), then stock `GRPOTrainer`'s
    step at the search's smallest P if it is predicted to fit in the time left."""
    import torch

    from trl_longstraw.testing import build_tokenizer

    deadline = time.monotonic() + args.budget_s
    spec = SLICES[args.model]
    label = args.model + ("-tiny" if args.tiny else "-slice")
    key = adapter_key(spec["family"])
    if key is None:
        results.add(kind="whole_step_missing", model=label, reason=f"no adapter for {args.model} in this checkout")
        return
    use_env_findings(args)
    t0 = time.monotonic()
    model = build_model(
        spec["family"],
        spec["tiny" if args.tiny else "real"],
        args.device,
        torch.bfloat16 if args.device == "cuda" else torch.float32,
    )
    results.add(
        kind="whole_step_setup",
        model=label,
        description=spec["name"],
        params=sum(p.numel() for p in model.parameters()),
        build_s=time.monotonic() - t0,
        chunk=args.chunk,
        adapter=key,
    )
    step = WholeStep(args, model, build_tokenizer(), Memory(args.device), results, label)
    step.measure("exact", args.start // 4, phase="warmup", record=False)  # kernels, allocator pools
    keep = (deadline - time.monotonic()) / 5
    runs = search(
        lambda p: step.measure("exact", p),
        label,
        "whole step",
        args.start,
        args.max_positions,
        deadline - keep,
        results,
    )
    if not runs:
        return
    # Stock's step: the prompt prefilled G times to generate and G times in the loss forward, so about G/2 of ours'.
    first = runs[0]
    predicted = step.g / 2 * first["step_s"]
    left = deadline - time.monotonic()
    if predicted < left:
        step.measure("stock", first["P"], phase="reference")
    else:
        results.add(
            kind="whole_step_skipped",
            model=label,
            impl="stock",
            P=first["P"],
            reason=f"predicted {predicted:.0f} s, {left:.0f} s left",
        )


# ------------------------------------------------------------------------------------------------- summary stage
def summary_general(records: list[dict]) -> list[str]:
    md = []
    for r in records:
        if r["kind"] == "env":
            md += ["", "## Environment", ""]
            md += [f"- {k}: {v}" for k, v in r.items() if k not in ("kind", "time")]
    checks = [r for r in records if r["kind"] == "attention_check"]
    if checks:
        md += ["", "## prefix_merge_attention on the device (bf16) vs reference_attention", ""]
        md += [
            "| path | function | case | max abs err | max rel err | ok | fwd+bwd s | error |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in checks:
            md.append(
                f"| {r['path']} | {r.get('function')} | {r['case']} | {fmt(r.get('max_abs_err'), '.2e')} | "
                f"{fmt(r.get('max_rel_err'), '.2e')} | {r['ok']} | {fmt(r.get('seconds_fwd_bwd'), '.4f')} | "
                f"{r.get('error') or ''} |"
            )
    for r in (r for r in records if r["kind"] == "attention_backend"):
        times = ", ".join(f"{b}: {fmt(t, '.4f')} s" for b, t in r["seconds_fwd_bwd"].items())
        md += [
            "",
            f"- SDPA backend for the prefix-merge parts: fastest exact **{r['choice']}** (fwd+bwd over the "
            f"cases, `-` where a case failed: {times}); library default {r['default']}",
        ]
    md += summary_kernels(records)
    bf16 = [r for r in records if r["kind"] == "bf16_check"]
    if bf16:
        md += ["", "## bf16 end to end through train(): errors against stock fp32 (ours / stock)", ""]
        md += ["| model | log-probs | loss | gradient | worst group | ok | error |", "|---|---|---|---|---|---|---|"]
        for r in bf16:
            cells = [
                f"{fmt(r.get(f'{key}_err_ours'), '.2e')} / {fmt(r.get(f'{key}_err_stock'), '.2e')}"
                for key in ("logps", "loss", "grad")
            ]
            group = (
                f"{r['worst_group']}: {r['worst_group_err_ours']:.2e} / {r['worst_group_err_stock']:.2e}"
                if "worst_group" in r
                else "-"
            )
            md.append(f"| {r['model']} | {' | '.join(cells)} | {group} | {r['ok']} | {r.get('error') or ''} |")
    for r in (r for r in records if r["kind"] in ("e2e_check", "error")):
        md += ["", "## Tiny model on the device: exact mode vs stock GRPOTrainer" if r["kind"] == "e2e_check" else ""]
        md += [f"- {k}: {v}" for k, v in r.items() if k not in ("time",)]
    return md


def summary_whole_step(records: list[dict]) -> list[str]:
    """The whole-step stage: per step the phases' times and peaks, the generation / loss peak ratio against the
    issue's 10% target, the prompt passes per distinct prompt, and stock's step beside ours at the smallest P."""
    from bench_whole_step import GENERATION_MARGIN

    steps = [r for r in records if r["kind"] == "whole_step"]
    other = [r for r in records if r["kind"] in ("whole_step_setup", "whole_step_missing", "whole_step_skipped")]
    if not steps and not other:
        return []
    md = ["", "## Whole GRPO step through trainer.train(): generation + loss (exact mode)", ""]
    for r in other:
        cells = (
            f"{k}: {fmt(v, '.3g') if isinstance(v, float) else v}" for k, v in r.items() if k not in ("kind", "time")
        )
        md.append(f"- {r['kind']}: " + ", ".join(cells))
    if not steps:
        return md
    md += [
        "",
        "Peaks: `torch.cuda.max_memory_allocated` from a reset at the start of each phase (on CPU the resident set's "
        "high-water mark); growth over the memory held when generation starts; ratio = generation / loss. Passes: "
        "how many times the backbone ran each distinct prompt's positions (hook-counted), without autograd "
        "(prefills) and with it (ours: the reverse pass; stock: its loss forward).",
        "",
        "| model | impl | phase | P | G | C | status | step s | generation s | loss s | generation peak / growth "
        "GiB | loss peak / growth GiB | peak ratio | growth ratio | prefills per prompt | passes with autograd | "
        "completion tokens (min-max) |",
        "|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in steps:
        peaks = [
            f"{fmt(r.get(f'{phase}_peak_gib'), '.3f')} / {fmt(r.get(f'{phase}_growth_gib'), '.3f')}"
            for phase in ("generation", "loss")
        ]
        grad = r["generation_grad"] + r["loss_grad"] if r["status"] == "ok" else None
        lengths = f"{r['completion_min']}-{r['completion_max']}" if "completion_min" in r else "-"
        md.append(
            f"| {r['model']} | {r['impl']} | {r['phase']} | {r['P']:,} | {r['G']} | {r['C']} | {r['status']} | "
            f"{fmt(r.get('step_s'), '.1f')} | {fmt(r.get('generation_s'), '.1f')} | {fmt(r.get('loss_s'), '.1f')} | "
            f"{peaks[0]} | {peaks[1]} | {fmt(r.get('peak_ratio'), '.3f')} | {fmt(r.get('growth_ratio'), '.3f')} | "
            f"{fmt(r.get('prefills_per_prompt'), '.2f')} | {fmt(grad, '.2f')} | {lengths} |"
            + (f" {r['error']}" if r.get("error") else "")
        )
    ours = [r for r in steps if r["impl"] != "stock" and r["status"] == "ok"]
    md.append("")
    for label in dict.fromkeys(r["model"] for r in ours):
        best = max((r for r in ours if r["model"] == label), key=lambda r: r["P"])
        end = [r for r in records if r["kind"] == "search_end" and r["model"] == label and r["mode"] == "whole step"]
        md.append(
            f"- {label}: largest P of a whole step measured: {best['P']:,} ({best['step_s']:.1f} s; search ended by "
            f"{end[-1]['reason'] if end else '-'})"
        )
    for r in ours:
        verdicts = [
            f"{name} {r[key]:.3f}: {'met' if r[key] <= 1 + GENERATION_MARGIN else 'NOT met'}"
            for name, key in (("peak", "peak_ratio"), ("growth", "growth_ratio"))
            if r.get(key) is not None
        ]
        md.append(
            f"- {r['model']} P={r['P']:,}: generation / loss (target <= {1 + GENERATION_MARGIN:.2f}): "
            + "; ".join(verdicts)
            + f"; prefills per prompt {r['prefills_per_prompt']:.2f} (one per step shared by generation and loss)"
        )
    for stock in (r for r in steps if r["impl"] == "stock" and r["status"] == "ok"):
        same = [r for r in ours if r["model"] == stock["model"] and r["P"] == stock["P"]]
        if same:
            r = same[0]
            md.append(
                f"- stock / ours at P={r['P']:,}: step time {stock['step_s'] / r['step_s']:.1f}x, loss peak growth "
                f"{fmt(stock['loss_growth_gib'] / r['loss_growth_gib'] if r['loss_growth_gib'] > 0 else None, '.1f')}"
                f"x, prefills per prompt {stock['prefills_per_prompt']:.0f} vs {r['prefills_per_prompt']:.0f}"
            )
    return md


def summary_kernels(records: list[dict]) -> list[str]:
    checks = [r for r in records if r["kind"] in ("dsa_check", "gdn_check")]
    if not checks:
        return []
    md = [
        "",
        "## CUDA kernels vs their PyTorch references (bf16 vs fp32 reference; times on the same bf16 inputs)",
        "",
    ]
    md += [
        "| kernel | case | ok | errors | reference s | kernel s | speed-up | note |",
        "|---|---|---|---|---:|---:|---:|---|",
    ]
    for r in checks:
        ref_s, got_s = r.get("seconds_reference", r.get("seconds_torch")), r.get("seconds_kernel")
        if r["kind"] == "dsa_check" and r["part"] == "selection":
            errors = f"rows identical {fmt(r.get('rows_identical'), '.4f')}, recall {fmt(r.get('recall'), '.5f')}"
        else:
            errors = ", ".join(f"{k} {v:.1e}" for k, v in (r.get("rel_errors") or {}).items())
        note = r.get("error") or (f"fla installed: {r['fla']}" if "fla" in r else "")
        speedup = ref_s / got_s if ref_s and got_s else None
        md.append(
            f"| {r['kind'][:3]} {r['part']} | {r.get('case', '')} | {r['ok']} | {errors} | {fmt(ref_s, '.4f')} | "
            f"{fmt(got_s, '.4f')} | {fmt(speedup, '.1f')} | {note} |"
        )
    return md


PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12}  # dense bf16 tensor-core peak (SXM)


def peak_flops(records: list[dict]) -> float | None:
    gpu = next((r.get("gpu") for r in records if r["kind"] == "env" and r.get("gpu")), None) or ""
    return next((peak for name, peak in PEAK_BF16_FLOPS.items() if name in gpu), None)


def throughput(r: dict, peak: float | None) -> dict[str, tuple[float | None, float | None]]:
    """Per phase `(tokens/s, MFU)` of a step: prefill and reverse over P tokens, replays over the completions."""
    out = {}
    for phase, tokens in (("prefill", r["P"]), ("replay", r.get("completion_tokens")), ("reverse", r["P"])):
        seconds, flops = r.get(f"{phase}_s"), r.get(f"flops_{phase}")
        rate = tokens / seconds if seconds and tokens else None
        out[phase] = (rate, flops / seconds / peak if seconds and flops and peak else None)
    return out


def summary_model(records: list[dict], label: str) -> list[str]:
    md = ["", f"## {label}", ""]
    for r in (r for r in records if r.get("model") == label and r["kind"] in ("model", "model_missing")):
        md += [f"- {k}: {v}" for k, v in r.items() if k not in ("kind", "time", "model")]
    steps = [r for r in records if r["kind"] == "step" and r["model"] == label]
    if steps:
        md += [
            "",
            "| phase | mode | P | G | status | step s | peak GiB | growth GiB | prefill s | replays s | reverse s | "
            "state GiB |",
            "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in steps:
            md.append(
                f"| {r.get('phase')} | {r['mode']} | {r['P']:,} | {r['G']} | {r['status']} | "
                f"{fmt(r.get('step_s'), '.1f')} | {fmt(r.get('peak_gib'), '.2f')} | "
                f"{fmt(r.get('growth_gib'), '.2f')} | "
                f"{fmt(r.get('prefill_s'), '.1f')} | {fmt(r.get('replay_s'), '.1f')} | "
                f"{fmt(r.get('reverse_s'), '.1f')} | {fmt(r.get('state_gib'), '.2f')} |"
            )
        md.append("")
    for mode in ("detached", "exact"):
        ok = [r for r in steps if r["mode"] == mode and r["status"] == "ok" and r.get("phase") == "search"]
        ends = [r for r in records if r["kind"] == "search_end" and r["model"] == label and r["mode"] == mode]
        if not ok:
            continue
        best = max(ok, key=lambda r: r["P"])
        line = (
            f"- {mode}: largest prompt positions per step measured: {best['P']:,} (peak {best['peak_gib']:.2f} GiB, "
            f"{best['step_s']:.1f} s)"
        )
        md.append(line + (f"; search ended by {ends[-1]['reason']}" if ends else ""))
        pts = sorted((r["P"], r["peak_gib"]) for r in ok)
        if len(pts) >= 2 and pts[-2][0] < pts[-1][0] < MAX_POSITIONS:
            (p0, m0), (p1, m1) = pts[-2], pts[-1]
            slope = (m1 - m0) / (p1 - p0)
            md.append(
                f"  - peak grows {slope * GIB / 1024:.1f} KiB per prompt position between P={p0:,} and {p1:,}; "
                f"linear extrapolation to 2^21 = 2,097,152 positions: {m1 + slope * (2**21 - p1):.1f} GiB "
                "(extrapolated, not measured)"
            )
    peak = peak_flops(records)
    ok = [r for r in steps if r["status"] == "ok" and r.get("prefill_s")]
    if ok:
        md += ["", f"Tokens/s and model FLOPs utilisation (peak {fmt(peak, '.3g')} FLOP/s; see `FlopModel`):", ""]
        md += ["| phase | mode | P | prefill tok/s | MFU | replay tok/s | MFU | reverse tok/s | MFU |"]
        md += ["|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in ok:
            cells = [f"{fmt(rate, ',.0f')} | {fmt(mfu, '.1%')}" for rate, mfu in throughput(r, peak).values()]
            md.append(f"| {r.get('phase')} | {r['mode']} | {r['P']:,} | " + " | ".join(cells) + " |")
    for r in (r for r in steps if r.get("phase") == "reference kernels" and r["status"] == "ok"):
        same = [x for x in ok if x.get("phase") == "search" and x["mode"] == "detached" and x["P"] == r["P"]]
        if same:
            md.append(
                f"- kernels vs PyTorch references (detached, P={r['P']:,}): prefill {same[0]['prefill_s']:.2f} s vs "
                f"{r['prefill_s']:.2f} s ({r['prefill_s'] / same[0]['prefill_s']:.1f}x), step {same[0]['step_s']:.1f}"
                f" s vs {r['step_s']:.1f} s"
            )
    for r in (r for r in records if r["kind"] == "group_compare" and r["model"] == label):
        md.append(
            f"- G=2 vs G=8 at P={r['P']:,} (exact): peak {r['peak_gib_G2']:.2f} -> {r['peak_gib_G8']:.2f} GiB "
            f"({(r['peak_gib_G8'] / r['peak_gib_G2'] - 1) * 100:+.1f}%), growth {r['growth_gib_G2']:.3f} -> "
            f"{r['growth_gib_G8']:.3f} GiB; step {fmt(r['step_s_G2'], '.1f')} -> {fmt(r['step_s_G8'], '.1f')} s"
        )
    for r in (r for r in records if r["kind"] == "planner" and r.get("model") == label):
        if "planner_exit" not in r:
            md.append(f"- planner: {r.get('status')}")
            continue
        same = r["P"] == r["measured_P"]
        md.append(
            f"- planner, {r['mode']}, P={r['P']:,} (`{r['planner_args']}`, exit {r['planner_exit']}): peak "
            f"{fmt(r.get('planner_step_peak_gib'), '.2f')} GiB without optimizer state, of which "
            f"{fmt(r.get('planner_growth_gib'), '.2f')} GiB beyond weights and gradients"
            + (
                f"; measured: peak {r['measured_peak_gib']:.2f} GiB, growth {r['measured_growth_gib']:.2f} GiB"
                if same
                else f" (prediction only; largest measured P {r['measured_P']:,})"
            )
        )
    return md


def summary_prefill_ratio(records: list[dict]) -> list[str]:
    """The issue's bar: the GLM slice's per-token prefill time at most 2x the Qwen slice's, at equal P (detached)."""

    def per_token(prefix: str) -> dict[int, float]:
        return {
            r["P"]: r["prefill_s"] / r["P"]
            for r in records
            if r["kind"] == "step"
            and r["model"].startswith(prefix)
            and r.get("phase") == "search"
            and r["mode"] == "detached"
            and r["status"] == "ok"
            and r.get("prefill_s")
        }

    glm, qwen = per_token("glm_moe_dsa"), per_token("qwen3_5")
    common = sorted(set(glm) & set(qwen))
    if not common:
        return []
    md = ["", "## GLM slice vs Qwen slice: prefill time per prompt token (detached)", ""]
    md += ["| P | GLM ms/token | Qwen ms/token | ratio (bar: <= 2) |", "|---:|---:|---:|---:|"]
    md += [f"| {p:,} | {glm[p] * 1e3:.3f} | {qwen[p] * 1e3:.3f} | {glm[p] / qwen[p]:.2f} |" for p in common]
    return md


def stage_summary(args, results: Results) -> None:
    records = []
    if results.path.exists():
        records = [json.loads(line) for line in results.path.read_text().splitlines() if line.strip()]
    md = ["# GPU check results", "", f"Written by `benchmarks/gpu_check.sh` at {time.strftime('%Y-%m-%d %H:%M %Z')}."]
    sections = [lambda: summary_general(records), lambda: summary_whole_step(records)]
    labels = list(dict.fromkeys(r["model"] for r in records if r["kind"] in ("model", "model_missing")))
    sections += [lambda label=label: summary_model(records, label) for label in labels]
    sections.append(lambda: summary_prefill_ratio(records))
    for section in sections:
        try:
            md += section()
        except Exception as e:  # one malformed record must not cost the rest of the report
            md += ["", f"(a section failed to render: {type(e).__name__}: {e})"]
    timeouts = [r for r in records if r["kind"] == "stage_timeout"]
    if timeouts:
        md += ["", "## Stages stopped by their time limit", ""]
        md += [f"- {r['stage']} after {r['seconds']:.0f} s" for r in timeouts]
    out = Path(args.out) / "gpu_results.md"
    out.write_text("\n".join(md) + "\n")
    print("\n".join(md))


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", choices=["env", "kernels", "bf16", "model", "whole_step", "summary"], required=True)
    parser.add_argument("--model", choices=sorted(SLICES), default="llama")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny widths and short prompts (CPU test of this script)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_out")
    parser.add_argument("--budget-s", type=float, default=120, help="seconds for this stage (a watchdog ends it)")
    parser.add_argument("--start", type=int, default=None, help="first P of the search (default 32K; tiny 256)")
    parser.add_argument("--max-positions", type=int, default=MAX_POSITIONS)
    parser.add_argument("--chunk", type=int, default=None, help="prefill_chunk_size (default 16384; tiny 128)")
    parser.add_argument("--C", type=int, default=128, help="completion tokens (longest row)")
    args = parser.parse_args(argv)
    args.start = args.start or (256 if args.tiny else 32768)
    args.chunk = args.chunk or (128 if args.tiny else 16384)
    if args.tiny:
        args.max_positions = min(args.max_positions, 1024)
    results = Results(Path(args.out) / "gpu_results.jsonl")
    if args.stage == "summary":
        return stage_summary(args, results)
    if args.device == "cpu":
        # Triton kernels run on CPU tensors through Triton's interpreter, which is chosen when a kernel is defined.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    if args.device == "cpu":
        # One thread: the CPU run is a test of this script on a shared machine, where more threads only contend.
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            results.add(kind="error", stage=args.stage, error="CUDA is not available")
            raise SystemExit("CUDA is not available: run with --device cpu --tiny to test this script on CPU")
    # The watchdog leaves a few seconds for the shell's `timeout` to be the last resort only.
    named = args.stage in ("model", "whole_step")
    watchdog(args.budget_s + 10, results, f"{args.stage} {args.model if named else ''}".strip())
    stages = dict(
        env=stage_env, kernels=stage_kernels, bf16=stage_bf16, model=stage_model, whole_step=stage_whole_step
    )
    try:
        stages[args.stage](args, results)
    except Exception as e:
        import traceback

        traceback.print_exc()
        results.add(kind="error", stage=args.stage, model=args.model, error=f"{type(e).__name__}: {e}"[:800])
        raise SystemExit(1) from e


if __name__ == "__main__":
    main()
