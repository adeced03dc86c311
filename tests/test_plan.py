"""Capacity planner: real-shape presets, state accounting, the budget, the largest-positions solve, the CLI."""

from __future__ import annotations

import contextlib
import functools
import io
import re
import shlex
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GlmMoeDsaConfig, LlamaConfig, Qwen3_5TextConfig

from tests.tolerances import PARAM_COUNT_RTOL, STATE_FIXED_RTOL
from trl_longstraw import plan
from trl_longstraw.plan import (
    ModelStats,
    Setup,
    estimate,
    largest_positions,
    meta_model,
    model_stats,
    parse_bytes,
    parse_count,
    preset_config,
    prompt_state_bytes,
    with_yarn,
)

KiB, MiB, GiB = 2**10, 2**20, 2**30
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def preset_stats():
    """`name -> (config, ModelStats)` of the real-shape presets, built once on the meta device."""
    out = {}
    for name in plan.PRESETS:
        config = preset_config(name)
        out[name] = (config, model_stats(meta_model(config), config))
    return out


def _item(budget, name):
    (item,) = [i for i in budget.items if i.name == name]
    return item.nbytes


# ------------------------------------------------------------------------------------------------------ presets
def test_preset_parameter_counts_match_published(preset_stats):
    qwen = preset_stats["qwen3.6-27b"][1]
    glm_config, glm = preset_stats["glm-5.2"]
    # Qwen3.6-27B: "27B" on the model card (the text model; the vision encoder and MTP head are not built).
    assert qwen.total_params == pytest.approx(27e9, rel=PARAM_COUNT_RTOL)
    # GLM-5.2: ~743B total in vLLM's recipe; the model card's 753B also counts the MTP block, one more MoE layer,
    # which transformers does not build.
    assert glm.total_params == pytest.approx(743e9, rel=PARAM_COUNT_RTOL)
    assert glm.total_params + glm.largest_layer_params == pytest.approx(753e9, rel=PARAM_COUNT_RTOL)
    assert qwen.trainable_params == qwen.total_params and glm.trainable_params == glm.total_params
    assert (qwen.num_layers, glm.num_layers) == (64, 78)


def test_preset_layouts():
    qwen = preset_config("qwen3.6-27b")
    assert [i for i, t in enumerate(qwen.layer_types) if t == "full_attention"] == list(range(3, 64, 4))
    assert (qwen.hidden_size, qwen.num_attention_heads, qwen.num_key_value_heads, qwen.head_dim) == (5120, 24, 4, 256)
    assert (qwen.linear_num_key_heads, qwen.linear_num_value_heads, qwen.linear_conv_kernel_dim) == (16, 48, 4)
    glm = preset_config("glm-5.2")
    # IndexShare: layers 0, 1, 2, then every 4th own an indexer; the 57 others reuse the previous top-k.
    assert [i for i, t in enumerate(glm.indexer_types) if t == "full"] == [0, 1, 2] + list(range(6, 78, 4))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(glm)
    assert [i for i, layer in enumerate(model.model.layers) if layer.self_attn.indexer is not None] == [
        i for i, t in enumerate(glm.indexer_types) if t == "full"
    ]
    assert (glm.kv_lora_rank, glm.qk_rope_head_dim, glm.index_head_dim, glm.index_topk) == (512, 64, 128, 2048)
    assert glm.n_routed_experts == 256


def test_lora_counts_adapters_on_every_linear():
    config = LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    stats = model_stats(model, config, lora_rank=4)
    # Per layer: q (32->32), k and v (32->16), o (32->32), gate and up (32->48), down (48->32).
    per_layer = 4 * (64 + 48 + 48 + 64 + 80 + 80 + 80)
    assert stats.trainable_params == 2 * per_layer
    assert stats.total_params == sum(p.numel() for p in model.parameters()) + 2 * per_layer


# ------------------------------------------------------------------------------------------------- state bytes
def test_state_bytes_real_shapes():
    per_token, fixed = prompt_state_bytes(preset_config("qwen3.6-27b"))
    assert per_token == 64 * KiB  # 16 full layers x K and V x 4 heads x 256 x bf16
    assert fixed == pytest.approx(148 * MiB, rel=STATE_FIXED_RTOL)
    assert fixed == 48 * (48 * 128 * 128 * 4 + 10240 * 3 * 2)  # recurrent state fp32 + conv tail bf16, 48 layers
    per_token, fixed = prompt_state_bytes(preset_config("glm-5.2"))
    assert (per_token, fixed) == (78 * (512 + 64) * 2 + 21 * 128 * 2, 0)  # 93 KiB: 21 indexers under IndexShare
    # GLM-5's layout, every layer with its own indexer: the issue's "about 107 KiB per token".
    assert prompt_state_bytes(GlmMoeDsaConfig())[0] == pytest.approx(107 * KiB, rel=0.01)


def test_state_bytes_follow_the_dtype():
    config = preset_config("qwen3.6-27b")
    bf16, fp32 = prompt_state_bytes(config, 2), prompt_state_bytes(config, 4)
    assert fp32[0] == 2 * bf16[0]
    assert fp32[1] > bf16[1]  # the conv tail doubles, the recurrent state is fp32 either way


def test_planned_state_equals_the_engine_state(tiny_model_path):
    from trl_longstraw.adapters import get_adapter
    from trl_longstraw.engine import Engine, PromptGroup

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path("llama"))
    engine = Engine(model, model, get_adapter(model), chunk_size=5)
    tokens = torch.randint(3, model.config.vocab_size, (13,))
    state = engine.prefill(PromptGroup(tokens=tokens, pad=2, rows=[0]))
    stats = model_stats(model, state_dtype_bytes=4)
    for mode in ("exact", "detached"):
        budget = estimate(stats, Setup(positions=13, prefill_chunk_size=5, mode=mode, gpus=1))
        assert _item(budget, "prompt state") == state.nbytes()
        assert _item(budget, "prompt state gradient") == (state.nbytes() if mode == "exact" else 0)


def test_planned_decode_tail_equals_the_decoder_tail(tiny_model_path):
    """The planner's decode tail is what shared-prompt generation allocates for G rows of C tokens."""
    from transformers import GenerationConfig

    from trl_longstraw.adapters import get_adapter
    from trl_longstraw.engine import Engine
    from trl_longstraw.generation import generate_shared

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path("llama"))
    engine = Engine(model, model, get_adapter(model), chunk_size=5)
    tails = []
    make_tail = engine.adapter.decode_tail
    engine.adapter.decode_tail = lambda capacity: tails.append(make_tail(capacity)) or tails[-1]
    group, completion = 3, 6
    config = GenerationConfig(max_new_tokens=completion, min_new_tokens=completion, do_sample=False)
    prompt = torch.randint(3, model.config.vocab_size, (13,)).tolist()
    generate_shared(model, engine, [prompt] * group, config, 0, [1], None, torch.device("cpu"))
    (tail,) = tails
    allocated = sum(t.numel() * t.element_size() for buffers in tail.buffers.values() for t in buffers)
    stats = model_stats(model, state_dtype_bytes=4)
    budget = estimate(stats, Setup(positions=13, completion_length=completion, group_size=group, gpus=1))
    assert _item(budget, "decode tail") == allocated > 0


def test_sharded_decode_tail_and_batch_count_this_gpus_rows(preset_stats):
    """With a sharded prompt state a GPU decodes and holds only its share of a prompt's G rows (GLM-5.2's recipe: 32
    completions over 32 GPUs, one each): the decode tail is that share's, not G rows' (2.91 GiB at 1,024 tokens), and
    TRL's batch (prompt and completion ids and masks, int64) is that share's [rows, P + C], held through the step,
    with its copies (concatenations, the shuffle) in the phase of the activations."""
    _, stats = preset_stats["glm-5.2"]
    setup = Setup(positions=2_100_000, completion_length=1024, group_size=32, gpus=32, shard_prompt_state=True)
    sharded = {i.name: i for i in estimate(stats, setup).items}
    assert sharded["decode tail"].nbytes == 1024 * stats.state_per_token == 93 * 2**20
    assert (
        sharded["decode tail"].detail.startswith("1 row x") and "32 rows over 32 GPUs" in sharded["decode tail"].detail
    )
    unsharded = {i.name: i for i in estimate(stats, replace(setup, shard_prompt_state=False)).items}
    assert unsharded["decode tail"].nbytes == 32 * 1024 * stats.state_per_token
    grouped = {i.name: i for i in estimate(stats, replace(setup, shard_group=8)).items}
    assert grouped["decode tail"].nbytes == 4 * 1024 * stats.state_per_token
    batch = 2 * (2_100_000 + 1024) * 8
    assert sharded["batch ids"].nbytes == batch and sharded["batch ids"].phase is None
    assert sharded["batch copies"].nbytes == batch and sharded["batch copies"].phase == "activations"
    assert unsharded["batch ids"].nbytes == 32 * batch
    # Qwen3.6 at 2.1M, 8 rows on one GPU: 134 MB per [8, P] int64 tensor.
    _, qwen = preset_stats["qwen3.6-27b"]
    one = {i.name: i for i in estimate(qwen, Setup(positions=2_100_000, completion_length=512)).items}
    assert one["batch ids"].nbytes == 2 * 8 * (2_100_000 + 512) * 8


def test_unsupported_model_type_lists_supported():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported.*glm_moe_dsa.*llama"):
        prompt_state_bytes(GPT2Config())


