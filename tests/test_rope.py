"""Every RoPE type of transformers gives stock's log-probs, loss and gradients, prompts beyond the window included.

`dynamic` and `longrope` recompute their frequencies from the positions of each forward call; the engine pins them
to those of stock's one forward over the padded P + C positions (`trl_longstraw.rope`), and shared-prompt generation
follows `transformers.generate`'s prompt forward and per-step growth.
"""

from __future__ import annotations

import pytest
import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tests.grpo_pair import make_pair
from tests.helpers import assert_grads_close, make_trainer, run_steps
from tests.tolerances import LOSS_ATOL
from trl_longstraw.rope import RotaryPin, updates_per_call
from trl_longstraw.testing import build_tokenizer, random_micro_batch, save_tiny_model, tiny_rope

VOCAB = len(build_tokenizer())
# Every type transformers offers: a new one in a later version is tested (and must pass) without editing this file.
ROPE_TYPES = ["default", *ROPE_INIT_FUNCTIONS]
WINDOW = 16
# Two steps: P + C = 36 then 31 positions, both beyond the window (and beyond LongRoPE's original window). Dynamic
# NTK keeps the frequencies of the longest call so far, so the second step rotates with those of 36 in stock too.
LONG = dict(prompt_lengths=[27, 19, 3], completion_lengths=[9, 1, 5, 3, 4], group_of_row=[0, 1, 0, 2, 1])
SHORT = dict(prompt_lengths=[22, 5], completion_lengths=[6, 2, 9], group_of_row=[1, 0, 1], completion_width=9)
PER_CALL = ("dynamic", "longrope")
CASES = [("llama", t) for t in ROPE_TYPES] + [(f, t) for f in ("qwen3_5", "glm_moe_dsa") for t in PER_CALL]


def rotary(trainer):
    return trainer.model.model.rotary_emb


def rope_model(tmp_path, family: str, rope_type: str):
    return save_tiny_model(tmp_path / f"{family}-{rope_type}", family, **tiny_rope(family, rope_type, WINDOW))


@pytest.mark.parametrize("family,rope_type", CASES)
def test_exact_matches_stock_for_every_rope_type(tmp_path, family, rope_type):
    from trl import GRPOTrainer

    path = rope_model(tmp_path, family, rope_type)
    settings = dict(loss_type="dapo", beta=0.0)
    stock = make_trainer(path, GRPOTrainer, **settings)
    ours = make_trainer(path, prompt_gradient="exact", prefill_chunk_size=5, prefill_progress=False, **settings)
    for seed, shape in enumerate((LONG, SHORT)):
        mb = random_micro_batch(**shape, vocab_size=VOCAB, seed=seed)
        ref_losses, ref_grads = run_steps(stock, [mb])
        losses, grads = run_steps(ours, [mb])
        assert abs(losses[0] - ref_losses[0]) <= LOSS_ATOL
        assert_grads_close(grads, ref_grads)
        # The module's state evolves as in stock: the next call starts from the same frequencies.
        assert torch.equal(rotary(ours).inv_freq, rotary(stock).inv_freq)
        assert int(rotary(ours).max_seq_len_cached) == int(rotary(stock).max_seq_len_cached)
    if updates_per_call(rope_type):
        # The case is meaningful: stock's frequencies are no longer those the model was built with.
        assert not torch.equal(rotary(stock).inv_freq, rotary(stock).original_inv_freq)


def test_dynamic_rope_beyond_the_window_in_detached_mode_scores_as_stock(tmp_path):
    """The values (log-probs) that detached mode trains on are stock's too: pinning does not depend on the mode."""
    from trl import GRPOTrainer

    path = rope_model(tmp_path, "llama", "dynamic")
    stock = make_trainer(path, GRPOTrainer, beta=0.0)
    ours = make_trainer(path, prompt_gradient="detached", prefill_chunk_size=4, prefill_progress=False, beta=0.0)
    mb = random_micro_batch(**LONG, vocab_size=VOCAB, seed=3)
    ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], dim=1)
    mask = torch.cat([mb["prompt_mask"], mb["completion_mask"]], dim=1)
    k = mb["completion_ids"].shape[1]
    with torch.no_grad():
        ref, _, _ = stock._get_per_token_logps_and_entropies(stock.model, ids, mask, k)
        got, _, _ = ours._get_per_token_logps_and_entropies(ours.model, ids, mask, k)
    scored = mb["completion_mask"].bool()
    assert torch.allclose(got[scored], ref[scored], atol=1e-5, rtol=0)


