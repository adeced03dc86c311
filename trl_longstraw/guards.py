"""Early checks: stop a run at once, with the numbers and the fix, instead of failing late or going silently wrong.

- `check_positions`: prompts beyond the model's RoPE window. Without RoPE scaling the positions past the window were
  never trained, so the run is refused; with scaling (YaRN, ...) past the scaled window it is only warned about.
- `check_memory`: the planner's estimate of a step against the free device memory, before the first step.
- `check_dropout`: active dropout in the policy, its adapters or a reference model in training mode.
- `check_prompt_column`, `longest_prompts`, `check_reward_weights`: the dataset and the rewards, at construction,
  instead of a `KeyError` or a bare count mismatch inside TRL at the first step.

All are pure functions; `LongStrawGRPOTrainer` calls them with its model, batch and device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .plan import Budget

# `plan` is imported inside the functions: importing the package (which imports the trainer, then this module) must
# not import it, or `python -m trl_longstraw.plan` would find its own module already loaded.


def check_positions(config, positions: int) -> str | None:
    """Checks that `positions` (prompt + completion, padding included) fit the RoPE window of a text `config`.

    Returns:
        `None` when they fit, or a warning message when they exceed a window that RoPE scaling already extends.

    Raises:
        ValueError: when they exceed the window of a model without RoPE scaling, naming the YaRN setting to load it
            with.
    """
    from .plan import rope_scaled, rope_window, yarn_factor

    window, native = rope_window(config)
    if window is None or positions <= window:
        return None
    if not rope_scaled(config):
        factor = yarn_factor(positions, window)
        raise ValueError(
            f"sequences of {positions:,} positions (prompt + completion) exceed the model's window of {window:,} "
            "positions (max_position_embeddings), and its RoPE is not scaled: the positions beyond it were never "
            f"trained. Load the model with YaRN RoPE scaling: rope_parameters rope_type='yarn', factor={factor}, "
            f"original_max_position_embeddings={window} and max_position_embeddings={window * factor}. In a recipe "
            "config (or GRPOConfig.model_init_kwargs when the model is given by name) that is `model_init_kwargs: "
            f"{{max_position_embeddings: {window * factor}, rope_parameters: {{rope_type: yarn, factor: {factor}, "
            f"original_max_position_embeddings: {window}, <the checkpoint's other rope_parameters keys, e.g. "
            "rope_theta>}}` (under `text_config:` for Qwen3.5/3.6, see recipes/configs/); in Python, "
            f"AutoModelForCausalLM.from_pretrained(name, config=trl_longstraw.plan.with_yarn(AutoConfig."
            f"from_pretrained(name), {positions})). Or shorten the prompts."
        )
    return (
        f"sequences of {positions:,} positions (prompt + completion) exceed the model's RoPE window of {window:,} "
        f"positions, already scaled from {native:,}: quality past it is untested. Raise the scaling factor "
        "(trl_longstraw.plan.with_yarn(config, positions) picks one) or shorten the prompts."
    )


def device_free_memory(device: torch.device) -> tuple[int, int] | None:
    """`(free bytes, total bytes)` of a CUDA device, counting memory cached by PyTorch's allocator as free;
    `None` for other devices."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device), total


def worst_over_processes(accelerator, free_bytes: int, prompt_length: int, completion_length: int):
    """`(least free bytes, longest prompt, longest completion)` over the processes, so that every process takes the
    same decision: one that stopped alone would leave the others waiting in the next collective."""
    local = torch.tensor([free_bytes, -prompt_length, -completion_length], device=accelerator.device)
    worst = accelerator.gather(local).view(-1, 3).min(dim=0).values.tolist()
    return worst[0], -worst[1], -worst[2]


