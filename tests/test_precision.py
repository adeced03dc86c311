"""Mixed precision as stock runs it: TRL's default `bf16=True` over fp32 weights loaded from a path, and bf16 weights.

- every engine forward (prefill, scoring, replays, reverse pass, shared-prompt decoding) runs under the autocast that
  accelerate wraps around stock's forward;
- the prompt state is stored in the autocast dtype (the DeltaNet recurrent state stays fp32), as the planner and the
  memory guard count it;
- our autograd Functions accumulate in fp32 whatever autocast is active, in their forward and their backward;
- end to end through `trainer.train()`: ours' error against stock fp32 is at most `BF16_ERROR_FACTOR` times stock's
  own bf16 error, for the per-token log-probs, the loss and the gradient (`tests/precision.py`).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import make_trainer
from tests.precision import PROMPTS, errors, run, three_runs
from tests.tolerances import BF16_ERROR_FACTOR, LOSS_ATOL
from trl_longstraw import guards
from trl_longstraw.adapters import ADAPTERS
from trl_longstraw.attention import prefix_merge_attention
from trl_longstraw.engine import PromptGroup
from trl_longstraw.glm_moe_dsa import sparse_latent_attention
from trl_longstraw.testing import build_tokenizer, save_tiny_model, tiny_config

FAMILIES = ["llama", "qwen3_5", "glm_moe_dsa"]
VOCAB = len(build_tokenizer())
GB = 10**9


def _autocast_seen(module: torch.nn.Module, calls: list) -> torch.utils.hooks.RemovableHandle:
    """Records, at each call of `module`, whether CPU autocast is on and its dtype."""
    return module.register_forward_pre_hook(
        lambda m, args: calls.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
    )


@pytest.mark.parametrize("precision", ["bf16", "fp32", "fp16"])
def test_engine_runs_under_the_autocast_of_stocks_forward(tiny_model_path, precision):
    """The backbone sees the same autocast when the engine prefills and scores as when accelerate's prepared forward
    (what stock calls) runs it. fp16 on CPU: accelerate turns mixed precision off there, and so does the engine."""
    trainer = make_trainer(tiny_model_path("llama"), bf16=precision == "bf16", fp16=precision == "fp16")
    model = trainer.accelerator.prepare_model(trainer.model)
    seen = {"stock": [], "engine": []}
    handle = _autocast_seen(model.model, seen["stock"])
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]))
    handle.remove()
    handle = _autocast_seen(model.model, seen["engine"])
    ids = torch.tensor([[9, 10, 11, 12, 13, 5, 6, 7]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        trainer._engine(model).score(ids[:, :5], mask[:, :5], ids[:, 5:], mask[:, 5:])
    handle.remove()
    # One prefill chunk (4 prompt tokens) and one branch.
    assert len(seen["engine"]) >= 2
    assert set(seen["engine"]) == set(seen["stock"])
    assert seen["stock"][0][0] == (precision == "bf16")
    if precision == "bf16":
        assert seen["stock"][0][1] == torch.bfloat16


def test_no_engine_autocast_under_fsdp2(tiny_model_path):
    """Under FSDP2 accelerate wraps no forward in autocast (its `MixedPrecisionPolicy` casts the gathered parameters
    instead), so the engine enters none either."""
    trainer = make_trainer(tiny_model_path("llama"), bf16=True)
    with trainer._autocast():
        assert torch.is_autocast_enabled("cpu")
    trainer.is_fsdp_enabled = True
    with trainer._autocast():
        assert not torch.is_autocast_enabled("cpu")


def _expected_dtypes(state, layer: int) -> list[torch.dtype]:
    """bf16 everywhere, except the recurrent state of a Gated DeltaNet record `(conv_tail, state)`, which is fp32."""
    record = next(r for r in state.records[layer] if r is not None)
    if layer in state.recurrent:
        return [torch.bfloat16, torch.float32]
    return [torch.bfloat16] * len(record)


@pytest.mark.parametrize("mode", ["exact", "detached"])
@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_state_is_stored_in_the_autocast_dtype_as_planned(tiny_model_path, family, mode):
    """fp32 weights, bf16=True: every record is bf16 (2 bytes, as the planner assumes) but the DeltaNet recurrent
    state, and the memory guard's estimate of the prompt state (`guards.runtime_budget`) is what the engine holds."""
    trainer = make_trainer(tiny_model_path(family), bf16=True, prompt_gradient=mode, prefill_chunk_size=4)
    model = trainer.model
    assert next(model.parameters()).dtype == torch.float32
    tokens = torch.randint(3, VOCAB, (14,))
    state = trainer._engine(model).prefill(PromptGroup(tokens=tokens, pad=0, rows=[0]), boundaries=mode == "exact")
    assert state.num_chunks == 4
    for layer, records in state.records.items():
        for record in records:
            if record is not None:
                assert [t.dtype for t in record] == _expected_dtypes(state, layer), (layer, record)
    budget = guards.runtime_budget(
        model, trainer.args, prompt_length=14, completion_length=9, gpus=1, fsdp=False, gpu_memory=80 * GB
    )
    assert budget.setup.compute_bytes == 2
    (planned,) = [item.nbytes for item in budget.items if item.name == "prompt state"]
    assert planned == state.nbytes()


