"""Qwen3.5 / Qwen3.6 hybrid (transformers `qwen3_5`): Gated DeltaNet + gated attention.

The tiny model (`testing.QWEN3_5_TINY`) has DeltaNet layers before and after a gated-attention layer, grouped value
heads and partial mRoPE, and decays slow enough that the recurrent state carries over many tokens. Micro-batches
have left-padded prompts of different odd lengths (one of a single token: no prefix; one of two: a prefix shorter
than the conv window), ragged completions including one of length 1, and prefill chunks that divide no prompt.
"""

from __future__ import annotations

import types

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import LinearAttentionLayer
from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5GatedDeltaNet,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)
from trl.trainer.utils import add_fused_lm_head

from tests.helpers import assert_grads_close, detached_reference, make_trainer, rebind_recurrent_state, run_steps
from tests.tolerances import DELTA_RULE_ATOL, GRAD_RTOL, LOGP_ATOL, LOSS_ATOL
from trl_longstraw.adapters import get_adapter
from trl_longstraw.engine import Engine, Pass, PromptGroup, PromptState, use_pass
from trl_longstraw.plan import preset_config
from trl_longstraw.qwen3_5 import (
    Qwen3_5Adapter,
    resume_gated_delta_rule,
    segment_gated_delta_rule,
    torch_gated_delta_rule,
)
from trl_longstraw.qwen3_5 import (
    torch_recurrent_gated_delta_rule as ours_recurrent,
)
from trl_longstraw.reference import plain_token_logps
from trl_longstraw.testing import build_tokenizer, random_micro_batch, tiny_config

VOCAB = len(build_tokenizer())
# Rows 0/2 and 1/4 share prompts; row 3 has a 1-token prompt (no prefix), row 5 a 2-token one (1-token prefix).
PROMPTS = [13, 7, 1, 2]
GROUP_OF_ROW = [0, 1, 0, 2, 1, 3]
COMPLETIONS = [9, 1, 5, 3, 4, 2]
CHUNK = 5


@pytest.fixture(scope="module")
def path(tiny_model_path):
    return tiny_model_path("qwen3_5")