# ------------------------------------------------------------------------------------------------------ budget
def test_budget_lines(preset_stats):
    _, stats = preset_stats["qwen3.6-27b"]
    base = Setup(positions=100_001, prefill_chunk_size=4096, gpus=8, gpu_memory=96 * 10**9)
    exact, detached = estimate(stats, base), estimate(stats, replace(base, mode="detached"))
    chunks = -(-100_000 // 4096)
    assert _item(exact, "prompt state") == 100_000 * stats.state_per_token + chunks * stats.state_fixed
    assert _item(detached, "prompt state") == 100_000 * stats.state_per_token + stats.state_fixed
    # Gradients: every per-token record, and the recurrent boundary states two at a time (the reverse pass frees them).
    assert _item(exact, "prompt state gradient") == 100_000 * stats.state_per_token + 2 * stats.state_fixed
    assert _item(detached, "prompt state gradient") == 0
    # FSDP shards weights, gradients and optimizer state; 16 bytes per trainable parameter under mixed precision.
    shards = [_item(exact, n) for n in ("weights", "gradients", "optimizer state")]
    assert sum(shards) == pytest.approx(16 * stats.total_params / 8, abs=8)
    sharded = estimate(stats, replace(base, shard_prompt_state=True))
    # The per-token part is split over the shard group. Each GPU keeps the recurrent boundary states of its own chunks
    # (3 of the 24 before the last), the final one, and one copy broadcast by its owner in the reverse pass.
    split = -(-100_000 * stats.state_per_token // 8)
    assert _item(sharded, "prompt state") == split + (3 + 1 + 1) * stats.state_fixed
    assert _item(sharded, "prompt state gradient") == split + 2 * stats.state_fixed
    sharded_detached = estimate(stats, replace(base, shard_prompt_state=True, mode="detached"))
    assert _item(sharded_detached, "prompt state") == split + stats.state_fixed  # the final one, on every GPU
    # Prompts of one and two chunks hold every boundary on every GPU, no more.
    for positions, held in [(4096, 1), (8192, 2)]:
        short = estimate(stats, replace(base, positions=positions, shard_prompt_state=True))
        per_token = -(-(positions - 1) * stats.state_per_token // 8)
        assert _item(short, "prompt state") == per_token + held * stats.state_fixed
    # Only the larger of the branch graph and the chunk activations counts.
    phased = [i.nbytes for i in exact.items if i.phase]
    assert exact.peak == sum(i.nbytes for i in exact.items if not i.phase) + max(phased)
    assert exact.to_allocate == exact.peak - _item(exact, "weights")
    one_gpu = estimate(stats, replace(base, gpus=1))
    assert not [i for i in one_gpu.items if i.name == "FSDP all-gathered"]


def test_activation_estimate_covers_saved_tensors():
    """Per layer and token, the estimate is at least what autograd saves in a stock layer, and not far above."""
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=64,
    )
    model = AutoModelForCausalLM.from_config(config).train()
    params = {p.data_ptr() for p in model.parameters()}

    def saved_bytes(tokens: int) -> int:
        seen = {}

        def pack(t):
            if t.data_ptr() not in params:
                seen[(t.data_ptr(), t.dtype, tuple(t.shape), t.stride())] = t.numel() * t.element_size()
            return t

        hidden = torch.randn(1, tokens, 64, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.model(inputs_embeds=hidden, position_ids=torch.arange(tokens)[None], use_cache=False)
        return sum(seen.values())

    measured = (saved_bytes(64) - saved_bytes(32)) / 32 / config.num_hidden_layers
    estimated = (
        plan.activation_multiples("llama")[1] * model_stats(model, state_dtype_bytes=4).layer_activation_elems * 4
    )
    assert measured <= estimated <= 2 * measured


# ----------------------------------------------------------------------------------------------- largest positions
def _h200x32(mode: str, shard: bool) -> Setup:
    """32 GPUs of 141 GB, bf16 weights and gradients."""
    return Setup(
        positions=1,
        mode=mode,
        gpus=32,
        gpu_memory=141 * 10**9,
        shard_prompt_state=shard,
        frozen_weight_bytes=2,
        trainable_weight_bytes=2,
        grad_bytes=2,
        optimizer_bytes=4,
    )


def _glm_lora(preset_stats) -> ModelStats:
    """GLM-5.2 with LoRA rank 8: full fine-tuning of GLM-5.2 does not fit 32 GPUs at any length."""
    config = preset_stats["glm-5.2"][0]
    with torch.device("meta"):
        return model_stats(AutoModelForCausalLM.from_config(config), config, lora_rank=8)


# GLM-5.2 without a sharded prompt state is `test_whole_model_gather_without_sharded_state`: nothing fits.
@pytest.mark.parametrize(
    ("name", "shard"), [("qwen3.6-27b", False), ("qwen3.6-27b", True), ("glm-5.2", True)], ids=str
)
@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_largest_positions_is_exact(preset_stats, name, mode, shard):
    stats = _glm_lora(preset_stats) if name == "glm-5.2" else preset_stats[name][1]
    setup = _h200x32(mode, shard)
    longest = largest_positions(stats, setup)
    assert 1 < longest < plan.MAX_POSITIONS
    assert estimate(stats, replace(setup, positions=longest)).fits
    assert not estimate(stats, replace(setup, positions=longest + 1)).fits
    assert not estimate(stats, replace(setup, positions=longest + setup.prefill_chunk_size)).fits


def test_branch_round_exchange_is_counted(preset_stats):
    """A sharded branch round gathers every rank's queries of one attention layer and returns fp32 partial outputs:
    GLM-5.2's absorbed MLA queries are 64 heads x (512 + 64) wide, its partial latents 64 x 512. The branch graph
    grows by that exchange, linearly in the number of ranks up to `glm_moe_dsa.EXCHANGE_ROWS` gathered queries, the
    slices in which GLM exchanges them; unsharded it has none."""
    from trl_longstraw.glm_moe_dsa import EXCHANGE_ROWS

    _, stats = preset_stats["glm-5.2"]
    assert stats.query_exchange == (64 * 576, 64 * 512)
    setup = Setup(positions=100_000, gpus=2, completion_length=1000, shard_prompt_state=True)

    def branch(**changes):
        return _item(estimate(stats, replace(setup, **changes)), "branch graph")

    per_query = 64 * 576 * setup.compute_bytes + 3 * (64 * 512 + 1) * 4
    assert branch(gpus=4) - branch() == 2 * 1000 * per_query
    assert branch() - branch(shard_prompt_state=False) == 2 * 1000 * per_query
    assert 4 * 1000 <= EXCHANGE_ROWS < 8 * 1000
    assert branch(gpus=8) - branch(shard_prompt_state=False) == EXCHANGE_ROWS * per_query
    assert branch(gpus=32) == branch(gpus=8)


def test_context_parallel_round_exchange_is_counted(preset_stats):
    """A context-parallel round of GLM-5.2 gathers every rank's chunk rows of one layer (512 + 64 latent and rope key,
    128 index key; with their gradient in the reverse pass) and exchanges the prefix like a branch round, at most
    `EXCHANGE_ROWS` queries at a time; the chunk activations grow by that, and unsharded they have none."""
    from trl_longstraw.glm_moe_dsa import EXCHANGE_ROWS

    _, stats = preset_stats["glm-5.2"]
    assert stats.round_row_elems == 512 + 64 + 128
    setup = Setup(positions=100_000, gpus=8, prefill_chunk_size=1024, shard_prompt_state=True)
    per_query = 64 * 576 * setup.compute_bytes + 3 * (64 * 512 + 1) * 4

    def chunk(**changes):
        return _item(estimate(stats, replace(setup, **changes)), "chunk activations")

    for mode, copies in (("exact", 2), ("detached", 1)):
        rows = 8 * 1024 * (512 + 64 + 128) * setup.compute_bytes * copies
        assert chunk(mode=mode) - chunk(mode=mode, shard_prompt_state=False) == rows + EXCHANGE_ROWS * per_query


def test_context_parallel_exchange_is_counted(preset_stats):
    """A context-parallel round (Qwen3.6-27B: 24 query heads and 4 key-value heads of 256, at W = 8 and chunks of 4096
    in bf16) exchanges, for one attention layer at a time, every rank's queries, keys and values and the fp32
    partial outputs of the round (`plan.context_parallel_exchange`): forward 5.2 GB (at the final merge), backward
    (exact mode's reverse pass, at the final all-to-all) 10.6 GB, counted in the chunk activations with the later
    rank's widened delta rule, the round's gathered states and recurrent records, and the attention outputs it keeps
    in fp32; an unsharded state has none. A group of 6 ranks, which does not divide the 16 DeltaNet key heads, is
    context-parallel too (the delta rule runs sequence-parallel). GLM-5.2's rounds exchange MLA rows instead
    (`round_row_elems`, tested with its own term)."""
    _, stats = preset_stats["qwen3.6-27b"]
    assert stats.context_parallel_heads == 0 and preset_stats["glm-5.2"][1].context_parallel_heads == -1
    assert stats.round_kv_elems == 2 * 4 * 256 and preset_stats["glm-5.2"][1].round_kv_elems == 0
    chunk_tokens, w, q, heads, kv = 4096, 8, 24 * 256, 24, 2 * 4 * 256
    # Gathered bf16 queries, keys and values and the queries' permuted copy; fp32 parts computed, packed, received,
    # and the merge's stack of the W + 1 parts and its weighted copy.
    forward = chunk_tokens * (w * (2 * q + kv) * 2 + ((5 * w + 2) * q + 3 * w * heads) * 4)
    # Gathered q | dout | out | lse | k | v in fp32 and its permuted copy, contiguous dout and out, dq shares,
    # key-value gradients, this rank's packed rows, shares and key-value gradients sent and received; the queries cast
    # back.
    rows = 3 * q + heads
    backward = chunk_tokens * (
        (w * (rows + kv) + w * rows + 2 * w * q + w * q + w * kv + rows + 2 * w * (q + kv)) * 4 + w * q * 2
    )
    assert (round(forward / 1e9, 1), round(backward / 1e9, 1)) == (5.2, 10.6)
    assert plan.context_parallel_exchange(stats, w, chunk_tokens, 2, autograd=False) == forward
    assert plan.context_parallel_exchange(stats, w, chunk_tokens, 2, autograd=True) == backward
    setup = Setup(positions=500_000, gpus=8, shard_prompt_state=True, prefill_chunk_size=4096)

    def chunk(stats=stats, **changes):
        return _item(estimate(stats, replace(setup, **changes)), "chunk activations")

    wider = plan._reverse_mixer_bytes(stats, "linear_attention", 2, widened=True)
    wider -= plan._reverse_mixer_bytes(stats, "linear_attention", 2)
    for gpus in (8, 6):
        exchange = plan.context_parallel_exchange(stats, gpus, chunk_tokens, 2, autograd=True)
        others = 2 * (gpus - 1) * stats.state_fixed + plan.round_states_bytes(stats, gpus)
        fp32_kept = chunk_tokens * stats.kept_attention[0] * 2
        added = chunk(gpus=gpus) - chunk(gpus=gpus, shard_prompt_state=False)
        assert added == exchange + chunk_tokens * wider + others + fp32_kept, gpus
    prefill = max(
        plan.prefill_bytes(stats, 2, chunk_tokens, widened=True),
        plan.prefill_bytes(stats, 2, chunk_tokens, mixers=False) + forward,
    )
    assert chunk(mode="detached") == prefill + plan.round_states_bytes(stats, 8)


def test_attention_reuse_switch_is_counted(preset_stats):
    """`reverse_attention_reuse=False` (`--no-attention-reuse`): the reverse pass keeps no attention outputs, so its
    chunk activations drop by 16 full-attention layers x 24 heads x (256 + one log-sum-exp) per token, in fp32 in a
    context-parallel round (a bf16 model), and the longest prompt grows; the switch is suggested when the run does not
    fit."""
    _, stats = preset_stats["qwen3.6-27b"]
    setup = Setup(positions=500_000, gpus=8, shard_prompt_state=True, prefill_chunk_size=4096)
    kept = _item(estimate(stats, setup), "chunk activations")
    plain = _item(estimate(stats, replace(setup, attention_reuse=False)), "chunk activations")
    assert stats.kept_attention == (16 * 24 * 256, 16 * 24)
    assert kept - plain == 4096 * 16 * 24 * (256 * 4 + 4)
    assert largest_positions(stats, replace(setup, attention_reuse=False)) > largest_positions(stats, setup)
    detached = replace(setup, mode="detached")
    without = replace(detached, attention_reuse=False)
    assert estimate(stats, detached).to_allocate == estimate(stats, without).to_allocate


def test_prefill_attention_reuse_is_counted(preset_stats):
    """`prefill_attention_reuse=True` (`--prefill-attention-reuse`): the prefill keeps, for every prompt token, 16
    full-attention layers x 24 heads x (256 bf16 + one fp32 log-sum-exp) until the reverse pass; counted as its own
    item, suggested off when the run does not fit, and nothing in detached mode or with a sharded state (which the
    config refuses with it). The reverse pass takes a chunk's kept outputs from the prefill instead of keeping its
    own (`Pass.attention_reuse`), so its chunk activations lose them: counted once, on CUDA and in the CPU
    inventory (`plan.reverse_bytes`)."""
    _, stats = preset_stats["qwen3.6-27b"]
    setup = Setup(positions=200_000, gpus=8, prefill_chunk_size=4096)
    on = replace(setup, prefill_attention_reuse=True)
    kept = _item(estimate(stats, on), "prefill attention outputs")
    per_token = 16 * 24 * (256 * 2 + 4)
    assert kept == plan.state_tokens(200_000) * per_token
    chunk = _item(estimate(stats, setup), "chunk activations")
    assert _item(estimate(stats, on), "chunk activations") == chunk - 4096 * per_token
    assert estimate(stats, on).to_allocate - estimate(stats, setup).to_allocate == kept - 4096 * per_token
    _, tiny = _tiny_stats("llama", hidden_size=96, intermediate_size=400, num_attention_heads=3, head_dim=32)
    cpu = Setup(positions=5000, prefill_chunk_size=1000, gpus=1, compute_bytes=4, device="cpu")
    outputs, lses = tiny.kept_attention
    reverse = _item(estimate(tiny, cpu), "chunk activations")
    assert reverse == 1000 * plan.reverse_bytes(tiny, 4, "cpu")
    cpu_on = estimate(tiny, replace(cpu, prefill_attention_reuse=True))
    assert _item(cpu_on, "chunk activations") == reverse - 1000 * (outputs * 4 + lses * 4)
    assert _item(cpu_on, "prefill attention outputs") == 4999 * (outputs * 4 + lses * 4)
    assert all(item.name != "prefill attention outputs" for item in estimate(stats, setup).items)
    assert largest_positions(stats, on) < largest_positions(stats, setup)
    assert any("prefill_attention_reuse=False" in line for line in plan.suggestions(estimate(stats, on)))
    for changes in (dict(mode="detached"), dict(shard_prompt_state=True)):
        assert estimate(stats, replace(on, **changes)).items == estimate(stats, replace(setup, **changes)).items


def test_layer_by_layer_gather_without_sharded_state(preset_stats):
    """Without a sharded prompt state the ranks agree on equal pass counts (the data-parallel lockstep), so FSDP2
    gathers layer by layer, as with the state sharded over all GPUs: the root module and two layers, not GLM-5.2's
    1.5 TB in bf16."""
    stats = _glm_lora(preset_stats)
    setup = replace(_h200x32("detached", False), positions=1000)
    per_pass = {item.name: item for item in estimate(stats, setup).items}["FSDP all-gathered"]
    sharded = {item.name: item for item in estimate(stats, replace(setup, shard_prompt_state=True)).items}
    assert per_pass == sharded["FSDP all-gathered"]
    assert per_pass.nbytes < (stats.total_params + stats.trainable_params) * 2 / 10
    assert per_pass.detail.startswith("per pass")


def test_data_parallel_row_fits(capsys):
    """Issue 14's data-parallel row (README): Qwen3.6-27B, 100K positions, detached, 8 x 96 GB, no sharded state.
    FSDP2 gathers layer by layer, so it fits; gathering the whole model (27B parameters and their gradient in bf16,
    100 GiB) could not."""
    argv = ["--model", "qwen3.6-27b", "--positions", "100K", "--gpus", "8", "--gpu-memory", "96GB"]
    argv += ["--mode", "detached"]
    assert plan.main(argv) == 0
    out = capsys.readouterr().out
    assert "verdict: FITS" in out and "prompt state not sharded" in out
    assert "FSDP all-gathered        11.61 GiB  per pass" in out


def test_shard_groups_smaller_than_the_gpus(preset_stats):
    """Groups of 8 of 32 GPUs split the state 8 ways and exchange queries over 8 ranks; their passes are padded to the
    world's, so FSDP2 gathers layer by layer as with one group of all GPUs or no sharded state (the root module and
    two layers, not GLM-5.2's 1.5 TB in bf16)."""
    stats = _glm_lora(preset_stats)
    setup = replace(_h200x32("exact", True), positions=100_000)
    grouped = {i.name: i for i in estimate(stats, replace(setup, shard_group=8)).items}
    whole = {i.name: i for i in estimate(stats, setup).items}
    unsharded = {i.name: i for i in estimate(stats, replace(setup, shard_prompt_state=False)).items}
    assert grouped["FSDP all-gathered"] == whole["FSDP all-gathered"] == unsharded["FSDP all-gathered"]
    assert grouped["FSDP all-gathered"].nbytes < (stats.total_params + stats.trainable_params) * 2 / 10
    assert grouped["FSDP all-gathered"].detail.startswith("per pass")
    assert "sharded /8" in grouped["prompt state"].detail and "sharded /32" in whole["prompt state"].detail
    assert "across the 8 ranks" in grouped["branch graph"].detail


def test_cli_refuses_a_group_that_does_not_divide_the_gpus(capsys):
    argv = ["--model", "glm-5.2", "--positions", "1000", "--gpus", "32", "--shard-prompt-state"]
    with pytest.raises(SystemExit) as exit_info:
        plan.main(argv + ["--prompt-shard-group-size", "6"])
    assert exit_info.value.code == 2 and "must divide --gpus (32)" in capsys.readouterr().err


def test_largest_positions_is_zero_when_nothing_fits(preset_stats):
    _, stats = preset_stats["glm-5.2"]
    setup = Setup(positions=1, gpus=32, gpu_memory=96 * 10**9)
    assert not estimate(stats, setup).fits
    assert largest_positions(stats, setup) == 0


def test_suggestions_report_their_own_verdicts(preset_stats):
    config = preset_stats["qwen3.6-27b"][0]
    with torch.device("meta"):
        stats = model_stats(AutoModelForCausalLM.from_config(config), config, lora_rank=8)
    # 4M positions: sharding over the 8 GPUs is not enough, 10 are.
    setup = Setup(positions=4_000_000, mode="exact", gpus=8, gpu_memory=96 * 10**9)
    lines = plan.suggestions(estimate(stats, setup))
    detached = [s for s in lines if s.startswith("prompt_gradient='detached'")]
    sharded = [s for s in lines if s.startswith("shard_prompt_state=True")]
    assert detached and sharded and any("GPUs" in s for s in lines) and lines[-1].startswith("a shorter prompt")
    fits_sharded = estimate(stats, replace(setup, shard_prompt_state=True)).fits
    assert sharded[0].endswith("(fits)") == fits_sharded
    assert f"at most {largest_positions(stats, setup):,} positions" in lines[-1]


# -------------------------------------------------------------------------------------------------------- RoPE
def test_presets_set_yarn_beyond_the_native_window():
    qwen = preset_config("qwen3.6-27b", 2_100_512)
    assert qwen.rope_parameters["rope_type"] == "yarn"
    assert qwen.rope_parameters["factor"] == 9.0  # ceil(2,100,512 / 262,144)
    assert qwen.rope_parameters["original_max_position_embeddings"] == 262144
    assert qwen.max_position_embeddings == 9 * 262144
    # Qwen's own RoPE settings survive: theta, 64 rotary dims of 256, multimodal sections.
    assert qwen.rope_parameters["rope_theta"] == 1e7 and qwen.rope_parameters["partial_rotary_factor"] == 0.25
    assert qwen.rope_parameters["mrope_section"] == [11, 11, 10]
    glm = preset_config("glm-5.2", 2_100_512)
    assert (glm.rope_parameters["factor"], glm.max_position_embeddings) == (3.0, 3 * 1048576)
    native = preset_config("qwen3.6-27b", 262144)
    assert native.rope_parameters["rope_type"] == "default" and native.max_position_embeddings == 262144
    assert plan.rope_window(qwen) == (9 * 262144, 262144) and plan.rope_scaled(qwen)


def test_yarn_config_is_used_by_transformers():
    config = Qwen3_5TextConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        vocab_size=64,
        max_position_embeddings=64,
        rope_parameters={**plan.QWEN3_6_27B["rope_parameters"]},
    )
    scaled = with_yarn(config, 200)
    model = AutoModelForCausalLM.from_config(scaled)
    rotary = model.model.rotary_emb
    assert rotary.rope_type == "yarn"
    assert rotary.attention_scaling == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)  # factor 4
    out = model(input_ids=torch.randint(0, 64, (1, 9)), position_ids=torch.arange(150, 159)[None])
    assert torch.isfinite(out.logits).all()


# ---------------------------------------------------------------------------------------------------- parsing
def test_parse_count_and_bytes():
    assert parse_count("2.1M") == 2_100_000
    assert parse_count("512K") == 512_000
    assert parse_count("1Mi") == 2**20
    assert parse_count("131072") == 131072
    assert parse_bytes("96GB") == 96 * 10**9
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("141G") == 141 * 10**9
    for bad in ("", "2.1X", "GB", "-5"):
        with pytest.raises(ValueError, match="cannot read"):
            parse_bytes(bad)


# -------------------------------------------------------------------------------------------------------- CLI
def test_main_in_process(capsys, tmp_path):
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=2**30,
    )
    config.save_pretrained(tmp_path)
    argv = ["--model", str(tmp_path), "--gpus", "1", "--gpu-memory", "1GiB", "--mode", "detached"]
    assert plan.main(argv + ["--positions", "1K"]) == 0
    out = capsys.readouterr().out
    assert "verdict: FITS" in out and "prompt state" in out and "largest prompt that fits" in out
    assert plan.main(argv + ["--positions", "100M"]) == 3
    out = capsys.readouterr().out
    assert "verdict: DOES NOT FIT" in out
    longest = int(out.split("largest prompt that fits: ")[1].split(" ")[0].replace(",", ""))
    assert plan.main(argv + ["--positions", str(longest)]) == 0
    assert plan.main(argv + ["--positions", str(longest + 1)]) == 3