def runtime_budget(
    causal_lm,
    args,
    prompt_length: int,
    completion_length: int,
    gpus: int,
    fsdp: bool,
    gpu_memory: int,
    offload: bool = False,
) -> Budget:
    """The planner's estimate of a training step of `causal_lm` as the trainer runs it.

    Parameter counts and byte sizes come from the live model (`requires_grad` decides what trains; gradients and
    AdamW's two moments take the trainable parameters' dtype); the rest from `args` (a `LongStrawGRPOConfig`:
    expert parallelism from `expert_parallel_size`, the boundary states' host memory from
    `offload_boundary_states`). `offload`: FSDP2 keeps its shards in host memory (`CPUOffloadPolicy`, by accelerate's
    `fsdp_offload_params` or `fsdp_cpu_offload`).
    """
    from .plan import Setup, estimate, model_stats

    params = list(causal_lm.parameters())
    trainable = next((p for p in params if p.requires_grad), None)
    frozen = next((p for p in params if not p.requires_grad), None)
    weight_bytes = trainable.element_size() if trainable is not None else 2
    compute_bytes = 2 if (args.bf16 or args.fp16 or params[0].element_size() == 2) else 4
    stats = model_stats(causal_lm, state_dtype_bytes=compute_bytes)
    setup = Setup(
        positions=prompt_length,
        completion_length=max(completion_length, args.max_completion_length or 0),
        group_size=args.num_generations or 1,
        prefill_chunk_size=args.prefill_chunk_size,
        mode=args.prompt_gradient,
        gpus=gpus,
        gpu_memory=gpu_memory,
        shard_prompt_state=bool(getattr(args, "shard_prompt_state", False)),
        shard_group=getattr(args, "prompt_shard_group_size", 0),
        fsdp=fsdp,
        gradient_checkpointing=bool(args.gradient_checkpointing),
        trainable_weight_bytes=weight_bytes,
        frozen_weight_bytes=frozen.element_size() if frozen is not None else weight_bytes,
        grad_bytes=weight_bytes,
        optimizer_bytes=2 * weight_bytes,
        compute_bytes=compute_bytes,
        expert_parallel=getattr(args, "expert_parallel_size", 1) > 1,
        ep_size=getattr(args, "expert_parallel_size", 1) if getattr(args, "expert_parallel_size", 1) > 1 else 0,
        offload=offload,
        offload_boundary_states=bool(getattr(args, "offload_boundary_states", False)),
        reverse_checkpointing=bool(getattr(args, "reverse_checkpointing", True)),
        attention_reuse=bool(getattr(args, "reverse_attention_reuse", True)),
        prefill_attention_reuse=bool(getattr(args, "prefill_attention_reuse", False)),
    )
    return estimate(stats, setup)


def check_memory(budget: Budget, free_bytes: int) -> None:
    """Stops a run whose first step cannot fit, before it starts.

    `budget.to_allocate` (the estimated peak minus the weights already in memory) is compared with `free_bytes`.

    Raises:
        ValueError: with the budget, the free memory and concrete changes (detached mode, sharded prompt state,
            another chunk size, more GPUs, shorter prompts), each with its own estimate.
    """
    from .plan import _size, format_budget, suggestions

    if budget.to_allocate <= free_bytes:
        return
    u = budget.setup
    changes = "\n".join(f"  - {s}" for s in suggestions(budget, free_bytes))
    raise ValueError(
        f"this run needs about {_size(budget.to_allocate)} more per GPU at the peak of a step ({_size(budget.peak)} "
        f"in all, weights included), but only {_size(free_bytes)} is free on the device. It would run out of memory "
        f"mid-step. The estimate, for {u.positions:,} prompt positions and {u.completion_length:,}-token "
        f"completions:\n{format_budget(budget, 'per-GPU budget:')}\nTo fit, change one of:\n{changes}\n"
        "Plan other settings with `python -m trl_longstraw.plan`. If you know the run fits (the estimate is "
        "approximate), set memory_guard=False."
    )


def active_dropout(model: torch.nn.Module, in_training_mode_only: bool = False) -> list[str]:
    """The modules of `model` that drop activations at random in training, each as `"name (what=p)"`.

    Torch dropout modules with `p > 0` (PEFT's `lora_dropout` among them) and attention layers whose
    `attention_dropout` is above zero (transformers applies it functionally, in training mode only). With
    `in_training_mode_only`, modules in eval mode are left out (a reference model that never trains).
    """
    found = []
    for name, module in model.named_modules():
        if in_training_mode_only and not module.training:
            continue
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            found.append(f"{name or type(module).__name__} (p={module.p:g})")
        rate = getattr(module, "attention_dropout", 0.0)
        if isinstance(rate, (int, float)) and rate > 0:
            found.append(f"{name} (attention_dropout={rate:g})")
    return found