def micro_batch(prompts=PROMPTS, seed: int = 1, beta: bool = True) -> dict:
    mb = random_micro_batch(prompts, COMPLETIONS, GROUP_OF_ROW, VOCAB, seed=seed)
    if beta:
        g = torch.Generator().manual_seed(seed + 100)
        mb["ref_per_token_logps"] = -torch.rand(mb["completion_ids"].shape, generator=g) * 5 - 1
    return mb


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error in norm; absolute below norm 1 (some gradients are exactly zero, e.g. that of the decay
    when the state is zero)."""
    return ((a - b).norm() / b.norm().clamp_min(1.0)).item()


def _grads(fn, inputs):
    out, state = fn(*inputs)
    g = torch.Generator().manual_seed(5)
    loss = (out * torch.randn(out.shape, generator=g)).sum() + (state * torch.randn(state.shape, generator=g)).sum()
    return out, state, torch.autograd.grad(loss, [x for x in inputs if x is not None and x.requires_grad])


def _delta_rule_inputs(length: int, initial: bool, seed: int = 0):
    """q, k `[1, T, 2, 8]`, v `[1, T, 6, 8]` (3 value heads per key head), g, beta `[1, T, 6]`, state `[1, 6, 8, 8]`"""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, length, 2, 8, generator=g) for _ in range(2))
    v = torch.randn(1, length, 6, 8, generator=g)
    decay = -torch.rand(1, length, 6, generator=g) * 0.3
    beta = torch.rand(1, length, 6, generator=g)
    state = torch.randn(1, 6, 8, 8, generator=g) if initial else None
    return [x if x is None else x.requires_grad_() for x in (q, k, v, decay, beta, state)]


def _stock(q, k, v, g, beta, state, recurrent=False):
    fn = torch_recurrent_gated_delta_rule if recurrent else torch_chunk_gated_delta_rule
    return fn(q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)


@pytest.mark.parametrize("length", [1, 63, 150])
@pytest.mark.parametrize("initial", [False, True], ids=["zero-state", "initial-state"])
def test_delta_rule_matches_stock(length, initial):
    """Outputs, final state and every input gradient (initial state included) equal stock's chunked and per-token
    delta rules."""
    inputs = _delta_rule_inputs(length, initial)
    out, state, grads = _grads(torch_gated_delta_rule, inputs)
    for recurrent in (False, True):
        ref_out, ref_state, ref_grads = _grads(lambda *x, r=recurrent: _stock(*x, recurrent=r), inputs)
        torch.testing.assert_close(out, ref_out, atol=DELTA_RULE_ATOL, rtol=0)
        torch.testing.assert_close(state, ref_state, atol=DELTA_RULE_ATOL, rtol=0)
        for g, ref in zip(grads, ref_grads, strict=True):
            assert _rel(g, ref) <= GRAD_RTOL


@pytest.mark.parametrize("initial", [False, True], ids=["zero-state", "initial-state"])
def test_recurrent_delta_rule_matches_stock(initial):
    """The per-token rule that decoding runs: stock's per-token rule (which transformers decodes with) and our
    chunked rule, on outputs and final state; rows broadcast from one initial state, which it never writes."""
    inputs = [x if x is None else x.detach() for x in _delta_rule_inputs(7, initial, seed=2)]
    out, state = ours_recurrent(*inputs)
    for recurrent in (False, True):
        ref_out, ref_state = _stock(*inputs, recurrent=recurrent)
        torch.testing.assert_close(out, ref_out, atol=DELTA_RULE_ATOL, rtol=0)
        torch.testing.assert_close(state, ref_state, atol=DELTA_RULE_ATOL, rtol=0)
    # Three rows decoding one token each from a shared batch-1 state, as the G rows of one prompt do.
    q, k, v, g, beta, initial_state = inputs
    signs = torch.tensor([1.0, 0.5, -1.0]).view(3, 1, 1, 1)
    rows = [x[:, :1].expand(3, -1, -1, -1) * signs for x in (q, k, v)]
    shared = None if initial_state is None else initial_state.expand(3, -1, -1, -1)
    before = None if initial_state is None else initial_state.clone()
    out, state = ours_recurrent(*rows, g[:, :1].expand(3, -1, -1), beta[:, :1].expand(3, -1, -1), shared)
    for row in range(3):
        one = [x[row : row + 1] for x in rows] + [g[:, :1], beta[:, :1], initial_state]
        ref_out, ref_state = _stock(*one, recurrent=True)
        torch.testing.assert_close(out[row : row + 1], ref_out, atol=DELTA_RULE_ATOL, rtol=0)
        torch.testing.assert_close(state[row : row + 1], ref_state, atol=DELTA_RULE_ATOL, rtol=0)
    assert before is None or torch.equal(initial_state, before)


def test_delta_rule_carries_state_across_splits():
    """Running a sequence in pieces that divide no block, each starting from the last final state, equals one run,
    gradients included (they flow back through every intermediate state)."""
    inputs = _delta_rule_inputs(150, initial=True, seed=1)
    out, state, grads = _grads(torch_gated_delta_rule, inputs)

    def pieces(q, k, v, g, beta, s):
        outs = []
        for a, b in zip([0, 1, 4, 70, 135], [1, 4, 70, 135, 150], strict=True):
            o, s = torch_gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], s)
            outs.append(o)
        return torch.cat(outs, 1), s

    split_out, split_state, split_grads = _grads(pieces, inputs)
    torch.testing.assert_close(split_out, out, atol=DELTA_RULE_ATOL, rtol=0)
    torch.testing.assert_close(split_state, state, atol=DELTA_RULE_ATOL, rtol=0)
    for g, ref in zip(split_grads, grads, strict=True):
        assert _rel(g, ref) <= GRAD_RTOL


@pytest.mark.parametrize("initial", [False, True], ids=["zero-state", "initial-state"])
def test_segment_delta_rule_resumes_from_any_state(initial):
    """The context-parallel delta rule (`segment_gated_delta_rule`, `resume_gated_delta_rule`, as the later ranks of a
    round run it): segments that divide no block (of 1, 2, 63, 70 and 14 tokens), each run from a zero state with its
    transition, then resumed one after the other from the state before it (`final + transition @ start`) equal the
    plain rule over the whole sequence: outputs, final state, and every input gradient (initial state included);
    without queries, the same final state and transition."""
    inputs = _delta_rule_inputs(150, initial, seed=3)
    out, state, grads = _grads(torch_gated_delta_rule, inputs)

    def segments(q, k, v, g, beta, s):
        outs = []
        if s is None:
            s = torch.zeros(1, 6, 8, 8)
        for a, b in zip([0, 1, 3, 66, 136], [1, 3, 66, 136, 150], strict=True):
            o, carry, final, transition = segment_gated_delta_rule(
                q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b]
            )
            assert carry.shape == (1, b - a, 6, 8) and transition.shape == (1, 6, 8, 8)
            # Without queries (the last layer of a prompt pass): the same final state and transition, bit for bit.
            alone = segment_gated_delta_rule(None, k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b])
            assert alone[:2] == (None, None) and torch.equal(alone[2], final) and torch.equal(alone[3], transition)
            outs.append(resume_gated_delta_rule(o, carry, s))
            s = final + transition @ s
        return torch.cat(outs, 1), s

    seg_out, seg_state, seg_grads = _grads(segments, inputs)
    torch.testing.assert_close(seg_out, out, atol=DELTA_RULE_ATOL, rtol=0)
    torch.testing.assert_close(seg_state, state, atol=DELTA_RULE_ATOL, rtol=0)
    assert len(seg_grads) == len(grads)
    for g, ref in zip(seg_grads, grads, strict=True):
        assert _rel(g, ref) <= GRAD_RTOL


@pytest.mark.parametrize("length", [1, 63, 150, 1031])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delta_rule_without_autograd_bounds_its_block_terms(length, dtype, monkeypatch):
    """Without autograd (prefill, scoring) the within-block terms `[B, H, n, 64, 64]` are built for groups of blocks
    no larger than the layer's values `[B, H, T, Dv]`, instead of for all blocks at once; the output and final state
    are the same bits as the recording path's (which builds them at once for its linear backward)."""
    import trl_longstraw.qwen3_5 as qwen3_5

    inputs = [None if x is None else x.detach().to(dtype) for x in _delta_rule_inputs(length, initial=True)]
    inputs[-1] = inputs[-1].float()  # the recurrent state stays fp32
    groups = []
    block_terms = qwen3_5._block_terms

    def counted(query, *args):
        groups.append(query.shape[2])
        return block_terms(query, *args)

    monkeypatch.setattr(qwen3_5, "_block_terms", counted)
    with torch.no_grad():
        out, state = torch_gated_delta_rule(*inputs)
    blocks = -(-length // qwen3_5.DELTA_RULE_BLOCK)
    # Dv = 8: a group of n blocks of 64 x 64 terms is at most the size of the values when n <= blocks * 8 / 64.
    assert sum(groups) == blocks and max(groups) == max(1, blocks * 8 // qwen3_5.DELTA_RULE_BLOCK)
    groups.clear()
    recording = [x if x is None or i > 0 else x.clone().requires_grad_() for i, x in enumerate(inputs)]
    ref_out, ref_state = torch_gated_delta_rule(*recording)
    assert groups == [blocks]
    assert torch.equal(out, ref_out.detach()) and torch.equal(state, ref_state.detach())


def _per_block_nodes(fn, length: int) -> int:
    """Number of `select` and in-place slice-write nodes in the graph of `fn`'s output for a sequence of `length`."""
    out = fn(*_delta_rule_inputs(length, initial=True))[0]
    seen, stack, count = set(), [out.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += type(node).__name__ in ("SelectBackward0", "CopySlices")
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return count


def test_delta_rule_backward_has_no_per_block_full_size_buffers():
    """Structural check of the linear backward: the graph has no `select` of a full-length tensor and no in-place
    write into one per block (each allocates a full-length gradient buffer in backward, which makes stock's backward
    quadratic in the length; benchmarks/qwen3_5_delta_rule.py measures both)."""
    assert _per_block_nodes(torch_gated_delta_rule, 640) == _per_block_nodes(torch_gated_delta_rule, 128)
    # The check can fail: stock's graph grows with the number of blocks.
    assert _per_block_nodes(_stock, 640) > _per_block_nodes(_stock, 128)


# --------------------------------------------------------------------------------------------------- prefix + replay
@pytest.fixture(scope="module")
def fused_model(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    return model


# Chunks of one and two tokens are shorter than the conv window; 150 tokens span three delta-rule blocks.
REPLAY_CASES = [(PROMPTS, 1), (PROMPTS, 2), ([13, 7, 1, 150], 5), ([13, 7, 1, 150], 64), ([13, 7, 1, 150], 70)]
REPLAY_CASES += [([13, 7, 1, 150], 1000)]


@pytest.mark.parametrize("prompts,chunk", REPLAY_CASES, ids=[f"{max(p)}-chunk{c}" for p, c in REPLAY_CASES])
def test_replay_matches_full_forward(fused_model, prompts, chunk):
    """Prefix state + branch replay gives the per-token log-probs and entropies of stock's padded full forward."""
    mb = micro_batch(prompts=prompts)
    ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], 1)
    mask = torch.cat([mb["prompt_mask"], mb["completion_mask"]], 1)
    k = mb["completion_ids"].shape[1]
    with torch.no_grad():
        logits = fused_model(input_ids=ids, attention_mask=mask).logits[:, -k - 1 : -1]
    ref_lp, ref_ent = plain_token_logps(logits, mb["completion_ids"], 1.0)
    engine = Engine(fused_model, fused_model, get_adapter(fused_model), chunk_size=chunk)
    with torch.no_grad():
        lp, ent = engine.score(mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], mb["completion_mask"])
    scored = mb["completion_mask"].bool()
    torch.testing.assert_close(lp[scored], ref_lp[scored], atol=LOGP_ATOL, rtol=0)
    torch.testing.assert_close(ent[scored], ref_ent[scored], atol=LOGP_ATOL, rtol=0)


def test_replay_needs_the_recurrent_state(fused_model, monkeypatch):
    """Control for the test above: ignoring the DeltaNet records moves the log-probs far outside the tolerance."""
    mb = micro_batch()
    engine = Engine(fused_model, fused_model, get_adapter(fused_model), chunk_size=CHUNK)
    args = (mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], mb["completion_mask"])
    with torch.no_grad():
        lp, _ = engine.score(*args)
        deltanets = {m.layer_idx for m in fused_model.modules() if isinstance(m, Qwen3_5GatedDeltaNet)}
        read = Pass.read
        monkeypatch.setattr(Pass, "read", lambda self, layer: [] if layer in deltanets else read(self, layer))
        blind, _ = engine.score(*args)
    assert (lp - blind).abs().max() > 1e3 * LOGP_ATOL