def _attention_inputs(dtype):
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_()

    # 4 query heads over 2 key heads, 3 new tokens, prefix chunks of 5 and 2 keys.
    q, k, v = rand(1, 4, 3, 8), rand(1, 2, 3, 8), rand(1, 2, 3, 8)
    prefix = [(rand(1, 2, 5, 8), rand(1, 2, 5, 8)), (rand(1, 2, 2, 8), rand(1, 2, 2, 8))]
    return [q, k, v, *[x for kv in prefix for x in kv]], lambda xs: prefix_merge_attention(
        xs[0], xs[1], xs[2], [(xs[3], xs[4]), (xs[5], xs[6])], 0.35
    )


def _latent_inputs(dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 3, 10, generator=g).to(dtype).requires_grad_()  # [S, H, R + Dr]
    parts = [torch.randn(n, 10, generator=g).to(dtype).requires_grad_() for n in (7, 5)]
    sel = torch.tensor([[0, 3, 8, -1], [1, 2, 7, 11], [4, 5, 6, 9], [10, 11, -1, -1], [0, 1, 2, 3]])
    return [q, *parts], lambda xs: sparse_latent_attention(xs[0], list(xs[1:]), sel, 0.4, 6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["kernel", "portable", "latent"])
def test_autograd_functions_accumulate_in_fp32_under_autocast(monkeypatch, case, dtype):
    """Our attention Functions on half-precision inputs give the same outputs and gradients, bit for bit, with CPU
    autocast on around their forward and their backward (the autograd engine runs a backward under the autocast
    state of the thread calling it) as with it off: autocast would lower their fp32 einsums."""
    from trl_longstraw import attention

    monkeypatch.setattr(attention, "USE_KERNELS", case == "kernel")
    inputs, fn = (_latent_inputs if case == "latent" else _attention_inputs)(dtype)
    grad = torch.randn(fn(inputs).shape, generator=torch.Generator().manual_seed(1)).to(dtype)

    def run(autocast: bool):
        xs = [x.detach().clone().requires_grad_() for x in inputs]
        with torch.autocast("cpu", dtype=dtype, enabled=autocast):
            out = fn(xs)
            out.backward(grad)
        return [out.detach()] + [x.grad for x in xs]

    plain, autocast = run(False), run(True)
    for a, b in zip(plain, autocast, strict=True):
        assert a.dtype == dtype and torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_train_with_trls_default_bf16_from_an_fp32_path(tmp_path, family):
    """The issue's first must-show, with generation: `GRPOConfig`'s default `bf16=True`, `use_cpu=True`, fp32 weights
    from a path, prompts of several chunks left-padded: `train()` runs (it raised `expected scalar type Float but
    found BFloat16`) and its prompt state is bf16."""
    path = save_tiny_model(tmp_path / family, family)
    out = run(path, "ours", "exact", None)
    trainer = out["trainer"]
    assert trainer.args.bf16 and next(trainer.model.parameters()).dtype == torch.float32
    assert len({len(c) for c in out["completions"]}) > 1 and out["grads"]
    (logs,) = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert torch.isfinite(torch.tensor(logs["loss"]))
    # The step's largest prompt state is the longest prompt's, in bf16 records: the same prefill again gives it.
    longest = max(len(build_tokenizer()(p)["input_ids"]) for p in PROMPTS)
    state = trainer._engine(trainer.model).prefill(
        PromptGroup(tokens=torch.randint(3, VOCAB, (longest,)), pad=0, rows=[0]), boundaries=True
    )
    assert {t.dtype for t in state.tensors()} == (
        {torch.bfloat16, torch.float32} if family == "qwen3_5" else {torch.bfloat16}
    )
    assert logs["longstraw/state_gib"] * 2**30 == pytest.approx(state.nbytes(), rel=1e-6)


# Criterion cases: (model family, overrides of its tiny config, whether each parameter group is checked too).
# glm_moe_dsa keeps its DSA top-k (5 of up to 19 keys) and MoE routing (2 of 4 experts): bf16 rounding flips a few
# of these discrete choices, in stock as in ours, so a group's error is decided by which choices flip (measured over
# 4 seeds: ours/stock 0.6x to 3.7x per group, 0.6x to 1.5x on the whole gradient); its groups are checked on the
# same model with every key and every expert taken, where the errors are rounding alone.
GLM_DENSE = dict(index_topk=64, num_experts_per_tok=4)
CRITERION_CASES = [
    ("llama", {}, True),
    ("qwen3_5", {}, True),
    ("glm_moe_dsa", {}, False),
    ("glm_moe_dsa", GLM_DENSE, True),
]
BF16_WEIGHTS = dict(bf16=False, model_init_kwargs={"dtype": "bfloat16"})


