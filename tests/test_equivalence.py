"""Exact mode equals stock GRPOTrainer; detached mode equals its plain reference.

Micro-batches have left-padded prompts of different odd lengths, groups on non-adjacent rows, partial groups,
a completion of length 1, ragged completions, and a prefill chunk size that divides no prompt.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.helpers import assert_grads_close, detached_reference, make_trainer, run_steps
from tests.tolerances import LOGP_ATOL, LOSS_ATOL
from trl_longstraw.testing import build_tokenizer, random_micro_batch

VOCAB = len(build_tokenizer())
# Prompts 0 and 1 are split over rows 0/2 and 1/4; row 3 is a partial group of its own (a 1-token prompt, no prefix).
PROMPTS = [13, 7, 1]
GROUP_OF_ROW = [0, 1, 0, 2, 1]
COMPLETIONS = [9, 1, 5, 3, 4]
CHUNK = 5


def micro_batch(seed: int = 1, beta: bool = True, old: bool = False, **extra) -> dict:
    mb = random_micro_batch(PROMPTS, COMPLETIONS, GROUP_OF_ROW, VOCAB, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    shape = mb["completion_ids"].shape
    if beta:
        mb["ref_per_token_logps"] = -torch.rand(shape, generator=g) * 5 - 1
    if old:
        # Close to the model's own log-probs (about -log V), so that ratios land on both sides of the clip range.
        mb["old_per_token_logps"] = -torch.log(torch.tensor(float(VOCAB))) + 0.3 * torch.randn(shape, generator=g)
    mb.update(extra)
    return mb


# (name, config overrides, micro-batch options). Every loss type, and every option of the loss.
CASES = [
    ("grpo", dict(loss_type="grpo", beta=0.0), dict(beta=False)),
    ("grpo-beta", dict(loss_type="grpo", beta=0.1), dict()),
    ("bnpo-beta-old", dict(loss_type="bnpo", beta=0.1), dict(old=True)),
    ("dr_grpo", dict(loss_type="dr_grpo", beta=0.0), dict(beta=False, old=True)),
    ("dapo-beta", dict(loss_type="dapo", beta=0.05), dict(old=True)),
    ("cispo", dict(loss_type="cispo", beta=0.0, epsilon_high=1.1), dict(beta=False, old=True)),
    ("sapo", dict(loss_type="sapo", beta=0.0), dict(beta=False, old=True)),
    ("luspo-seq", dict(loss_type="luspo", beta=0.0, importance_sampling_level="sequence"), dict(beta=False, old=True)),
    ("vespo", dict(loss_type="vespo", beta=0.0), dict(beta=False, old=True)),
    ("grpo-delta", dict(loss_type="grpo", beta=0.0, delta=1.05), dict(beta=False, old=True)),
    ("bnpo-seq-kl", dict(loss_type="bnpo", beta=0.1, importance_sampling_level="sequence"), dict(old=True)),
    ("dapo-opsm", dict(loss_type="dapo", beta=0.0, off_policy_mask_threshold=0.01), dict(beta=False, old=True)),
    ("dapo-bias-kl", dict(loss_type="dapo", beta=0.1, use_bias_correction_kl=True), dict(old=True)),
    ("grpo-entropy", dict(loss_type="grpo", beta=0.0, entropy_coef=0.3), dict(beta=False)),
    (
        "bnpo-adaptive-entropy",
        dict(loss_type="bnpo", beta=0.0, use_adaptive_entropy=True, entropy_coef=0.2, entropy_target=100.0),
        dict(beta=False),
    ),
    ("dapo-top-entropy", dict(loss_type="dapo", beta=0.0, top_entropy_quantile=0.5), dict(beta=False)),
]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("name,config,options", CASES, ids=[c[0] for c in CASES])
def test_exact_matches_stock(tiny_model_path, family, name, config, options):
    from trl import GRPOTrainer

    path = tiny_model_path(family)
    stock = make_trainer(path, GRPOTrainer, **config)
    ours = make_trainer(path, prompt_gradient="exact", prefill_chunk_size=CHUNK, prefill_progress=False, **config)
    mb = micro_batch(**options)
    ref_losses, ref_grads = run_steps(stock, [mb])
    losses, grads = run_steps(ours, [mb])
    assert abs(losses[0] - ref_losses[0]) <= LOSS_ATOL
    assert_grads_close(grads, ref_grads)
    # Metrics are logged once per micro-batch under stock's names, with stock's values.
    for key, values in stock._metrics["train"].items():
        if key == "step_time":
            continue
        assert ours._metrics["train"][key] == pytest.approx(values, abs=1e-5), key


def test_vllm_importance_sampling_ratio_matches_stock(tiny_model_path):
    """The vLLM truncated-importance-sampling ratio multiplies the per-token loss as in stock."""
    from trl import GRPOTrainer

    path = tiny_model_path("llama")
    stock = make_trainer(path, GRPOTrainer, loss_type="dapo", beta=0.0)
    ours = make_trainer(path, prefill_chunk_size=CHUNK, prefill_progress=False, loss_type="dapo", beta=0.0)
    for t in (stock, ours):
        # No vLLM here: only the loss reads these flags, so turn them on after construction.
        t.use_vllm, t.vllm_importance_sampling_correction = True, True
    g = torch.Generator().manual_seed(7)
    mb = micro_batch(beta=False, old=True)
    mb["importance_sampling_ratio"] = torch.rand(mb["completion_ids"].shape, generator=g) + 0.5
    ref_losses, ref_grads = run_steps(stock, [mb])
    losses, grads = run_steps(ours, [mb])
    assert abs(losses[0] - ref_losses[0]) <= LOSS_ATOL
    assert_grads_close(grads, ref_grads)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ckpt", "ckpt"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_exact_gradient_accumulation_and_checkpointing(tiny_model_path, family, checkpointing):
    """Two micro-batches accumulated into one optimizer step, with gradient checkpointing on and off."""
    from trl import GRPOTrainer

    path = tiny_model_path(family)
    config = dict(loss_type="bnpo", beta=0.1, gradient_checkpointing=checkpointing)
    stock = make_trainer(path, GRPOTrainer, **config)
    ours = make_trainer(path, prefill_chunk_size=CHUNK, prefill_progress=False, **config)
    if checkpointing:
        assert all(layer.gradient_checkpointing for layer in ours.model.model.layers)
    mbs = [micro_batch(seed=1), micro_batch(seed=2)]
    ref_losses, ref_grads = run_steps(stock, mbs)
    losses, grads = run_steps(ours, mbs)
    assert losses == pytest.approx(ref_losses, abs=LOSS_ATOL)
    assert_grads_close(grads, ref_grads)


def test_scoring_matches_stock_logps(tiny_model_path):
    """No-grad scoring (used for old and reference log-probs) equals stock's per-token log-probs and entropies."""
    from trl import GRPOTrainer

    path = tiny_model_path("llama")
    stock = make_trainer(path, GRPOTrainer)
    ours = make_trainer(path, prefill_chunk_size=CHUNK, prefill_progress=False)
    mb = micro_batch()
    ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], 1)
    mask = torch.cat([mb["prompt_mask"], mb["completion_mask"]], 1)
    k = mb["completion_ids"].shape[1]
    with torch.no_grad():
        ref_lp, ref_ent, _ = stock._get_per_token_logps_and_entropies(stock.model, ids, mask, k, compute_entropy=True)
        lp, ent, _ = ours._get_per_token_logps_and_entropies(ours.model, ids, mask, k, compute_entropy=True)
    torch.testing.assert_close(lp, ref_lp, atol=LOGP_ATOL, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=LOGP_ATOL, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_detached_matches_plain_reference(tiny_model_path, family):
    """Detached mode equals stock's loss on log-probs from a plain detached-prompt forward (fresh cache per branch)."""
    from trl import GRPOTrainer

    path = tiny_model_path(family)
    config = dict(loss_type="grpo", beta=0.1, entropy_coef=0.1)
    reference = detached_reference(path, **config)
    ours = make_trainer(path, prompt_gradient="detached", prefill_chunk_size=CHUNK, prefill_progress=False, **config)
    mb = micro_batch()
    ref_losses, ref_grads = run_steps(reference, [mb])
    losses, grads = run_steps(ours, [mb])
    assert abs(losses[0] - ref_losses[0]) <= LOSS_ATOL
    assert_grads_close(grads, ref_grads)
    # The detached gradient is really different from the exact one (the prompt path is missing).
    exact = make_trainer(path, GRPOTrainer, **config)
    _, exact_grads = run_steps(exact, [mb])
    name = "model.layers.0.self_attn.k_proj.weight"
    assert ((grads[name] - exact_grads[name]).norm() / exact_grads[name].norm()) > 1e-2


def test_branch_replay_does_not_write_the_prompt_state(tiny_model_path):
    """Replaying branches with autograd leaves the retained prompt state bit-identical (no in-place cache appends),
    and the backward pass reuses the state that the scoring pass of the same micro-batch left."""
    path = tiny_model_path("llama")
    ours = make_trainer(path, prefill_chunk_size=CHUNK, prefill_progress=False)
    engine = ours._engine(ours.model)
    mb = random_micro_batch([13], [9, 1, 4], [0, 0, 0], VOCAB, seed=3)
    batch = (mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], mb["completion_mask"])
    with torch.no_grad():
        engine.score(*batch, keep=True)
    (state,) = engine.held().values()
    before = [t.clone() for t in state.tensors()]
    assert len(before) == 2 * 2 * 3  # 2 layers x (k, v) x ceil(12 / 5) chunks
    seen = []
    engine.backward(
        *batch,
        torch.ones(mb["completion_ids"].shape),
        None,
        False,
        lambda loss: (seen.append(list(engine.held().values())), loss.backward()),
    )
    assert len(seen) == 3 and all(len(kept) == 1 and kept[0] is state for kept in seen)
    assert all(torch.equal(a, b) for a, b in zip(before, state.tensors(), strict=True))


