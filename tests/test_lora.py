"""LoRA/PEFT: LongStraw trains the adapters in both modes; exact-mode adapter gradients equal stock's."""

import pytest
import torch
from grpo_pair import assert_grads_close, grads, make_pair
from peft import LoraConfig
from tolerances import LOSS_ATOL

from trl_longstraw.testing import random_micro_batch


def lora() -> LoraConfig:
    # init_lora_weights=False: B is random too, so A receives a gradient and the adapters change the outputs.
    targets = ["q_proj", "k_proj", "v_proj", "up_proj"]
    return LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)


def step(trainer, mb, checkpointing: bool):
    trainer._prepare_inputs = lambda x: x
    trainer.current_gradient_accumulation_steps = 1
    if checkpointing:
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trainer.model.zero_grad()
    loss = trainer.training_step(trainer.model, dict(mb), mb["num_items_in_batch"])
    return loss, grads(trainer.model)


def micro_batch(vocab_size):
    mb = random_micro_batch([13, 7, 1], [9, 1, 5, 3, 4], [0, 1, 0, 2, 1], vocab_size, seed=1)
    mb["ref_per_token_logps"] = -torch.rand(mb["completion_ids"].shape, generator=torch.Generator().manual_seed(2)) * 5
    return mb


@pytest.mark.parametrize("checkpointing", [False, True])
def test_exact_lora_gradients_equal_stock(tiny_model_path, checkpointing):
    stock, ours = make_pair(tiny_model_path("llama"), peft_config=lora(), loss_type="bnpo")
    mb = micro_batch(ours.model.config.vocab_size)
    stock_loss, stock_grads = step(stock, mb, checkpointing)
    our_loss, our_grads = step(ours, mb, checkpointing)
    assert abs(stock_loss.item() - our_loss.item()) <= LOSS_ATOL
    assert all("lora_" in name for name in stock_grads), "only the adapters train"
    assert_grads_close(stock_grads, our_grads)


def test_detached_lora_trains_the_adapters(tiny_model_path):
    stock, ours = make_pair(tiny_model_path("llama"), peft_config=lora(), longstraw={"prompt_gradient": "detached"})
    mb = micro_batch(ours.model.config.vocab_size)
    stock_loss, stock_grads = step(stock, mb, False)
    our_loss, our_grads = step(ours, mb, False)
    # Same loss; the gradient leaves out the paths through the prompt, so it differs, but every adapter is trained:
    # q/k/v adapters through the completion tokens' own keys, values and queries.
    assert abs(stock_loss.item() - our_loss.item()) <= LOSS_ATOL
    assert set(our_grads) == set(stock_grads)
    assert all(g.norm() > 0 for g in our_grads.values())
    worst = max(((our_grads[n] - g).norm() / g.norm()).item() for n, g in stock_grads.items())
    assert worst > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_lora_training_runs_and_moves_only_the_adapters(tiny_model_path, mode):
    settings = dict(num_iterations=2, max_steps=2, generation_kwargs={"do_sample": False})
    _, ours = make_pair(tiny_model_path("llama"), peft_config=lora(), longstraw={"prompt_gradient": mode}, **settings)
    before = {n: p.detach().clone() for n, p in ours.model.named_parameters()}
    ours.train()
    after = dict(ours.model.named_parameters())
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert moved and all("lora_" in n for n in moved)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in ours.state.log_history if "loss" in r)