def test_activate_restores_the_modules(fused_model):
    deltanet = next(m for m in fused_model.modules() if isinstance(m, Qwen3_5GatedDeltaNet))
    adapter = get_adapter(fused_model)
    assert isinstance(adapter, Qwen3_5Adapter)
    with adapter.activate():
        assert "forward" in deltanet.__dict__
        assert fused_model.config._attn_implementation == "longstraw"
    assert "forward" not in deltanet.__dict__
    assert fused_model.config._attn_implementation != "longstraw"


def test_accelerate_hooks_still_run(fused_model):
    """With an accelerate hook on a DeltaNet (as device_map dispatch adds), the hook still fires while the engine
    runs, the results stay right, and the hook is intact afterwards."""
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    class Counting(ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            Counting.calls += 1
            return args, kwargs

    deltanet = next(m for m in fused_model.modules() if isinstance(m, Qwen3_5GatedDeltaNet))
    mb = micro_batch()
    args = (mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], mb["completion_mask"])
    engine = Engine(fused_model, fused_model, get_adapter(fused_model), chunk_size=CHUNK)
    with torch.no_grad():
        ref, _ = engine.score(*args)
        add_hook_to_module(deltanet, Counting())
        try:
            hook_forward = deltanet.forward
            lp, _ = engine.score(*args)
            assert deltanet.forward is hook_forward
            assert deltanet._old_forward.__func__ is Qwen3_5GatedDeltaNet.forward
        finally:
            remove_hook_from_module(deltanet)
            # accelerate leaves the bound stock forward as an instance attribute; drop it for the other tests.
            del deltanet.forward
    # One call per prefill chunk (3 + 2 + 1, none for the 1-token prompt) and per branch (6 rows).
    assert Counting.calls == 6 + 6
    torch.testing.assert_close(lp, ref, atol=0, rtol=0)


