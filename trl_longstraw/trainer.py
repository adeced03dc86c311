"""`LongStrawGRPOTrainer`: `trl.GRPOTrainer` with the prompt-once scoring and loss path.

The loss is TRL's own `_compute_loss`, evaluated on per-token log-probs and entropies that the engine computes once
per micro-batch without autograd (each distinct prompt prefilled once, each completion replayed against it). Its
gradient with respect to those per-token values is exact for every loss type and option, since the loss depends on
the model only through them. Each completion is then replayed with autograd and back-propagated on its own with that
gradient as its weight; in exact mode the gradient left on the prompt state is finally carried through the prompt.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils import DistributedType
from accelerate.utils.memory import clear_device_cache
from torch.utils.data import Sampler
from transformers import PreTrainedModel, TrainerCallback
from transformers.training_args import OptimizerNames
from transformers.utils import is_sagemaker_mp_enabled, logging
from trl import GRPOTrainer
from trl.extras.profiling import profiling_context
from trl.models import unwrap_model_for_generation
from trl.trainer.utils import RepeatSampler, split_tensor_dict

from . import expert_parallel, guards
from .adapters import get_adapter
from .batch import tokenize_distinct
from .config import LongStrawGRPOConfig
from .distributed import fsdp2_offloads, fsdp2_root
from .engine import Engine, group_prompts
from .generation import check_generation_config, generate_shared
from .rope import rotary_modules
from .sharding import PromptShards, shard_group_size

logger = logging.get_logger(__name__)

# Per-process file, in each checkpoint folder, of the generation buffer (see `_save_rng_state`).
GENERATION_STATE_NAME = "longstraw_generation_{}.pt"
# Per-row inputs that are reported when a micro-batch is non-finite, to point at the cause. Not
# `sampling_per_token_logps`: vLLM returns NaN there legitimately and TRL neutralizes it.
_NONFINITE_CONTEXT = ("advantages", "old_per_token_logps", "ref_per_token_logps", "importance_sampling_ratio")

# Marks the rows of a generation batch whose old-policy log-probs are deferred to the first loss pass that sees
# them (see `LongStrawGRPOTrainer._generate_and_score_completions`). A `[B]` bool tensor, so it survives the shuffle
# and the split into micro-batches like every other per-row field.
OLD_LOGPS_PENDING = "longstraw_old_per_token_logps_pending"


def _causal_lm(model) -> PreTrainedModel:
    """The `PreTrainedModel` under accelerate/DDP/PEFT wrappers (PEFT's layers stay in place)."""
    while hasattr(model, "module"):
        model = model.module
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


class LongStrawGRPOTrainer(GRPOTrainer):
    """Drop-in `GRPOTrainer` for prompts of hundreds of thousands to millions of tokens.

    Takes the same arguments as `trl.GRPOTrainer`; `args` must be a [`LongStrawGRPOConfig`].
    """

    _tag_names = ["trl", "grpo", "longstraw"]
    _name = "LongStrawGRPO"

    def __init__(self, model, reward_funcs=None, args: LongStrawGRPOConfig | None = None, *rest, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = LongStrawGRPOConfig(f"{str(name).split('/')[-1]}-LongStrawGRPO")
        if not isinstance(args, LongStrawGRPOConfig):
            raise ValueError(
                f"LongStrawGRPOTrainer needs a LongStrawGRPOConfig, got {type(args).__name__}: build the config with "
                "trl_longstraw.LongStrawGRPOConfig(...), which accepts every GRPOConfig argument."
            )
        _check_args(args)
        guards.check_reward_weights(reward_funcs, args.reward_weights)
        if args.expert_parallel_size > 1:
            # Before `GRPOTrainer` loads anything: TRL loads the policy (given by name) and the reference model with
            # the `distributed_config` set here.
            expert_parallel.prepare(model if isinstance(model, str) else _causal_lm(model), args)
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        self._check_setup()
        self._window_warned = False
        self._check_dataset()
        self._engines: dict[int, Engine] = {}
        self._prompt_shards = self._make_prompt_shards()
        self._choose_generation()
        # Bytes the engines may hold in prompt states beyond the one in use (`Engine.hold_budget`), sharded or not: no
        # limit on CPU (the guard measures no host memory); on GPU the newest state only until the memory guard has
        # measured what the step leaves free (`_check_memory`).
        self._hold_budget: int | None = 0 if self.accelerator.device.type == "cuda" else None
        self._precomputed: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._memory_checked = False
        # The planner's estimate of a step, from the memory guard before the first GPU step (for the model card).
        self.memory_estimate: dict[str, int] | None = None
        # The base model's name for the model card, when the model's config does not say it (a local folder).
        self.base_model_name: str | None = None
        # Old-policy log-probs: armed while the generation batch is scored; the global step they belong to.
        self._defer_old_logps = False
        self._old_logps_step: int | None = None
        self.add_callback(_FillOldLogpsBeforeUpdate(self))

    # ---------------------------------------------------------------------------------------------------- checks
    def _check_setup(self) -> None:
        if self._is_vlm:
            raise ValueError("vision inputs are not supported by LongStrawGRPOTrainer: use trl.GRPOTrainer.")
        if self.aux_loss_enabled:
            raise ValueError(
                "the MoE router auxiliary loss is not supported by LongStrawGRPOTrainer (the prompt is shared by the "
                "group, so its routing would be counted once instead of G times): set router_aux_loss_coef=0.0."
            )
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            raise ValueError("DeepSpeed is not supported by LongStrawGRPOTrainer: use FSDP2 or DDP via Accelerate.")
        if self.accelerator.distributed_type == DistributedType.FSDP and not self.accelerator.is_fsdp2:
            raise ValueError(
                "FSDP1 is not supported by LongStrawGRPOTrainer: set fsdp_version: 2 in the accelerate config (see "
                "recipes/accelerate/fsdp2.yaml)."
            )
        if hasattr(self.model, "_orig_mod"):
            raise ValueError(
                "a torch.compile'd model is not supported by LongStrawGRPOTrainer (see torch_compile): pass the model "
                "itself, not torch.compile(model)."
            )
        parallelism = self.accelerator.parallelism_config
        if parallelism is not None and (parallelism.cp_enabled or parallelism.sp_enabled):
            raise ValueError(
                "context or sequence parallelism (cp_size or sp_size > 1 in the accelerate parallelism_config) is not "
                "supported by LongStrawGRPOTrainer, nor by GRPOTrainer: set cp_size=1 and sp_size=1. To spread a long "
                "prompt over the GPUs, set shard_prompt_state=True, which splits each prompt's state over the ranks."
            )
        if self.args.n_gpu > 1:
            raise ValueError(
                "torch.nn.DataParallel (several GPUs in one process) is not supported: launch one process per GPU "
                "with `accelerate launch`."
            )
        adapter = get_adapter(_causal_lm(self.model))
        if self.args.expert_parallel_size > 1:
            ep, offload = self.args.expert_parallel_size, self.args.fsdp_cpu_offload
            expert_parallel.check_loaded(_causal_lm(self.model), ep, offload)
            if self.ref_model is not None:
                expert_parallel.check_loaded(self.ref_model, ep, offload, role="reference model")
        guards.check_dropout(self.model, self.ref_model)
        rotary_modules(_causal_lm(self.model))  # refuses per-call RoPE that the engine cannot pin
        if self.args.shard_prompt_state and not getattr(adapter, "shards_prompt_state", False):
            raise ValueError(
                f"shard_prompt_state is not supported by the {_causal_lm(self.model).config.model_type!r} adapter "
                "yet: set shard_prompt_state=False (and use more GPUs or prompt_gradient='detached' for capacity)."
            )
        if self.ref_model is not None:
            get_adapter(_causal_lm(self.ref_model))

    def _choose_generation(self) -> None:
        """Shared-prompt generation (`generation.py`) where the adapter decodes (against a sharded state, if
        `shard_prompt_state`), else transformers' `generate` with a warning saying why. Under FSDP2 every process
        decodes in lockstep, whatever the shard groups (see `generation`)."""
        self._shared_generation = False
        if not self.args.shared_generation or self.use_vllm or self.use_transformers_continuous_batching:
            return
        adapter = get_adapter(_causal_lm(self.model))
        model_type = _causal_lm(self.model).config.model_type
        if not hasattr(adapter, "decode_tail"):
            logger.warning(
                f"model_type {model_type!r} has no shared-prompt decoding yet: generation runs through transformers' "
                "generate, which prefills each prompt G times."
            )
        elif self.args.shard_prompt_state and not getattr(adapter, "decodes_sharded", False):
            logger.warning(
                f"model_type {model_type!r} does not decode against a sharded prompt state yet: with "
                "shard_prompt_state=True, generation runs through transformers' generate."
            )
        else:
            check_generation_config(self.generation_config)
            self._shared_generation = True

    def _check_dataset(self) -> None:
        """The training dataset's prompt column, and its longest prompts against the model's RoPE window.

        Only the two longest prompts by characters (of at most 4,096 rows drawn at random) are tokenized, so a
        million-token dataset costs seconds here; `_check_window` still checks every sequence at each step.
        """
        # The longest prompt found, in tokens: the memory guard's estimate before the first generation.
        self._dataset_prompt_length: int | None = None
        guards.check_prompt_column(self.train_dataset)
        if self.environment_factories is not None:
            return  # prompts are rendered with each row's environment tools, known only at generation
        longest = guards.longest_prompts(self.train_dataset, seed=self.args.seed)
        if longest:
            prompt_length = max(len(ids) for ids in self._tokenize_prompts(longest)[0])
            self._dataset_prompt_length = prompt_length
            self._check_window(self.model, prompt_length + (self.args.max_completion_length or 0))

    def _make_prompt_shards(self) -> PromptShards | None:
        """The prompt shard group of this rank (`shard_prompt_state`), or None when the state is not sharded."""
        if not self.args.shard_prompt_state or not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        world = dist.get_world_size()
        rows = self.args.per_device_train_batch_size * self.args.steps_per_generation
        size = shard_group_size(world, self.args.prompt_shard_group_size, self.num_generations, rows)
        if size == world:
            return PromptShards(None)
        # Under FSDP2 the groups run their passes padded to the world's agreed counts (`Engine.lockstep`), so FSDP2
        # still gathers layer by layer.
        group = None
        for first in range(0, world, size):  # every rank creates every group, as new_group requires
            ranks = list(range(first, first + size))
            created = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                group = created
        return PromptShards(group)

    def _check_window(self, model, positions: int) -> None:
        """Refuses sequences beyond an unscaled RoPE window; warns once beyond a scaled one."""
        warning = guards.check_positions(_causal_lm(model).config.get_text_config(), positions)
        if warning is not None and not self._window_warned:
            self._window_warned = True
            logger.warning(warning)

    def _check_memory(self, model, prompt_length: int, completion_length: int) -> None:
        """Before the first step on GPU: stops a run that the planner says cannot fit in the free memory.

        The planner's step includes generation's decode tail; the memory left free after the step's estimate holds
        the prompt states of further prompts (`Engine.hold_budget`).
        """
        self._memory_checked = True
        memory = guards.device_free_memory(self.accelerator.device) if self.args.memory_guard else None
        if memory is None:
            return
        free, prompt, completion = guards.worst_over_processes(
            self.accelerator, memory[0], prompt_length, completion_length
        )
        budget = guards.runtime_budget(
            _causal_lm(model),
            self.args,
            prompt_length=prompt,
            completion_length=completion,
            gpus=self.accelerator.num_processes,
            # FSDP2 through accelerate, or applied by transformers at load time (expert parallelism).
            fsdp=self.is_fsdp_enabled or fsdp2_root(model) is not None,
            gpu_memory=memory[1],
            offload=fsdp2_offloads(model),
        )
        guards.check_memory(budget, free)
        self.memory_estimate = {
            "peak": budget.peak,
            "to_allocate": budget.to_allocate,
            "free": free,
            "gpu_memory": memory[1],
            "positions": prompt,
            "completion_length": completion,
        }
        # What the step leaves free holds the prompt states of further prompts (generation's offers, the states a
        # micro-batch of several prompts keeps from scoring to backward). The same on every process (the least free
        # memory of any): sharded, the ranks of a shard group count each state as its largest share and so keep the
        # same states (`Engine._hold`).
        self._hold_budget = free - budget.to_allocate
        for engine in self._engines.values():
            engine.hold_budget = self._hold_budget

    # ---------------------------------------------------------------------------------------------------- engine
    def _autocast(self) -> contextlib.AbstractContextManager:
        """The autocast of stock's forward, for every forward of the engines.

        `Accelerator.prepare` wraps the model's `forward` (and the reference model's) in `accelerator.autocast()`
        when mixed precision is native (`bf16=True`; `fp16=True` on GPU), which `train()` does; here it applies from
        the first engine call, `training_step` called directly included. Under FSDP2 accelerate wraps nothing: its
        `MixedPrecisionPolicy` casts the gathered parameters instead, which the engine's passes see as they are.
        """
        if self.is_fsdp_enabled:
            return contextlib.nullcontext()
        return self.accelerator.autocast()

    def _engine(self, model) -> Engine:
        causal_lm = _causal_lm(model)
        engine = self._engines.get(id(causal_lm))
        if engine is None:
            engine = Engine(
                model,
                causal_lm,
                get_adapter(causal_lm),
                chunk_size=self.args.prefill_chunk_size,
                progress=self.args.prefill_progress and self.accelerator.is_main_process,
                shards=self._prompt_shards,
                autocast=self._autocast,
                offload_boundaries=self.args.offload_boundary_states,
                checkpoint_reverse=self.args.reverse_checkpointing,
                attention_reuse=self.args.reverse_attention_reuse,
                prefill_attention=self.args.prefill_attention_reuse,
            )
            engine.hold_budget = self._hold_budget
            self._engines[id(causal_lm)] = engine
        engine.model = model
        return engine

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        """Stock signature. Returns the values the training step computed, or scores without autograd."""
        if self._precomputed is not None:
            logps, entropies = self._precomputed
            return logps, entropies if compute_entropy else None, None
        if torch.is_grad_enabled():
            raise RuntimeError("LongStrawGRPOTrainer scores with autograd only through training_step")
        self._check_window(model, input_ids.shape[1])
        k = logits_to_keep
        if self._defer_old_logps and model is self.model:
            # The old-policy call of `_generate_and_score_completions`; its values come from the loss pass.
            self._defer_old_logps = False
            return input_ids.new_zeros(input_ids.shape[0], k, dtype=torch.float32), None, None
        # Branches batched up to a prefill chunk's worth of tokens: the activation memory of one prefill chunk.
        logps, entropies = self._engine(model).score(
            input_ids[:, :-k],
            attention_mask[:, :-k],
            input_ids[:, -k:],
            attention_mask[:, -k:],
            batch_tokens=self.args.prefill_chunk_size,
        )
        return logps, entropies if compute_entropy else None, None

    # -------------------------------------------------------------------------------------------- old log-probs
    def _generate_and_score_completions(self, inputs):
        """Stock, except that old-policy log-probs are deferred when the weights cannot change before they are used.

        Stock scores every completion with the policy right after generation (one more pass over each prompt) when
        `gradient_accumulation_steps % (steps_per_generation * num_iterations) != 0`. Until the next optimizer step
        the policy is the one that generated, so the first loss pass over a micro-batch computes exactly those
        log-probs (its no-grad scoring); they are stored into the buffered micro-batch for the later iterations.
        Micro-batches whose first loss pass comes after an optimizer step are scored just before that step
        (`_fill_pending_old_logps`), with the same weights as stock. Not deferred: evaluation, and vLLM importance
        sampling, which needs them at generation time.
        """
        generate_every = self.args.steps_per_generation * self.num_iterations
        armed = (
            self.model.training
            and self.args.gradient_accumulation_steps % generate_every != 0
            and not (self.use_vllm and self.vllm_importance_sampling_correction)
        )
        self._defer_old_logps = armed
        try:
            output = super()._generate_and_score_completions(inputs)
            consumed = not self._defer_old_logps
        finally:
            self._defer_old_logps = False
        if armed:
            if not consumed or "old_per_token_logps" not in output:
                raise RuntimeError("LongStrawGRPOTrainer: GRPOTrainer did not ask for old-policy log-probs")
            del output["old_per_token_logps"]
            output[OLD_LOGPS_PENDING] = torch.ones(
                len(output["prompt_ids"]), dtype=torch.bool, device=output["prompt_ids"].device
            )
            self._old_logps_step = self.state.global_step
        return output

    def _check_old_logps_step(self) -> None:
        if self.state.global_step != self._old_logps_step:
            raise RuntimeError(
                "LongStrawGRPOTrainer: deferred old-policy log-probs would be computed after an optimizer step "
                f"(generated at step {self._old_logps_step}, now {self.state.global_step})"
            )

    def _fill_pending_old_logps(self) -> None:
        """Scores the buffered micro-batches still waiting for old-policy log-probs, before the weights change."""
        for batch in self._buffered_inputs or []:
            if OLD_LOGPS_PENDING in batch:
                self._check_old_logps_step()
                with torch.no_grad():
                    logps, _ = self._engine(self.model).score(
                        batch["prompt_ids"],
                        batch["prompt_mask"],
                        batch["completion_ids"],
                        batch["completion_mask"],
                        batch_tokens=self.args.prefill_chunk_size,
                        reuse=True,
                    )
                batch["old_per_token_logps"] = logps
                del batch[OLD_LOGPS_PENDING]

    # ------------------------------------------------------------------------------------------------ generation
    def _tokenize_prompts(self, prompts: list):
        """Stock's, run once per run of equal consecutive prompts: the G rows of a prompt share its ids
        (`batch.tokenize_distinct`). With environments each row renders its own tools: stock's, row by row."""
        if self.environment_factories is not None:
            return super()._tokenize_prompts(prompts)
        return tokenize_distinct(super()._tokenize_prompts, prompts)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """Shared-prompt generation on the transformers path (see `generation.py`); stock otherwise."""
        if not self._shared_generation or images is not None or multimodal_fields:
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images=has_tool_images
            )
        with (
            profiling_context(self, "longstraw.generate"),
            unwrap_model_for_generation(
                self.model_wrapped,
                self.accelerator,
                gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                generation_kwargs=self.generation_kwargs,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as unwrapped_model,
            torch.no_grad(),
        ):
            engine = self._engine(unwrapped_model)
            completion_ids = generate_shared(
                unwrapped_model,
                engine,
                prompt_ids,
                self.generation_config,
                pad_token_id=self._tokenizer.pad_token_id,
                eos_token_ids=self.eos_token_ids,
                pad_to_multiple_of=self.pad_to_multiple_of,
                device=self.accelerator.device,
                offer_boundaries=self._offer_boundaries(engine),
            )
        return completion_ids, None

    def _offer_boundaries(self, engine: Engine) -> bool | None:
        """Whether generation's prompt states go to the loss pass, and with which chunk boundaries (None: not).

        In training, the loss pass that follows with the same weights (`num_iterations=1`, or the first iteration)
        takes them instead of prefilling again (`Engine.offer`); exact mode needs the recurrent chunk boundaries.
        Not with per-call RoPE (dynamic, longrope): generation pins other frequencies than the loss pass. Every
        prompt is offered at the positions the loss pass gives it (after its left padding in the batch); with a
        sharded prompt state, the ranks of a shard group agree on which prompts they offer and take (see
        `generation.generate_shared` and `Engine._agree_held`).
        """
        if not self.model.training or engine.rope.modules:
            return None
        return self.args.prompt_gradient == "exact"

    # ------------------------------------------------------------------------------------------------------ step
    def training_step(self, model, inputs, num_items_in_batch):
        """`Trainer.training_step` with the engine's loss and backward, and `GRPOTrainer.training_step`'s timing.

        Of what Trainer's step does around `compute_loss` and `accelerator.backward` (transformers 5.23), this keeps
        the train modes, `_prepare_inputs`, `compute_loss_context_manager` and `torch_empty_cache_steps`. The rest
        has no work here: context parallelism, SageMaker model parallelism, LOMO optimizers (whose update runs inside
        backward), DeepSpeed and several GPUs per process are refused at construction, and GRPO's loss is already
        scaled for gradient accumulation (`loss_is_scaled_for_ga`).
        """
        time_before = time.perf_counter()
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        if not self._memory_checked and self._dataset_prompt_length is not None:
            # Before the first generation, with the dataset's longest prompt, so that the guard covers generation.
            self._check_memory(model, self._dataset_prompt_length, self.args.max_completion_length or 0)
        inputs = self._prepare_inputs(inputs)
        if not self._memory_checked:
            self._check_memory(model, inputs["prompt_ids"].shape[1], inputs["completion_ids"].shape[1])
        with self.compute_loss_context_manager():
            loss = self._loss_and_backward(model, inputs)
        del inputs
        steps = self.args.torch_empty_cache_steps
        if steps is not None and self.state.global_step % steps == 0:
            clear_device_cache()
            if torch.backends.mps.is_available() and hasattr(torch.mps, "clear_graph_cache"):
                torch.mps.clear_graph_cache()
        # Bookkeeping of GRPOTrainer.training_step, whose super() call this method replaces.
        self._step += 1
        self._current_train_step_time += time.perf_counter() - time_before
        if self._step % self.current_gradient_accumulation_steps == 0:
            self._metrics["train"]["step_time"].append(self._current_train_step_time)
            self._current_train_step_time = 0.0
        return loss.detach()

    def _loss_and_backward(self, model, inputs: dict[str, Any]) -> torch.Tensor:
        """Scores the micro-batch once, evaluates TRL's loss on the scores, then back-propagates branch by branch."""
        self._check_completions(inputs["completion_mask"])
        self._check_window(model, inputs["prompt_ids"].shape[1] + inputs["completion_ids"].shape[1])
        engine = self._engine(model)
        engine.stats.reset()
        old_pending = OLD_LOGPS_PENDING in inputs
        if old_pending:
            self._check_old_logps_step()
        prompt = (inputs["prompt_ids"], inputs["prompt_mask"])
        completion = (inputs["completion_ids"], inputs["completion_mask"])
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        exact = self.args.prompt_gradient == "exact"
        with torch.no_grad():
            logps, entropies = engine.score(*prompt, *completion, keep=True, boundaries=exact)
        wrt = [logps.requires_grad_()] + ([entropies.requires_grad_()] if entropies is not None else [])
        self._precomputed = (logps, entropies)
        metrics_before = {key: len(values) for key, values in self._metrics["train"].items()}
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            self._precomputed = None
        if old_pending:
            # Same weights as at generation: these are the old-policy log-probs of the later iterations. This pass
            # itself used `per_token_logps.detach()`, as stock does whenever old and current policy coincide.
            inputs["old_per_token_logps"] = logps.detach().clone()
            del inputs[OLD_LOGPS_PENDING]
        grads = torch.autograd.grad(loss, wrt, allow_unused=True)
        grad_logps = torch.zeros_like(logps) if grads[0] is None else grads[0]
        grad_entropies = grads[1] if len(grads) > 1 else None
        per_token = {
            "per-token log-probs": logps,
            "per-token entropies": entropies,
            "loss gradients w.r.t. log-probs": grad_logps,
            "loss gradients w.r.t. entropies": grad_entropies,
        }
        problem = self._nonfinite(inputs, per_token, loss)
        if self.args.on_nonfinite == "skip":
            self._metrics["train"]["longstraw/nonfinite_skipped"].append(float(problem is not None))
        if problem is not None:
            engine.release()
            if self.args.on_nonfinite == "raise":
                raise FloatingPointError(
                    f"{problem}. Nothing of this micro-batch was back-propagated. Common causes: diverged weights "
                    "(lower learning_rate, keep max_grad_norm clipping on), a reward function returning NaN/inf, or "
                    "fp16 overflow (use bf16). Set on_nonfinite='skip' to skip such micro-batches with a warning."
                )
            logger.warning(f"{problem}. Skipping this micro-batch (on_nonfinite='skip'): it contributes no gradient.")
            # The metrics of a skipped micro-batch are dropped with it; its loss is logged as NaN, which the
            # Trainer's logging_nan_inf_filter leaves out of the logged average.
            metrics = self._metrics["train"]
            for key in list(metrics):
                if key != "longstraw/nonfinite_skipped":
                    del metrics[key][metrics_before.get(key, 0) :]
                    if not metrics[key]:
                        del metrics[key]
            return torch.full_like(loss.detach(), math.nan)
        engine.backward(
            *prompt,
            *completion,
            grad_logps,
            grad_entropies,
            exact=exact,
            backward_fn=self.accelerator.backward,
        )
        self._log_engine_stats(engine)
        return loss.detach()

    def _check_completions(self, completion_mask: torch.Tensor) -> None:
        """Refuses empty completions (rows of `completion_mask` `[B, C]`) unless `mask_truncated_completions` is on.

        With `mask_truncated_completions=True`, TRL zeroes the mask of every truncated completion: such rows
        legitimately contribute nothing, exactly as in `GRPOTrainer`. Otherwise every completion TRL builds holds at
        least one token, so an all-zero row means the generator (or a `rollout_func`) returned no tokens: its reward
        still shapes its group's advantages while the row itself trains nothing.
        """
        if self.mask_truncated_completions:
            return
        empty = (completion_mask.sum(dim=1) == 0).nonzero().flatten().tolist()
        if empty:
            raise ValueError(
                f"rows {empty} of the micro-batch at global_step={self.state.global_step} have an empty completion "
                "(completion_mask all zero) while mask_truncated_completions=False: the generator or rollout_func "
                "returned no tokens for them. Check the generation settings (e.g. a prompt that fills the "
                "generator's context window, max_completion_length) or the rollout_func; set "
                "mask_truncated_completions=True only if masked-out completions are intended."
            )

    def _nonfinite(
        self, inputs: dict[str, Any], per_token: dict[str, torch.Tensor | None], loss: torch.Tensor
    ) -> str | None:
        """Describes the non-finite values among `per_token` (`[B, C]`, at the completion mask) and `loss`, or `None`.

        Agreed across processes, so that all of them raise (or skip) together instead of some waiting forever in a
        collective. The description names the rows of the micro-batch and the step, and the per-row inputs that are
        non-finite too, which usually point at the cause.
        """
        mask = inputs["completion_mask"].bool()
        found = []
        for name, values in per_token.items():
            if values is not None:
                rows = (~torch.isfinite(values) & mask).any(dim=1).nonzero().flatten().tolist()
                if rows:
                    found.append(f"{name} in rows {rows}")
        if not bool(torch.isfinite(loss)):
            found.append(f"the loss ({loss.item()})")
        # Every process takes part in the reduction, whatever it found.
        flag = self.accelerator.reduce(torch.tensor(float(bool(found)), device=mask.device), reduction="sum")
        if not bool(flag > 0):
            return None
        if not found:
            found.append("values on another process")
        context = []
        for name in _NONFINITE_CONTEXT:
            value = inputs.get(name)
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.ndim in (1, 2):
                bad = ~torch.isfinite(value)
                if value.ndim == 2 and value.shape == mask.shape:
                    bad = bad & mask
                rows = (bad if bad.ndim == 1 else bad.any(dim=1)).nonzero().flatten().tolist()
                if rows:
                    context.append(f"{name} in rows {rows}")
        where = (
            f"while computing optimizer step {self.state.global_step + 1} (global_step={self.state.global_step}, "
            f"micro-batch {self._step} of this run)"
        )
        message = f"non-finite {', '.join(found)} {where}"
        if context:
            message += f"; non-finite inputs: {', '.join(context)}"
        return message

    def _log_engine_stats(self, engine: Engine) -> None:
        metrics = self._metrics["train"]
        stats = engine.stats
        metrics["longstraw/prompt_positions"].append(float(stats.prompt_positions))
        metrics["longstraw/prompt_positions_reused"].append(float(stats.reused_positions))
        metrics["longstraw/prefill_s"].append(stats.prefill_s)
        metrics["longstraw/replay_s"].append(stats.replay_s)
        metrics["longstraw/reverse_s"].append(stats.reverse_s)
        metrics["longstraw/state_gib"].append(stats.state_bytes / 2**30)
        if torch.cuda.is_available():
            metrics["longstraw/peak_memory_gib"].append(torch.cuda.max_memory_allocated() / 2**30)
        else:
            metrics["longstraw/peak_rss_gib"].append(peak_rss_gib())

    # ----------------------------------------------------------------------------------------------- checkpoints
    def _generation_layout(self) -> dict[str, int]:
        """The settings under which a saved generation buffer means the same thing on resume."""
        args = self.args
        return {
            "world_size": args.world_size,
            "per_device_train_batch_size": args.per_device_train_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "steps_per_generation": args.steps_per_generation,
            "num_iterations": self.num_iterations,
        }

    def create_model_card(self, model_name=None, dataset_name=None, tags=None) -> None:
        """Saves the model card to `output_dir/README.md` (`trl_longstraw.card`: the base model, the LongStraw
        method and mode, the hardware and the planner's verdict), in place of TRL's."""
        if not self.is_world_process_zero():
            return
        from .card import model_card

        tags = [tags] if isinstance(tags, str) else tags
        model_card(self, model_name, dataset_name, tags).save(os.path.join(self.args.output_dir, "README.md"))

    def _save_rng_state(self, output_dir: str) -> None:
        """Saves, with each process's RNG state, its generation buffer and micro-step counter.

        `GRPOTrainer` does not checkpoint them: a run resumed between two generations regenerates early (different
        completions) and its later generations fall on different steps. They are restored together with the RNG state
        (`_load_rng_state`), so the resumed steps equal those of an uninterrupted run.
        """
        super()._save_rng_state(output_dir)
        state = {"step": self._step, "buffered_inputs": self._buffered_inputs, "layout": self._generation_layout()}
        torch.save(state, os.path.join(output_dir, GENERATION_STATE_NAME.format(self.args.process_index)))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        super()._load_rng_state(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, GENERATION_STATE_NAME.format(self.args.process_index))
        if not os.path.isfile(path):
            logger.warning(f"{path} not found: resuming as GRPOTrainer does, regenerating completions at once.")
            return
        state = torch.load(path, map_location=self.accelerator.device, weights_only=True)
        if state["layout"] != self._generation_layout():
            logger.warning(
                f"the checkpoint's generation buffer was saved with {state['layout']}, this run has "
                f"{self._generation_layout()}: regenerating completions at once instead of resuming it."
            )
            return
        self._step = state["step"]
        self._buffered_inputs = state["buffered_inputs"]

    # ---------------------------------------------------------------------------------------------------- inputs
    def _get_train_sampler(self, dataset=None) -> Sampler:
        sampler = super()._get_train_sampler(dataset)
        return EpochSampler(sampler) if isinstance(sampler, RepeatSampler) else sampler

    def _prepare_inputs(self, generation_batch: dict[str, torch.Tensor | Any]) -> dict[str, torch.Tensor | Any]:
        if not (self.args.group_shuffle and self.model.training):
            return super()._prepare_inputs(generation_batch)
        # GRPOTrainer._prepare_inputs, with whole groups shuffled instead of rows.
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            generation_batch = self._generate_and_score_completions(generation_batch)
            generation_batch = shuffle_groups(
                generation_batch, self.args.per_device_train_batch_size, _local_group_size(self.args)
            )
            self._buffered_inputs = split_tensor_dict(generation_batch, self.args.steps_per_generation)
        return self._buffered_inputs[self._step % self.args.steps_per_generation]


def _local_group_size(args: LongStrawGRPOConfig) -> int:
    """Rows of one group that a process's generation batch holds together: `num_generations` when it holds whole
    groups, fewer when a group is spread over processes. Group and process boundaries both fall on its multiples."""
    return math.gcd(args.num_generations, args.per_device_train_batch_size * args.steps_per_generation)


class _FillOldLogpsBeforeUpdate(TrainerCallback):
    """Computes the deferred old-policy log-probs that no loss pass has produced yet, before each optimizer step."""

    def __init__(self, trainer: LongStrawGRPOTrainer):
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._fill_pending_old_logps()

    def on_optimizer_step(self, args, state, control, **kwargs):
        # Held prompt states (generation's offers not taken) belong to the weights before the update.
        for engine in self.trainer._engines.values():
            engine.release()


def peak_rss_gib() -> float:
    """Peak resident set size of this process so far, in GiB (the CPU counterpart of the GPU's peak memory)."""
    # ru_maxrss is in KiB on Linux, in bytes on macOS.
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**30


def shuffle_groups(batch: dict[str, Any], micro_batch_size: int, group_size: int) -> dict[str, Any]:
    """Permutes the rows of `batch` so that groups (`group_size` rows of one prompt) move as a whole, in random order.

    The rows of each prompt are cut into groups in their order in the batch, so a prompt that occurs several times in
    the dataset makes several groups.

    Raises:
        ValueError: if the groups cannot tile the micro-batches: each prompt must have a multiple of `group_size` rows,
            and `group_size` must divide `micro_batch_size` or be a multiple of it.
    """
    groups = []
    for prompt in group_prompts(batch["prompt_ids"], batch["prompt_mask"]):
        groups += [prompt.rows[i : i + group_size] for i in range(0, len(prompt.rows), group_size)]
    sizes = sorted(len(rows) for rows in groups)
    if (
        sizes[0] != group_size
        or sizes[-1] != group_size
        or (micro_batch_size % group_size and group_size % micro_batch_size)
    ):
        raise ValueError(
            f"group_shuffle needs whole groups of {group_size} rows per micro-batch, but this process holds groups of "
            f"sizes {sizes} for micro-batches of {micro_batch_size} rows. Make per_device_train_batch_size a multiple "
            "or a divisor of num_generations, keep the rows of each group consecutive in the generation batch (as "
            "TRL's RepeatSampler does), or set group_shuffle=False."
        )
    order = torch.randperm(len(groups)).tolist()
    permutation = torch.tensor([row for i in order for row in groups[i]])

    def permute(value):
        if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0):
            return value
        if isinstance(value, torch.Tensor):
            return value[permutation.to(value.device)]
        return [value[i] for i in permutation.tolist()]

    return {key: permute(value) for key, value in batch.items()}


class EpochSampler(Sampler):
    """TRL's `RepeatSampler`, made to give epoch `e` the same order in a resumed run as in an uninterrupted one.

    `RepeatSampler` draws each epoch's permutation from one generator seeded once, so a run resumed in epoch `e > 0`
    replays the permutation of epoch 0. The Trainer calls `set_epoch(e)` before iterating each epoch; this reseeds
    the generator and draws the permutations of the `e` previous epochs again, which gives exactly the order of an
    uninterrupted run.
    """

    def __init__(self, sampler: RepeatSampler):
        self.sampler = sampler

    def set_epoch(self, epoch: int) -> None:
        sampler = self.sampler
        if sampler.shuffle and sampler.seed is not None:
            sampler.generator.manual_seed(sampler.seed)
            for _ in range(epoch):
                torch.randperm(sampler.num_samples, generator=sampler.generator)

    def __iter__(self):
        return iter(self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


def _check_args(args: LongStrawGRPOConfig, world_size: int | None = None) -> None:
    """Settings that the engine cannot honour exactly. Each message names the alternative.

    `world_size`: the processes of the run (default: this launch's, `args.world_size`; the planner passes its GPUs).
    """
    world_size = args.world_size if world_size is None else world_size
    expert_parallel.check_args(args, world_size)
    micro_batch, group = args.per_device_train_batch_size, _local_group_size(args)
    if args.group_shuffle and micro_batch % group and group % micro_batch:
        raise ValueError(
            f"group_shuffle cannot split the generation batch into micro-batches of whole groups: "
            f"per_device_train_batch_size={micro_batch} is neither a multiple nor a divisor of the {group} rows of a "
            f"group that each process holds (num_generations={args.num_generations}, "
            f"steps_per_generation={args.steps_per_generation}). Make per_device_train_batch_size a multiple or a "
            "divisor of num_generations, or set group_shuffle=False."
        )
    if args.on_nonfinite == "skip" and world_size > 1:
        raise ValueError(
            "on_nonfinite='skip' is supported in single-process runs only: skipping the last micro-batch of an "
            "accumulation window on every process would leave the window's gradients unsynchronized. Use "
            "on_nonfinite='raise'."
        )
    if args.torch_compile:
        raise ValueError(
            "torch_compile is not supported by LongStrawGRPOTrainer: its adapters route every layer through the "
            "engine's current pass (prompt chunk, branch or reverse chunk), state that a compiled graph would bake in "
            "or recompile for at each pass. Set torch_compile=False."
        )
    if args.optim in (OptimizerNames.LOMO, OptimizerNames.ADALOMO):
        raise ValueError(
            f"optim={args.optim.value!r} is not supported by LongStrawGRPOTrainer: LOMO updates each weight inside "
            "backward, and the engine back-propagates a micro-batch in many passes (one per completion and prompt "
            "chunk), so later passes would run on already-updated weights. Use another optimizer, e.g. "
            "optim='adamw_torch' or 'adafactor'."
        )
    if is_sagemaker_mp_enabled():
        raise ValueError(
            "SageMaker model parallelism is not supported by LongStrawGRPOTrainer: use FSDP2 or DDP via Accelerate."
        )
    if args.use_liger_kernel:
        raise ValueError("use_liger_kernel is not supported by LongStrawGRPOTrainer: set use_liger_kernel=False.")
    if args.deepspeed:
        raise ValueError("DeepSpeed is not supported by LongStrawGRPOTrainer: use FSDP2 or DDP via Accelerate.")
    if (
        args.prompt_gradient == "exact"
        and args.gradient_checkpointing
        and (args.gradient_checkpointing_kwargs or {}).get("use_reentrant")
    ):
        raise ValueError(
            "reentrant gradient checkpointing cannot carry the gradient into the prompt state (it is not an input of "
            "the checkpointed layers): set gradient_checkpointing_kwargs={'use_reentrant': False}, or "
            "prompt_gradient='detached'."
        )