@pytest.mark.slow
def test_cli_exit_codes(capsys):
    """`python -m trl_longstraw.plan` exits 0 when the plan fits and 3 when it does not (README examples). The
    command itself runs once (its exit status is `main`'s return value), the other case through `main`."""
    common = ["--model", "qwen3.6-27b", "--positions", "2.1M", "--gpus", "8", "--gpu-memory", "96GB"]
    assert plan.main(common + ["--mode", "detached", "--shard-prompt-state"]) == 0
    fits = capsys.readouterr().out
    assert "verdict: FITS" in fits and "yarn factor 9" in fits
    command = [sys.executable, "-m", "trl_longstraw.plan", *common, "--mode", "exact"]
    too_big = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    assert too_big.returncode == 3, too_big.stderr
    assert "verdict: DOES NOT FIT" in too_big.stdout and "prompt_gradient='detached'" in too_big.stdout


# ------------------------------------------------------------------------------------------- CLI errors, refusals
def test_cli_unsupported_model_is_a_one_line_error(tmp_path, capsys):
    """A GPT-2 config.json: exit 2 and one line on stderr naming the supported model types, no traceback."""
    from transformers import GPT2Config

    GPT2Config().save_pretrained(tmp_path)
    assert plan.main(["--model", str(tmp_path), "--positions", "100K"]) == 2
    result = capsys.readouterr()
    assert result.out == "" and result.err.count("\n") == 1 and "Traceback" not in result.err
    assert "model_type 'gpt2' is not supported" in result.err and "qwen3_5" in result.err


