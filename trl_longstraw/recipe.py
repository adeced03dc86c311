"""The pieces of `recipes/grpo_long.py` that other code reuses: its arguments, parser, names and run summary.

`make_parser()` is the recipe's `TrlParser` over (`LongStrawScriptArguments`, `LongStrawGRPOConfig`, `ModelConfig`),
so a recipe YAML (a flat mapping over the fields of the three) is checked the same way wherever it is read: by the
recipe, by `python -m trl_longstraw.hub export`, and by the tests.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass, field

import torch
from trl import ModelConfig, ScriptArguments, TrlParser

from .config import LongStrawGRPOConfig
from .tasks import TASK_NAMES, exact_match_reward, load_task_dataset, retrieval_reward
from .trainer import peak_rss_gib
from .warmup import ACCURACY_KEY, HeldOutAccuracy, supervised_warmup

TINY_MODEL_PREFIX = "longstraw/tiny-"


@dataclass
class LongStrawScriptArguments(ScriptArguments):
    """Arguments of `recipes/grpo_long.py` on top of TRL's `ScriptArguments`.

    Parameters:
        dataset_name (`str`, *optional*, defaults to `"longstraw/needle"`):
            A task shipped with trl_longstraw (`longstraw/needle`, `longstraw/kv-retrieval`), built in memory, or a
            dataset of the Hub or on disk with a `prompt` column.
        prompt_tokens (`int`, *optional*, defaults to `384`):
            Prompt length, in tokens, of the built-in tasks.
        num_prompts (`int`, *optional*, defaults to `256`):
            Number of prompts of the built-in tasks.
        needles (`int`, *optional*, defaults to `1`):
            `longstraw/needle` only: how many times the needle is written, each at its own random depth.
        conversational (`bool`, *optional*, defaults to `False`):
            Give the built-in tasks' prompts as a one-message user conversation, for chat models.
        tiny_hidden_size (`int`, *optional*, defaults to `64`):
            Hidden size of the model that `--model_name_or_path longstraw/tiny-<family>` builds.
        reward_funcs (`list[str]`, *optional*, defaults to `["retrieval_reward"]`):
            Reward functions by name; see `reward_function`.
        warmup_sft_steps (`int`, *optional*, defaults to `0`):
            Built-in tasks only: supervised steps on the answers of short prompts of the task before GRPO starts
            (`trl_longstraw.warmup.supervised_warmup`); 0 for none.
        warmup_sft_prompt_tokens (`int`, *optional*, defaults to `32`):
            Prompt length, in tokens, of the warm-up's prompts.
        warmup_sft_batch_size (`int`, *optional*, defaults to `16`):
            Prompts per warm-up step.
        warmup_sft_learning_rate (`float`, *optional*, defaults to `3e-3`):
            AdamW learning rate of the warm-up.
        heldout_prompts (`int`, *optional*, defaults to `0`):
            Built-in tasks only: how many held-out prompts of `prompt_tokens` tokens (never trained on) measure the
            greedy accuracy at step 0 and every `heldout_steps` steps, logged as `longstraw/heldout_accuracy`; 0 for
            none.
        heldout_steps (`int`, *optional*, defaults to `10`):
            Steps between two measurements of the held-out accuracy.
    """

    dataset_name: str | None = field(
        default="longstraw/needle",
        metadata={"help": f"A task shipped with trl_longstraw ({', '.join(TASK_NAMES)}), or a Hub/local dataset."},
    )
    prompt_tokens: int = field(
        default=384,
        metadata={"help": "Prompt length in tokens of the built-in tasks (exact for word-level tokenizers)."},
    )
    num_prompts: int = field(default=256, metadata={"help": "Number of prompts of the built-in tasks."})
    needles: int = field(
        default=1,
        metadata={"help": "longstraw/needle only: how many times the needle is written, at random depths."},
    )
    conversational: bool = field(
        default=False,
        metadata={"help": "Give the built-in tasks' prompts as a one-message user conversation (chat models)."},
    )
    tiny_hidden_size: int = field(
        default=64,
        metadata={"help": "Hidden size of a longstraw/tiny-<family> model (2 layers, 4 heads, MLP 2x hidden)."},
    )
    reward_funcs: list[str] = field(
        default_factory=lambda: ["retrieval_reward"],
        metadata={
            "help": "Reward functions: retrieval_reward, exact_match_reward, accuracy_reward, think_format_reward, "
            "or a dotted import path such as my_module.my_reward."
        },
    )
    warmup_sft_steps: int = field(
        default=0,
        metadata={
            "help": "Built-in tasks: supervised steps on short prompts' answers before GRPO (0: none). With "
            "--use_peft they train the adapter only (the saved and resumed weights)."
        },
    )
    warmup_sft_prompt_tokens: int = field(default=32, metadata={"help": "Prompt length of the warm-up, in tokens."})
    warmup_sft_batch_size: int = field(default=16, metadata={"help": "Prompts per warm-up step."})
    warmup_sft_learning_rate: float = field(default=3e-3, metadata={"help": "AdamW learning rate of the warm-up."})
    heldout_prompts: int = field(
        default=0,
        metadata={"help": "Built-in tasks: held-out prompts whose greedy accuracy is logged (0: none)."},
    )
    heldout_steps: int = field(default=10, metadata={"help": "Steps between two held-out accuracy measurements."})

    def __post_init__(self):
        if (self.warmup_sft_steps or self.heldout_prompts) and self.dataset_name not in TASK_NAMES:
            raise ValueError(
                f"warmup_sft_steps and heldout_prompts build prompts of a built-in task ({', '.join(TASK_NAMES)}), "
                f"not of {self.dataset_name!r}: set them to 0, or use a built-in task."
            )
        if (self.warmup_sft_steps or self.heldout_prompts) and self.conversational:
            raise ValueError(
                "warmup_sft_steps and heldout_prompts read plain-text prompts, not conversations: set them to 0 with "
                "conversational, or leave conversational off."
            )


def make_parser(config_class: type = LongStrawGRPOConfig) -> TrlParser:
    """The recipe's parser over (`LongStrawScriptArguments`, `LongStrawGRPOConfig`, `ModelConfig`); the planner
    passes a subclass of `LongStrawGRPOConfig` as `config_class` (`trl_longstraw.plan.recipe_training_args`).

    `--lora_dropout` defaults to 0 instead of `ModelConfig`'s 0.05: LongStrawGRPOTrainer refuses active dropout
    (each token runs in several passes, each of which would draw its own mask). A YAML key or flag still sets it.
    """
    parser = TrlParser((LongStrawScriptArguments, config_class, ModelConfig))
    parser.set_defaults_with_config(lora_dropout=0.0)
    return parser


def reward_function(name: str):
    """The reward function called `name`: `retrieval_reward` or `exact_match_reward` (trl_longstraw.tasks),
    `accuracy_reward` or `think_format_reward` (TRL), or a dotted import path `module.function`.

    Raises:
        ValueError: for any other name, listing the known ones.
    """
    from trl.rewards import accuracy_reward, think_format_reward

    known = {
        "retrieval_reward": retrieval_reward,
        "exact_match_reward": exact_match_reward,
        "accuracy_reward": accuracy_reward,
        "think_format_reward": think_format_reward,
    }
    if name in known:
        return known[name]
    if "." in name:
        module_path, func_name = name.rsplit(".", 1)
        sys.path.insert(0, os.getcwd())
        return getattr(importlib.import_module(module_path), func_name)
    raise ValueError(f"unknown reward function {name!r}: use one of {', '.join(known)} or a dotted import path.")


def resolve_model_path(name: str | None, output_dir: str, seed: int = 0, tiny_hidden_size: int = 64) -> str:
    """The path to load for `--model_name_or_path name`.

    `longstraw/tiny-<family>` (e.g. `longstraw/tiny-llama`) builds a tiny random model of that transformers family
    (2 layers, 4 heads, hidden size `tiny_hidden_size`) with the word-level tokenizer of `trl_longstraw.testing`,
    offline, into `<output_dir>/tiny-model` (on the main process; the others wait), and returns that path. Any other
    name is returned as is.
    """
    if name is None:
        raise ValueError("set --model_name_or_path: a Hub id, a local path, or longstraw/tiny-llama for a demo.")
    if not name.startswith(TINY_MODEL_PREFIX):
        return name
    from accelerate import PartialState

    from .testing import save_tiny_model

    path = os.path.join(output_dir, "tiny-model")
    state = PartialState()
    with state.main_process_first():
        if state.is_main_process:
            save_tiny_model(
                path,
                family=name[len(TINY_MODEL_PREFIX) :],
                seed=seed,
                hidden_size=tiny_hidden_size,
                intermediate_size=2 * tiny_hidden_size,
                head_dim=tiny_hidden_size // 4,
            )
    return path


# Keys of `rope_parameters` that a RoPE-scaling override sets; any other key must keep the checkpoint's value.
_SCALING_KEYS = {
    "rope_type",
    "factor",
    "original_max_position_embeddings",
    "attention_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "truncate",
}


def check_rope_override(model_path: str, model_init_kwargs: dict, **config_kwargs) -> None:
    """Checks a `rope_parameters` override in `model_init_kwargs` against the checkpoint's config.

    transformers replaces the whole `rope_parameters` mapping with the override, so a key it leaves out (or mistypes)
    silently falls back to a default: `rope_theta` would become 10,000. The override may add or change only the
    scaling keys (`rope_type`, `factor`, `original_max_position_embeddings`, ...); every other key of the
    checkpoint's `rope_parameters` must be given with the checkpoint's value. The override may sit at the top level
    or under `text_config` (Qwen3.5/3.6 checkpoints nest their language model's config there).

    Raises:
        ValueError: naming each key that the override drops or changes, with the checkpoint's value.
    """
    nested = "text_config" in model_init_kwargs
    override = (model_init_kwargs.get("text_config") or {}) if nested else model_init_kwargs
    if "rope_parameters" not in override:
        return
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, **config_kwargs)
    config = config.get_text_config() if nested else config
    original = dict(config.rope_parameters or {})
    wanted = override["rope_parameters"] or {}
    problems = [
        f"{key}: checkpoint {original[key]!r}, override {wanted.get(key, '<missing>')!r}"
        for key in sorted(set(original) - _SCALING_KEYS)
        if key not in wanted or wanted[key] != original[key]
    ]
    if problems:
        raise ValueError(
            "model_init_kwargs' rope_parameters replaces the checkpoint's whole mapping but differs from it outside "
            f"the scaling keys ({'; '.join(problems)}): copy those values from the checkpoint's config.json."
        )


def build_dataset(script_args: LongStrawScriptArguments, tokenizer, seed: int = 0):
    """The training dataset: a built-in task sized with `tokenizer`, or `load_dataset(dataset_name)[train split]`."""
    if script_args.dataset_name in TASK_NAMES:
        return load_task_dataset(
            script_args.dataset_name,
            num_prompts=script_args.num_prompts,
            prompt_tokens=script_args.prompt_tokens,
            tokenizer=tokenizer,
            seed=seed,
            conversational=script_args.conversational,
            needles=script_args.needles,
        )
    from datasets import load_dataset

    dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
    return dataset[script_args.dataset_train_split]


def warm_up(script_args: LongStrawScriptArguments, model, tokenizer, seed: int = 0) -> list[float]:
    """Runs the supervised warm-up that `script_args` asks for (none if `warmup_sft_steps` is 0) on `model` in place,
    over fresh prompts of the built-in task (seed `seed + 1`, apart from the training prompts); returns its losses."""
    if not script_args.warmup_sft_steps:
        return []
    dataset = load_task_dataset(
        script_args.dataset_name,
        num_prompts=script_args.warmup_sft_steps * script_args.warmup_sft_batch_size,
        prompt_tokens=script_args.warmup_sft_prompt_tokens,
        tokenizer=tokenizer,
        seed=seed + 1,
        needles=script_args.needles,
    )
    return supervised_warmup(
        model,
        tokenizer,
        dataset,
        steps=script_args.warmup_sft_steps,
        batch_size=script_args.warmup_sft_batch_size,
        learning_rate=script_args.warmup_sft_learning_rate,
        seed=seed,
    )


def add_heldout_accuracy(trainer, script_args: LongStrawScriptArguments, seed: int = 0) -> HeldOutAccuracy | None:
    """Adds to `trainer` the `HeldOutAccuracy` callback that `script_args` asks for (none if `heldout_prompts` is 0),
    over `heldout_prompts` prompts of the built-in task at the training length, drawn with seed `seed + 2`."""
    if not script_args.heldout_prompts:
        return None
    dataset = load_task_dataset(
        script_args.dataset_name,
        num_prompts=script_args.heldout_prompts,
        prompt_tokens=script_args.prompt_tokens,
        tokenizer=trainer.processing_class,
        seed=seed + 2,
        needles=script_args.needles,
    )
    callback = HeldOutAccuracy(trainer, dataset, every=script_args.heldout_steps)
    trainer.add_callback(callback)
    return callback


def peak_memory_gib() -> tuple[str, float]:
    """(`what`, GiB): the peak GPU memory allocated, or on CPU the peak resident set size of this process."""
    if torch.cuda.is_available():
        return "peak GPU memory allocated", torch.cuda.max_memory_allocated() / 2**30
    return "peak RSS", peak_rss_gib()


def summarize(log_history: list[dict], window: int = 10) -> dict[str, float]:
    """Summary of a run from `trainer.state.log_history`: mean reward (and exact-match accuracy, if logged) of the
    first and last `window` logged steps, the mean prompt positions prefilled per micro-batch (by its loss pass, or by
    generation when the loss pass took generation's state), and the first and last held-out accuracy with their steps
    (`heldout_first_step`, `heldout_first`, ...), if logged.

    Raises:
        ValueError: if no logged step holds a reward.
    """
    steps = [h for h in log_history if "reward" in h]
    if not steps:
        raise ValueError("the run logged no reward: set logging_steps so that at least one step is logged.")
    window = max(1, min(window, len(steps) // 2))
    reused = any("longstraw/prompt_positions_reused" in h for h in steps)

    def mean(key: str, rows: list[dict]) -> float:
        values = [r[key] for r in rows if key in r]
        return sum(values) / len(values) if values else float("nan")

    summary = {
        "logged_steps": len(steps),
        "window": window,
        "reward_first": mean("reward", steps[:window]),
        "reward_last": mean("reward", steps[-window:]),
        "prompt_positions": mean("longstraw/prompt_positions", steps)
        + (mean("longstraw/prompt_positions_reused", steps) if reused else 0.0),
    }
    accuracy_key = "rewards/exact_match_reward/mean"
    if any(accuracy_key in r for r in steps):
        summary["accuracy_first"] = mean(accuracy_key, steps[:window])
        summary["accuracy_last"] = mean(accuracy_key, steps[-window:])
    heldout = [(r["step"], r[ACCURACY_KEY]) for r in log_history if ACCURACY_KEY in r]
    if heldout:
        (summary["heldout_first_step"], summary["heldout_first"]) = heldout[0]
        (summary["heldout_last_step"], summary["heldout_last"]) = heldout[-1]
    return summary


def format_summary(summary: dict, script_args: LongStrawScriptArguments, args: LongStrawGRPOConfig) -> str:
    """The end-of-run summary block printed by the recipe."""
    w = summary["window"]
    # The prompts' measured length (`summary["prompt_tokens"]`, e.g. "211 tokens"); `prompt_tokens` sizes only the
    # built-in tasks.
    prompt_tokens = summary.get("prompt_tokens") or f"{script_args.prompt_tokens} tokens"
    lines = [
        "==================== trl_longstraw run summary ====================",
        f"task                    {script_args.dataset_name}, prompts of {prompt_tokens}, "
        f"prefill chunks of {args.prefill_chunk_size}, prompt_gradient={args.prompt_gradient}",
    ]
    if script_args.warmup_sft_steps:
        lines.append(
            f"supervised warm-up      {script_args.warmup_sft_steps} steps on {script_args.warmup_sft_prompt_tokens}"
            f"-token prompts, {script_args.warmup_sft_batch_size} a step, before GRPO"
        )
    lines += [
        f"prompt positions        {summary['prompt_positions']:.0f} prefilled per micro-batch (each distinct prompt "
        f"once for its {args.num_generations} completions)",
        f"{summary['peak_memory_what']:<23} {summary['peak_memory_gib']:.2f} GiB",
        f"mean reward             first {w} steps {summary['reward_first']:.3f}  ->  last {w} steps "
        f"{summary['reward_last']:.3f}",
    ]
    if "accuracy_first" in summary:
        lines.append(
            f"exact-match accuracy    first {w} steps {summary['accuracy_first']:.3f}  ->  last {w} steps "
            f"{summary['accuracy_last']:.3f}"
        )
    if "heldout_first" in summary:
        lines.append(
            f"held-out accuracy       step {summary['heldout_first_step']} {summary['heldout_first']:.3f}  ->  step "
            f"{summary['heldout_last_step']} {summary['heldout_last']:.3f} (greedy, {script_args.heldout_prompts} "
            f"prompts of {script_args.prompt_tokens} tokens never trained on)"
        )
    if "processes" in summary:
        sharded = summary.get("shard_group", 0)
        lines.append(
            f"processes               {summary['processes']}"
            + (f", prompt state sharded over groups of {sharded}" if sharded else "")
        )
    lines.append(f"train runtime           {summary['train_runtime_s']:.0f} s for {summary['logged_steps']} steps")
    lines.append("=" * 68)
    return "\n".join(lines)
