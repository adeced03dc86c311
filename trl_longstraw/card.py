"""The model card (`README.md`) that `LongStrawGRPOTrainer` saves with its checkpoints and final model.

TRL's card names the base model only when it is a Hub id (so a model loaded from a local folder, as the recipe does
for its tiny models, became "None", in `pipeline(model="None")` too) and credits the trainer's method to GRPO's paper.
This card names the base model however it was given, describes the LongStraw method and the run's mode (prompt
gradient, prefill chunk, sharding), the hardware the run used and, when the trainer's memory guard ran (on GPU), the
planner's verdict for it; GRPO itself is still credited to DeepSeekMath.
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

import torch
from huggingface_hub import ModelCard, ModelCardData

if TYPE_CHECKING:
    from .trainer import LongStrawGRPOTrainer

GIB = 2**30
MODES = {
    "exact": "`exact`: the gradient is `GRPOTrainer`'s, the prompt included (recomputed chunk by chunk in reverse)",
    "detached": "`detached`: the prompt state is a constant, so only the completion tokens' computation gets a "
    "gradient (a biased gradient, for longer prompts)",
}


def is_hub_id(name: str | None) -> bool:
    """Whether `name` looks like a Hub model id (`owner/name`), not a local folder or a trl_longstraw tiny model."""
    return bool(name) and not os.path.isdir(name) and name.count("/") == 1 and not name.startswith("longstraw/")


def hardware(trainer: LongStrawGRPOTrainer) -> str:
    """The run's processes and device, e.g. `8 processes on NVIDIA H20` or `1 process on CPU`."""
    n = trainer.accelerator.num_processes
    device = trainer.accelerator.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type.upper()
    return f"{n} process{'es' if n > 1 else ''} on {name}"


def planner_verdict(trainer: LongStrawGRPOTrainer) -> str:
    """The planner's verdict for the run's hardware, from the memory guard's estimate before the first GPU step."""
    estimate = trainer.memory_estimate
    if estimate is None:
        reason = "the run was not on GPU" if trainer.accelerator.device.type != "cuda" else "memory_guard was off"
        return f"not estimated ({reason}; plan a GPU run with `python -m trl_longstraw.plan`)."
    peak, total, to_allocate, free = (estimate[k] / GIB for k in ("peak", "gpu_memory", "to_allocate", "free"))
    return (
        f"fits: about {peak:.1f} GiB per GPU at the peak of a step (of {total:.1f} GiB; {to_allocate:.1f} GiB to "
        f"allocate, {free:.1f} GiB free) for {estimate['positions']:,} prompt positions and "
        f"{estimate['completion_length']:,}-token completions."
    )


def model_card(
    trainer: LongStrawGRPOTrainer,
    model_name: str | None = None,
    dataset_name: str | None = None,
    tags: list[str] | None = None,
) -> ModelCard:
    """The card of `trainer`'s model. The base model is `trainer.base_model_name` if set (the recipe sets the name it
    was given, e.g. `longstraw/tiny-llama`), else the model config's `_name_or_path`."""
    args = trainer.args
    base = trainer.base_model_name or getattr(trainer.model.config, "_name_or_path", None) or "unknown"
    hub_base = base if is_hub_id(base) else None
    model_name = model_name or os.path.basename(os.path.normpath(args.output_dir))
    # Where the saved model can be loaded from: its Hub repository if it goes to one, else the output folder.
    location = args.hub_model_id or args.output_dir
    tags = sorted({"generated_from_trainer", *(tags or []), *trainer._tag_names})
    data = ModelCardData(
        base_model=hub_base,
        datasets=[dataset_name] if dataset_name else None,
        library_name="transformers",
        model_name=model_name,
        tags=tags,
    )
    base_text = f"[{base}](https://huggingface.co/{base})" if hub_base else f"`{base}`"
    if dataset_name:
        base_text += f" on the `{dataset_name}` dataset"
    sharding = (
        f", the prompt state sharded over groups of {trainer._prompt_shards.world} processes"
        if trainer._prompt_shards is not None
        else ""
    )
    versions = "\n".join(f"- {name}: {_version(name)}" for name in ("trl_longstraw", "trl", "transformers", "torch"))
    citation = trainer._paper["citation"]
    text = f"""---
{data.to_yaml()}
---

# Model Card for {model_name}

This model is a fine-tuned version of {base_text}, trained with LongStrawGRPO: `LongStrawGRPOTrainer` of
`trl_longstraw`, a drop-in extension of [TRL](https://github.com/huggingface/trl)'s `GRPOTrainer` for prompts of
hundreds of thousands to millions of tokens.

## Quick start

```python
from transformers import pipeline

generator = pipeline("text-generation", model="{location}")
print(generator("Your long prompt", max_new_tokens=128, return_full_text=False)[0]["generated_text"])
```

## Training procedure

GRPO (Group Relative Policy Optimization, introduced in [DeepSeekMath](https://huggingface.co/papers/2402.03300)) with
the LongStraw method: each distinct prompt is prefilled once, in chunks of {args.prefill_chunk_size:,} tokens, and
its {args.num_generations} completions are scored against that shared prompt state instead of re-reading the prompt
once per completion; rewards, advantages and the loss are TRL's.

- mode (`prompt_gradient`): {MODES.get(args.prompt_gradient, f"`{args.prompt_gradient}`")}
- groups: {args.num_generations} completions per prompt of at most {args.max_completion_length} tokens, `loss_type`
  `{args.loss_type}`, beta {args.beta}{sharding}
- hardware: {hardware(trainer)}
- planner (`trl_longstraw.plan`) for this hardware: {planner_verdict(trainer)}

### Framework versions

{versions}

## Citations

Cite GRPO as:

```bibtex
{citation}
```
"""
    return ModelCard(text)


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "unknown"