def test_cli_presets_are_case_insensitive_and_unknown_ones_are_errors(capsys):
    argv = ["--positions", "1K", "--gpus", "8", "--mode", "detached", "--shard-prompt-state"]
    assert plan.main(["--model", "Qwen3.6-27B"] + argv) == 0
    assert capsys.readouterr().out.startswith("Qwen3.6-27B (qwen3_5_text)")
    assert plan.main(["--model", "qwen3.7-27b"] + argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert "'qwen3.7-27b' is neither a preset (qwen3.6-27b, glm-5.2, in any case)" in captured.err


def test_cli_verdict_includes_the_trainers_refusals(capsys, tmp_path):
    """A prompt beyond an unscaled RoPE window fits in memory but the trainer refuses it: exit 4, its message."""
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=2048
    )
    config.save_pretrained(tmp_path)
    argv = ["--model", str(tmp_path), "--gpus", "1", "--gpu-memory", "1GiB", "--completion-length", "16"]
    assert plan.main(argv + ["--positions", "2032"]) == 0
    assert "verdict: FITS" in capsys.readouterr().out
    assert plan.main(argv + ["--positions", "2033"]) == 4
    out = capsys.readouterr().out
    assert "verdict: REFUSED -- fits in memory" in out
    assert "  - sequences of 2,049 positions (prompt + completion) exceed the model's window of 2,048" in out
    # A per-layer-type RoPE that updates at each call is refused by the trainer (trl_longstraw.rope).
    # (No transformers family ships one yet: the rotary module is given one by hand.)
    model = meta_model(config)
    model.model.rotary_emb.rope_type = {"full_attention": "dynamic", "sliding_attention": "dynamic"}
    setup = Setup(positions=100, gpus=1)
    assert any("per-layer-type RoPE" in r for r in plan.trainer_refusals(config, model, setup))
    # Dropout, which the trainer refuses in any mode.
    dropped = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    dropped.attention_dropout = 0.1
    (reason,) = plan.trainer_refusals(dropped, meta_model(dropped), setup)
    assert reason.startswith("dropout is active in model.layers.0.self_attn (attention_dropout=0.1)")


def test_cli_reads_a_recipe_and_flags_override_it(capsys):
    """`--config` takes model, positions, mode, chunk, group, completion length, LoRA and sharding from a recipe."""
    config = str(REPO / "recipes/configs/qwen3.6-27b_8xh20_2.1m_detached.yaml")
    assert plan.main(["--config", config, "--gpus", "8", "--gpu-memory", "96GB"]) == 0
    out = capsys.readouterr().out
    assert "run: 2,100,000 prompt positions, detached mode, 8 x 1,024-token completions, prefill chunk 4,096" in out
    assert "prompt state sharded over groups of 8 GPUs" in out and "verdict: FITS" in out
    # The recipe's YaRN (factor 8.25 from model_init_kwargs), not the planner's own choice (9).
    assert "scaled (yarn factor 8.25) to 2,162,688 for 2,101,024 positions" in out
    flags = ["--positions", "100K", "--mode", "exact", "--group-size", "4", "--no-shard-prompt-state"]
    assert plan.main(["--config", config, "--gpus", "8"] + flags) in (0, 3)
    out = capsys.readouterr().out
    assert "run: 100,000 prompt positions, exact mode, 4 x 1,024-token completions" in out
    assert "prompt state not sharded" in out
    # LoRA from the recipe: rank and target modules (the tiny demo has none: full fine-tuning).
    tiny = str(REPO / "recipes/configs/tiny_cpu.yaml")
    assert plan.main(["--config", tiny, "--gpus", "1", "--gpu-memory", "1GB"]) == 0
    assert "longstraw/tiny-llama (llama): 80.58K parameters, 80.58K trainable" in capsys.readouterr().out


def test_recipe_refusals(tmp_path, capsys):
    """A recipe's training arguments that the trainer refuses (here the MoE router's auxiliary loss, left at the
    model's default, and a RoPE override that changes rope_theta) make the verdict REFUSED or join DOES NOT FIT."""
    tiny = (REPO / "recipes/configs/tiny_cpu.yaml").read_text()
    recipe = tmp_path / "r.yaml"
    recipe.write_text(tiny.replace("longstraw/tiny-llama", "longstraw/tiny-qwen3_moe"))
    argv = ["--config", str(recipe), "--gpus", "1", "--gpu-memory", "1GB"]
    assert plan.main(argv) == 4
    assert "set router_aux_loss_coef=0.0" in capsys.readouterr().out
    recipe.write_text(
        tiny.replace("longstraw/tiny-llama", "longstraw/tiny-qwen3_moe")
        + "router_aux_loss_coef: 0.0\nmodel_init_kwargs:\n  rope_parameters: {rope_type: yarn, factor: 2.0, "
        "original_max_position_embeddings: 1024}\n"
    )
    assert plan.main(argv) == 4
    out = capsys.readouterr().out
    assert "router_aux_loss_coef" not in out and "rope_theta: checkpoint" not in out
    assert "rope_theta: model 10000.0, override '<missing>'" in out


def test_shard_group_needs_the_trainers_group_size(capsys, tmp_path):
    """The trainer's rule for a sharded prompt state (`sharding.shard_group_size`): G must be a multiple of the shard
    group's GPUs x rows per process. The planner refuses the same setups with the trainer's own message (exit 4),
    and without `--group-size` takes the smallest G that the trainer accepts at one row per process (8 when the
    group is at most 8 GPUs, 32 over 32 GPUs, as the GLM-5.2 config's num_generations)."""
    from trl_longstraw.sharding import shard_group_size

    base = ["--model", "qwen3.6-27b", "--positions", "100K", "--gpu-memory", "96GB", "--mode", "detached"]
    with pytest.raises(ValueError) as trainer:
        shard_group_size(16, 0, 8, 1)
    assert plan.main([*base, "--gpus", "16", "--shard-prompt-state", "--group-size", "8"]) == 4
    out = capsys.readouterr().out
    assert "verdict: REFUSED" in out and f"  - {trainer.value}" in out
    for argv, group in (
        (["--gpus", "16", "--shard-prompt-state"], 16),
        (["--gpus", "16", "--shard-prompt-state", "--prompt-shard-group-size", "4"], 8),
        (["--gpus", "16"], 8),
        (["--gpus", "16", "--shard-prompt-state", "--group-size", "24", "--prompt-shard-group-size", "8"], 24),
    ):
        assert plan.main([*base, *argv]) == 0, argv
        assert f"mode, {group} x 512-token completions" in capsys.readouterr().out, argv
    assert [plan.default_group_size(g, True) for g in (1, 2, 8, 12, 32)] == [8, 8, 8, 12, 32]
    # A recipe's generation batch is global: TRL spreads it over the processes (32 rows over 32: one per process).
    recipe = plan.read_recipe(REPO / "recipes/configs/glm-5.2_32xh20_2.1m.yaml")
    assert plan.rows_per_process(recipe, 32) == 1 and plan.rows_per_process(recipe, 8) == 4
    custom = tmp_path / "r.yaml"
    custom.write_text((REPO / "recipes/configs/tiny_cpu.yaml").read_text() + "steps_per_generation: 3\n")
    assert (
        plan.rows_per_process(plan.read_recipe(custom), 32)
        == 3 * plan.read_recipe(custom).training_args.per_device_train_batch_size
    )


