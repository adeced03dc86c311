# Copyright 2026 The trl_longstraw authors. Licensed under the Apache License, Version 2.0.
"""GRPO with long prompts: `LongStrawGRPOTrainer` as a TRL-style script.

With no arguments it runs a demo on CPU in about a minute (a few on a busy machine): the embedded default
`TINY_CPU_DEFAULTS` below, the same settings as `recipes/configs/tiny_cpu.yaml`. A tiny random Llama trains on the
`longstraw/needle` task with 384-token prompts prefilled in chunks of 128 (a progress bar shows the chunks), after
a short supervised warm-up on 64-token needles (see `trl_longstraw.warmup`); GRPO then raises its greedy accuracy on
held-out 384-token prompts, logged every 10 steps, and the run ends with a summary of the prompt positions, the peak
memory, the mean reward of the first and last steps and the held-out accuracy at the start and the end.

    accelerate launch recipes/grpo_long.py          # the embedded default (CPU demo)
    python recipes/grpo_long.py                     # the same, one process
    accelerate launch --config_file recipes/accelerate/fsdp2.yaml --num_processes 8 recipes/grpo_long.py \\
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

import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import ModelConfig, get_peft_config
from trl.trainer.utils import create_model_from_path

from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer
from trl_longstraw.recipe import (
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
    "warmup_sft_prompt_tokens": 64,
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


def parse(argv: list[str]) -> tuple[LongStrawScriptArguments, LongStrawGRPOConfig, ModelConfig]:
    """Parses `argv` like the command line; with no arguments at all, the embedded default `TINY_CPU_DEFAULTS`."""
    parser = make_parser()
    if not argv:
        parser.set_defaults_with_config(**TINY_CPU_DEFAULTS)
    return parser.parse_args_and_config(argv)


def main(
    script_args: LongStrawScriptArguments, training_args: LongStrawGRPOConfig, model_args: ModelConfig
) -> LongStrawGRPOTrainer:
    """Trains, prints the run summary, saves the model unless `save_strategy` is `"no"`, and returns the trainer."""
    is_tiny = (model_args.model_name_or_path or "").startswith(TINY_MODEL_PREFIX)
    if is_tiny and not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        # A tiny model gains nothing from intra-op threads, and on a shared CPU their spin-waiting makes each op many
        # times slower (measured: 0.3 s against 10-20 s per micro-batch on 2 busy cores).
        torch.set_num_threads(1)
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
    check_rope_override(
        model_path,
        model_init_kwargs,
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
    )
    model = create_model_from_path(model_path, architecture=AutoModelForCausalLM, **model_init_kwargs)
    tokenizer = AutoTokenizer.from_pretrained(
        model_path,
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        padding_side="left",
        truncation_side="left",
    )
    # GRPOTrainer reads model_init_kwargs again only to build a reference model (beta > 0): give it the policy's.
    training_args.model_init_kwargs = model_init_kwargs if training_args.beta != 0.0 else None

    warm_up(script_args, model, tokenizer, seed=training_args.seed)

    trainer = LongStrawGRPOTrainer(
        model=model,
        reward_funcs=[reward_function(name) for name in script_args.reward_funcs],
        args=training_args,
        train_dataset=build_dataset(script_args, tokenizer, seed=training_args.seed),
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
    )
    add_heldout_accuracy(trainer, script_args, seed=training_args.seed)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)

    summary = summarize(trainer.state.log_history)
    summary["peak_memory_what"], summary["peak_memory_gib"] = peak_memory_gib()
    summary["train_runtime_s"] = trainer.state.log_history[-1].get("train_runtime", float("nan"))
    summary["processes"] = trainer.accelerator.num_processes
    summary["shard_group"] = trainer._prompt_shards.world if trainer._prompt_shards is not None else 0
    trainer.accelerator.print("\n" + format_summary(summary, script_args, training_args))
    if training_args.save_strategy != "no":
        trainer.save_model(training_args.output_dir)
    trainer.end()
    return trainer


if __name__ == "__main__":
    trained = main(*parse(sys.argv[1:]))
    if trained.accelerator.num_processes > 1:
        # The run is complete and the process group destroyed; a gloo (CPU) run can still abort in interpreter
        # teardown ("terminate called without an active exception"), which the launcher would report as a failure.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