def _assert_within_factor(runs: dict, groups: bool) -> dict:
    ours, stock = (errors(runs[name], runs["stock fp32"]) for name in ("ours bf16", "stock bf16"))
    factor = BF16_ERROR_FACTOR
    assert ours["logps"] <= factor * stock["logps"], (ours["logps"], stock["logps"])
    assert ours["loss"] <= factor * max(stock["loss"], LOSS_ATOL), (ours["loss"], stock["loss"])
    assert ours["grad"] <= factor * stock["grad"], (ours["grad"], stock["grad"])
    if groups:
        for group, err in ours["groups"].items():
            assert err <= factor * stock["groups"][group], (group, err, stock["groups"][group])
    # Not vacuous: the low-precision runs really are low precision.
    assert stock["logps"] > 1e-4 and stock["grad"] > 1e-3
    return ours


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["exact", "detached"])
@pytest.mark.parametrize("family,overrides,groups", CRITERION_CASES, ids=["llama", "qwen3_5", "glm", "glm-dense"])
def test_bf16_error_at_most_twice_stocks(monkeypatch, tmp_path, family, overrides, groups, mode):
    """TRL's default bf16 autocast over fp32 weights; detached mode against its plain reference. qwen3_5's delta rule
    runs its hand-written backward wherever autograd records (the replays, and exact mode's reverse pass); the prompt
    passes replace the last layer's attention output projection where it has one (`Engine._records_only`)."""
    from trl_longstraw import engine, qwen3_5

    calls, replaced = [], []
    apply = qwen3_5._DeltaRuleFunction.apply
    monkeypatch.setattr(qwen3_5._DeltaRuleFunction, "apply", lambda *args: calls.append(1) or apply(*args))
    forward_replaced = engine._forward_replaced
    monkeypatch.setattr(
        engine,
        "_forward_replaced",
        lambda module, forward: replaced.append(module) or forward_replaced(module, forward),
    )
    path = save_tiny_model(tmp_path / family, family, **overrides)
    runs = three_runs(path, mode)
    assert all(runs[name]["trainer"].args.bf16 for name in ("stock bf16", "ours bf16"))
    _assert_within_factor(runs, groups)
    assert bool(calls) == (family == "qwen3_5")
    # The tiny qwen3_5 ends with a Gated DeltaNet layer; the others with an attention layer.
    projections = {
        id(m.self_attn.o_proj)
        for run in runs.values()
        for m in run["trainer"].model.modules()
        if hasattr(m, "self_attn")
    }
    assert any(id(m) in projections for m in replaced) == (family != "qwen3_5")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_bf16_weights_error_at_most_twice_stocks(tmp_path, family):
    """Weights loaded in bf16 (`model_init_kwargs={"dtype": "bfloat16"}`, no autocast), exact mode."""
    path = save_tiny_model(tmp_path / family, family)
    runs = three_runs(path, "exact", low=BF16_WEIGHTS)
    assert all(p.dtype == torch.bfloat16 for p in runs["ours bf16"]["trainer"].model.parameters())
    _assert_within_factor(runs, groups=True)


# The families whose adapter decodes against a shared prompt state (the others generate with transformers' loop).
DECODING = [f for f in FAMILIES if hasattr(ADAPTERS[tiny_config(f, VOCAB).model_type], "decode_tail")]


@pytest.mark.parametrize("family", DECODING)
def test_shared_generation_under_stocks_autocast(tiny_model_path, family):
    """bf16=True: greedy shared-prompt decoding gives stock's completions under the autocast of its prepared forward,
    and the prompt state a generation prefills is, bit for bit, the one the loss pass prefills (same engine, same
    autocast), so the loss pass could take it over."""
    from grpo_pair import make_pair

    stock, ours = make_pair(
        tiny_model_path(family), generation_kwargs={"do_sample": False}, max_completion_length=6, bf16=True
    )
    ids = [stock.processing_class(text=p)["input_ids"] for p in PROMPTS for _ in range(2)]
    with stock.accelerator.autocast():  # what accelerate's prepared forward wraps each step of `generate` in
        expected, _ = stock._generate_single_turn(ids, None, {}, 2)
    engine = ours._engine(ours.model)
    states, prefill = [], engine.prefill
    engine.prefill = lambda *args, **kwargs: states.append(prefill(*args, **kwargs)) or states[-1]
    got, _ = ours._generate_single_turn(ids, None, {}, 2)
    assert got == expected
    longest = max(range(len(PROMPTS)), key=lambda i: len(ids[2 * i]))
    generated = states[longest]  # one prefill per distinct prompt, in order; the longest is not padded
    scored = prefill(PromptGroup(tokens=torch.tensor(ids[2 * longest]), pad=0, rows=[0]))
    pairs = list(zip(generated.tensors(), scored.tensors(), strict=True))
    assert pairs and all(a.dtype in (torch.bfloat16, torch.float32) and torch.equal(a, b) for a, b in pairs)
    assert any(a.dtype == torch.bfloat16 for a, _ in pairs)