def test_replay_does_not_write_the_prompt_state(fused_model):
    """Replaying branches with autograd against the state the scoring pass kept leaves every record bit-identical."""
    engine = Engine(fused_model, fused_model, get_adapter(fused_model), chunk_size=CHUNK)
    mb = random_micro_batch([13], [9, 1, 4], [0, 0, 0], VOCAB, seed=3)
    args = (mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], mb["completion_mask"])
    with torch.no_grad():
        engine.score(*args, keep=True)
    (state,) = engine.held().values()
    before = [t.clone() for t in state.tensors()]
    seen = []

    def backward(loss):
        seen.extend(engine.held().values())
        loss.backward()

    engine.backward(*args, torch.ones(mb["completion_ids"].shape), None, False, backward)
    assert len(seen) == 3 and all(kept is state for kept in seen)
    after = list(state.tensors())
    assert len(after) == 2 * 3 + 2 * 3  # attention: (k, v) x 3 chunks; 3 DeltaNets: (tail, state) of the last chunk
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_vision_language_class_is_rejected():
    from transformers import Qwen3_5ForConditionalGeneration

    text = tiny_config("qwen3_5", VOCAB).to_dict()
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32)
    vlm = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision))
    with pytest.raises(ValueError, match="Qwen3_5ForCausalLM.from_pretrained"):
        get_adapter(vlm)