def test_states_beyond_the_hold_budget_are_prefilled_again_with_one_warning(tiny_model_path, caplog):
    """With a hold budget too small for the other prompts' states, the backward pass prefills them again, gets the
    the same gradients as with every state held, and says so once."""
    path = tiny_model_path("llama")
    mb = random_micro_batch([13, 9, 11], [4, 2, 3, 5, 1, 2], [0, 1, 2, 0, 1, 2], VOCAB, seed=5)
    batch = (mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], mb["completion_mask"])
    results = []
    for budget in (None, 0):
        ours = make_trainer(path, prefill_chunk_size=CHUNK, prefill_progress=False)
        engine = ours._engine(ours.model)
        engine.hold_budget = budget
        engine.stats.reset()
        with torch.no_grad(), caplog.at_level("WARNING"):
            engine.score(*batch, keep=True, boundaries=True)
            assert len(engine.held()) == (3 if budget is None else 1)
        engine.backward(*batch, torch.ones(mb["completion_ids"].shape), None, True, torch.Tensor.backward)
        assert not engine.held()
        # Prompt positions prefilled: 12 + 8 + 10 once; with the last scored state held, the two others twice.
        assert engine.stats.prompt_positions == (30 if budget is None else 30 + 12 + 8)
        results.append({n: p.grad.clone() for n, p in ours.model.named_parameters() if p.grad is not None})
    assert caplog.text.count("do not all fit") == 1
    assert results[0].keys() == results[1].keys()
    assert all(torch.equal(results[0][n], results[1][n]) for n in results[0])


