"""TRL's chunked fused LM head (`trl.kernels.ChunkedLogProbFunction`), as the engine uses it, against a plain
full-logits `log_softmax` reference: per-token log-probs, entropies and every gradient, with a vocabulary larger than
(and not a multiple of) the vocabulary chunk, and more tokens than the token chunk."""

import pytest
import torch
import trl.kernels.chunked_logprob as chunked_logprob
import trl.trainer.utils as trl_utils
from tolerances import GRAD_RTOL, LOGP_ATOL
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM
from trl.kernels import ChunkedLogProbFunction
from trl.trainer.utils import add_fused_lm_head

from trl_longstraw.engine import Engine
from trl_longstraw.kv import KVCacheAdapter
from trl_longstraw.testing import random_micro_batch, tiny_config

VOCAB = 301
VOCAB_CHUNK = 64  # 301 = 4 * 64 + 45: five tiles, the last one ragged
TOKEN_CHUNK = 5
TEMPERATURE = 0.7


@pytest.fixture
def small_tiles(monkeypatch):
    """Shrinks both tile sizes so that tiny inputs span several tiles in both directions."""
    monkeypatch.setattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", VOCAB_CHUNK)
    monkeypatch.setattr(chunked_logprob, "TOKEN_CHUNK_SIZE", TOKEN_CHUNK)


def reference_logps_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature: float):
    """Plain reference: `log_softmax(logits / T)` over the whole vocabulary `[..., V]`; returns logps and entropy."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, labels[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("bias", [False, True])
def test_function_matches_log_softmax(bias):
    g = torch.Generator().manual_seed(0)
    n, h = 13, 16
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = torch.randn(VOCAB, h, generator=g, requires_grad=True)
    b = torch.randn(VOCAB, generator=g, requires_grad=True) if bias else None
    targets = torch.randint(0, VOCAB, (n,), generator=g)
    # Targets in the first, a middle and the ragged last tile.
    targets[:3] = torch.tensor([0, 130, VOCAB - 1])
    g_logp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    leaves = [hidden, weight] + ([b] if bias else [])

    old = chunked_logprob.TOKEN_CHUNK_SIZE
    chunked_logprob.TOKEN_CHUNK_SIZE = TOKEN_CHUNK
    try:
        logp, ent, *_ = ChunkedLogProbFunction.apply(
            hidden, weight, b, targets, TEMPERATURE, VOCAB_CHUNK, None, 1.0, ("entropy",)
        )
        grads = torch.autograd.grad((logp * g_logp).sum() + (ent * g_ent).sum(), leaves)
    finally:
        chunked_logprob.TOKEN_CHUNK_SIZE = old

    logits = hidden @ weight.T + (b if bias else 0)
    ref_logp, ref_ent = reference_logps_entropy(logits, targets, TEMPERATURE)
    ref_grads = torch.autograd.grad((ref_logp * g_logp).sum() + (ref_ent * g_ent).sum(), leaves)
    assert (logp - ref_logp).abs().max() <= LOGP_ATOL
    assert (ent - ref_ent).abs().max() <= LOGP_ATOL
    for grad, ref in zip(grads, ref_grads, strict=True):
        assert rel_err(grad, ref) <= GRAD_RTOL


def tiny_llama(vocab: int = VOCAB):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        tiny_config("llama", vocab_size=vocab, attn_implementation="eager"), dtype=torch.float32
    )
    # As GRPOTrainer patches the policy.
    add_fused_lm_head(model, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    return model


def test_branch_forward_matches_full_logits(small_tiles):
    """The engine's branch call, `model(ids, position_ids, shift_labels, fused_lm_head=True)`, on a plain model."""
    model = tiny_llama()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (1, 12), generator=g)
    labels = torch.randint(3, VOCAB, (1, 12), generator=g)
    positions = torch.arange(7, 19)[None]
    w_logp, w_ent = torch.randn(1, 12, generator=g), torch.randn(1, 12, generator=g)

    out = model(input_ids=ids, position_ids=positions, shift_labels=labels, fused_lm_head=True)
    assert out.log_probs.shape == out.entropy.shape == (1, 12)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad((out.log_probs * w_logp).sum() + (out.entropy * w_ent).sum(), params)

    logits = model(input_ids=ids, position_ids=positions).logits
    ref_logp, ref_ent = reference_logps_entropy(logits, labels, TEMPERATURE)
    ref_grads = torch.autograd.grad((ref_logp * w_logp).sum() + (ref_ent * w_ent).sum(), params)
    assert (out.log_probs - ref_logp).abs().max() <= LOGP_ATOL
    assert (out.entropy - ref_ent).abs().max() <= LOGP_ATOL
    for (name, _), grad, ref in zip(model.named_parameters(), grads, ref_grads, strict=True):
        assert rel_err(grad, ref) <= GRAD_RTOL, name


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "detached"])
def test_engine_score_and_backward_match_full_logits(small_tiles, exact):
    """`Engine.score` and `Engine.backward` (chunked prompt, fused head) against one padded full-sequence forward with
    full logits. Detached mode is compared with a reference that stops the gradient at the prompt's keys/values."""
    model = tiny_llama()
    # Two prompts (left-padded, odd lengths), ragged completions including length 1.
    mb = random_micro_batch([11, 6], [7, 1, 4, 5], [0, 1, 0, 1], VOCAB, seed=2)
    g = torch.Generator().manual_seed(3)
    mask = mb["completion_mask"].float()
    w_logp, w_ent = torch.randn(mask.shape, generator=g) * mask, torch.randn(mask.shape, generator=g) * mask
    engine = Engine(model, model, KVCacheAdapter(model), chunk_size=4)
    prompt, completion = (mb["prompt_ids"], mb["prompt_mask"]), (mb["completion_ids"], mb["completion_mask"])

    with torch.no_grad():
        logps, entropies = engine.score(*prompt, *completion)
    model.zero_grad()
    engine.backward(*prompt, *completion, w_logp, w_ent, exact=exact, backward_fn=torch.Tensor.backward)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], 1)
    attention_mask = torch.cat([mb["prompt_mask"], mb["completion_mask"]], 1)
    c = mb["completion_ids"].shape[1]
    if exact:
        logits = model(input_ids=ids, attention_mask=attention_mask).logits
    else:
        logits = detached_prompt_forward(model, ids, attention_mask, mb["prompt_ids"].shape[1] - 1)
    ref_logp, ref_ent = reference_logps_entropy(logits[:, -c - 1 : -1], mb["completion_ids"], TEMPERATURE)
    ref_logp, ref_ent = ref_logp * mask, ref_ent * mask
    ((ref_logp * w_logp).sum() + (ref_ent * w_ent).sum()).backward()

    assert (logps - ref_logp).abs().max() <= LOGP_ATOL
    assert (entropies - ref_ent).abs().max() <= LOGP_ATOL
    for name, p in model.named_parameters():
        assert p.grad.norm() > 0, name
        assert rel_err(grads[name], p.grad) <= GRAD_RTOL, name