def check_dropout(model: torch.nn.Module, ref_model: torch.nn.Module | None = None) -> None:
    """Refuses active dropout in the policy (any mode: it trains) or in a reference model in training mode.

    The engine evaluates each token several times per step (the no-grad scoring whose values the loss uses, each
    completion's replay with autograd and, in exact mode, the prompt's reverse pass); each run would draw its own
    dropout mask, so the gradient would not be that of the logged loss.

    Raises:
        ValueError: naming the modules and the settings that turn their dropout off.
    """
    found = active_dropout(model) + (active_dropout(ref_model, in_training_mode_only=True) if ref_model else [])
    if not found:
        return
    shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    raise ValueError(
        f"dropout is active in {shown}: LongStrawGRPOTrainer scores, replays and (in exact mode) recomputes each "
        "token in separate passes, each with its own random dropout mask, so the gradient would not be that of the "
        "logged loss. Turn dropout off: lora_dropout=0 in the LoraConfig (recipes/grpo_long.py: --lora_dropout 0, "
        "its default), attention_dropout=0.0 in the model config (e.g. model_init_kwargs={'attention_dropout': "
        "0.0}), or disable_dropout=True in the trainer config (sets the p of torch dropout modules, LoRA's "
        "included, to 0; not attention_dropout)."
    )


def check_prompt_column(dataset) -> None:
    """Checks that `dataset` has a `prompt` column of text or conversations, as `GRPOTrainer` reads it.

    `None` (no training dataset) and datasets that do not list their columns (an `IterableDataset` without
    features, a plain torch dataset) pass; a `datasets.Dataset`'s first row is checked for the prompt's type.

    Raises:
        ValueError: naming the missing column and the dataset's columns, or the prompt's unexpected type.
    """
    columns = getattr(dataset, "column_names", None)
    if dataset is None or columns is None:
        return
    if "prompt" not in columns:
        raise ValueError(
            f"train_dataset has no 'prompt' column (its columns: {', '.join(columns) or 'none'}): GRPOTrainer reads "
            "each row's prompt from it. Rename the column holding the prompts, e.g. "
            "dataset.rename_column('question', 'prompt'), or map the rows to {'prompt': ...}."
        )
    if not hasattr(dataset, "__getitem__") or len(dataset) == 0:
        return
    prompt = dataset[0]["prompt"]
    conversation = isinstance(prompt, list) and all(isinstance(m, dict) and "content" in m for m in prompt)
    if not isinstance(prompt, str) and not (conversation and prompt):
        raise ValueError(
            f"train_dataset's 'prompt' column holds {type(prompt).__name__} values (first row: {str(prompt)[:80]!r}): "
            "each prompt must be a string, or a conversation as a list of {'role': ..., 'content': ...} messages."
        )


def _prompt_chars(prompt) -> int:
    """The length in characters of a prompt (text, or the text contents of a conversation's messages)."""
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(m["content"]) if isinstance(m.get("content"), str) else 0 for m in prompt)


def longest_prompts(dataset, count: int = 2, sample: int = 4096, seed: int = 0) -> list:
    """The `count` longest prompts, by characters, of `dataset` (of at most `sample` rows drawn at random).

    Tokenizing a whole column at construction could take minutes for million-token prompts: only these few are
    tokenized, so the window check sees the longest prompts of the data unless characters and tokens disagree
    widely. The check at each step covers the rest. Datasets without a length return `[]`.
    """
    if dataset is None or not hasattr(dataset, "__len__") or getattr(dataset, "column_names", None) is None:
        return []
    rows = len(dataset)
    if rows > sample:
        indices = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))[:sample].tolist()
        dataset = dataset.select(indices)
    prompts = dataset["prompt"]
    return sorted(prompts, key=_prompt_chars, reverse=True)[:count]


def check_reward_weights(reward_funcs, reward_weights: list[float] | None) -> None:
    """Checks that `reward_weights`, when set, gives one weight per reward function.

    Raises:
        ValueError: with both counts, the functions' names and how to fix either side (a recipe config's
            `reward_weights` stays in force when `--reward_funcs` alone is overridden).
    """
    funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if reward_weights is None or len(reward_weights) == len(funcs):
        return
    names = [f if isinstance(f, str) else getattr(f, "__name__", type(f).__name__) for f in funcs]
    raise ValueError(
        f"reward_weights has {len(reward_weights)} weights {list(reward_weights)} for {len(funcs)} reward "
        f"function(s) ({', '.join(names)}): give one weight per reward function, in the same order (e.g. "
        f"--reward_weights {' '.join(['1.0'] * len(funcs))}), or unset reward_weights to weigh each one 1.0. A "
        "recipe config's reward_weights still applies when only --reward_funcs is given on the command line."
    )
