"""`LongStrawGRPOConfig`: `GRPOConfig` plus the settings of the prompt-once engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

PROMPT_GRADIENT_MODES = ("exact", "detached")


@dataclass
class LongStrawGRPOConfig(GRPOConfig):
    r"""
    Configuration class for [`LongStrawGRPOTrainer`]. Inherits every parameter of [`trl.GRPOConfig`].

    Parameters:
        prompt_gradient (`str`, *optional*, defaults to `"exact"`):
            `"exact"`: the gradient flows through the prompt too; parameter gradients equal `GRPOTrainer`'s up to
            float rounding. `"detached"`: the prompt state is treated as a constant, as in the published LongStraw
            design; it reaches longer prompts but the gradient is biased (it omits every path through the prompt).
        prefill_chunk_size (`int`, *optional*, defaults to `4096`):
            Prompt tokens per chunk, in the prefill and in the exact-mode reverse pass. Activation memory scales with
            it; the prompt state does not.
        group_shuffle (`bool`, *optional*, defaults to `True`):
            Shuffle whole groups of completions, not rows, when the generation batch is split into micro-batches,
            so that the completions of one prompt share one prefill.
        prefill_progress (`bool`, *optional*, defaults to `True`):
            Show a progress bar over the prefill chunks of prompts longer than one chunk (main process only).
        shared_generation (`bool`, *optional*, defaults to `True`):
            On the transformers generation path (no vLLM), prefill each distinct prompt once and decode its G samples
            against that one state, instead of `model.generate` on G copies of the prompt. `False` generates with
            transformers' own loop, as `GRPOTrainer` does. The vLLM paths are unchanged either way.
    """

    prompt_gradient: str = field(
        default="exact",
        metadata={
            "help": "'exact': gradients flow through the prompt and equal GRPOTrainer's. 'detached': the prompt "
            "state is a constant (LongStraw's design): longer prompts, biased gradient.",
            "choices": list(PROMPT_GRADIENT_MODES),
        },
    )
    prefill_chunk_size: int = field(
        default=4096,
        metadata={"help": "Prompt tokens per chunk in the prefill and in the exact-mode reverse pass."},
    )
    group_shuffle: bool = field(
        default=True,
        metadata={
            "help": "Shuffle whole groups, not rows, when splitting the generation batch into micro-batches, so the "
            "completions of one prompt share one prefill."
        },
    )
    prefill_progress: bool = field(
        default=True,
        metadata={"help": "Show a progress bar over the prefill chunks of prompts longer than one chunk."},
    )
    shared_generation: bool = field(
        default=True,
        metadata={
            "help": "Transformers generation path: prefill each distinct prompt once and decode its G samples "
            "against it. False: transformers' own generate, as GRPOTrainer."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if self.prompt_gradient not in PROMPT_GRADIENT_MODES:
            raise ValueError(
                f"prompt_gradient={self.prompt_gradient!r} is not supported: use 'exact' (gradients equal "
                "GRPOTrainer's) or 'detached' (longer prompts, biased gradient)."
            )
        if not isinstance(self.prefill_chunk_size, int) or self.prefill_chunk_size <= 0:
            raise ValueError(
                f"prefill_chunk_size={self.prefill_chunk_size!r} must be a positive number of tokens, e.g. 4096."
            )
