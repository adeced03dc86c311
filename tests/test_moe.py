"""MoE models: the router auxiliary loss is refused (see docs/whole_step.md); with it off, generation and the
no-grad scoring of a qwen3_moe model go through the shared-prompt paths and equal stock's."""

import pytest
import torch
from grpo_pair import PROMPTS, make_pair
from tolerances import LOGP_ATOL

from trl_longstraw.testing import random_micro_batch, save_tiny_model

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1, mlp_only_layers=[])


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe", **MOE)


def test_router_aux_loss_is_refused_with_the_fix_named(moe_path):
    # qwen3_moe declares router_aux_loss_coef=0.001, so the auxiliary loss is on by default.
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.0"):
        make_pair(moe_path)


def test_moe_generation_and_scoring_match_stock(moe_path):
    stock, ours = make_pair(moe_path, router_aux_loss_coef=0.0, generation_kwargs={"do_sample": False})
    ids = [stock.processing_class(text=p)["input_ids"] for p in PROMPTS + PROMPTS[:2]]
    assert ours._generate_single_turn(ids, None, {}, 3)[0] == stock._generate_single_turn(ids, None, {}, 3)[0]
    mb = random_micro_batch([13, 7, 1], [9, 1, 5, 3, 4], [0, 1, 0, 2, 1], ours.model.config.vocab_size, seed=1)
    ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], 1)
    mask = torch.cat([mb["prompt_mask"], mb["completion_mask"]], 1)
    results = []
    for t in (stock, ours):
        with torch.no_grad():
            results.append(t._get_per_token_logps_and_entropies(t.ref_model, ids, mask, mb["completion_ids"].shape[1]))
    torch.testing.assert_close(results[1][0], results[0][0], atol=LOGP_ATOL, rtol=0)
