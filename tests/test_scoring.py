"""No-grad scoring: old-policy and reference log-probs through prompt-once scoring equal stock's."""

from dataclasses import replace

import pytest
import torch
from grpo_pair import generation_inputs, make_pair
from peft import LoraConfig
from tolerances import LOGP_ATOL
from trl.trainer.utils import use_adapter

from trl_longstraw.engine import Engine, group_prompts, pack_rows
from trl_longstraw.testing import random_micro_batch
from trl_longstraw.trainer import OLD_LOGPS_PENDING


def lora(**overrides) -> LoraConfig:
    # init_lora_weights=False: random A and B, so the adapters change the outputs from the first step.
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)


def scoring_batch(vocab_size: int):
    # Left-padded prompts of odd, different lengths (one of a single token), ragged completions of length 1 to 9,
    # one fully masked completion (mask_truncated_completions), rows of one prompt not adjacent.
    return random_micro_batch([13, 7, 1], [9, 1, 5, 0, 3, 4, 1], [0, 1, 0, 2, 1, 0, 2], vocab_size, seed=1)


def logps_of(trainer, model, mb, compute_entropy=True):
    ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], 1)
    mask = torch.cat([mb["prompt_mask"], mb["completion_mask"]], 1)
    with torch.no_grad():
        logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
            model, ids, mask, mb["completion_ids"].shape[1], batch_size=2, compute_entropy=compute_entropy
        )
    return logps, entropies


def assert_scores_close(ref, ours, mask):
    for a, b in zip(ref, ours, strict=True):
        if a is None:
            assert b is None
            continue
        assert (b[mask == 0] == 0).all()
        torch.testing.assert_close(b, a, atol=LOGP_ATOL, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5", "glm_moe_dsa"])
@pytest.mark.parametrize("chunk", [2, 16])
def test_policy_and_separate_reference_model_match_stock(tiny_model_path, family, chunk):
    # Chunks of 16 tokens: the prompts fit one chunk, and the short branches of a prompt are scored in batches of
    # up to 16 padded tokens where the adapter batches branches.
    stock, ours = make_pair(tiny_model_path(family), longstraw={"prefill_chunk_size": chunk})
    assert ours.ref_model is not None
    mb = scoring_batch(ours.model.config.vocab_size)
    for attr in ("model", "ref_model"):
        # The reference model's fused head computes no entropy (stock asks for none).
        entropy = attr == "model"
        ref = logps_of(stock, getattr(stock, attr), mb, entropy)
        got = logps_of(ours, getattr(ours, attr), mb, entropy)
        assert_scores_close(ref, got, mb["completion_mask"])


def test_peft_reference_with_adapters_disabled_matches_stock(tiny_model_path):
    stock, ours = make_pair(tiny_model_path("llama"), peft_config=lora())
    assert ours.ref_model is None
    mb = scoring_batch(ours.model.config.vocab_size)
    results = []
    for trainer in (stock, ours):
        policy = logps_of(trainer, trainer.model, mb)
        with use_adapter(trainer.accelerator.unwrap_model(trainer.model), adapter_name=None):
            reference = logps_of(trainer, trainer.model, mb)
        results.append((policy, reference))
    (stock_policy, stock_ref), (our_policy, our_ref) = results
    assert_scores_close(stock_policy, our_policy, mb["completion_mask"])
    assert_scores_close(stock_ref, our_ref, mb["completion_mask"])
    # The adapters matter, so the disabled-adapter pass really is a different model.
    assert (stock_policy[0] - stock_ref[0]).abs().max() > 100 * LOGP_ATOL


def test_reference_pass_prefills_each_prompt_once(tiny_model_path):
    _, ours = make_pair(tiny_model_path("llama"))
    mb = scoring_batch(ours.model.config.vocab_size)
    engine = ours._engine(ours.ref_model)
    engine.stats.reset()
    logps_of(ours, ours.ref_model, mb)
    prompt_lengths = [len(g.tokens) for g in group_prompts(mb["prompt_ids"], mb["prompt_mask"])]
    assert engine.stats.prompt_positions == sum(n - 1 for n in prompt_lengths)


@pytest.mark.parametrize("batch_tokens", [1, 10, 27, 1000])
def test_batched_scoring_matches_per_branch(tiny_model_path, batch_tokens):
    _, ours = make_pair(tiny_model_path("qwen3"))
    mb = scoring_batch(ours.model.config.vocab_size)
    engine: Engine = ours._engine(ours.model)
    args = (mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], mb["completion_mask"])
    with torch.no_grad():
        alone = engine.score(*args)
        batched = engine.score(*args, batch_tokens=batch_tokens)
    assert_scores_close(alone, batched, mb["completion_mask"])


def test_pack_rows_respects_the_token_budget():
    lengths = [9, 1, 5, 0, 3, 4, 1, 12]
    rows = [0, 1, 2, 4, 5, 6, 7]
    for budget in (1, 8, 10, 15, 100):
        batches = pack_rows(rows, lengths, budget)
        assert sorted(r for b in batches for r in b) == rows
        for batch in batches:
            assert len(batch) == 1 or len(batch) * max(lengths[r] for r in batch) <= budget
    assert pack_rows(rows, lengths, 100) == [[7, 0, 2, 5, 4, 1, 6]]
    assert pack_rows(rows, lengths, 10) == [[7], [0], [2, 5], [4, 1, 6]]


