"""The `trl-longstraw` command: GRPO with long prompts from a recipe config, after `pip install .` in a checkout
(trl_longstraw is not on PyPI).

    trl-longstraw grpo --config config.yaml [--flag value ...]
    accelerate launch [launch options] -m trl_longstraw.cli grpo --config config.yaml [--flag value ...]

`grpo` trains `LongStrawGRPOTrainer` as `recipes/grpo_long.py` does (that script is a thin wrapper around this
module): every `LongStrawGRPOConfig` (hence `GRPOConfig`), TRL `ModelConfig` and `LongStrawScriptArguments` field is
a flag and a YAML key, flags override the YAML, and the run ends with a summary and the final model (with its model
card) in `output_dir`. A config published with `python -m trl_longstraw.hub export` runs as is.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.trainer_utils import get_last_checkpoint
from transformers.utils import logging
from trl import ModelConfig, get_peft_config
from trl.trainer.utils import create_model_from_path

from . import expert_parallel
from .config import LongStrawGRPOConfig
from .recipe import (
    TINY_MODEL_PREFIX,
    LongStrawScriptArguments,
    add_heldout_accuracy,
    build_dataset,
    check_rope_override,
    format_summary,
    make_parser,
    peak_memory_gib,
    resolve_model_path,
    reward_function,
    summarize,
    warm_up,
)
from .tasks import TASK_NAMES
from .trainer import LongStrawGRPOTrainer

logger = logging.get_logger(__name__)

COMMANDS = ("grpo",)
USAGE = "usage: trl-longstraw grpo --config CONFIG.yaml [--field value ...]   (trl-longstraw grpo --help: all fields)"


def parse(
    argv: list[str], defaults: dict | None = None, prog: str | None = None
) -> tuple[LongStrawScriptArguments, LongStrawGRPOConfig, ModelConfig]:
    """Parses the `grpo` command's arguments `argv` (a `--config` YAML and flags) with the recipe's parser.

    `defaults`, if given, replace the fields' defaults (a YAML and flags still override them). `prog` names the
    command in `--help` and usage errors (argparse's default is the script's file name, e.g. `cli.py`).
    """
    parser = make_parser()
    if prog is not None:
        parser.prog = prog
    if defaults:
        parser.set_defaults_with_config(**defaults)
    return parser.parse_args_and_config(argv)


def _launch_options(cmdline: list[str]) -> list[str] | None:
    """The words after `accelerate launch` (or `accelerate-launch`, `-m accelerate.commands.launch`) in `cmdline`,
    or None if it is not such a command line."""
    for i, word in enumerate(cmdline):
        if os.path.basename(word) == "accelerate-launch" or word == "accelerate.commands.launch":
            return cmdline[i + 1 :]
        if word == "launch" and i > 0 and os.path.basename(cmdline[i - 1]) == "accelerate":
            return cmdline[i + 1 :]
    return None


def _parent() -> tuple[list[str], dict[str, str]] | None:
    """The parent process's command line and environment (the launcher's, under `accelerate launch`), if readable."""
    import psutil

    try:
        parent = psutil.Process(os.getppid())
        return parent.cmdline(), parent.environ()
    except psutil.Error:
        return None


def requested_processes(cmdline: list[str]) -> int | None:
    """The number of processes that an `accelerate launch` command line asks for with `--num_processes`, or None
    (not such a command line, or no `--num_processes` before the training script)."""
    options = _launch_options(cmdline)
    for i, word in enumerate(options or []):
        if word in ("-m", "--module") or word.endswith(".py"):
            return None  # the training script and its arguments follow
        if word.startswith(("--num_processes=", "--num-processes=")):
            return int(word.split("=", 1)[1])
        if word in ("--num_processes", "--num-processes") and i + 1 < len(options):
            return int(options[i + 1])
    return None


def check_processes(running: int, cmdline: list[str] | None = None) -> None:
    """Warns when fewer processes run than the launcher asked for: `accelerate launch --cpu --num_processes 2` starts
    one process (its CPU launcher is single-process), silently. `cmdline` defaults to the parent process's."""
    if cmdline is None:
        parent = _parent()
        if parent is None:
            return
        cmdline = parent[0]
    requested = requested_processes(cmdline)
    if requested is not None and requested > running:
        logger.warning(
            f"accelerate launch asked for {requested} processes, but {running} runs: with --cpu, accelerate starts a "
            f"single process. For {requested} CPU processes (gloo), launch with `ACCELERATE_USE_CPU=1 accelerate "
            f"launch --multi_gpu --num_processes {requested} ...`."
        )


