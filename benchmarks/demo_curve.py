"""What the CPU demo learns: the held-out needle accuracy of `recipes/grpo_long.py`'s embedded default, per seed.

Runs the demo (no arguments: `TINY_CPU_DEFAULTS`) once per seed, in one process, each with its own output folder,
and reads `longstraw/heldout_accuracy` (greedy exact match on prompts of the demo's length never trained on) from
`trainer.state.log_history`: step 0 is the model after the supervised warm-up, before any GRPO step. Writes a table
(`DEMO.md`), the curves (`DEMO.json`) and a plot (`plots/demo_accuracy.png`).

    python benchmarks/demo_curve.py [--seeds 0,1,2,3,4,5] [--jobs 2] [--out benchmarks]

`--jobs N` runs N seeds at a time, each in its own process (one thread each).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import platform
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "recipes"))

import grpo_long  # noqa: E402  (recipes/grpo_long.py)

from trl_longstraw.warmup import ACCURACY_KEY  # noqa: E402


def run(seed: int) -> dict:
    """One demo run with `seed`: its held-out accuracy curve, mean reward per step and train runtime."""
    script_args, training_args, model_args = grpo_long.parse([])
    training_args.seed = seed
    training_args.output_dir = tempfile.mkdtemp()
    training_args.disable_tqdm = True
    trainer = grpo_long.main(script_args, training_args, model_args)
    history = trainer.state.log_history
    return {
        "seed": seed,
        "heldout": [[h["step"], h[ACCURACY_KEY]] for h in history if ACCURACY_KEY in h],
        "reward": [[h["step"], h["reward"]] for h in history if "reward" in h],
        "train_runtime_s": history[-1]["train_runtime"],
        "prompt_tokens": script_args.prompt_tokens,
        "heldout_prompts": script_args.heldout_prompts,
        "warmup": f"{script_args.warmup_sft_steps} steps on {script_args.warmup_sft_prompt_tokens}-token prompts",
    }


def write(runs: list[dict], out: Path, command: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    date = datetime.date.today().isoformat()
    (out / "DEMO.json").write_text(json.dumps({"command": command, "date": date, "runs": runs}, indent=1) + "\n")
    first = runs[0]
    lines = [
        "# What the CPU demo learns",
        "",
        f"Measured {date} on {platform.machine()}, CPU, with:",
        "",
        "```",
        command,
        "```",
        "",
        f"The embedded default of `recipes/grpo_long.py` (= `recipes/configs/tiny_cpu.yaml`) with each seed: a random "
        f"2-layer Llama, a supervised warm-up ({first['warmup']}), then GRPO on {first['prompt_tokens']}-token "
        f"needle prompts. Held-out accuracy: greedy exact match on {first['heldout_prompts']} prompts of "
        f"{first['prompt_tokens']} tokens that no phase trains on; step 0 is after the warm-up, before GRPO. "
        "By chance: 0.1. Train runtime: wall time of the GRPO phase, `--jobs` seeds at a time on a shared machine.",
        "",
        "| seed | " + " | ".join(f"step {s}" for s, _ in first["heldout"]) + " | GRPO gain | train runtime |",
        "|---" * (len(first["heldout"]) + 3) + "|",
    ]
    for r in runs:
        values = [a for _, a in r["heldout"]]
        lines.append(
            f"| {r['seed']} | "
            + " | ".join(f"{a:.3f}" for a in values)
            + f" | {values[-1] - values[0]:+.3f} | {r['train_runtime_s']:.0f} s |"
        )
    (out / "DEMO.md").write_text("\n".join(lines) + "\n")

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in runs:
        ax.plot(*zip(*r["heldout"], strict=True), marker="o", label=f"seed {r['seed']}")
    ax.axhline(0.1, color="gray", linestyle=":", label="chance")
    ax.set(
        xlabel="GRPO step (0: after the supervised warm-up)",
        ylabel="held-out accuracy",
        title=f"CPU demo: greedy needle accuracy at {first['prompt_tokens']} tokens",
        ylim=(0, 1.02),
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    (out / "plots").mkdir(exist_ok=True)
    fig.savefig(out / "plots" / "demo_accuracy.png", dpi=100)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0,1,2,3,4,5", help="comma-separated seeds")
    parser.add_argument("--jobs", type=int, default=1, help="seeds run at a time, one process each")
    parser.add_argument("--out", default=str(ROOT / "benchmarks"), help="folder for DEMO.md, DEMO.json, plots/")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        runs = list(pool.map(run, seeds))
    command = " ".join(["python benchmarks/demo_curve.py", *(sys.argv[1:] if argv is None else argv)])
    write(runs, Path(args.out), command)


if __name__ == "__main__":
    main()
