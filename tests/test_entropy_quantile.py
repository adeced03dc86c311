"""`top_entropy_quantile < 1`: TRL's loss masks on the entropies of the engine's no-grad scoring pass, which is
the pre-pass the issue asks for (each prompt prefilled once for the whole micro-batch). Loss and gradients equal
stock's."""

import pytest
import torch
from grpo_pair import assert_grads_close, grads, make_pair
from tolerances import LOSS_ATOL

from trl_longstraw.testing import random_micro_batch


@pytest.mark.parametrize(
    "family,settings",
    [
        ("llama", {"top_entropy_quantile": 0.5}),
        # With an entropy bonus, the gradient also flows through the masked entropies.
        ("qwen3", {"top_entropy_quantile": 0.2, "entropy_coef": 0.05, "loss_type": "grpo"}),
    ],
)
def test_top_entropy_quantile_matches_stock(tiny_model_path, family, settings):
    stock, ours = make_pair(tiny_model_path(family), **settings)
    mb = random_micro_batch([13, 7, 1], [9, 1, 5, 3, 4, 6], [0, 1, 0, 2, 1, 2], ours.model.config.vocab_size, seed=3)
    mb["ref_per_token_logps"] = -torch.rand(mb["completion_ids"].shape, generator=torch.Generator().manual_seed(4))
    results = []
    for t in (stock, ours):
        t._prepare_inputs = lambda x: x
        t.current_gradient_accumulation_steps = 1
        t.model.zero_grad()
        loss = t.training_step(t.model, dict(mb), mb["num_items_in_batch"])
        results.append((loss, grads(t.model)))
    (stock_loss, stock_grads), (our_loss, our_grads) = results
    assert abs(stock_loss.item() - our_loss.item()) <= LOSS_ATOL
    assert_grads_close(stock_grads, our_grads)
    # The mask is not trivial: with quantile q, about a fraction q of the completion tokens keep their gradient.
    entropies = ours._engine(ours.model).score(
        mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], mb["completion_mask"]
    )[1]
    kept = ours.get_high_entropy_mask(entropies, mb["completion_mask"], 1 - settings["top_entropy_quantile"])
    assert 0 < kept.sum() < mb["completion_mask"].sum()