def threads_chosen(environ: dict[str, str], parent: tuple[list[str], dict[str, str]] | None) -> bool:
    """Whether the user chose the number of CPU threads: `OMP_NUM_THREADS` is set in this process's environment
    `environ`, and not only by `accelerate launch` (the `parent`'s command line and environment), which sets it in its
    processes to the cores per process when the launcher's own environment lacks it."""
    if "OMP_NUM_THREADS" not in environ:
        return False
    if parent is not None and _launch_options(parent[0]) is not None:
        return "OMP_NUM_THREADS" in parent[1] or any(w.startswith("--num_cpu_threads") for w in parent[0])
    return True


def configure_cpu_threads(model: torch.nn.Module, tiny: bool, on_cpu: bool, chosen: bool) -> str | None:
    """Sets the CPU threads of a CPU run, or advises; returns the line it logged (None on GPU or when all is well).

    On a shared or small CPU, the spin-waiting of intra-op threads makes a small model's many small ops many times
    slower: the tiny recipe ran 2 steps in 2.8 s with one thread against 78.3 s with two on a busy 2-core machine
    (benchmarks/CPU_THREADS.md). A built-in tiny model (`longstraw/tiny-*`) gets one thread unless the user `chosen`
    a number; another model of under 100M parameters running with several threads gets the advice.
    """
    if not on_cpu:
        return None
    threads = torch.get_num_threads()
    if tiny and not chosen:
        torch.set_num_threads(1)
        line = (
            f"CPU run of a tiny model: 1 intra-op thread instead of {threads} (much faster for small ops, see "
            "benchmarks/CPU_THREADS.md); set OMP_NUM_THREADS to choose."
        )
    elif threads > 1 and sum(p.numel() for p in model.parameters()) < 100_000_000:
        line = (
            f"CPU run of a small model with {threads} intra-op threads per process: small models often run many "
            "times faster with OMP_NUM_THREADS=1 (the tiny recipe: 2.8 s against 78.3 s with 2 threads on a busy "
            "2-core machine, benchmarks/CPU_THREADS.md)."
        )
    else:
        return None
    logger.warning(line)
    return line


def check_saving(args: LongStrawGRPOConfig) -> None:
    """Warns when `save_steps` is set while `save_strategy` is `"no"` (as in `tiny_cpu.yaml`): no checkpoint would be
    written, silently."""
    default = next(f.default for f in dataclasses.fields(LongStrawGRPOConfig) if f.name == "save_steps")
    if args.save_strategy == "no" and args.save_steps != default:
        logger.warning(
            f"save_steps={args.save_steps:g} writes no checkpoint while save_strategy is 'no' (the config sets it): "
            f"add --save_strategy steps to save one every {args.save_steps:g} steps. The final model is saved to "
            "output_dir either way."
        )


def resume_target(args: LongStrawGRPOConfig) -> str | None:
    """The checkpoint that `args.resume_from_checkpoint` names, for `Trainer.train(resume_from_checkpoint=...)`.

    `true` (any case, or `yes`, `1`), Trainer's convention, is the last checkpoint in `output_dir`; `false` (`no`, `0`)
    or unset is none; anything else is a checkpoint path, returned as is.

    Raises:
        ValueError: for `true` when `output_dir` holds no checkpoint.
    """
    value = args.resume_from_checkpoint
    word = str(value).strip().lower() if value is not None else "false"
    if word in ("false", "no", "0", ""):
        return None
    if word not in ("true", "yes", "1"):
        return value
    last = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
    if last is None:
        raise ValueError(
            f"resume_from_checkpoint=true resumes from the last checkpoint-<step> folder in output_dir "
            f"({args.output_dir}), but it holds none: give the output_dir of the run to resume (it must have saved "
            "checkpoints: save_strategy steps and save_steps), or a checkpoint's path."
        )
    logger.info(f"resuming from {last}")
    return last


def prompt_token_lengths(trainer: LongStrawGRPOTrainer, sample: int = 16, seed: int = 0) -> list[int]:
    """Token lengths, as the trainer tokenizes them (chat template included), of up to `sample` prompts of the
    training dataset drawn at random; `[]` for a dataset without a length or with per-row environments."""
    dataset = trainer.train_dataset
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "select") or trainer.environment_factories is not None:
        return []
    indices = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:sample].tolist()
    return [len(ids) for ids in trainer._tokenize_prompts(list(dataset.select(indices)["prompt"]))[0]]


def describe_lengths(lengths: list[int]) -> str | None:
    """`"211 tokens"`, or `"180-240 tokens (mean 211 of 16 sampled)"` when the lengths differ; None for none."""
    if not lengths:
        return None
    low, high = min(lengths), max(lengths)
    if low == high:
        return f"{low} tokens"
    return f"{low}-{high} tokens (mean {sum(lengths) / len(lengths):.0f} of {len(lengths)} sampled)"