def detached_prompt_forward(model, ids, attention_mask, n_prompt):
    """Full-sequence logits where the keys and values of the first `n_prompt` positions carry no gradient."""
    from transformers.models.llama import modeling_llama

    original = modeling_llama.eager_attention_forward

    def stop_prompt_grad(module, query, key, value, *args, **kwargs):
        key = torch.cat([key[:, :, :n_prompt].detach(), key[:, :, n_prompt:]], 2)
        value = torch.cat([value[:, :, :n_prompt].detach(), value[:, :, n_prompt:]], 2)
        return original(module, query, key, value, *args, **kwargs)

    modeling_llama.eager_attention_forward = stop_prompt_grad
    try:
        return model(input_ids=ids, attention_mask=attention_mask).logits
    finally:
        modeling_llama.eager_attention_forward = original


class _Shapes(TorchDispatchMode):
    """Records the shape of every tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(x, torch.Tensor):
                self.shapes.append(tuple(x.shape))
        return out


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain-would-fail"])
def test_branch_never_holds_full_vocab_rows(small_tiles, fused):
    """No op of a branch forward+backward returns a tensor with a full-vocabulary last dim (`[.., C, V]` logits).

    The `plain` case runs the unfused head and must see such tensors, which shows the check can fail."""
    model = tiny_llama()
    ids = torch.randint(3, VOCAB, (1, 9))
    with _Shapes() as rec:
        if fused:
            out = model(input_ids=ids, shift_labels=ids, fused_lm_head=True)
            (out.log_probs.sum() + out.entropy.sum()).backward()
        else:
            model(input_ids=ids).logits.sum().backward()
    full_rows = [s for s in rec.shapes if len(s) >= 2 and s[-1] == VOCAB]
    assert bool(full_rows) != fused, full_rows
    if fused:
        tiles = [s for s in rec.shapes if len(s) == 2 and s[-1] <= VOCAB_CHUNK and s[0] <= TOKEN_CHUNK]
        assert tiles, "expected [token tile, vocab tile] buffers"