def test_cache_is_rejected(fused_model):
    adapter = get_adapter(fused_model)
    state = Engine(fused_model, fused_model, adapter, chunk_size=4).prefill(
        PromptGroup(tokens=torch.arange(3, 12), pad=0, rows=[0])
    )
    with adapter.activate(), use_pass(Pass(state, visible=state.num_chunks)), torch.no_grad():
        with pytest.raises(ValueError, match="use_cache=False"):
            fused_model.base_model(input_ids=torch.tensor([[3, 4]]), use_cache=True)


# ------------------------------------------------------------------------------------------------------ accounting
def qwen3_6_27b_text_config() -> Qwen3_5TextConfig:
    """The text config of Qwen3.6-27B (no weights): the planner's preset, 64 layers, every 4th gated attention."""
    return preset_config("qwen3.6-27b")


def test_state_bytes_real_shape():
    config = qwen3_6_27b_text_config()
    assert config.layer_types.count("full_attention") == 16
    per_token, fixed = Qwen3_5Adapter.state_bytes(config)
    # 16 attention layers x (K + V) x 4 heads x 256 x bf16.
    assert per_token == 16 * 2 * 4 * 256 * 2 == 64 * 2**10
    # 48 DeltaNet layers x (conv tail: 3 positions x (2x16x128 + 48x128) channels in bf16, + fp32 state 48x128x128).
    assert fixed == 48 * (3 * 10240 * 2 + 48 * 128 * 128 * 4)
    # The "about 148 MiB" counts the 4-position conv window of the stock cache; the tail needs 3 (146.8 MiB).
    assert fixed / 2**20 == pytest.approx(148, rel=0.01)
    assert Qwen3_5Adapter.state_bytes(Qwen3_5Config(text_config=config.to_dict())) == (per_token, fixed)


