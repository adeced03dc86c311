"""`LongStrawGRPOTrainer`: `trl.GRPOTrainer` with the prompt-once scoring and loss path.

The loss is TRL's own `_compute_loss`, evaluated on per-token log-probs and entropies that the engine computes once
per micro-batch without autograd (each distinct prompt prefilled once, each completion replayed against it). Its
gradient with respect to those per-token values is exact for every loss type and option, since the loss depends on
the model only through them. Each completion is then replayed with autograd and back-propagated on its own with that
gradient as its weight; in exact mode the gradient left on the prompt state is finally carried through the prompt.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from accelerate.utils import DistributedType
from transformers import PreTrainedModel
from trl import GRPOTrainer
from trl.trainer.utils import split_tensor_dict

from .adapters import get_adapter
from .config import LongStrawGRPOConfig
from .engine import Engine, group_prompts


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
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        self._check_setup()
        self._engines: dict[int, Engine] = {}
        self._precomputed: tuple[torch.Tensor, torch.Tensor | None] | None = None

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
        if self.args.n_gpu > 1:
            raise ValueError(
                "torch.nn.DataParallel (several GPUs in one process) is not supported: launch one process per GPU "
                "with `accelerate launch`."
            )
        get_adapter(_causal_lm(self.model))
        if self.ref_model is not None:
            get_adapter(_causal_lm(self.ref_model))

    # ---------------------------------------------------------------------------------------------------- engine
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
            )
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
        k = logits_to_keep
        logps, entropies = self._engine(model).score(
            input_ids[:, :-k], attention_mask[:, :-k], input_ids[:, -k:], attention_mask[:, -k:]
        )
        return logps, entropies if compute_entropy else None, None

    # ------------------------------------------------------------------------------------------------------ step
    def training_step(self, model, inputs, num_items_in_batch):
        time_before = time.perf_counter()
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self._loss_and_backward(model, inputs)
        # Bookkeeping of GRPOTrainer.training_step, whose super() call this method replaces.
        self._step += 1
        self._current_train_step_time += time.perf_counter() - time_before
        if self._step % self.current_gradient_accumulation_steps == 0:
            self._metrics["train"]["step_time"].append(self._current_train_step_time)
            self._current_train_step_time = 0.0
        return loss.detach()

    def _loss_and_backward(self, model, inputs: dict[str, Any]) -> torch.Tensor:
        """Scores the micro-batch once, evaluates TRL's loss on the scores, then back-propagates branch by branch."""
        engine = self._engine(model)
        engine.stats.reset()
        prompt = (inputs["prompt_ids"], inputs["prompt_mask"])
        completion = (inputs["completion_ids"], inputs["completion_mask"])
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        exact = self.args.prompt_gradient == "exact"
        with torch.no_grad():
            logps, entropies = engine.score(*prompt, *completion, keep_last=True, boundaries=exact)
        wrt = [logps.requires_grad_()] + ([entropies.requires_grad_()] if entropies is not None else [])
        self._precomputed = (logps, entropies)
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            self._precomputed = None
        grads = torch.autograd.grad(loss, wrt, allow_unused=True)
        grad_logps = torch.zeros_like(logps) if grads[0] is None else grads[0]
        grad_entropies = grads[1] if len(grads) > 1 else None
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

    def _log_engine_stats(self, engine: Engine) -> None:
        metrics = self._metrics["train"]
        stats = engine.stats
        metrics["longstraw/prompt_positions"].append(float(stats.prompt_positions))
        metrics["longstraw/prefill_s"].append(stats.prefill_s)
        metrics["longstraw/replay_s"].append(stats.replay_s)
        metrics["longstraw/reverse_s"].append(stats.reverse_s)
        metrics["longstraw/state_gib"].append(stats.state_bytes / 2**30)
        if torch.cuda.is_available():
            metrics["longstraw/peak_memory_gib"].append(torch.cuda.max_memory_allocated() / 2**30)

    # ---------------------------------------------------------------------------------------------------- inputs
    def _prepare_inputs(self, generation_batch: dict[str, torch.Tensor | Any]) -> dict[str, torch.Tensor | Any]:
        if not (self.args.group_shuffle and self.model.training):
            return super()._prepare_inputs(generation_batch)
        # GRPOTrainer._prepare_inputs, with whole groups shuffled instead of rows.
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            generation_batch = self._generate_and_score_completions(generation_batch)
            generation_batch = shuffle_groups(generation_batch, self.args.per_device_train_batch_size)
            self._buffered_inputs = split_tensor_dict(generation_batch, self.args.steps_per_generation)
        return self._buffered_inputs[self._step % self.args.steps_per_generation]


def shuffle_groups(batch: dict[str, Any], micro_batch_size: int) -> dict[str, Any]:
    """Permutes the rows of `batch` so that groups (rows with one prompt) move as a whole, in random order.

    Raises:
        ValueError: if the groups cannot tile the micro-batches: they must all have one size `s`, and `s` must
            divide `micro_batch_size` or be a multiple of it.
    """
    groups = group_prompts(batch["prompt_ids"], batch["prompt_mask"])
    sizes = {len(g.rows) for g in groups}
    size = next(iter(sizes))
    if len(sizes) > 1 or (micro_batch_size % size and size % micro_batch_size):
        raise ValueError(
            f"group_shuffle needs whole groups per micro-batch, but this process holds groups of sizes "
            f"{sorted(len(g.rows) for g in groups)} for micro-batches of {micro_batch_size} rows. Make "
            "per_device_train_batch_size a multiple or a divisor of num_generations (and the generation batch of each "
            "process a multiple of num_generations), or set group_shuffle=False."
        )
    order = torch.randperm(len(groups)).tolist()
    permutation = torch.tensor([row for i in order for row in groups[i].rows])

    def permute(value):
        if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0):
            return value
        if isinstance(value, torch.Tensor):
            return value[permutation.to(value.device)]
        return [value[i] for i in permutation.tolist()]

    return {key: permute(value) for key, value in batch.items()}


def _check_args(args: LongStrawGRPOConfig) -> None:
    """Settings that the engine cannot honour exactly. Each message names the alternative."""
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