def test_recipe_batch_is_the_planned_processes(capsys, tmp_path):
    """TRL derives `steps_per_generation` from the number of processes (`GRPOConfig.__post_init__`: a global
    `generation_batch_size` is spread over them), and with it each process's rows and group share: the planner checks
    a recipe with the values of its `--gpus` processes, not those of the recipe's one-process parse."""
    from trl_longstraw.sharding import shard_group_size
    from trl_longstraw.trainer import _local_group_size

    glm = plan.read_recipe(REPO / "recipes/configs/glm-5.2_32xh20_2.1m.yaml")
    assert glm.training_args.steps_per_generation == 32  # one process: all 32 rows
    for gpus, steps in ((32, 1), (8, 4)):  # 32 rows / (1 per device x gpus)
        args = plan.recipe_training_args(glm, gpus)
        assert (args.steps_per_generation, args.generation_batch_size, args.world_size) == (steps, 32, gpus)
        rows = args.per_device_train_batch_size * args.steps_per_generation
        # The trainer's shard group (all ranks) and each process's share of a group (one row each over 32).
        assert shard_group_size(gpus, args.prompt_shard_group_size, args.num_generations, rows) == gpus
        assert _local_group_size(args) == rows == steps
    with pytest.raises(ValueError, match=r"generation_batch_size \(32\) must be divisible by the global batch size"):
        plan.recipe_training_args(glm, 24)
    # A group of 6 over micro-batches of 4: one process holds the whole group (refused: 4 neither divides nor is a
    # multiple of 6), each of 3 processes holds 4 rows, a group share of 2 (accepted); 2 processes: TRL refuses 12.
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        (REPO / "recipes/configs/tiny_cpu.yaml")
        .read_text()
        .replace("num_generations: 8", "num_generations: 6")
        .replace("per_device_train_batch_size: 8", "per_device_train_batch_size: 4")
        + "generation_batch_size: 12\n"
    )
    argv = ["--config", str(recipe), "--gpu-memory", "1GB", "--gpus"]
    assert plan.main([*argv, "3"]) == 0
    assert "verdict: FITS" in capsys.readouterr().out
    assert plan.main([*argv, "1"]) == 4
    assert "group_shuffle cannot split the generation batch" in capsys.readouterr().out
    assert plan.main([*argv, "2"]) == 4
    assert "  - generation_batch_size (12) must be divisible by the global batch size (8)." in capsys.readouterr().out


def test_scores_count_this_gpus_rows(preset_stats):
    """The loss pass's log-probs, entropies and their gradients `[rows, C]` fp32 are of the rows a GPU holds: all G
    unsharded, G / group when the prompt state is sharded (as the decode tail's rows)."""
    _, stats = preset_stats["qwen3.6-27b"]
    setup = Setup(positions=100_000, gpus=32, group_size=32, completion_length=512)
    assert _item(estimate(stats, setup), "scores") == 4 * 32 * 512 * 4
    sharded = replace(setup, shard_prompt_state=True)
    assert _item(estimate(stats, sharded), "scores") == 4 * 1 * 512 * 4
    assert _item(estimate(stats, replace(sharded, shard_group=8)), "scores") == 4 * 4 * 512 * 4


