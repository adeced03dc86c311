"""What ours' generation phase holds at its peak, sub-phase by sub-phase: one whole step of `bench_whole_step.py`'s
worker (same trainer, warm-up and batch) with meters at the boundaries of generation's parts.

At each boundary it prints, over the resident set before the step: the resident set now (`rss`), the high-water mark
since the previous boundary (`hwm`, `VmHWM` reset by `clear_refs`), and the bytes glibc's malloc has handed out and
not taken back (`live`, `mallinfo2`: heap in use plus mmapped blocks). `rss - live` is memory the allocator holds
but no tensor or object uses (freed heap not returned to the system), which the resident set counts all the same.
Per decoder layer and pass kind (prefill, decode, loss) it prints the highest `hwm` seen during that layer's forward.

    python benchmarks/generation_memory.py --P 32K --impl detached

Linux only (`/proc/self/clear_refs`, glibc); run with `MALLOC_MMAP_THRESHOLD_=65536` as the benchmarks do (set here).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import gc
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

MIB = 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--P", default="32K")
    parser.add_argument("--impl", default="detached", choices=("exact", "detached"))
    parser.add_argument("--G", type=int, default=8)
    parser.add_argument("--C", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=1024)
    args = parser.parse_args(argv)
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:
        from bench_step import MMAP_THRESHOLD

        os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
        os.execv(sys.executable, [sys.executable, *sys.argv])

    import tempfile

    import torch
    from bench_step import _rss, _status_kib, parse_sizes
    from bench_whole_step import build_trainer, prompt_text

    import trl_longstraw.generation as generation
    from trl_longstraw.engine import Engine
    from trl_longstraw.testing import save_tiny_model

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2

    def live() -> int:
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd

    (p,) = parse_sizes(args.P)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    path = save_tiny_model(Path(tempfile.mkdtemp(prefix="generation_memory_")) / "qwen3_5", "qwen3_5")
    trainer = build_trainer(args.impl, str(path), args.G, args.C, args.chunk, "float32")
    model = trainer.model
    model.train()
    trainer.training_step(model, [{"prompt": prompt_text(64, 1)}] * args.G, None)
    model.zero_grad(set_to_none=False)
    for engine in trainer._engines.values():
        engine.release()
    batch = [{"prompt": prompt_text(p, 0)}] * args.G
    gc.collect()
    base, live_base = _rss(), live()

    def reset() -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def hwm() -> float:
        return (_status_kib("VmHWM") * 1024 - base) / MIB

    def mark(label: str) -> None:
        rss, held = (_rss() - base) / MIB, (live() - live_base) / MIB
        print(f"{label:<44} rss {rss:+8.2f}  hwm {hwm():+8.2f}  live {held:+8.2f} MiB", flush=True)
        reset()

    kind = {"now": "other"}
    layer_peaks: dict[tuple[str, str], float] = collections.defaultdict(float)
    for i, layer in enumerate(model.model.layers):
        name = f"layer {i} " + ("DeltaNet" if hasattr(layer, "linear_attn") else "attention")

        def pre(module, inputs, name=name):
            reset()

        def post(module, inputs, output, name=name):
            layer_peaks[kind["now"], name] = max(layer_peaks[kind["now"], name], hwm())

        layer.register_forward_pre_hook(pre)
        layer.register_forward_hook(post)

    prefill = Engine.prefill

    def metered_prefill(self, group, **kwargs):
        # In generation the decoder prefills, then decodes; the loss pass takes generation's state (or prefills).
        phase = "generation" if kind["now"] == "decode" else kind["now"]
        mark(f"{phase}: before prefill")
        before, kind["now"] = kind["now"], "prefill" if phase == "generation" else kind["now"]
        state = prefill(self, group, **kwargs)
        kind["now"] = before
        mark(f"{phase}: prefill (state {state.nbytes() / MIB:.2f} MiB)")
        return state

    Engine.prefill = metered_prefill
    decoder = generation.shared_prompt_decoder

    def metered_decoder(*a, **k):
        decode = decoder(*a, **k)

        def run(*aa, **kk):
            kind["now"] = "decode"
            out = decode(*aa, **kk)
            kind["now"] = "generation"
            mark("generation: decoding")
            return out

        return run

    generation.shared_prompt_decoder = metered_decoder
    single_turn = trainer._generate_single_turn

    def metered_single_turn(*a, **k):
        mark("generation: before generate (tokenization)")
        out = single_turn(*a, **k)
        mark("generation: after generate")
        return out

    trainer._generate_single_turn = metered_single_turn
    generate_and_score = trainer._generate_and_score_completions

    def metered_generation(inputs):
        kind["now"] = "generation"
        reset()
        out = generate_and_score(inputs)
        mark("generation: rest (TRL's batch, rewards)")
        kind["now"] = "loss"
        return out

    trainer._generate_and_score_completions = metered_generation
    reset()
    trainer.training_step(model, batch, None)
    mark("loss")
    print("\nper layer, highest hwm during its forward (MiB over the step's starting RSS):")
    for (phase, name), peak in sorted(layer_peaks.items()):
        print(f"  {phase:<8} {name:<20} {peak:+8.2f}")


if __name__ == "__main__":
    main()
