"""Builders shared by the tests: paired stock/LongStraw trainers and gradient comparison."""

from __future__ import annotations

import tempfile

import torch
from datasets import Dataset
from trl import GRPOConfig

from tests.tolerances import GRAD_RTOL
from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer
from trl_longstraw.reference import detached_prompt_logps


def zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def base_args(**overrides) -> dict:
    args = dict(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=9,
        report_to=[],
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        gradient_checkpointing=False,
    )
    args.update(overrides)
    return args


def make_trainer(path, cls=LongStrawGRPOTrainer, **overrides):
    """A trainer on the model saved at `path`, ready for `training_step` on hand-built micro-batches."""
    config_cls = LongStrawGRPOConfig if cls is LongStrawGRPOTrainer else GRPOConfig
    kw = base_args(**overrides)
    if config_cls is GRPOConfig:
        for key in ("prompt_gradient", "prefill_chunk_size", "group_shuffle", "prefill_progress"):
            kw.pop(key, None)
    trainer = cls(str(path), zero_reward, config_cls(**kw), train_dataset=Dataset.from_dict({"prompt": ["a"] * 4}))
    trainer._prepare_inputs = lambda x: x
    trainer.current_gradient_accumulation_steps = 1
    if trainer.args.gradient_checkpointing:
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return trainer


def detached_reference(path, **overrides):
    """A stock `GRPOTrainer` whose log-probs come from `reference.detached_prompt_logps`: stock's loss and backward on
    a plain detached-prompt forward (the prompt without autograd, each completion on a fresh copy of the cache).

    transformers drops the cache under gradient checkpointing, so the reference always runs without it.
    """
    from trl import GRPOTrainer

    return score_detached(make_trainer(path, GRPOTrainer, **{**overrides, "gradient_checkpointing": False}))


def score_detached(trainer):
    """Makes a stock `GRPOTrainer` (built without gradient checkpointing) score every log-prob, old-policy and
    reference ones included, with `reference.detached_prompt_logps` on its policy model."""
    causal_lm = trainer.model

    def plain(model, input_ids, attention_mask, logits_to_keep, compute_entropy=False, **kwargs):
        lp, ent = detached_prompt_logps(causal_lm, input_ids, attention_mask, logits_to_keep, trainer.temperature)
        return lp, ent if compute_entropy else None, None

    trainer._get_per_token_logps_and_entropies = plain
    return trainer


def run_steps(trainer, micro_batches) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Accumulates `training_step` over `micro_batches`; returns the losses and the parameter gradients."""
    trainer.model.zero_grad(set_to_none=True)
    trainer.current_gradient_accumulation_steps = len(micro_batches)
    losses = [float(trainer.training_step(trainer.model, dict(mb), mb["num_items_in_batch"])) for mb in micro_batches]
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return losses, grads


def assert_grads_close(ours: dict, ref: dict, rtol: float = GRAD_RTOL) -> float:
    """Every parameter that has a reference gradient has ours, within `rtol` relative error in norm."""
    assert ref, "the reference produced no gradient"
    assert set(ours) == set(ref), f"gradients differ in which parameters they reach: {set(ours) ^ set(ref)}"
    worst = 0.0
    for name, g in ref.items():
        err = ((ours[name] - g).norm() / g.norm().clamp_min(1e-30)).item()
        worst = max(worst, err)
        assert err <= rtol, f"{name}: relative gradient error {err:.3e} > {rtol:.1e}"
    return worst


def rebind_recurrent_state(self, recurrent_states, state_idx=0, **kwargs):
    """For the detached reference on Qwen3.5 (patch `transformers.cache_utils.LinearAttentionLayer` with it): stock
    `LinearAttentionLayer.update_recurrent_state`, storing the new state instead of copying it into the old
    one: the in-place copy overwrites a tensor that the branch's own graph saved, so backward fails."""
    if not self.is_recurrent_states_initialized[state_idx]:
        self.lazy_initialization(recurrent_states=recurrent_states, state_idx=state_idx)
    self.recurrent_states[state_idx] = recurrent_states
    return recurrent_states
