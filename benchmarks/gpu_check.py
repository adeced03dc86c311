"""The GPU check's Python stages (driven by `benchmarks/gpu_check.sh`; see benchmarks/README.md).

Stages, each run as its own process under a time limit:

- `env`: versions and device; the fused-kernel path of `prefix_merge_attention` against the portable path and the
  plain reference on the device (bf16, grouped-query heads, several prefix chunks, T=1, every gradient); a tiny
  model's exact-mode gradients against stock `GRPOTrainer` on the device (fp32).
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

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


def attention_check(device: str, tiny: bool, results: Results) -> bool:
    """The kernel path and the portable path of `prefix_merge_attention` against `reference_attention` on `device`.

    Returns whether the output and every gradient are within the bf16 relative tolerance of the table."""
    import torch
    from tolerances import ATTN_RTOL_BF16

    from trl_longstraw import attention

    # (Hq, Hkv, D, T, prefix chunk sizes): Qwen3.6 full attention (24/4, 256) as a branch and as a prefill chunk,
    # Llama-70B-like (64/8, 128) at T=1, and MHA.
    cases = [(24, 4, 256, 128, [4096, 1000, 77]), (24, 4, 256, 2048, [2048, 333]), (64, 8, 128, 1, [3000, 5])]
    cases.append((8, 8, 64, 97, [513]))
    if tiny:
        cases = [(4, 2, 16, 9, [13, 5]), (4, 2, 16, 1, [7]), (4, 4, 16, 5, [3])]
    all_ok = True
    for hq, hkv, d, t, sizes in cases:
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v, grad_out = (_rand(g, device, 1, h, t, d) for h in (hq, hkv, hkv, hq))
        prefix = [(_rand(g, device, 1, hkv, s, d), _rand(g, device, 1, hkv, s, d)) for s in sizes]

        def run(fn, upcast, inputs=(q, k, v, prefix, grad_out)):
            return _attend_and_grad(fn, *inputs, upcast=upcast, device=device)

        ref, ref_grads, _, _ = run(attention.reference_attention, upcast=True)
        for use_kernels in (True, False):
            attention.USE_KERNELS = use_kernels
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
            all_ok &= ok
            results.add(
                kind="attention_check",
                path="kernel" if use_kernels else "portable",
                function=fn,
                case=dict(Hq=hq, Hkv=hkv, D=d, T=t, prefix=sizes),
                max_abs_err=max(errs) if errs else None,
                max_rel_err=max(rels) if rels else None,
                rel_tolerance=ATTN_RTOL_BF16,
                ok=ok,
                seconds_fwd_bwd=seconds,
                error=error,
            )
    return all_ok


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
    ok = attention_check(args.device, args.tiny, results)
    (Path(args.out) / "kernel_ok").write_text("1" if ok else "0")
    try:
        e2e_check(args.device, results)
    except Exception as e:
        results.add(kind="e2e_check", ok=False, error=f"{type(e).__name__}: {e}"[:500])


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

    def measure(self, mode: str, p: int, g: int, phase: str = "search", record: bool = True) -> dict:
        import torch

        from trl_longstraw.testing import random_micro_batch

        c = self.args.C
        lengths = [c - i * c // (2 * g) for i in range(g)]  # ragged, as in bench_step.py
        mb = random_micro_batch([p], lengths, [0] * g, self.vocab, seed=p)
        mb = {k: v.to(self.args.device) for k, v in mb.items()}
        self.trainer.args.prompt_gradient = mode
        out = dict(kind="step", phase=phase, model=self.label, mode=mode, P=p, G=g, C=c, chunk=self.args.chunk)
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
            engine._kept = None
        gc.collect()
        if self.args.device == "cuda":
            torch.cuda.empty_cache()


def search(step: Step, mode: str, start: int, stop: int, deadline: float, results: Results) -> list[dict]:
    """Doubling search over P; stops at `stop`, on OOM, or when the next step is predicted to end after `deadline`
    (its time extrapolated from the last two steps' growth factor, at least 2x, at most 4x)."""
    runs, p = [], start
    while p <= stop:
        if runs:
            last = runs[-1]["step_s"]
            factor = min(4.0, max(2.0, last / runs[-2]["step_s"])) if len(runs) > 1 else 4.0
            if time.monotonic() + last * factor > deadline:
                results.add(kind="search_end", model=step.label, mode=mode, reason="time cap", next_P=p)
                break
        r = step.measure(mode, p, 8)
        if r["status"] != "ok":
            results.add(kind="search_end", model=step.label, mode=mode, reason=r["status"], at_P=p)
            break
        runs.append(r)
        p = min(p * 2, stop) if p < stop else stop + 1
    else:
        results.add(kind="search_end", model=step.label, mode=mode, reason="reached max positions")
    return runs


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
    kernel_flag = Path(args.out) / "kernel_ok"
    if kernel_flag.exists() and kernel_flag.read_text() == "0":
        attention.USE_KERNELS = False
        # The portable path's fp32 score tile is [Hq, chunk, KEY_BLOCK]: keep it near 1.6 GB at real widths.
        args.chunk = min(args.chunk, 4096)
        print("the kernel check failed: measuring with the portable attention path, chunk 4096", flush=True)
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
        runs = search(step, mode, args.start, args.max_positions, time.monotonic() + share, results)
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


def search_records(results: Results, label: str, mode: str) -> list[dict]:
    records = [json.loads(line) for line in results.path.read_text().splitlines() if line.strip()]
    return [
        r
        for r in records
        if r.get("kind") == "step" and r["model"] == label and r["mode"] == mode and r.get("phase") == "search"
    ]


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


def stage_summary(args, results: Results) -> None:
    records = []
    if results.path.exists():
        records = [json.loads(line) for line in results.path.read_text().splitlines() if line.strip()]
    md = ["# GPU check results", "", f"Written by `benchmarks/gpu_check.sh` at {time.strftime('%Y-%m-%d %H:%M %Z')}."]
    sections = [lambda: summary_general(records)]
    labels = list(dict.fromkeys(r["model"] for r in records if r["kind"] in ("model", "model_missing")))
    sections += [lambda label=label: summary_model(records, label) for label in labels]
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
    parser.add_argument("--stage", choices=["env", "bf16", "model", "summary"], required=True)
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
    import torch

    if args.device == "cpu":
        # One thread: the CPU run is a test of this script on a shared machine, where more threads only contend.
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            results.add(kind="error", stage=args.stage, error="CUDA is not available")
            raise SystemExit("CUDA is not available: run with --device cpu --tiny to test this script on CPU")
    # The watchdog leaves a few seconds for the shell's `timeout` to be the last resort only.
    watchdog(args.budget_s + 10, results, f"{args.stage} {args.model if args.stage == 'model' else ''}".strip())
    try:
        {"env": stage_env, "bf16": stage_bf16, "model": stage_model}[args.stage](args, results)
    except Exception as e:
        import traceback

        traceback.print_exc()
        results.add(kind="error", stage=args.stage, model=args.model, error=f"{type(e).__name__}: {e}"[:800])
        raise SystemExit(1) from e


if __name__ == "__main__":
    main()
