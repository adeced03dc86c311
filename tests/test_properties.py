"""Property-based equivalence of the engine with plain references, over random micro-batch layouts.

Hypothesis draws the number of prompts and their lengths (including 1, i.e. no prefill at all), group sizes with
rows of one prompt scattered through the micro-batch, extra left padding of the prompts and right padding of the
completions, ragged completion lengths (including 0, a masked-out completion, and 1), and prefill chunk sizes that
may or may not divide the prompts. For each draw:

- `Engine.score` equals a plain padded full-sequence forward of the model, as `GRPOTrainer` runs it;
- exact-mode gradients of a per-token weighted loss equal those of that plain forward;
- detached-mode gradients equal a plain reference that prefills each prompt into a transformers KV cache without
  autograd and runs the completion on top of it.
"""

import functools

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM
from trl.trainer.utils import add_fused_lm_head

from tests.tolerances import GRAD_RTOL, LOGP_ATOL
from trl_longstraw.adapters import get_adapter
from trl_longstraw.engine import Engine
from trl_longstraw.testing import build_tokenizer, random_micro_batch, tiny_config

VOCAB = len(build_tokenizer())
# Small, so the module runs in about a minute on two cores; derandomized, so CI runs are reproducible.
PROPERTY_SETTINGS = settings(
    max_examples=15,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@functools.cache
def model():
    """One tiny fp32 llama (GQA, 2 layers) with TRL's fused LM head, shared by every example."""
    torch.manual_seed(0)
    causal_lm = AutoModelForCausalLM.from_config(
        tiny_config("llama", VOCAB), dtype=torch.float32, attn_implementation="eager"
    )
    add_fused_lm_head(causal_lm, outputs=("log_probs", "entropy"))
    return causal_lm


@st.composite
def layouts(draw):
    """A micro-batch as GRPO builds it, with per-token loss weights, and a chunk size."""
    prompt_lengths = draw(st.lists(st.integers(1, 11), min_size=1, max_size=3))
    group_sizes = draw(st.lists(st.integers(1, 3), min_size=len(prompt_lengths), max_size=len(prompt_lengths)))
    group_of_row = draw(st.permutations([g for g, size in enumerate(group_sizes) for _ in range(size)]))
    completion_lengths = draw(st.lists(st.integers(0, 6), min_size=len(group_of_row), max_size=len(group_of_row)))
    if not any(completion_lengths):
        completion_lengths[0] = 1  # at least one scored token, so that there is a gradient to compare
    width = max(completion_lengths) + draw(st.integers(0, 2))
    seed = draw(st.integers(0, 2**16))
    mb = random_micro_batch(prompt_lengths, completion_lengths, group_of_row, VOCAB, seed, completion_width=width)
    extra_pad = draw(st.integers(0, 3))
    rows = len(group_of_row)
    mb["prompt_ids"] = torch.cat([torch.zeros(rows, extra_pad, dtype=torch.long), mb["prompt_ids"]], dim=1)
    mb["prompt_mask"] = torch.cat([torch.zeros(rows, extra_pad, dtype=torch.long), mb["prompt_mask"]], dim=1)
    g = torch.Generator().manual_seed(seed + 1)
    mask = mb["completion_mask"]
    mb["grad_logps"] = torch.randn(mask.shape, generator=g) * mask
    mb["grad_entropies"] = torch.randn(mask.shape, generator=g) * mask
    return mb, draw(st.integers(1, 8))


def engine(chunk_size: int) -> Engine:
    causal_lm = model()
    return Engine(causal_lm, causal_lm, get_adapter(causal_lm), chunk_size=chunk_size)


def inputs(mb):
    return mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], mb["completion_mask"]