def test_prediction_step_evaluates(tiny_model_path):
    """Evaluation keeps working: prediction_step returns stock's loss without touching gradients."""
    from trl import GRPOTrainer

    path = tiny_model_path("llama")
    stock = make_trainer(path, GRPOTrainer, loss_type="bnpo", beta=0.1)
    ours = make_trainer(path, prefill_chunk_size=CHUNK, prefill_progress=False, loss_type="bnpo", beta=0.1)
    mb = micro_batch()
    for t in (stock, ours):
        t.model.eval()
    ref_loss, _, _ = stock.prediction_step(stock.model, dict(mb), prediction_loss_only=True)
    loss, _, _ = ours.prediction_step(ours.model, dict(mb), prediction_loss_only=True)
    assert abs(float(loss) - float(ref_loss)) <= LOSS_ATOL
    assert all(p.grad is None for p in ours.model.parameters())


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_reverse_pass_reuses_attention_in_checkpoint_recompute(tiny_model_path, family, monkeypatch):
    """Exact mode under gradient checkpointing: the reverse pass's recompute takes each attention layer's kept output
    instead of attending again; the loss and every gradient are bitwise those of recomputing it, with fewer fused
    attention forwards. `reverse_attention_reuse=False` turns it off for the reverse pass, with the same result. The
    loss pass's branches take theirs in their recompute in both modes."""
    from trl_longstraw import attention, engine

    path = tiny_model_path(family)
    ours = make_trainer(path, prefill_chunk_size=CHUNK, prefill_progress=False, gradient_checkpointing=True)
    calls = []
    forward = attention._kernel_forward
    monkeypatch.setattr(attention, "_kernel_forward", lambda *a: calls.append(1) or forward(*a))
    mb = micro_batch(seed=3)
    losses, grads = run_steps(ours, [mb])
    reused = len(calls)
    calls.clear()
    with monkeypatch.context() as m:
        m.setattr(engine.Pass, "attention_reuse", lambda self, layer_idx: None)
        ref_losses, ref_grads = run_steps(ours, [mb])
    assert 0 < reused < len(calls)
    assert losses == ref_losses
    assert grads.keys() == ref_grads.keys() and all(torch.equal(grads[n], ref_grads[n]) for n in grads)
    # reverse_attention_reuse=False: the reverse pass attends again in its recompute.
    recomputed = len(calls)
    calls.clear()
    ours.args.reverse_attention_reuse = False
    ours._engines.clear()
    try:
        off_losses, off_grads = run_steps(ours, [mb])
    finally:
        ours.args.reverse_attention_reuse = True
        ours._engines.clear()
    assert reused < len(calls) <= recomputed
    assert off_losses == losses and all(torch.equal(off_grads[n], grads[n]) for n in grads)
    # Detached mode: the loss pass's branches alone take their kept outputs in the recompute.
    detached = make_trainer(
        path, prompt_gradient="detached", prefill_chunk_size=CHUNK, prefill_progress=False, gradient_checkpointing=True
    )
    calls.clear()
    losses, grads = run_steps(detached, [mb])
    reused = len(calls)
    calls.clear()
    with monkeypatch.context() as m:
        m.setattr(engine.Pass, "attention_reuse", lambda self, layer_idx: None)
        ref_losses, ref_grads = run_steps(detached, [mb])
    assert 0 < reused < len(calls)
    assert losses == ref_losses and all(torch.equal(grads[n], ref_grads[n]) for n in grads)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_reverse_pass_without_checkpointing_matches(tiny_model_path, family):
    """Exact mode under gradient checkpointing with `reverse_checkpointing=False`: the reverse pass keeps each chunk's
    graph instead of recomputing its layers (fewer MLP forwards), and the loss and every gradient equal those of the
    checkpointed reverse pass."""
    path = tiny_model_path(family)
    results, calls = [], []  # calls: one entry per MLP forward, the run's `checkpointed`
    for checkpointed in (True, False):
        ours = make_trainer(
            path,
            prefill_chunk_size=CHUNK,
            prefill_progress=False,
            gradient_checkpointing=True,
            reverse_checkpointing=checkpointed,
        )
        before = len(calls)
        # Wrapped forwards, not forward hooks: gradient checkpointing's recompute runs no module hooks.
        for name, mlp in ours.model.named_modules():
            if name.endswith(".mlp"):
                mlp.forward = functools.partial(_counted, mlp.forward, calls, checkpointed)
        results.append(run_steps(ours, [micro_batch(seed=3)]))
        assert len(calls) > before
    (losses, grads), (ref_losses, ref_grads) = results[1], results[0]
    assert calls.count(False) < calls.count(True)
    assert losses == ref_losses
    assert grads.keys() == ref_grads.keys() and all(torch.equal(grads[n], ref_grads[n]) for n in grads)


