"""`LongStrawGRPOConfig`: `GRPOConfig` plus the settings of the prompt-once engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

PROMPT_GRADIENT_MODES = ("exact", "detached")
NONFINITE_POLICIES = ("raise", "skip")


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
            Show progress bars for prompts longer than one chunk (main process only): over the prefill chunks, the
            decoding steps of shared-prompt generation, the loss pass's branches and the exact-mode reverse pass's
            chunks.
        shard_prompt_state (`bool`, *optional*, defaults to `False`):
            Spread each prompt's state over the ranks of a shard group: each rank keeps 1/W of the prompt chunks and
            attention over the prompt merges the ranks' parts. The ranks of a group must hold the same prompts in
            every micro-batch (different completions of them). State memory shrinks W times, and so does the
            prompt attention of the prefill and reverse passes; for llama-type models, Qwen3.5/3.6 and GLM-5/5.2 the
            ranks also split those passes' tokens (context parallelism: each rank runs 1/W of the prompt through every
            layer).
            Every attention (and DeltaNet) layer of every pass exchanges partial results. Gradients equal the
            unsharded ones up to float rounding.
        prompt_shard_group_size (`int`, *optional*, defaults to `0`):
            Ranks per shard group, consecutive in rank order (e.g. the GPUs of one node); `0` means all processes.
            Must divide the number of processes; needs `shard_prompt_state=True` (without a sharded state there are
            no shard groups, so a nonzero value is refused). Under FSDP2 smaller groups pad their passes to the other
            groups' (one-token filler passes), so FSDP2 gathers the model layer by layer with any group size.
        reverse_checkpointing (`bool`, *optional*, defaults to `True`):
            Exact mode with `gradient_checkpointing`: the reverse pass recomputes each layer of a prompt chunk during
            the chunk's backward, as stock's checkpointing does. `False` keeps the chunk's whole autograd graph
            instead: one forward of the chunk less (benchmarks/LIMIT_8K_REVERSE_off.md), every layer's activations of
            one chunk live at once; a smaller `prefill_chunk_size` brings that memory back down. Same gradients.
        offload_boundary_states (`bool`, *optional*, defaults to `False`):
            Exact mode: keep the recurrent layers' state at each prompt chunk boundary (Gated DeltaNet; needed only by
            the reverse pass) in host memory, pinned on CUDA, and bring each back one chunk ahead of the reverse pass
            on a side stream. Gradients are identical; device memory drops by one recurrent state per chunk (147 MiB
            per chunk on Qwen3.6-27B). Models without recurrent layers keep no boundaries and are unaffected.
        reverse_attention_reuse (`bool`, *optional*, defaults to `True`):
            Exact mode under gradient checkpointing: the reverse pass keeps each attention layer's output and
            log-sum-exp from its forward, so that the checkpoint recompute takes them instead of attending (and, with
            a sharded prompt state, exchanging) again. Bitwise the same gradients; costs one attention output and
            log-sum-exp per attention layer and chunk token (0.76 GiB per GPU for Qwen3.6-27B at chunks of 4096,
            `trl_longstraw.plan`). `False`: attend again, for the memory.
        prefill_attention_reuse (`bool`, *optional*, defaults to `False`):
            Exact mode, prompt state not sharded: the prefill keeps each attention layer's output and log-sum-exp for
            every prompt token, and the reverse pass's forward of each chunk takes them instead of attending again
            (the same chunk from the same records). Same gradients; saves one attention forward over the prompt (7%
            of the tiny qwen3_5 exact step at 16K, benchmarks/LIMIT_32K_PREFILL_REUSE.md) and holds one attention
            output per attention layer and prompt token from the prefill until the reverse pass reaches its chunk (3
            times the keys and values on Qwen3.6-27B, counted by `trl_longstraw.plan`). Models whose attention does
            not go through the KV path (`glm_moe_dsa`) keep nothing.
        expert_parallel_size (`int`, *optional*, defaults to `1`):
            MoE models (`glm_moe_dsa`, `qwen3_moe`): spread each MoE layer's experts over groups of this many ranks
            through transformers' expert parallelism (`DistributedConfig(ep_size=...)`, the model's
            `base_model_ep_plan`, all-to-all token exchange); every other parameter is sharded by FSDP2 over all
            processes. Experts are never all-gathered. Runs in the engine's lockstep (the prompt state sharded over all
            processes or over smaller shard groups, or not sharded); must divide the number of processes and of
            experts; checkpoints need `save_only_model=True`. `1`: off. See `trl_longstraw/expert_parallel.py`.
        fsdp_cpu_offload (`bool`, *optional*, defaults to `False`):
            With `expert_parallel_size > 1` (transformers shards the model): FSDP2's `CPUOffloadPolicy`, i.e. the
            sharded parameters (the fp32 master weights when the model is loaded in fp32 and computes in bf16), their
            gradients and the optimizer state live in host memory and the optimizer step runs on the CPU; each layer
            is copied to the device when FSDP2 gathers it. Gradients are unchanged. Under accelerate's FSDP2 (no
            expert parallelism) the same policy is accelerate's `fsdp_offload_params: true`
            (`recipes/accelerate/fsdp2_offload.yaml`).
        on_nonfinite (`str`, *optional*, defaults to `"raise"`):
            What a micro-batch whose per-token log-probs, entropies, loss or loss gradient are NaN or infinite does,
            checked before anything is back-propagated into the parameters. `"raise"`: stop with a `FloatingPointError`
            naming the rows and the step. `"skip"`: log a warning and skip the micro-batch (no gradient, loss logged as
            NaN); single-process runs only.
        memory_guard (`bool`, *optional*, defaults to `True`):
            Before the first step on GPU, compare the capacity planner's estimate of a step with the free device
            memory, and stop with the numbers and concrete suggestions if it cannot fit.
        shared_generation (`bool`, *optional*, defaults to `True`):
            On the transformers generation path (no vLLM), prefill each distinct prompt once and decode its G samples
            against that one state, instead of `model.generate` on G copies of the prompt. `False` generates with
            transformers' own loop, as `GRPOTrainer` does. The vLLM paths are unchanged either way. With
            `shard_prompt_state`, the ranks of a shard group decode in lockstep against the sharded state. Under FSDP2
            (accelerate's, or transformers' under `expert_parallel_size > 1`), where every forward issues collectives,
            all ranks decode in one lockstep: with one shard group of every process, its ranks step together;
            without a sharded state or with smaller shard groups, the ranks (groups) agree on prefill passes and
            steps and run filler forwards where they have less to do. Generation settings it does not reproduce raise
            `ValueError` (see `generation.py`).
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
        metadata={
            "help": "Show progress bars for prompts longer than one chunk (main process): over the prefill chunks, "
            "the decoding steps of shared-prompt generation, the loss pass's branches and the exact-mode reverse "
            "pass's chunks."
        },
    )
    memory_guard: bool = field(
        default=True,
        metadata={
            "help": "Before the first step on GPU, stop if the capacity planner's estimate of a step exceeds the free "
            "device memory."
        },
    )
    shard_prompt_state: bool = field(
        default=False,
        metadata={
            "help": "Spread each prompt's state over the ranks of a shard group (1/W of the chunks each, attention "
            "merged across ranks). The ranks of a group must hold the same prompts in every micro-batch."
        },
    )
    prompt_shard_group_size: int = field(
        default=0,
        metadata={
            "help": "Ranks per prompt shard group, consecutive in rank order (e.g. one node's GPUs); 0 means all "
            "processes. Must divide the number of processes; needs shard_prompt_state=True. Under FSDP2 smaller "
            "groups pad their passes to the other groups' (one-token fillers), so FSDP2 gathers layer by layer with "
            "any group size."
        },
    )
    reverse_checkpointing: bool = field(
        default=True,
        metadata={
            "help": "Exact mode under gradient checkpointing: recompute each layer of a reverse-pass chunk during "
            "its backward (the least memory). False keeps the chunk's whole autograd graph instead: one forward less "
            "per chunk (the tiny qwen3_5 step about 15 percent faster), with every layer's activations of one chunk "
            "live; pair it with a smaller prefill_chunk_size. Identical gradients."
        },
    )
    offload_boundary_states: bool = field(
        default=False,
        metadata={
            "help": "Exact mode: keep the recurrent state at each prompt chunk boundary in (pinned) host memory until "
            "the reverse pass, prefetched one chunk ahead. Identical gradients, less device memory."
        },
    )
    reverse_attention_reuse: bool = field(
        default=True,
        metadata={
            "help": "Exact mode with gradient checkpointing: keep each attention layer's output for the reverse "
            "pass's recompute instead of attending (and exchanging) again. Same gradients, faster; costs one "
            "attention output per layer and chunk token. False: less memory."
        },
    )
    prefill_attention_reuse: bool = field(
        default=False,
        metadata={
            "help": "Exact mode, unsharded prompt state: keep each attention layer's output from the prefill for the "
            "reverse pass, which then does not attend again in its forward. Same gradients, faster; costs one "
            "attention output per attention layer and prompt token until the reverse pass."
        },
    )
    expert_parallel_size: int = field(
        default=1,
        metadata={
            "help": "MoE models: spread each MoE layer's experts over groups of this many ranks with transformers' "
            "expert parallelism (ep_size, all-to-all), the rest sharded by FSDP2; with or without a sharded prompt "
            "state, any shard group size. Checkpoints need save_only_model=True. 1: off."
        },
    )
    fsdp_cpu_offload: bool = field(
        default=False,
        metadata={
            "help": "With expert_parallel_size > 1: FSDP2's CPUOffloadPolicy (sharded parameters, gradients and "
            "optimizer state in host memory, optimizer step on CPU). Under accelerate's FSDP2 use its "
            "fsdp_offload_params: true instead."
        },
    )
    on_nonfinite: str = field(
        default="raise",
        metadata={
            "help": "A micro-batch with NaN/inf log-probs, entropies, loss or loss gradient: 'raise' (stop, naming "
            "the rows and the step) or 'skip' (warn and skip the micro-batch; single-process runs only).",
            "choices": list(NONFINITE_POLICIES),
        },
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
        if self.offload_boundary_states and self.prompt_gradient != "exact":
            raise ValueError(
                "offload_boundary_states=True only applies to prompt_gradient='exact' (detached mode keeps no chunk "
                "boundaries): set offload_boundary_states=False."
            )
        if self.prefill_attention_reuse and (self.prompt_gradient != "exact" or self.shard_prompt_state):
            raise ValueError(
                "prefill_attention_reuse=True keeps attention outputs for the exact-mode reverse pass of an unsharded "
                "prompt state: use prompt_gradient='exact' without shard_prompt_state, or set "
                "prefill_attention_reuse=False."
            )
        if not isinstance(self.prompt_shard_group_size, int) or self.prompt_shard_group_size < 0:
            raise ValueError(
                f"prompt_shard_group_size={self.prompt_shard_group_size!r} must be 0 (all processes) or a positive "
                "number of ranks that divides the number of processes."
            )
        if self.prompt_shard_group_size and not self.shard_prompt_state:
            # Only the sharded prompt state forms shard groups; the expert-parallel group is expert_parallel_size.
            raise ValueError(
                f"prompt_shard_group_size={self.prompt_shard_group_size} only applies to a sharded prompt state: set "
                "shard_prompt_state=True, or drop prompt_shard_group_size (0, the default)."
            )
        ep = self.expert_parallel_size
        if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
            raise ValueError(
                f"expert_parallel_size={ep!r} must be a positive number of ranks (1 turns expert parallelism off)."
            )
        if self.fsdp_cpu_offload and ep == 1:
            raise ValueError(
                "fsdp_cpu_offload=True applies to models that transformers shards at load time "
                "(expert_parallel_size > 1). Under accelerate's FSDP2, set fsdp_offload_params: true in the "
                "accelerate config instead (recipes/accelerate/fsdp2_offload.yaml) and fsdp_cpu_offload=False."
            )
        if self.on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(
                f"on_nonfinite={self.on_nonfinite!r} is not supported: use 'raise' (stop at the first micro-batch "
                "with NaN/inf values) or 'skip' (skip such micro-batches with a warning)."
            )
        chunk = self.prefill_chunk_size
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
            raise ValueError(
                f"prefill_chunk_size={self.prefill_chunk_size!r} must be a positive number of tokens, e.g. 4096."
            )