def plain_scores(mb) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies `[B, C]` of the completions from one padded full-sequence forward, with autograd."""
    prompt_ids, prompt_mask, completion_ids, completion_mask = inputs(mb)
    logits = model()(
        input_ids=torch.cat([prompt_ids, completion_ids], dim=1),
        attention_mask=torch.cat([prompt_mask, completion_mask], dim=1),
    ).logits
    logp = logits[:, prompt_ids.shape[1] - 1 : -1].float().log_softmax(-1)
    logps = logp.gather(-1, completion_ids[..., None])[..., 0]
    entropies = -(logp.exp() * logp).sum(-1)
    return logps * completion_mask, entropies * completion_mask


def detached_reference_backward(mb) -> None:
    """Per row: the prompt prefilled into a KV cache without autograd, then the completion on top, with autograd."""
    prompt_ids, prompt_mask, completion_ids, completion_mask = inputs(mb)
    width = prompt_ids.shape[1]
    for row in range(prompt_ids.shape[0]):
        n = int(completion_mask[row].sum())
        if n == 0:
            continue
        tokens = prompt_ids[row][prompt_mask[row].bool()]
        pad = width - tokens.shape[0]
        cache = None
        if tokens.shape[0] > 1:
            with torch.no_grad():
                cache = model()(
                    input_ids=tokens[None, :-1],
                    position_ids=torch.arange(pad, width - 1)[None],
                    use_cache=True,
                ).past_key_values
        branch = torch.cat([tokens[-1:], completion_ids[row, : n - 1]])
        logits = model()(
            input_ids=branch[None],
            position_ids=torch.arange(width - 1, width - 1 + n)[None],
            past_key_values=cache,
            use_cache=cache is not None,
        ).logits[0]
        logp = logits.float().log_softmax(-1)
        logps = logp.gather(-1, completion_ids[row, :n, None])[:, 0]
        entropies = -(logp.exp() * logp).sum(-1)
        ((logps * mb["grad_logps"][row, :n]).sum() + (entropies * mb["grad_entropies"][row, :n]).sum()).backward()


def parameter_grads() -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in model().named_parameters() if p.grad is not None}
    model().zero_grad(set_to_none=True)
    return grads


def assert_grads_close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Every parameter's gradient within GRAD_RTOL of the reference, relative to its norm; a gradient that is zero in
    the reference (q and k projections when every query sees a single key) relative to the whole gradient's norm."""
    assert got.keys() == expected.keys()
    overall = torch.stack([ref.norm() for ref in expected.values()]).norm()
    for name, ref in expected.items():
        scale = ref.norm() if ref.norm() > 0 else overall
        error = (got[name] - ref).norm() / scale
        assert error <= GRAD_RTOL, f"{name}: relative error {error:.2e}"


def engine_backward(mb, chunk_size: int, exact: bool) -> dict[str, torch.Tensor]:
    """The training step's order: a scoring pass that keeps the last prompt state, then the backward."""
    e = engine(chunk_size)
    with torch.no_grad():
        e.score(*inputs(mb), keep=True)
    e.backward(*inputs(mb), mb["grad_logps"], mb["grad_entropies"], exact=exact, backward_fn=torch.Tensor.backward)
    return parameter_grads()


@PROPERTY_SETTINGS
@given(layouts())
def test_score_equals_plain_forward(layout):
    mb, chunk_size = layout
    with torch.no_grad():
        logps, entropies = engine(chunk_size).score(*inputs(mb))
        ref_logps, ref_entropies = plain_scores(mb)
    torch.testing.assert_close(logps, ref_logps, atol=LOGP_ATOL, rtol=0)
    torch.testing.assert_close(entropies, ref_entropies, atol=LOGP_ATOL, rtol=0)


@PROPERTY_SETTINGS
@given(layouts())
def test_exact_gradients_equal_plain_forward(layout):
    mb, chunk_size = layout
    model().zero_grad(set_to_none=True)
    ref_logps, ref_entropies = plain_scores(mb)
    ((ref_logps * mb["grad_logps"]).sum() + (ref_entropies * mb["grad_entropies"]).sum()).backward()
    expected = parameter_grads()
    assert_grads_close(engine_backward(mb, chunk_size, exact=True), expected)


@PROPERTY_SETTINGS
@given(layouts())
def test_detached_gradients_equal_cache_reference(layout):
    mb, chunk_size = layout
    model().zero_grad(set_to_none=True)
    detached_reference_backward(mb)
    expected = parameter_grads()
    assert_grads_close(engine_backward(mb, chunk_size, exact=False), expected)
