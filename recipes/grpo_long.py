# Copyright 2026 The trl_longstraw authors. Licensed under the Apache License, Version 2.0.
"""GRPO with long prompts: `LongStrawGRPOTrainer` as a TRL-style script.

With no arguments it runs a demo on CPU in about a minute (a few on a busy machine): the embedded default
`TINY_CPU_DEFAULTS` below, the same settings as `recipes/configs/tiny_cpu.yaml`. A tiny random Llama trains on the
`longstraw/needle` task with 384-token prompts prefilled in chunks of 128 (a progress bar shows the chunks), after
a short supervised warm-up on 32-token needles (see `trl_longstraw.warmup`); GRPO then raises its greedy accuracy on
held-out 384-token prompts, logged every 10 steps, and the run ends with a summary of the prompt positions, the peak
memory, the mean reward of the first and last steps and the held-out accuracy at the start and the end.

    accelerate launch recipes/grpo_long.py          # the embedded default (CPU demo)
    python recipes/grpo_long.py                     # the same, one process
    accelerate launch --config_file recipes/accelerate/fsdp2_offload.yaml --num_processes 8 recipes/grpo_long.py \\
        --config recipes/configs/qwen3.6-27b_8xh20_2.1m_exact.yaml

Every `LongStrawGRPOConfig` (hence `GRPOConfig`) and TRL `ModelConfig` field is a flag and a YAML key; flags
override the YAML. The script's own fields (`trl_longstraw.recipe.LongStrawScriptArguments`):

- `--dataset_name`: `longstraw/needle` or `longstraw/kv-retrieval` (built in memory by `trl_longstraw.tasks`, sized
  by `--prompt_tokens` and `--num_prompts`), or a dataset of the Hub or on disk with a `prompt` column.
- `--reward_funcs`: `retrieval_reward`, `exact_match_reward`, TRL's `accuracy_reward` and `think_format_reward`, or a
  dotted import path `my_module.my_reward`. Weigh them with `--reward_weights`.
- `--warmup_sft_steps N` (built-in tasks): N supervised steps on the answers of `--warmup_sft_prompt_tokens`-token
  prompts of the task (`--warmup_sft_batch_size` a step, AdamW at `--warmup_sft_learning_rate`) before GRPO.
- `--heldout_prompts N` (built-in tasks): greedy accuracy on N prompts of `--prompt_tokens` tokens never trained on,
  at step 0 and every `--heldout_steps` steps, logged as `longstraw/heldout_accuracy`.
- `--model_name_or_path longstraw/tiny-<family>` (`longstraw/tiny-llama`, `longstraw/tiny-qwen3`, ...) builds a tiny
  random model of that transformers family, offline, into `<output_dir>/tiny-model`.
- PEFT through `ModelConfig`: `--use_peft --lora_r 16 --lora_target_modules q_proj v_proj ...`. `--lora_dropout`
  defaults to 0 here (TRL's `ModelConfig` says 0.05): LongStrawGRPOTrainer refuses active dropout.

The policy is always loaded as a text causal LM (`AutoModelForCausalLM`) with its tokenizer: from a checkpoint that
also ships a vision tower (Qwen3.5/3.6), only the language model is loaded, trained and saved, as
LongStrawGRPOTrainer takes text prompts only.
"""

from __future__ import annotations

import sys

from trl_longstraw.cli import main as cli_main
from trl_longstraw.cli import parse as cli_parse
from trl_longstraw.cli import train as main  # noqa: F401  (the notebooks call grpo_long.main(*parse(...)))

# The embedded default, run when the script gets no arguments; `recipes/configs/tiny_cpu.yaml` holds the same values
# (a test checks that they agree). See `trl_longstraw.tasks` for what the tiny model learns within these steps.
TINY_CPU_DEFAULTS: dict = {
    "model_name_or_path": "longstraw/tiny-llama",
    "tiny_hidden_size": 64,
    "dtype": "float32",
    "dataset_name": "longstraw/needle",
    "prompt_tokens": 384,
    "needles": 1,
    "num_prompts": 256,
    "reward_funcs": ["retrieval_reward", "exact_match_reward"],
    "reward_weights": [1.0, 0.0],
    "warmup_sft_steps": 80,
    "warmup_sft_prompt_tokens": 32,
    "heldout_prompts": 256,
    "heldout_steps": 10,
    "prompt_gradient": "exact",
    "prefill_chunk_size": 128,
    "num_generations": 8,
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 2,
    "max_completion_length": 2,
    "temperature": 1.0,
    "beta": 0.0,
    "learning_rate": 3e-3,
    "lr_scheduler_type": "constant",
    "max_steps": 60,
    "bf16": False,
    "activation_checkpointing": True,
    "output_dir": "outputs/tiny-cpu",
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
    "seed": 0,
}


def parse(argv: list[str]):
    """Parses `argv` like the command line; with no arguments at all, the embedded default `TINY_CPU_DEFAULTS`."""
    return cli_parse(argv, defaults=None if argv else TINY_CPU_DEFAULTS)


if __name__ == "__main__":
    # `trl_longstraw.cli` trains, prints the summary and saves; this script adds only the embedded default.
    defaults = None if sys.argv[1:] else TINY_CPU_DEFAULTS
    sys.exit(cli_main(["grpo", *sys.argv[1:]], defaults=defaults, prog="grpo_long.py"))