def train(
    script_args: LongStrawScriptArguments, training_args: LongStrawGRPOConfig, model_args: ModelConfig
) -> LongStrawGRPOTrainer:
    """Trains, prints the run summary, saves the final model to `output_dir` and returns the trainer."""
    state = training_args.distributed_state
    if state.is_main_process:
        check_processes(state.num_processes)
    check_saving(training_args)
    resume = resume_target(training_args)
    model_path = resolve_model_path(
        model_args.model_name_or_path, training_args.output_dir, training_args.seed, script_args.tiny_hidden_size
    )

    model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
    }
    if training_args.distributed_state.distributed_type != "NO":
        model_init_kwargs["device_map"] = None  # each rank loads the model itself, as in GRPOTrainer
    model_init_kwargs.update(training_args.model_init_kwargs or {})
    if training_args.expert_parallel_size > 1:
        # transformers shards the model as it loads it: the experts over expert_parallel_size ranks, the rest FSDP2.
        # The settings are checked first, so that a wrong one stops the run before the model is read.
        world = training_args.world_size
        expert_parallel.check_args(training_args, world)
        config = AutoConfig.from_pretrained(
            model_path, revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code
        )
        expert_parallel.check_model_config(config, training_args.expert_parallel_size)
        model_init_kwargs = expert_parallel.model_init_kwargs(training_args, world, model_init_kwargs)
    check_rope_override(
        model_path,
        model_init_kwargs,
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
    )
    model = create_model_from_path(model_path, architecture=AutoModelForCausalLM, **model_init_kwargs)
    configure_cpu_threads(
        model,
        tiny=(model_args.model_name_or_path or "").startswith(TINY_MODEL_PREFIX),
        on_cpu=training_args.use_cpu or not torch.cuda.is_available(),
        chosen=threads_chosen(dict(os.environ), _parent()),
    )
    tokenizer = AutoTokenizer.from_pretrained(
        model_path,
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        padding_side="left",
        truncation_side="left",
    )
    # GRPOTrainer reads model_init_kwargs again only to build a reference model (beta > 0): give it the policy's.
    training_args.model_init_kwargs = model_init_kwargs if training_args.beta != 0.0 else None
    peft_config = get_peft_config(model_args)
    # A resumed run loads its trained weights from the checkpoint. With PEFT the warm-up trains the adapter (after the
    # trainer adds it), not the base weights: only the adapter is saved and resumed, so a warmed-up base would be lost.
    if resume is None and peft_config is None:
        warm_up(script_args, model, tokenizer, seed=training_args.seed)

    trainer = LongStrawGRPOTrainer(
        model=model,
        reward_funcs=[reward_function(name) for name in script_args.reward_funcs],
        args=training_args,
        train_dataset=build_dataset(script_args, tokenizer, seed=training_args.seed),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    if resume is None and peft_config is not None:
        warm_up(script_args, trainer.model, tokenizer, seed=training_args.seed)
    trainer.base_model_name = model_args.model_name_or_path  # for the model card: not the tiny model's folder
    add_heldout_accuracy(trainer, script_args, seed=training_args.seed)
    trainer.train(resume_from_checkpoint=resume)

    summary = summarize(trainer.state.log_history)
    summary["peak_memory_what"], summary["peak_memory_gib"] = peak_memory_gib()
    summary["train_runtime_s"] = trainer.state.log_history[-1].get("train_runtime", float("nan"))
    summary["processes"] = trainer.accelerator.num_processes
    summary["shard_group"] = trainer._prompt_shards.world if trainer._prompt_shards is not None else 0
    if trainer.accelerator.is_main_process:  # the one that prints the summary
        summary["prompt_tokens"] = describe_lengths(prompt_token_lengths(trainer, seed=training_args.seed))
    trainer.accelerator.print("\n" + format_summary(summary, script_args, training_args))
    # The final model and its card, whatever save_strategy says of checkpoints (as TRL's scripts do).
    trainer.save_model(training_args.output_dir)
    dataset = script_args.dataset_name if script_args.dataset_name not in TASK_NAMES else None
    trainer.create_model_card(dataset_name=dataset)
    trainer.end()
    return trainer


def main(argv: list[str] | None = None, defaults: dict | None = None, prog: str | None = None) -> int:
    """The `trl-longstraw` command line (`argv` defaults to `sys.argv[1:]`); returns the exit status, 2 for a usage
    error. `defaults` replace the fields' defaults, as in `parse`; `prog` names the command in its `--help` (default
    `trl-longstraw <command>`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + __doc__.split("\n\n")[0])
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(
            f"trl-longstraw: unknown command {command!r} (commands: {', '.join(COMMANDS)})\n{USAGE}", file=sys.stderr
        )
        return 2
    if not rest and not defaults:
        print(f"trl-longstraw {command}: give a recipe config\n{USAGE}", file=sys.stderr)
        return 2
    trainer = train(*parse(rest, defaults, prog=prog or f"trl-longstraw {command}"))
    if trainer.accelerator.num_processes > 1:
        # The run is complete and the process group destroyed; a gloo (CPU) run can still abort in interpreter
        # teardown ("terminate called without an active exception"), which the launcher would report as a failure.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