def test_kept_state_is_not_reused_by_other_scoring(tiny_model_path):
    """A state kept for the loss pass must not answer a later no-grad scoring with adapters disabled."""
    stock, ours = make_pair(tiny_model_path("llama"), peft_config=lora())
    mb = scoring_batch(ours.model.config.vocab_size)
    engine = ours._engine(ours.model)
    with torch.no_grad():
        engine.score(mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], mb["completion_mask"], keep=True)
    assert engine.held()
    with use_adapter(ours.accelerator.unwrap_model(ours.model), adapter_name=None):
        got = logps_of(ours, ours.model, mb)
    with use_adapter(stock.accelerator.unwrap_model(stock.model), adapter_name=None):
        ref = logps_of(stock, stock.model, mb)
    assert_scores_close(ref, got, mb["completion_mask"])


def test_offered_state_is_taken_only_with_the_same_weights_position_and_boundaries(tiny_model_path):
    """A state offered by generation (positions from 0) answers the loss pass's scoring of the unpadded prompt, with
    the loss pass's scores, while the weights are unchanged; not for a padded row, nor after an in-place update, nor
    without the chunk boundaries an exact pass needs (qwen3_5's recurrent layers)."""
    _, ours = make_pair(tiny_model_path("qwen3_5"), longstraw={"prefill_chunk_size": 4})
    engine = ours._engine(ours.model)
    mb = random_micro_batch([11, 6], [5, 3, 4], [0, 1, 0], ours.model.config.vocab_size, seed=2)
    batch = (mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], mb["completion_mask"])
    longest, shorter = group_prompts(mb["prompt_ids"], mb["prompt_mask"])
    assert longest.pad == 0 and shorter.pad > 0

    def score(**kwargs):
        engine.stats.reset()
        with torch.no_grad():
            out = engine.score(*batch, **kwargs)
        return out, engine.stats.prompt_positions

    (expected, _), positions = score()
    assert positions == 10 + 5
    # Generation prefills the shorter prompt from position 0, not at its left padding as the loss pass does.
    unpadded = replace(shorter, pad=0)
    for boundaries in (False, True):
        with torch.no_grad():
            engine.offer(longest, engine.prefill(longest, boundaries=boundaries))
            engine.offer(unpadded, engine.prefill(unpadded, boundaries=boundaries))
        (logps, _), positions = score(keep=True, boundaries=True)
        # The offer of the padded prompt's tokens at positions from 0 is not its state; boundaries are needed.
        assert positions == (5 if boundaries else 15)
        torch.testing.assert_close(logps, expected, atol=0, rtol=0)
        engine.release()
    with torch.no_grad():
        engine.offer(longest, engine.prefill(longest))
        next(ours.model.parameters()).add_(0)  # an in-place update, as an optimizer step makes
    assert score(keep=True)[1] == 15
    # Scoring without `reuse` (the reference model, the PEFT model with adapters disabled) never takes an offer.
    engine.release()
    with torch.no_grad():
        engine.offer(longest, engine.prefill(longest))
    assert score()[1] == 15 and engine.held()


# ------------------------------------------------------------------------------------------------ old log-probs
def old_logps_pair(path, **overrides):
    # gradient_accumulation_steps=1 with num_iterations=2: stock scores old-policy log-probs after generation.
    settings = dict(num_iterations=2, generation_kwargs={"do_sample": False}, per_device_train_batch_size=6)
    settings.update(overrides)
    stock, ours = make_pair(path, **settings)
    for t in (stock, ours):
        t.model.train()
    inputs = generation_inputs(["h i j k l m n", "x"], 3)
    return stock, ours, inputs


def test_old_logps_deferred_to_first_loss_pass_match_stock(tiny_model_path):
    stock, ours, inputs = old_logps_pair(tiny_model_path("llama"))
    expected = stock._generate_and_score_completions(inputs)
    batch = ours._generate_and_score_completions(inputs)
    assert "old_per_token_logps" not in batch and batch[OLD_LOGPS_PENDING].all()
    torch.testing.assert_close(batch["completion_ids"], expected["completion_ids"], rtol=0, atol=0)
    ours._prepare_inputs = lambda x: x
    ours.current_gradient_accumulation_steps = 1
    ours.training_step(ours.model, batch, batch["num_items_in_batch"])
    assert OLD_LOGPS_PENDING not in batch
    torch.testing.assert_close(batch["old_per_token_logps"], expected["old_per_token_logps"], atol=LOGP_ATOL, rtol=0)


def test_old_logps_left_pending_are_scored_before_the_optimizer_step(tiny_model_path):
    stock, ours, inputs = old_logps_pair(tiny_model_path("llama"))
    expected = stock._generate_and_score_completions(inputs)
    batch = ours._generate_and_score_completions(inputs)
    ours._buffered_inputs = [batch]
    ours.callback_handler.on_pre_optimizer_step(ours.args, ours.state, ours.control)
    assert OLD_LOGPS_PENDING not in batch
    torch.testing.assert_close(batch["old_per_token_logps"], expected["old_per_token_logps"], atol=LOGP_ATOL, rtol=0)


def test_old_logps_refused_after_a_weight_update(tiny_model_path):
    _, ours, inputs = old_logps_pair(tiny_model_path("llama"))
    batch = ours._generate_and_score_completions(inputs)
    ours._buffered_inputs = [batch]
    ours.state.global_step += 1
    with pytest.raises(RuntimeError, match="after an optimizer step"):
        ours._fill_pending_old_logps()


def test_old_logps_not_deferred_when_stock_skips_them(tiny_model_path):
    # num_iterations=1 and steps aligned: stock uses the current log-probs, so nothing is deferred.
    _, ours, inputs = old_logps_pair(tiny_model_path("llama"), num_iterations=1)
    batch = ours._generate_and_score_completions(inputs)
    assert OLD_LOGPS_PENDING not in batch and "old_per_token_logps" not in batch