def _retained_bytes(state) -> int:
    """Bytes of the distinct storages behind the records: what the state really keeps alive."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in state.tensors()}.values())


@pytest.mark.parametrize("boundaries", [False, True], ids=["detached", "exact"])
def test_retained_state_matches_accounting(fused_model, boundaries):
    """After a 22-token prefix in chunks of 5, the state holds the K/V of every token and one DeltaNet record per
    layer (detached) or one per chunk boundary (exact)."""
    engine = Engine(fused_model, fused_model, get_adapter(fused_model), chunk_size=5)
    state = engine.prefill(PromptGroup(tokens=torch.arange(3, 26), pad=2, rows=[0]), boundaries=boundaries)
    assert state.num_chunks == 5
    per_token, fixed = Qwen3_5Adapter.state_bytes(fused_model.config, dtype_bytes=4)
    assert _retained_bytes(state) == 22 * per_token + fixed * (5 if boundaries else 1)
    linear = [i for i, t in enumerate(fused_model.config.layer_types) if t == "linear_attention"]
    for layer in linear:
        kept = [r is not None for r in state.records[layer]]
        assert kept == ([True] * 5 if boundaries else [False] * 4 + [True])


def test_sharded_boundaries_need_constant_record_shapes():
    """A sharded exact-mode prefill drops a superseded record on the ranks that do not own its chunk, and refuses a
    recurrent record whose shapes or dtypes change between chunks: the reverse pass broadcasts a boundary into buffers
    shaped like the next one."""
    shard = types.SimpleNamespace(rank=1, owner=lambda chunk: chunk % 2)
    state = PromptState(boundaries=True)
    p = Pass(state, visible=0, append=True, shard=shard)
    tail, recurrent = torch.zeros(1, 40, 3), torch.zeros(1, 6, 8, 8)  # [1, C, kernel-1], [1, Hv, Dk, Dv]
    for _ in range(3):
        p.emit(0, (tail, recurrent), supersedes=True)
    assert [r is not None for r in state.records[0]] == [False, True, True] and state.recurrent == {0}
    with pytest.raises(ValueError, match="same ones in every chunk"):
        p.emit(0, (tail, recurrent.double()), supersedes=True)


# ---------------------------------------------------------------------------------------------------- vs GRPOTrainer
# Each loss type with checkpointing on and off, each with beta zero and positive.
EXACT_CASES = [
    ("dapo", 0.0, False),
    ("dapo", 0.05, True),
    ("grpo", 0.1, False),
    ("grpo", 0.0, True),
    ("bnpo", 0.1, True),
    ("bnpo", 0.0, False),
]


@pytest.mark.parametrize(
    "loss_type,beta,checkpointing", EXACT_CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in EXACT_CASES]
)
def test_exact_matches_stock(path, loss_type, beta, checkpointing):
    from trl import GRPOTrainer

    config = dict(loss_type=loss_type, beta=beta, gradient_checkpointing=checkpointing)
    stock = make_trainer(path, GRPOTrainer, **config)
    ours = make_trainer(path, prompt_gradient="exact", prefill_chunk_size=CHUNK, prefill_progress=False, **config)
    mb = micro_batch(beta=beta > 0)
    ref_losses, ref_grads = run_steps(stock, [mb])
    losses, grads = run_steps(ours, [mb])
    assert abs(losses[0] - ref_losses[0]) <= LOSS_ATOL
    assert_grads_close(grads, ref_grads)


def test_exact_matches_stock_long_prompts(path):
    """Prompts longer than the delta rule's 64-position blocks, cut into chunks that align with neither."""
    from trl import GRPOTrainer

    config = dict(loss_type="grpo", beta=0.1, gradient_checkpointing=True)
    stock = make_trainer(path, GRPOTrainer, **config)
    ours = make_trainer(path, prompt_gradient="exact", prefill_chunk_size=70, prefill_progress=False, **config)
    mb = micro_batch(prompts=[151, 67, 1, 2])
    ref_losses, ref_grads = run_steps(stock, [mb])
    losses, grads = run_steps(ours, [mb])
    assert abs(losses[0] - ref_losses[0]) <= LOSS_ATOL
    assert_grads_close(grads, ref_grads)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ckpt", "ckpt"])
def test_detached_matches_plain_reference(path, monkeypatch, checkpointing):
    """Detached mode equals stock's loss on log-probs from the stock model and cache: the prompt runs without
    autograd, each completion on a fresh deep copy of the cache. Every parameter gradient is compared."""
    from trl import GRPOTrainer

    monkeypatch.setattr(LinearAttentionLayer, "update_recurrent_state", rebind_recurrent_state)
    config = dict(loss_type="bnpo", beta=0.1)
    reference = detached_reference(path, **config)
    ours = make_trainer(
        path,
        prompt_gradient="detached",
        prefill_chunk_size=CHUNK,
        prefill_progress=False,
        gradient_checkpointing=checkpointing,
        **config,
    )
    mb = micro_batch()
    ref_losses, ref_grads = run_steps(reference, [mb])
    losses, grads = run_steps(ours, [mb])
    assert abs(losses[0] - ref_losses[0]) <= LOSS_ATOL
    assert_grads_close(grads, ref_grads)
    if not checkpointing:
        # The detached gradient really differs from the exact one: the first DeltaNet layer's projections get most
        # of their gradient through the prompt's recurrent state.
        exact = make_trainer(path, GRPOTrainer, **config)
        _, exact_grads = run_steps(exact, [mb])
        name = "model.layers.0.linear_attn.in_proj_qkv.weight"
        assert ((grads[name] - exact_grads[name]).norm() / exact_grads[name].norm()) > 1e-2