# -------------------------------------------------------------------------- expert parallelism, offload, DP mode
def test_expert_parallel_never_gathers_the_experts(preset_stats):
    """GLM-5.2: 256 routed experts per MoE layer, 8 per GPU over 32. FSDP2 gathers the layers without their experts
    (the largest is then a dense layer), and the weights per GPU stay a 1/32 share."""
    stats = _glm_lora(preset_stats)
    config = preset_stats["glm-5.2"][0]
    moe_layers = config.num_hidden_layers - config.first_k_dense_replace
    expert_per_layer = 256 * (2 * 2048 * 6144 + 6144 * 2048)  # gate_up [E, 2I, H] + down [E, H, I]
    assert (stats.num_experts, stats.expert_params) == (256, moe_layers * expert_per_layer)
    assert stats.expert_trainable == 0  # LoRA never targets the fused experts
    # Without experts, the largest layer is a dense one (MLP 12288 wide, an indexer), not a MoE layer.
    dense_layer = sum(p.numel() for p in meta_model(config).model.layers[0].parameters())
    assert stats.largest_layer_dense_params == dense_layer > stats.largest_layer_params - expert_per_layer
    setup = replace(_h200x32("exact", True), positions=100_000)
    plain, ep = estimate(stats, setup), estimate(stats, replace(setup, expert_parallel=True))
    gathered = stats.root_params + stats.root_trainable + 2 * stats.largest_layer_dense_params
    assert _item(ep, "FSDP all-gathered") == (gathered + stats.largest_layer_dense_trainable) * 2
    # Two MoE layers' experts in bf16 (36 GiB) are gathered without EP; with it, the root and two dense layers (5 GiB).
    assert _item(plain, "FSDP all-gathered") > 2 * expert_per_layer * 2 > 7 * _item(ep, "FSDP all-gathered")
    assert _item(ep, "weights") == pytest.approx(_item(plain, "weights"), abs=2)
    # EP groups of 8 of the 32 GPUs: 32 experts per EP rank, sharded by FSDP2 over the 4 groups (the same 1/32 per
    # GPU), and each layer's 32 local experts gathered over them.
    ep8 = estimate(stats, replace(setup, expert_parallel=True, ep_size=8))
    assert _item(ep8, "weights") == _item(ep, "weights")
    assert _item(ep8, "FSDP all-gathered") - _item(ep, "FSDP all-gathered") == 2 * (expert_per_layer // 8) * 2
    qwen = preset_stats["qwen3.6-27b"][1]
    with pytest.raises(ValueError, match="no routed experts"):
        estimate(qwen, replace(setup, expert_parallel=True))
    with pytest.raises(ValueError, match="ep_size=5 must divide the 32 GPUs"):
        replace(setup, expert_parallel=True, ep_size=5)


def test_offload_moves_cold_state_to_the_host(preset_stats):
    """FSDP2 CPU offload puts the weight, gradient and optimizer shards in host memory; offload_boundary_states
    keeps 3 recurrent boundaries on the GPU (the newest, the restored one, the one in flight) and this GPU's share
    of the others on the host, counted per node against --host-memory."""
    _, stats = preset_stats["qwen3.6-27b"]
    setup = Setup(positions=2_100_000, gpus=8, gpu_memory=96 * 10**9, shard_prompt_state=True)
    plain = estimate(stats, setup)
    off = estimate(stats, replace(setup, offload=True, offload_boundary_states=True))
    for name in ("weights", "gradients", "optimizer state"):
        assert _item(off, name) == 0
        (host,) = [i.nbytes for i in off.host if i.name == name]
        assert host == _item(plain, name)
    chunks = -(-2_099_999 // 4096)
    assert _item(plain, "prompt state") - _item(off, "prompt state") == (-(-(chunks - 1) // 8) + 2 - 3) * (
        stats.state_fixed
    )
    (boundaries,) = [i.nbytes for i in off.host if i.name == "boundary states"]
    assert boundaries == -(-(chunks - 1) // 8) * stats.state_fixed
    assert off.host_per_node == 8 * sum(i.nbytes for i in off.host)
    assert off.fits and not replace(off, setup=replace(off.setup, host_memory=off.host_per_node - 1)).fits
    # Detached mode keeps no boundaries: nothing to offload there.
    detached = estimate(stats, replace(setup, mode="detached", offload_boundary_states=True))
    assert not [i for i in detached.host if i.name == "boundary states"]


def test_host_memory_is_checked_by_default(capsys):
    """Without --host-memory the CLI checks the offloaded items against a DGX H100/H200 node's 2 TB (250 GB per
    process of the node); `--host-memory none` skips the check; a budget below the offloaded items refuses."""
    argv = ["--model", "qwen3.6-27b", "--positions", "2.1M", "--gpus", "8", "--mode", "exact"]
    argv += ["--shard-prompt-state", "--offload"]
    assert plan.default_host_memory(8, 8) == 2 * 10**12 and plan.default_host_memory(2, 8) == 5 * 10**11
    assert plan.main(argv) == 0
    out = capsys.readouterr().out
    assert "host memory            1.82 TiB  (default: 250 GB per process" in out
    assert plan.main(argv + ["--host-memory", "none"]) == 0
    assert "not checked (--host-memory none)" in capsys.readouterr().out
    assert plan.main(argv + ["--host-memory", "400GB"]) == 3
    assert "DOES NOT FIT in host memory" in capsys.readouterr().out
    assert plan.main(argv + ["--gpus-per-node", "1"]) == 0  # 250 GB for one process's 59 GiB


# -------------------------------------------------------------------------------------------------- calibration
def test_portable_attention_score_tiles_are_counted():
    """fp32 on CUDA (or heads wider than 256) has no fused attention kernel: the portable path's fp32 score tiles
    `[T, Hq, 4096]` are counted, 4 with autograd (reverse pass) and 3 without (prefill); none on CPU or in bf16."""
    config = LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8, head_dim=32
    )
    stats = model_stats(meta_model(config), config, state_dtype_bytes=4)
    setup = Setup(positions=20_000, prefill_chunk_size=2048, gpus=1, compute_bytes=4)
    for mode, tiles in (("exact", 4), ("detached", 3)):
        fp32 = estimate(stats, replace(setup, mode=mode))
        assert plan.score_tiles(stats, 4, 2048, autograd=mode == "exact") == tiles * 2048 * 8 * 4096 * 4
        assert plan.score_tiles(stats, 4, 2048, autograd=mode == "exact", device="cpu") == 0
        assert plan.score_tiles(stats, 2, 2048, autograd=mode == "exact") == 0
        assert "fp32 score tiles" in [i for i in fp32.items if i.name == "chunk activations"][0].detail
    # The prefill's inventory is the same on both devices: only the tiles differ.
    cpu = estimate(stats, replace(setup, mode="detached", device="cpu"))
    fp32 = estimate(stats, replace(setup, mode="detached"))
    assert _item(fp32, "chunk activations") - _item(cpu, "chunk activations") == 3 * 2048 * 8 * 4096 * 4


def _tiny_stats(family: str, **widths):
    from trl_longstraw.testing import tiny_config

    config = tiny_config(family, vocab_size=128, **widths).get_text_config()
    return config, model_stats(meta_model(config), config, state_dtype_bytes=4)


def test_cpu_reverse_pass_is_itemized():
    """On CPU the exact-mode reverse pass of a dense model is the itemized inventory (`plan.reverse_bytes`); CUDA keeps
    the activation multiples calibrated on the GPU check, and so do MoE models and the non-default switches.

    A further layer adds only what the chunk keeps per layer (its output, its kept attention output and log-sum-exp,
    its K and V records): the recomputed graphs at the peak are two layers' whatever the depth (traced at 2 and 3
    layers, benchmarks/CALIBRATION.md)."""
    widths = dict(hidden_size=96, intermediate_size=400, num_attention_heads=3, num_key_value_heads=1, head_dim=32)
    _, two = _tiny_stats("llama", num_hidden_layers=2, **widths)
    _, three = _tiny_stats("llama", num_hidden_layers=3, **widths)
    b = 4
    per_layer = 96 * b + 3 * 32 * b + 3 * 4 + 2 * 32 * b
    assert plan.reverse_bytes(three, b, "cpu") - plan.reverse_bytes(two, b, "cpu") == per_layer
    assert plan.reverse_bytes(two, b, "cuda") is None
    setup = Setup(positions=5000, prefill_chunk_size=1000, gpus=1, compute_bytes=b, device="cpu")
    assert _item(estimate(two, setup), "chunk activations") == 1000 * plan.reverse_bytes(two, b, "cpu")
    cuda = estimate(two, replace(setup, device="cuda"))
    no_reuse = estimate(two, replace(setup, attention_reuse=False))
    graph = two.num_layers * 96 * b + int(plan.activation_multiples("llama")[1] * two.layer_activation_elems * b)
    outputs, lses = two.kept_attention
    tiles = plan.score_tiles(two, b, 1000, autograd=True)  # fp32 on CUDA: the portable attention path
    assert _item(cuda, "chunk activations") == 1000 * (graph + outputs * b + lses * 4) + tiles
    assert _item(no_reuse, "chunk activations") == 1000 * graph
    # Gated DeltaNet layers before the last: the layer L-2 whose MLP backward is the peak holds the delta rule's graph.
    gdn = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24)
    _, qwen = _tiny_stats(
        "qwen3_5", num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], **widths, **gdn
    )
    _, attention_only = _tiny_stats(
        "qwen3_5", num_hidden_layers=2, layer_types=["full_attention"] * 2, **widths, **gdn
    )
    mixer = plan._reverse_mixer_bytes(qwen, "linear_attention", b) - plan._reverse_mixer_bytes(qwen, "attention", b)
    kept = 3 * 32 * b + 3 * 4 + 2 * 32 * b  # a second attention layer's kept output, log-sum-exp and records
    assert plan.reverse_bytes(attention_only, b, "cpu") - plan.reverse_bytes(qwen, b, "cpu") == kept - mixer
    _, glm = _tiny_stats("glm_moe_dsa")
    assert plan.reverse_bytes(glm, b, "cpu") is None


def test_delta_rule_groups_follow_the_engine(monkeypatch):
    """`plan.delta_rule_group` is the group of blocks that the no-grad delta rule builds its block terms for."""
    from trl_longstraw import qwen3_5

    for length, v_dim in ((1500, 24), (700, 8), (4096, 64), (100, 128), (64, 16)):
        groups = []
        block_terms = qwen3_5._block_terms

        def counted(query, *args, groups=groups, block_terms=block_terms):
            groups.append(query.shape[2])
            return block_terms(query, *args)

        monkeypatch.setattr(qwen3_5, "_block_terms", counted)
        g = -torch.rand(1, length, 2)
        inputs = (torch.randn(1, length, 1, 4), torch.randn(1, length, 1, 4), torch.randn(1, length, 2, v_dim))
        with torch.no_grad():
            qwen3_5.torch_gated_delta_rule(*inputs, g, torch.rand(1, length, 2))
        assert min(max(groups) * qwen3_5.DELTA_RULE_BLOCK, length) == plan.delta_rule_group(length, v_dim)


def test_later_ranks_of_a_round_count_the_widened_delta_rule():
    """A later rank of a qwen3_5 context-parallel round runs the delta rule on values widened by Dk zero columns
    (`qwen3_5.segment_gated_delta_rule`): the planner's value-wide work tensors there are `(Dv + Dk) / Dv` times the
    plain rule's, beside the widened values and the resumed output (reverse pass), and the no-grad prefill's delta rule
    runs `Dv + Dk` wide. A sharded budget (2 GPUs) reports that rank, on CPU (inventories) and CUDA (the multiples plus
    the widening); nothing changes for a model without Gated DeltaNet layers or for one process."""
    b, heads, k_dim, v_dim = 4, 4, 32, 48
    work = plan.delta_rule_value_work(heads, k_dim, v_dim)
    assert plan.delta_rule_value_work(heads, k_dim, v_dim + k_dim) * v_dim == work * (v_dim + k_dim)
    widths = dict(hidden_size=96, intermediate_size=160, num_attention_heads=3, num_key_value_heads=1, head_dim=32)
    gdn = dict(
        linear_num_key_heads=2, linear_num_value_heads=heads, linear_key_head_dim=k_dim, linear_value_head_dim=v_dim
    )
    _, qwen = _tiny_stats(
        "qwen3_5",
        num_hidden_layers=3,
        layer_types=["linear_attention", "linear_attention", "full_attention"],
        **widths,
        **gdn,
    )
    assert qwen.delta_rule == (heads, k_dim, v_dim, 2 * 2 * k_dim + heads * v_dim)
    plain, wide = (plan._reverse_mixer_bytes(qwen, "linear_attention", b, w) for w in (False, True))
    beside = heads * ((v_dim + k_dim) * b + v_dim * 4)  # the widened values, the resumed output
    wider = plan.delta_rule_value_work(heads, k_dim, v_dim + k_dim) - work + beside
    assert wide - plain == wider > 0
    assert plan.reverse_bytes(qwen, b, "cpu", widened=True) - plan.reverse_bytes(qwen, b, "cpu") == wider
    chunk = 1024
    assert plan.prefill_bytes(qwen, b, chunk, widened=True) - plan.prefill_bytes(qwen, b, chunk) == chunk * (
        heads * (v_dim + k_dim) * b
    ) + plan.delta_rule_prefill_bytes(chunk, heads, k_dim, v_dim + k_dim) - plan.delta_rule_prefill_bytes(
        chunk, heads, k_dim, v_dim
    )
    assert plan.delta_rule_prefill_bytes(chunk, heads, k_dim, v_dim + k_dim) > plan.delta_rule_prefill_bytes(
        chunk, heads, k_dim, v_dim
    )
    # A sharded budget: the later rank's chunk activations, next to the same step in one process. The widened rule
    # and an attention layer's exchange never coexist: the exchange goes beside the MLP phase (prefill) or the
    # attention layer's graph (CPU reverse); the CUDA multiples, per layer of any kind, take both.
    one = Setup(positions=20 * chunk, prefill_chunk_size=chunk, gpus=1, compute_bytes=b, fsdp=False)
    two = replace(one, gpus=2, shard_prompt_state=True)
    gathered = plan.round_states_bytes(qwen, 2)
    assert gathered == 2 * heads * k_dim * (v_dim + k_dim) * 4
    for device in ("cpu", "cuda"):
        for mode in ("exact", "detached"):
            exact = mode == "exact"
            single, sharded = (estimate(qwen, replace(u, mode=mode, device=device)) for u in (one, two))
            exchange = plan.context_parallel_exchange(qwen, 2, chunk, b, autograd=exact)
            records = 2 * qwen.state_fixed if exact else 0  # the other chunk's recomputed records and zero seeds
            tiles = plan.score_tiles(qwen, b, chunk, autograd=exact, device=device) + gathered + records
            if exact and device == "cuda":  # the multiples take the exchange and the widening
                expected = _item(single, "chunk activations") + chunk * wider + exchange + gathered + records
            elif exact:  # the larger of the widened rule's phase and an attention layer's backward with its exchange
                attention = plan.reverse_exchange_bytes(qwen, b, device)
                widened = chunk * plan.reverse_bytes(qwen, b, device, widened=True) + tiles
                expected = max(widened, chunk * attention + tiles + exchange)
                assert widened - _item(single, "chunk activations") == chunk * wider + gathered + records
            else:
                widened = plan.prefill_bytes(qwen, b, chunk, widened=True) + tiles
                expected = max(widened, plan.prefill_bytes(qwen, b, chunk, mixers=False) + tiles + exchange)
            assert _item(sharded, "chunk activations") == expected, (device, mode)
            assert "widened by Dk" in [i for i in sharded.items if i.name == "chunk activations"][0].detail
    # No Gated DeltaNet layer: no widening.
    _, llama = _tiny_stats("llama", num_hidden_layers=2, **widths)
    assert plan.prefill_bytes(llama, b, chunk, widened=True) == plan.prefill_bytes(llama, b, chunk)
    assert plan.reverse_bytes(llama, b, "cpu", widened=True) == plan.reverse_bytes(llama, b, "cpu")
    sharded = estimate(llama, replace(two, device="cpu"))
    assert "widened" not in [i for i in sharded.items if i.name == "chunk activations"][0].detail
    # A round's attention keeps its output for the recompute in the accumulation dtype: fp32 for a bf16 model.
    outputs, lses = llama.kept_attention
    for u, width in ((one, 2), (two, 4)):
        u = replace(u, compute_bytes=2)
        kept = _item(estimate(llama, u), "chunk activations")
        kept -= _item(estimate(llama, replace(u, attention_reuse=False)), "chunk activations")
        assert kept == chunk * (outputs * width + lses * 4), width


def test_delta_rule_saved_tensors_are_counted():
    """The CPU reverse inventory counts what the hand-written delta rule (`qwen3_5._DeltaRuleFunction`) saves for its
    backward (`plan.delta_rule_saved_bytes`): its saved tensors, read off the graph, byte for byte (a length that is
    not a multiple of the block), and the Gated DeltaNet mixer is those plus what the layer keeps around the rule."""
    from trl_longstraw.qwen3_5 import _DeltaRuleFunction

    heads, k_dim, v_dim, tokens = 3, 16, 24, 200
    torch.manual_seed(0)
    query, key = (torch.nn.functional.normalize(torch.randn(1, heads, tokens, k_dim), dim=-1) for _ in range(2))
    value = torch.randn(1, heads, tokens, v_dim, requires_grad=True)
    g, beta = -torch.rand(1, heads, tokens), torch.rand(1, heads, tokens)
    out, _ = _DeltaRuleFunction.apply(query, key, value, g, beta, None, None)
    saved = sum(t.nbytes for t in out.grad_fn.saved_tensors)
    assert plan.delta_rule_saved_bytes(tokens, heads, k_dim, v_dim) == saved
    widths = dict(hidden_size=96, intermediate_size=160, num_attention_heads=3, num_key_value_heads=1, head_dim=32)
    gdn = dict(
        linear_num_key_heads=1, linear_num_value_heads=heads, linear_key_head_dim=k_dim, linear_value_head_dim=v_dim
    )
    _, qwen = _tiny_stats(
        "qwen3_5", num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], **widths, **gdn
    )
    conv_dim = qwen.delta_rule[3]
    around = plan.REVERSE_DELTA_RULE
    per_token = around["conv"] * conv_dim * 4 + heads * 4 * (
        around["value"] * v_dim + around["key"] * k_dim + around["scalars"]
    )
    blocks = tokens // 64 * 64  # whole blocks: the per-token count
    rule = plan.delta_rule_saved_bytes(blocks, heads, k_dim, v_dim) - heads * 4 * (k_dim * v_dim + blocks // 64)
    assert blocks * plan._reverse_mixer_bytes(qwen, "linear_attention", 4) == blocks * per_token + rule


def test_sharded_cpu_reverse_pass_peaks_at_an_attention_layers_exchange():
    """A context-parallel round's attention layer exchanges in its backward, after its MLP's tensors are freed: the
    CPU reverse pass of a sharded llama rank is the larger of the MLP's phase (`reverse_bytes`) and the exchange's
    phase (`reverse_exchange_bytes` + `context_parallel_exchange`), not their sum (which was 12-19% above the
    measured peaks, benchmarks/CALIBRATION.md). CUDA keeps the sum (multiples)."""
    b, chunk = 4, 1000
    widths = dict(hidden_size=96, intermediate_size=400, num_attention_heads=3, num_key_value_heads=1, head_dim=32)
    _, llama = _tiny_stats("llama", num_hidden_layers=2, **widths)
    mlp_phase = plan.reverse_bytes(llama, b, "cpu")
    exchange_phase = plan.reverse_exchange_bytes(llama, b, "cpu")
    # The two phases share the chunk's tensors and the attention layer's saved ones; they differ by what is live.
    live = plan.REVERSE_LIVE_RESIDUALS * 96 + plan.REVERSE_MLP_LIVE * 400
    backward = (
        plan.REVERSE_EXCHANGE_RESIDUALS * 96 + plan.REVERSE_EXCHANGE_QUERY * 3 * 32 + plan.REVERSE_EXCHANGE_KV * 32
    )
    assert mlp_phase - exchange_phase == (live - backward) * b > 0
    assert plan.reverse_exchange_bytes(llama, b, "cuda") is None
    one = Setup(positions=20 * chunk, prefill_chunk_size=chunk, gpus=1, compute_bytes=b, fsdp=False, device="cpu")
    two = replace(one, gpus=2, shard_prompt_state=True)
    exchange = plan.context_parallel_exchange(llama, 2, chunk, b, autograd=True)
    tiles = plan.score_tiles(llama, b, chunk, autograd=True, device="cpu")
    expected = max(chunk * mlp_phase + tiles, chunk * exchange_phase + tiles + exchange)
    assert _item(estimate(llama, two), "chunk activations") == expected
    assert expected < chunk * mlp_phase + tiles + exchange
    # One process: no exchange, the MLP's phase.
    assert _item(estimate(llama, one), "chunk activations") == chunk * mlp_phase + tiles
    # CUDA: the multiples with the exchange on top.
    cuda = _item(estimate(llama, replace(two, device="cuda")), "chunk activations")
    single = _item(estimate(llama, replace(one, device="cuda")), "chunk activations")
    assert cuda - single == exchange


def test_widened_delta_rule_prefill_matches_the_allocated_peak():
    """The no-grad delta rule's count (`plan.delta_rule_prefill_bytes`: plain, and widened by Dk with the widened
    values beside it) against the peak that PyTorch's CPU allocator reaches in `torch_gated_delta_rule` and in
    `segment_gated_delta_rule` + `resume_gated_delta_rule` (a later rank of a round), at widths where each of the
    rule's moments is the larger: within 10% above and 5% below."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from calibrate_planner import allocated_peak

    from trl_longstraw import qwen3_5

    g = torch.Generator().manual_seed(0)
    t = 1024
    for k_heads, heads, k_dim, v_dim in ((2, 4, 32, 32), (1, 2, 64, 96), (1, 2, 128, 128)):
        inputs = (
            torch.randn(1, t, k_heads, k_dim, generator=g),
            torch.randn(1, t, k_heads, k_dim, generator=g),
            torch.randn(1, t, heads, v_dim, generator=g),
            -torch.rand(1, t, heads, generator=g),
            torch.rand(1, t, heads, generator=g),
        )
        start = torch.randn(1, heads, k_dim, v_dim, generator=g)

        def later(inputs=inputs, start=start):
            out, carry, _, _ = qwen3_5.segment_gated_delta_rule(*inputs)
            return qwen3_5.resume_gated_delta_rule(out, carry, start)

        with torch.no_grad():
            plain, _ = allocated_peak(functools.partial(qwen3_5.gated_delta_rule, *inputs, start))
            widened, _ = allocated_peak(later)
        predicted = plan.delta_rule_prefill_bytes(t, heads, k_dim, v_dim)
        assert 0.95 <= predicted / plain <= 1.10, ("plain", k_dim, v_dim, predicted, plain)
        predicted = plan.delta_rule_prefill_bytes(t, heads, k_dim, v_dim + k_dim) + t * heads * (v_dim + k_dim) * 4
        assert 0.95 <= predicted / widened <= 1.10, ("widened", k_dim, v_dim, predicted, widened)


def test_dsa_selection_buffers_are_counted(preset_stats):
    """GLM-5.2's top-k selection keeps each query's running candidates (2,048 kept + a block of at most 32,768 keys,
    fp32 scores and int64 numbers) and one fp32 indexer score tile of at most 2^26 elements."""
    _, stats = preset_stats["glm-5.2"]
    assert plan.dsa_selection_bytes(stats, 4096, 2_099_999) == 4096 * (2048 + 32768) * 12 + 2**26 * 4
    assert plan.dsa_selection_bytes(stats, 512, 1000) == 512 * (2048 + 1000) * 12 + 512 * 32 * 1000 * 4
    assert plan.dsa_selection_bytes(preset_stats["qwen3.6-27b"][1], 4096, 2_099_999) == 0
    budget = estimate(stats, Setup(positions=2_100_000, gpus=32, shard_prompt_state=True))
    assert "DSA top-k candidates" in [i for i in budget.items if i.name == "chunk activations"][0].detail


def test_dsa_cpu_counts_match_the_allocated_peaks(monkeypatch):
    """On CPU the DSA selection (`plan.dsa_selection_bytes`) and the sparse MLA (`plan.sparse_attention_bytes`,
    forward without grad and backward) are what `glm_moe_dsa`'s code allocates at its peak (profiler), at widths
    other than the calibration's: one key block and several (then several query blocks too), a merge-bound and a
    tile-bound selection; within 10% above and 5% below."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from calibrate_planner import allocated_peak

    from trl_longstraw import glm_moe_dsa as glm
    from trl_longstraw.testing import tiny_config

    g = torch.Generator().manual_seed(0)
    for s, prefix, index_heads, topk, key_block, tile in (
        (512, 1500, 2, 100, 1 << 15, 1 << 26),
        (300, 2700, 1, 256, 1024, 1 << 18),
    ):
        monkeypatch.setattr(glm, "INDEX_KEY_BLOCK", key_block)
        monkeypatch.setattr(glm, "INDEX_TILE", tile)
        widths = dict(num_attention_heads=6, num_key_value_heads=6, kv_lora_rank=40, qk_rope_head_dim=8)
        config = tiny_config(
            "glm_moe_dsa", vocab_size=128, index_topk=topk, index_n_heads=index_heads, index_head_dim=16, **widths
        ).get_text_config()
        stats = model_stats(meta_model(config), config, state_dtype_bytes=4)
        q, weights = torch.randn(s, index_heads, 16, generator=g), torch.randn(s, index_heads, generator=g)
        keys = [torch.randn(n, 16, generator=g) for n in (prefix // 2, prefix - prefix // 2, s)]
        peak, sel = allocated_peak(functools.partial(glm.select_topk, q, weights, keys, prefix, topk, 0.5))
        predicted = plan.dsa_selection_bytes(stats, s, prefix + s, device="cpu")
        assert 0.95 <= predicted / peak <= 1.10, ("selection", s, topk, predicted, peak)
        # The attention's output and the selection exist beside it: counted by the planner, not grown here.
        beside = s * (6 * 40 * 4 + topk * 8)
        q = torch.randn(s, 6, 48, generator=g, requires_grad=True)
        parts = [torch.randn(n, 48, generator=g, requires_grad=True) for n in (prefix, s)]
        with torch.no_grad():
            forward, _ = allocated_peak(functools.partial(glm.sparse_latent_attention, q, parts, sel, 0.3, 40))
        out = glm.sparse_latent_attention(q, parts, sel, 0.3, 40)
        backward, _ = allocated_peak(functools.partial(torch.autograd.grad, out, [q, *parts], torch.ones_like(out)))
        for autograd, peak in ((False, forward), (True, backward)):
            predicted = plan.sparse_attention_bytes(stats, s, autograd) - beside
            assert 0.95 <= predicted / peak <= 1.10, ("attention", autograd, s, topk, predicted, peak)
    assert plan.sparse_attention_bytes(model_stats(meta_model(LlamaConfig()), LlamaConfig()), 100, True) == 0


@pytest.mark.slow
def test_lm_head_weight_gradient_is_counted(preset_stats):
    """A trained LM head adds TRL's fused head's fp32 `[V, H]` weight gradient to the branch graph, plus its cast
    to a bf16 weight without FSDP (the GPU check's steps: their detached-mode peak); under FSDP2 the cast is the
    unsharded gradient already counted; nothing under LoRA."""
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8)
    full = model_stats(meta_model(config), config)
    lora = model_stats(meta_model(config), config, lora_rank=8)
    head = config.vocab_size * config.hidden_size
    assert full.head_trainable == head and lora.head_trainable == 0
    one = Setup(positions=10_000, gpus=1, trainable_weight_bytes=2, grad_bytes=2, compute_bytes=2)
    assert plan.head_gradient_bytes(full, one) == 6 * head
    assert plan.head_gradient_bytes(full, replace(one, trainable_weight_bytes=4)) == 4 * head
    assert plan.head_gradient_bytes(full, replace(one, gpus=8)) == 4 * head
    assert plan.head_gradient_bytes(lora, one) == 0
    branch = _item(estimate(full, one), "branch graph") - _item(estimate(lora, one), "branch graph")
    assert branch == 6 * head


def test_cpu_inventories_match_the_allocated_peaks():
    """The planner's CPU inventories (`plan.prefill_bytes`: the no-grad prefill; `plan.reverse_bytes`: the exact-mode
    reverse pass) against the peak that PyTorch's CPU allocator reaches in the engine (profiler), for widths other
    than those the tensor counts were read from (H=96, a chunk that does not divide the prompt; qwen3_5's Gated
    DeltaNet with 4 value heads of 24, so three groups of block terms): within 10% above and 5% below. glm_moe_dsa
    too: its DSA selection and sparse attention (`plan.dsa_bytes`) beside its CPU multiples
    (`plan.CPU_ACTIVATION_MULTIPLES`), at widths other than benchmarks/CALIBRATION.md's."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from calibrate_planner import allocated_peak, predict

    from trl_longstraw.adapters import get_adapter
    from trl_longstraw.engine import Engine, PromptGroup
    from trl_longstraw.testing import tiny_config

    common = dict(hidden_size=96, intermediate_size=400, num_attention_heads=3, num_key_value_heads=1, head_dim=32)
    widths = {
        "llama": dict(num_hidden_layers=2, **common),
        "qwen3_5": dict(
            num_hidden_layers=3,
            layer_types=["linear_attention", "linear_attention", "full_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=24,
            **common,
        ),
        "glm_moe_dsa": dict(
            hidden_size=96,
            intermediate_size=400,
            moe_intermediate_size=64,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            num_attention_heads=3,
            num_key_value_heads=3,
            n_routed_experts=4,
            num_experts_per_tok=2,
            kv_lora_rank=32,
            q_lora_rank=48,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            index_topk=64,
            index_head_dim=16,
            index_n_heads=2,
        ),
    }
    p, chunk = 3001, 1500
    for family, w in widths.items():
        torch.manual_seed(0)
        config = tiny_config(family, vocab_size=128, **w).get_text_config()
        model = AutoModelForCausalLM.from_config(config).train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        engine = Engine(model, model, get_adapter(model), chunk_size=chunk, progress=False)
        tokens = torch.randint(3, 128, (p,))

        def exact(group, measure, engine=engine, glm=family == "glm_moe_dsa"):
            """(prefill peak, reverse peak) of one exact-mode prompt, the reverse's with the state and its gradient
            (none for GLM's indexer keys, record element 1)."""
            prefill, state = measure(functools.partial(engine.prefill, group, boundaries=True))
            state.requires_grad_()
            held = 0
            for records in state.records.values():
                for record in records:
                    for i, t in enumerate(record or ()):
                        held += t.nbytes
                        if not (glm and i == 1):
                            t.grad = torch.ones_like(t)
                            held += t.nbytes
            reverse, _ = measure(functools.partial(engine.reverse, group, state))
            return prefill, reverse + held

        exact(PromptGroup(tokens=tokens[: chunk + 1], pad=0, rows=[0]), lambda fn: (0, fn()))  # warm-up
        measured = exact(PromptGroup(tokens=tokens, pad=0, rows=[0]), allocated_peak)
        for mode, peak in zip(("detached", "exact"), measured, strict=True):
            budget = predict(config, p, 1, 1, chunk, mode, 4, device="cpu")
            predicted = sum(_item(budget, n) for n in ("prompt state", "prompt state gradient", "chunk activations"))
            assert 0.95 <= predicted / peak <= 1.10, (family, mode, predicted, peak)


def test_malloc_peak_counts_frees_in_other_threads():
    """`calibrate_planner.malloc_peak` (the sharded rows' measure) sees an allocation, and a tensor freed by another
    thread (as gloo's workers drop collectives' tensors) no longer counts: two 32 MiB tensors one after the other,
    the first released in a thread, peak at one of them, not two."""
    import threading

    sys.path.insert(0, str(REPO / "benchmarks"))
    from calibrate_planner import malloc_peak

    size = 32 * 2**20

    def one_then_another():
        first = [torch.ones(size // 4)]
        thread = threading.Thread(target=first.clear)
        thread.start()
        thread.join()
        return torch.ones(size // 4)

    peak, out = malloc_peak(one_then_another)
    assert out.nbytes == size and 0.95 * size <= peak < 1.5 * size, peak


def test_planner_is_calibrated_on_the_gpu_check():
    """Every step the GPU check measured (benchmarks/gpu/gpu_results.jsonl) is predicted within 10% above and 5%
    below its peak (issue 14's target; benchmarks/calibrate_planner.py, benchmarks/CALIBRATION.md)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from calibrate_planner import gpu_rows

    rows, implied = gpu_rows()
    assert len(rows) >= 20
    for row in rows:
        predicted = sum(v for k, v in row.items() if k not in ("case", "measured"))
        assert 0.95 <= predicted / row["measured"] <= 1.10, row["case"]
    for (model_type, mode), values in implied.items():
        assert plan.activation_multiples(model_type)[mode == "exact"] >= max(values), (model_type, mode)


# ---------------------------------------------------------------------------------------------- README blocks
README = REPO / "README.md"
_BLOCK = re.compile(r"```text\n(\$ python -m trl_longstraw\.plan [^\n]*\n)(.*?)```", re.DOTALL)


def planner_output(command: str) -> str:
    """What `command` (`$ python -m trl_longstraw.plan ...`) prints, run in this process."""
    argv = shlex.split(command.removeprefix("$ python -m trl_longstraw.plan"))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = plan.main(argv)
    return out.getvalue(), code


def readme_with_planner_output(text: str) -> str:
    """`text` with the output of every planner command of a ```text block replaced by what the planner prints; a block
    may hold several commands, each followed by its output and a blank line."""

    def block(match: re.Match) -> str:
        body = match.group(1) + match.group(2)
        commands = [line for line in body.splitlines() if line.startswith("$ python -m trl_longstraw.plan")]
        parts = [command + "\n" + planner_output(command)[0] for command in commands]
        return "```text\n" + "\n".join(parts) + "```"

    return _BLOCK.sub(block, text)


@pytest.mark.slow
def test_readme_planner_blocks_match_the_planner():
    """Every planner command quoted in README.md prints exactly the quoted output (`python -m tests.test_plan`
    rewrites them), and the issue's rows fit: exit 0."""
    text = README.read_text()
    assert text == readme_with_planner_output(text), (
        "README.md's planner output is stale: run python -m tests.test_plan"
    )
    for command in (
        "$ python -m trl_longstraw.plan --model glm-5.2 --positions 2.1M --gpus 32 --gpu-memory 96GB --mode exact "
        "--lora-rank 16 --precision bf16 --shard-prompt-state --expert-parallel",
        "$ python -m trl_longstraw.plan --model qwen3.6-27b --positions 2.1M --gpus 8 --gpu-memory 96GB --mode exact "
        "--shard-prompt-state --offload",
        "$ python -m trl_longstraw.plan --model qwen3.6-27b --positions 4.46M --gpus 8 --gpu-memory 96GB "
        "--mode detached --shard-prompt-state --offload",
        "$ python -m trl_longstraw.plan --model qwen3.6-27b --positions 100K --gpus 8 --gpu-memory 96GB "
        "--mode detached",
    ):
        assert command in text
        assert planner_output(command)[1] == 0, command


# ----------------------------------------------------------------------------------------- recipe config quotes
CONFIGS = sorted((REPO / "recipes/configs").glob("*.yaml"))
_QUOTED = ("verdict:", "  total", "largest prompt that fits:")


def config_with_planner_output(text: str) -> tuple[str, list[tuple[str, int]]]:
    """A recipe config's text with its `#   >` lines replaced by what the planner command quoted above them prints
    (the verdict, the host total, the largest prompt), and `[(command, exit code)]`."""
    lines, out, runs = text.splitlines(keepends=True), [], []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.startswith("#   python -m trl_longstraw.plan "):
            out.append(line)
            i += 1
            continue
        command = ""
        while True:
            out.append(lines[i])
            part = lines[i].removeprefix("#").strip()
            command += " " + part.removesuffix("\\").strip()
            i += 1
            if not part.endswith("\\"):
                break
        while i < len(lines) and lines[i].startswith("#   >"):
            i += 1
        printed, code = planner_output("$ " + command.strip())
        runs.append((command.strip(), code))
        out += [f"#   > {p}\n" for p in printed.splitlines() if p.startswith(_QUOTED)]
    return "".join(out), runs


@pytest.mark.slow
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_recipe_configs_quote_the_planner(path):
    """Every shipped config that quotes a planner command quotes what it prints, and fits (exit 0)."""
    text = path.read_text()
    rewritten, runs = config_with_planner_output(text)
    assert rewritten == text, f"{path.name}'s planner quote is stale: run python -m tests.test_plan"
    assert all(code == 0 for _, code in runs), runs
    if path.name != "tiny_cpu.yaml":
        assert runs, f"{path.name} quotes no planner command"


if __name__ == "__main__":
    README.write_text(readme_with_planner_output(README.read_text()))
    print(f"rewrote the planner output in {README}")
    for config in CONFIGS:
        config.write_text(config_with_planner_output(config.read_text())[0])
        print(f"rewrote the planner output in {config}")


def test_calibration_keeps_hand_notes(tmp_path):
    """A rewrite of CALIBRATION.md from calibrate_planner's template keeps the notes under its `HAND_NOTES` heading
    (`hand_notes`: from that heading to the end), and a file without one gives none."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from calibrate_planner import HAND_NOTES, hand_notes

    path = tmp_path / "CALIBRATION.md"
    assert hand_notes(path) == []
    path.write_text("# Planner calibration\n\n| table |\n")
    assert hand_notes(path) == []
    path.write_text(f"# Planner calibration\n\n| table |\n\n{HAND_NOTES}\n\n- a note\n")
    assert hand_notes(path) == [HAND_NOTES, "", "- a note", ""]