def _counted(forward, calls: list, tag, *args, **kwargs):
    calls.append(tag)
    return forward(*args, **kwargs)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_reverse_pass_takes_prefill_attention(tiny_model_path, family, monkeypatch):
    """Exact mode with `prefill_attention_reuse=True`: the prefill keeps each attention layer's output and the
    reverse pass's forward takes it instead of attending again. With gradient checkpointing on (the reverse pass
    checkpointed or not) and off, the loss and every gradient are bitwise those of the default (attending again),
    with fewer fused attention forwards; the kept outputs are all consumed."""
    from trl_longstraw import attention
    from trl_longstraw.engine import Engine

    path = tiny_model_path(family)
    calls, left = [], []
    forward = attention._kernel_forward
    monkeypatch.setattr(attention, "_kernel_forward", lambda *a: calls.append(1) or forward(*a))
    reverse = Engine.reverse
    monkeypatch.setattr(
        Engine, "reverse", lambda self, g, state: (reverse(self, g, state), left.append(state.attention))[0]
    )
    mb = micro_batch(seed=3)
    for settings in (
        dict(gradient_checkpointing=True),
        dict(gradient_checkpointing=True, reverse_checkpointing=False),
        dict(gradient_checkpointing=False),
    ):
        results, counts = [], []
        for carry in (False, True):
            ours = make_trainer(path, prefill_chunk_size=CHUNK, prefill_progress=False, **settings)
            ours.args.prefill_attention_reuse = carry
            calls.clear()
            results.append(run_steps(ours, [mb]))
            counts.append(len(calls))
        assert left and not any(left)  # every kept output was taken or dropped by the reverse pass
        left.clear()
        (ref_losses, ref_grads), (losses, grads) = results
        assert counts[1] < counts[0], settings
        assert losses == ref_losses, settings
        assert grads.keys() == ref_grads.keys()
        assert all(torch.equal(grads[n], ref_grads[n]) for n in grads), settings