def words(n: int, offset: int = 0) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return " ".join(letters[(offset + i) % 26] for i in range(n))


def last_logits(trainer, ids, num_generations):
    """Completions of `_generate_single_turn` and the next-token logits `[rows, V]` of each `lm_head` call."""
    calls = []
    head = trainer.model.lm_head
    handle = head.register_forward_hook(lambda module, args, out: calls.append(out[:, -1].detach().clone()))
    try:
        completions, _ = trainer._generate_single_turn(ids, None, {}, num_generations)
    finally:
        handle.remove()
    return completions, calls


@pytest.mark.parametrize("rope_type", PER_CALL)
@pytest.mark.parametrize(
    "lengths",
    [
        [20, 9, 14],  # the longest prompt is beyond the window: its forward already rescales
        [12, 5, 9],  # within the window: decoding crosses it, and stock grows the frequencies step by step
    ],
)
def test_generation_follows_stock_generate(tmp_path, rope_type, lengths):
    """Step by step, each row's next-token logits equal those of stock's one batched `generate`: the prompt rotates
    with the frequencies of the batch's longest prompt, step k with those of k more positions, and every distinct
    prompt starts from the module state stock's call started from."""
    path = rope_model(tmp_path, "llama", rope_type)
    prompts = [words(n, offset=3 * i) for i, n in enumerate(lengths)]
    stock, ours = make_pair(path, prompts=prompts, generation_kwargs={"do_sample": False}, max_completion_length=9)
    group = 2
    ids = [stock.processing_class(text=p)["input_ids"] for p in prompts for _ in range(group)]
    expected, stock_logits = last_logits(stock, ids, group)
    got, our_logits = last_logits(ours, ids, group)
    assert got == expected
    assert max(len(ids[0]) + len(c) for c in expected) > WINDOW, "decoding must reach beyond the window"
    # Ours decodes prompt after prompt: its calls are the steps of the first prompt's rows, then the second's, ...
    for p in range(len(prompts)):
        steps = max(len(expected[r]) for r in range(p * group, (p + 1) * group))
        for step in range(steps):
            mine = our_logits.pop(0)
            torch.testing.assert_close(mine, stock_logits[step][p * group : (p + 1) * group], atol=1e-5, rtol=0)
    assert not our_logits
    # The module is left as stock's generate leaves it (the loss pass that follows starts from it).
    assert torch.equal(rotary(ours).inv_freq, rotary(stock).inv_freq)
    assert int(rotary(ours).max_seq_len_cached) == int(rotary(stock).max_seq_len_cached)


def test_pin_holds_the_outer_frequencies_and_ignores_static_types(tmp_path):
    from transformers import AutoModelForCausalLM

    static = AutoModelForCausalLM.from_pretrained(rope_model(tmp_path, "llama", "yarn"))
    assert RotaryPin(static).modules == []
    model = AutoModelForCausalLM.from_pretrained(rope_model(tmp_path, "llama", "dynamic"))
    pin = RotaryPin(model)
    (module,) = pin.modules
    before = pin.snapshot()
    with pin.pinned(40):
        at_40 = module.inv_freq.clone()
        with pin.pinned(64):
            assert torch.equal(module.inv_freq, at_40)
        model(torch.randint(3, VOCAB, (1, 5)))  # a short call inside the pin does not reset the frequencies
        assert torch.equal(module.inv_freq, at_40)
    assert module.rope_type == "dynamic"
    assert not torch.equal(at_40, before[0]["inv_freq"])
    pin.restore(before)
    assert torch.equal(module.inv_freq, before[0]["inv_freq"])


def test_per_layer_type_rope_with_a_per_call_type_is_refused():
    """Per-layer-type RoPE (a dict of types, as Gemma 3's) is not pinned; none of the supported models has it."""
    from trl_longstraw.rope import rotary_modules

    rotary = torch.nn.Module()
    rotary.rope_type = {"full_attention": "dynamic", "sliding_attention": "default"}
    model = torch.nn.ModuleDict({"rotary_emb": rotary})
    with pytest.raises(ValueError, match=r"rotary_emb uses per-layer-type RoPE with \['dynamic'\].*static rope_type"):
        rotary_modules(model)
    rotary.rope_type = {"full_attention": "yarn", "sliding_attention": "default"}
    assert rotary_modules(model) == []
