"""Capacity planner: will a LongStraw GRPO step fit in GPU memory, and what is the longest prompt that does?

    python -m trl_longstraw.plan --model {qwen3.6-27b|glm-5.2|PATH} --positions 2.1M --gpus 8 --gpu-memory 96GB \
        --mode {exact|detached} [--group-size G --completion-length C --prefill-chunk-size N --shard-prompt-state]
    python -m trl_longstraw.plan --config recipes/configs/X.yaml --gpus 8 --gpu-memory 96GB [flags override it]

The presets build the real shapes from transformers config classes and instantiate the model on the meta device, so
parameter counts are exact and nothing is downloaded; PATH loads a local `config.json` (or a folder holding one).

The budget is per GPU, at the peak of a training step (see `estimate`). Exit code 0 when it fits, 3 when it does not,
4 when it fits but the trainer would refuse the setup at construction (`trainer_refusals`), 2 for an error in the
arguments (one line on stderr: an unknown preset, an unsupported model, an unreadable recipe).
The same estimate backs the trainer's memory guard (`trl_longstraw.guards.check_memory`).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

# ------------------------------------------------------------------------------------------------------------ presets
# Public shapes. Qwen3.6-27B: model card and config.json of Qwen/Qwen3.6-27B (model_type qwen3_5; 64 layers laid out
# as 16 x (3 Gated DeltaNet + 1 gated attention), 262,144 native positions, rope_theta 1e7, 64 rotary dims of 256).
# GLM-5.2: zai-org/GLM-5.2 has GLM-5's glm_moe_dsa geometry (78 layers, 3 dense, MLA 512 + 64, 256 experts top-8,
# indexer 32 x 128, top-k 2048) plus IndexShare (index_topk_freq 4, index_skip_topk_offset 3: 21 layers own an
# indexer, 57 reuse the previous one's top-k and carry no indexer weights), a 1,048,576-position native window and
# rope_theta 8e6 (GLM-5 and GLM-5.1: 202,752 and 1e6).
QWEN3_6_27B = dict(
    vocab_size=248320,
    hidden_size=5120,
    intermediate_size=17408,
    num_hidden_layers=64,
    full_attention_interval=4,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    max_position_embeddings=262144,
    tie_word_embeddings=False,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
)
GLM_5_2 = dict(
    vocab_size=154880,
    hidden_size=6144,
    intermediate_size=12288,
    moe_intermediate_size=2048,
    num_hidden_layers=78,
    first_k_dense_replace=3,
    num_attention_heads=64,
    num_key_value_heads=64,
    q_lora_rank=2048,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=192,
    v_head_dim=256,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=8,
    index_n_heads=32,
    index_head_dim=128,
    index_topk=2048,
    index_topk_freq=4,
    index_skip_topk_offset=3,
    max_position_embeddings=1048576,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 8_000_000.0},
)


def _qwen3_6_27b():
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**copy.deepcopy(QWEN3_6_27B))


def _glm_5_2():
    from transformers import GlmMoeDsaConfig

    return GlmMoeDsaConfig(**copy.deepcopy(GLM_5_2))


# name -> (display name, config builder)
PRESETS = {"qwen3.6-27b": ("Qwen3.6-27B", _qwen3_6_27b), "glm-5.2": ("GLM-5.2", _glm_5_2)}

# RoPE types that extend the trained window. Anything else ("default", ...) is unscaled.
ROPE_SCALING_TYPES = ("linear", "dynamic", "yarn", "longrope", "llama3")


def preset_config(name: str, positions: int | None = None):
    """The text config of preset `name`, with YaRN set when `positions` exceed its native window."""
    if name.lower() not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)} or pass a config.json path")
    config = PRESETS[name.lower()][1]()
    return with_yarn(config, positions) if positions is not None else config


def _rope_dicts(config) -> list[dict]:
    params = getattr(config, "rope_parameters", None) or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        return list(params.values())  # one dict per layer type
    return [params] if params else []


def rope_window(config) -> tuple[int | None, int | None]:
    """`(configured window, native window)` of a text config, in positions.

    The configured window is `max_position_embeddings`. The native (trained) window is the same for unscaled RoPE,
    and `original_max_position_embeddings` when a scaling such as YaRN is set. `(None, None)` if the config has
    no `max_position_embeddings`.
    """
    window = getattr(config, "max_position_embeddings", None)
    native = window
    for params in _rope_dicts(config):
        if params.get("rope_type") in ROPE_SCALING_TYPES and params.get("original_max_position_embeddings"):
            native = min(native, params["original_max_position_embeddings"])
    return window, native


def rope_scaled(config) -> bool:
    """Whether the config's RoPE extends its trained window (linear, dynamic, YaRN, LongRoPE, llama3)."""
    return any(params.get("rope_type") in ROPE_SCALING_TYPES for params in _rope_dicts(config))


def yarn_factor(positions: int, native_window: int) -> int:
    """The smallest integer YaRN factor whose window `factor * native_window` holds `positions`."""
    return max(1, math.ceil(positions / native_window))


def with_yarn(config, positions: int):
    """A copy of the text `config` with YaRN RoPE scaling when `positions` exceed its native window.

    The factor is the smallest integer that covers `positions`; `max_position_embeddings` becomes the scaled window,
    and every other RoPE setting (theta, partial rotary factor, multimodal sections) is kept. Within the native
    window the config is returned unchanged (a copy). Load the model with this config (e.g.
    `AutoModelForCausalLM.from_pretrained(name, config=with_yarn(AutoConfig.from_pretrained(name), P))`): setting it
    on a built model does not recompute the rotary frequencies.
    """
    config = copy.deepcopy(config)
    _, native = rope_window(config)
    if native is None:
        raise ValueError(f"{type(config).__name__} has no max_position_embeddings: it does not use a RoPE window")
    if positions <= native:
        return config
    factor = yarn_factor(positions, native)
    params = _rope_dicts(config)
    if len(params) != 1:
        raise ValueError(
            f"{type(config).__name__} has per-layer-type RoPE parameters; set YaRN on each layer type by hand"
        )
    rope = dict(params[0])
    rope.update(rope_type="yarn", factor=float(factor), original_max_position_embeddings=native)
    config.rope_parameters = rope
    config.max_position_embeddings = native * factor
    return config


def load_config(path: str | Path):
    """The text config in a local `config.json` (or a folder holding one). Nothing is downloaded."""
    from transformers import AutoConfig

    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(
            f"{str(path)!r} is neither a preset ({', '.join(PRESETS)}, in any case) nor a config.json or a folder "
            "holding one"
        )
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"{file} has no model_type: it is not a transformers config.json")
    try:
        config = AutoConfig.for_model(data.pop("model_type"), **data)
    except (KeyError, ValueError) as e:
        raise ValueError(f"{file}: transformers cannot build its config ({e})") from None
    return config.get_text_config()


# -------------------------------------------------------------------------------------------------- prompt state
def qwen3_5_state_bytes(config, dtype_bytes: int = 2) -> tuple[int, int]:
    """`(bytes per prompt token, fixed bytes)` of a qwen3_5 prompt state.

    Full-attention layers keep K and V `[Hkv, D]` per token. Gated DeltaNet layers keep the conv tail (the last
    `kernel - 1` inputs of the causal conv, `[conv_dim, kernel - 1]`, model dtype) and the recurrent state
    `[Hv, Dk, Dv]` in fp32. Must equal the qwen3_5 adapter's `state_bytes` once it lands in `ADAPTERS`
    (`prompt_state_bytes` prefers the adapter's and the tests pin both to the same numbers).
    """
    types = config.layer_types
    full = sum(t == "full_attention" for t in types)
    linear = sum(t == "linear_attention" for t in types)
    per_token = full * 2 * config.num_key_value_heads * config.head_dim * dtype_bytes
    conv_dim = (
        2 * config.linear_num_key_heads * config.linear_key_head_dim
        + config.linear_num_value_heads * config.linear_value_head_dim
    )
    conv_tail = conv_dim * (config.linear_conv_kernel_dim - 1) * dtype_bytes
    recurrent = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
    return per_token, linear * (conv_tail + recurrent)


def glm_moe_dsa_state_bytes(config, dtype_bytes: int = 2) -> tuple[int, int]:
    """`(bytes per prompt token, fixed bytes)` of a glm_moe_dsa prompt state.

    Every layer keeps the compressed latent after its norm (`kv_lora_rank`) and the rope key (`qk_rope_head_dim`);
    layers that run their own indexer (`indexer_types == "full"`) also keep its keys (`index_head_dim`); layers that
    share the previous indexer's top-k keep none. Never decompressed K/V. Must equal the glm_moe_dsa adapter's
    `state_bytes` once it lands in `ADAPTERS`.
    """
    layers = config.num_hidden_layers
    indexers = sum(t == "full" for t in (config.indexer_types or ["full"] * layers))
    latent = layers * (config.kv_lora_rank + config.qk_rope_head_dim)
    return (latent + indexers * config.index_head_dim) * dtype_bytes, 0


# Formulas for architectures whose adapter is being written in parallel; an entry in ADAPTERS takes precedence.
LOCAL_STATE_BYTES = {
    "qwen3_5": qwen3_5_state_bytes,
    "qwen3_5_text": qwen3_5_state_bytes,
    "glm_moe_dsa": glm_moe_dsa_state_bytes,
}


def prompt_state_bytes(config, dtype_bytes: int = 2) -> tuple[int, int]:
    """`(bytes per prompt token, fixed bytes)` of the prompt state of a text config, from its adapter.

    Raises:
        ValueError: for a model type without an adapter, listing the supported ones.
    """
    from .adapters import ADAPTERS

    adapter = ADAPTERS.get(config.model_type)
    if adapter is not None:
        return adapter.state_bytes(config, dtype_bytes)
    if config.model_type in LOCAL_STATE_BYTES:
        return LOCAL_STATE_BYTES[config.model_type](config, dtype_bytes)
    supported = sorted(set(ADAPTERS) | set(LOCAL_STATE_BYTES))
    raise ValueError(
        f"model_type {config.model_type!r} is not supported by trl_longstraw. Supported: {', '.join(supported)}."
    )


def query_exchange(config) -> tuple[int, int]:
    """`(query elements, output elements)` per token of one attention layer exchanged by a branch round of the
    sharded prompt state: absorbed MLA queries `[latent | rope]` and latents for `glm_moe_dsa`, else `head_dim`
    queries and values, for all query heads."""
    heads = config.num_attention_heads
    if config.model_type == "glm_moe_dsa":
        return heads * (config.kv_lora_rank + config.qk_rope_head_dim), heads * config.kv_lora_rank
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads * head_dim, heads * head_dim


def kept_attention(config) -> tuple[int, int]:
    """`(output elements, fp32 log-sum-exp elements)` per token that the exact-mode reverse pass keeps for gradient
    checkpointing's recompute (`attention.prefix_merge_attention`'s `reuse`), summed over the layers whose prompt
    attention runs through `kv.attend`: every layer of a KV model, the full-attention layers of qwen3_5, none of
    glm_moe_dsa (its MLA + DSA attention keeps nothing)."""
    if config.model_type == "glm_moe_dsa":
        return 0, 0
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    layers = sum(t in ("full_attention", "sliding_attention") for t in types)
    return layers * query_exchange(config)[1], layers * config.num_attention_heads


def key_value_width(config) -> int:
    """Key (or value) elements per token of one attention layer: all key-value heads (`head_dim` wide)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return (getattr(config, "num_key_value_heads", None) or heads) * head_dim


def context_parallel_heads(config) -> int:
    """Whether the prompt passes of a sharded state are context-parallel rounds exchanging queries and partial
    outputs (`sharding._ShardedPrefixAttention`, `context_parallel_exchange`): 0 for every shard group size (KV-cache
    models, and `qwen3_5`, whose delta rule runs sequence-parallel for any group size), -1 for none (`glm_moe_dsa`: its
    MLA + DSA rounds exchange rows instead, `round_row_elems`). A positive value would be a head count that the group
    size must divide."""
    return -1 if config.model_type == "glm_moe_dsa" else 0


def context_parallel_exchange(stats: ModelStats, world: int, chunk: int, compute_bytes: int, autograd: bool) -> int:
    """Transient bytes of one attention layer's exchange in a context-parallel round of `world` chunks of `chunk`
    tokens (`sharding._ShardedPrefixAttention`), on each rank: what its forward (prefill) or backward (`autograd`,
    the exact-mode reverse pass, whose forward's buffers are freed by then) holds at its peak, beyond the layer's own
    tensors. Counted from the code at the moments that traces of 2-process CPU runs show as the peaks
    (`benchmarks/calibrate_planner.py --trace FAMILY --sharded P`), per token of this rank's chunk, `W = world`, and
    checked against those runs' peaks (benchmarks/CALIBRATION.md's sharded rows):

    - forward, at the final merge: every rank's queries, keys and values gathered (`W (q + kv)`, compute dtype) and
      the gathered queries' permuted copy (`W q`); in fp32, the partial outputs and log-sum-exps of every rank's
      queries against this rank's chunks (`W (out + h)`), packed and received (twice more), the merge's stack of the
      own and received parts and its weighted copy (`2 (W + 1) out`);
    - backward, at the final all-to-all: in fp32, every rank's queries, output gradients, outputs, log-sum-exps, keys
      and values gathered (`W (q + 2 out + h + kv)`) and their permuted copy without the keys (`W (q + 2 out + h)`),
      the contiguous output gradients and outputs (`2 W out`), the query-gradient shares (`W q`) and the earlier
      chunks' key and value gradients (`W kv`), this rank's packed rows (`q + 2 out + h`), the shares and key-value
      gradients sent and received (`2 W (q + kv)`); the gathered queries cast back (`W q`, compute dtype).
    """
    q, out = stats.query_exchange
    h, kv, w, b = stats.attention_heads, stats.round_kv_elems, world, compute_bytes
    if not autograd:
        return chunk * (w * (2 * q + kv) * b + ((5 * w + 2) * out + 3 * w * h) * 4)
    rows = q + 2 * out + h
    backward = w * (rows + kv) + w * rows + 2 * w * out + w * q + w * kv + rows + 2 * w * (q + kv)
    return chunk * (backward * 4 + w * q * b)


# ------------------------------------------------------------------------------------------------------- model
# Activation bytes of one layer, per token, as a multiple of the inputs and outputs of its matmuls (nn.Linear,
# nn.Conv1d, and the `top_k` active experts of fused MoE weights) in the compute dtype, `(no grad, with autograd)`.
# The multiple covers norms, activation functions and attention internals. With autograd: the recomputed layer's
# saved tensors and the gradients its backward allocates (the reverse pass's autograd buffers; a branch replay's
# too). No grad: what one layer's forward holds at once (the prefill), used for MoE models only; dense models' prefill
# is itemized (`prefill_bytes`). Calibrated on the steps of the GPU check whose peak is that phase (H200, bf16,
# real-width slices, chunks of 16,384: the exact-mode rows, and GLM's detached ones; the other detached rows peak in
# a branch's backward, at the LM head's weight gradient, `head_gradient_bytes`): the peak beyond the weights,
# gradients, prompt state and checkpointed layer inputs, per token and matmul element, is the same within 2% at every
# prompt length of a family; these are its largest values rounded up to 0.05 (`python benchmarks/calibrate_planner.py`
# prints them, benchmarks/CALIBRATION.md). GLM's DSA top-k selection is an item of its own (`dsa_bytes`).
# Those runs used the torch fallbacks of Gated DeltaNet (fla absent: fp32 internals) and of GLM's DSA selection and
# sparse attention; the fla and Triton kernels hold less. Model types without their own entry use the KV-cache
# families' (llama's). On CPU the reverse pass of dense models is itemized instead (`reverse_bytes`); MoE models keep
# these multiples there too, which are CUDA figures, GLM with its DSA selection and sparse attention counted from their
# code beside them (`dsa_bytes`; benchmarks/CALIBRATION.md has its CPU rows).
ACTIVATION_MULTIPLES = {
    "llama": (1.25, 1.75),
    "glm_moe_dsa": (0.5, 2.0),
    "qwen3_5_text": (1.8, 3.2),
    "qwen3_5": (1.8, 3.2),
}


def score_tiles(stats: ModelStats, compute_bytes: int, queries: int, autograd: bool, device: str = "cuda") -> int:
    """Bytes of the fp32 score tiles `[queries, Hq, KEY_BLOCK]` that prefix-merge attention's portable path holds for
    `queries` query tokens: scores and probabilities in the forward, also their gradients in the backward (4 tiles
    with autograd, 3 without, counting a temporary). The portable path runs where no fused kernel takes the inputs:
    fp32 on CUDA, or heads wider than 256 or not a multiple of 8 (`attention._kernel_for`; on CPU its flash kernel
    takes every width). 0 for GLM's sparse MLA, which does not use prefix-merge attention, and where a kernel runs."""
    from .attention import KEY_BLOCK

    kernel = device == "cpu" or (compute_bytes == 2 and stats.head_dim <= 256 and stats.head_dim % 8 == 0)
    if kernel or stats.model_type == "glm_moe_dsa" or not stats.attention_heads:
        return 0
    return (4 if autograd else 3) * queries * stats.attention_heads * KEY_BLOCK * 4


def head_gradient_bytes(stats: ModelStats, setup: Setup) -> int:
    """Bytes of the LM head's weight gradient in flight in a branch's backward, when the head is trained.

    TRL's fused LM head (`trl.kernels.chunked_logprob`, behind `fused_lm_head=True`) accumulates the weight gradient
    over its token tiles in an fp32 `[V, H]` buffer and returns it cast to the weight's dtype: both exist at once.
    The cast is a copy only for a weight that is not fp32, and a new buffer only without FSDP (the parameter's
    `.grad` then takes it with an in-place add); under FSDP2 it is the unsharded gradient, counted in "FSDP
    all-gathered". On the GPU check's steps (full fine-tuning, bf16) this is the detached-mode peak: `[V, H]` x 6
    bytes (benchmarks/CALIBRATION.md). 0 when the head is not trained (LoRA)."""
    n = stats.head_trainable
    shards = setup.gpus if setup.fsdp else 1
    weight_bytes = setup.compute_bytes if shards > 1 else setup.trainable_weight_bytes
    cast = n * weight_bytes if shards == 1 and weight_bytes != 4 else 0
    return n * 4 + cast


# The DSA merge (`glm_moe_dsa._keep_topk`) of a block of `n` candidates per query into `r` running ones, bytes per
# query (traced on CPU, `glm_moe_dsa.select_topk` alone at several widths): the block's fp32 scores, then the larger
# of three moments: the keep mask `[r + n]` bool and the tie ranks of a slice (`TOPK_SLICE` elements: a tie mask,
# its int32 copy and cumsum; `DSA_TIE_RANK_BYTES` per element); the keep mask and `nonzero`'s kept columns (two
# int64, then a copy of one: `DSA_NONZERO_BYTES` per kept); the kept columns and their gathers and selects, fp32 and
# int64 (`DSA_KEPT_BYTES` per kept: the new running set among them; `DSA_FIRST_KEPT_BYTES` into an empty running
# set: the columns and two gathers).
DSA_TIE_RANK_BYTES = 9
DSA_NONZERO_BYTES = 24
DSA_KEPT_BYTES = 53
DSA_FIRST_KEPT_BYTES = 20


def dsa_selection_bytes(stats: ModelStats, queries: int, keys: int, device: str = "cuda") -> int:
    """Bytes of the DSA top-k selection of `queries` query tokens over `keys` prompt keys (`glm_moe_dsa`'s PyTorch
    path, `glm_moe_dsa._running_topk`). 0 for other models.

    On CPU, what the code holds (traced: `benchmarks/calibrate_planner.py --trace glm_moe_dsa`, and
    `glm_moe_dsa.select_topk` alone): the running candidates of the other query blocks (`index_topk` fp32 scores and
    int64 key numbers per query; also this block's when the keys span several key blocks), and for one block of
    queries (as many as fit `INDEX_TILE` head scores against a key block of at most `INDEX_KEY_BLOCK`) the larger of
    its two phases: the fp32 score tile `[Q, heads, keys]` and the block's scores `[Q, keys]` it sums to; or the merge
    of the block's scores into the running candidates (`DSA_TIE_RANK_BYTES`).
    On CUDA, the term the GPU check's activation multiples were fitted with (`ACTIVATION_MULTIPLES`, measured on this
    path before the Triton kernels and the merge above): every query's `index_topk` plus one key block of candidates,
    12 bytes each, and one score tile; the Triton kernels now used there hold less."""
    if stats.model_type != "glm_moe_dsa" or not stats.index_topk:
        return 0
    from .glm_moe_dsa import INDEX_KEY_BLOCK, INDEX_TILE, TOPK_SLICE

    k, heads = stats.index_topk, stats.index_heads
    block = min(INDEX_KEY_BLOCK, max(keys, 1))
    if device != "cpu":
        return queries * (k + block) * (4 + 8) + min(INDEX_TILE, queries * heads * block) * 4
    rows = min(queries, max(1, INDEX_TILE // (heads * block)))
    kept = min(k, keys)
    step = max(1, TOPK_SLICE // rows)  # tie ranks per query and slice

    def phase(n: int, running: int) -> int:
        """Per query of a block, a key block of `n` scored and merged into `running` candidates."""
        ranks = min(step, n) * DSA_TIE_RANK_BYTES
        late = kept * (DSA_KEPT_BYTES if running else DSA_FIRST_KEPT_BYTES)
        merge = n * 4 + max(running + n + max(ranks, kept * DSA_NONZERO_BYTES), late)
        return max(n * (heads + 1) * 4, merge)

    # The first key block: the query blocks before this one hold their candidates. A later one (the second is the
    # largest): every query block holds them.
    peak = (queries - rows) * kept * (4 + 8) + rows * phase(block, 0)
    if keys > block:
        peak = max(peak, queries * kept * (4 + 8) + rows * phase(min(block, keys - block), kept))
    # The key block: its keys gathered from the chunks (fp32) and their int64 numbers.
    return peak + block * (stats.index_dim * 4 + 8)


def sparse_attention_bytes(stats: ModelStats, queries: int, autograd: bool) -> int:
    """Bytes of `glm_moe_dsa`'s PyTorch sparse MLA (`_SparseLatentAttention`) for `queries` query tokens, each over
    `index_topk` selected keys; 0 for other models. It runs blocks of `ATTN_SLOTS // index_topk` queries; traced on
    CPU (`sparse_latent_attention` alone at several widths), with the whole output `[S, heads, R]` and the selection
    `[S, k]` int64 beside it:
    - forward: the block's gathered latent rows `[Q * k, R + Dr]` fp32, and the larger of the gather's moment (one
      `ROUTE_ROWS` copy, the routing's int64 sort order and rows per slot) and the scores' (three fp32
      `[Q, heads, k]`);
    - with autograd, the backward's block: the gathered rows, their gradient and its latent part's product
      `[Q * k, R]`, the routing, two fp32 `[Q, heads, k]` (probabilities and their gradient), and the query gradient
      `[S, heads, R + Dr]`."""
    if stats.model_type != "glm_moe_dsa" or not stats.index_topk:
        return 0
    from .glm_moe_dsa import ATTN_SLOTS, ROUTE_ROWS

    k, heads = stats.index_topk, stats.attention_heads
    row, latent = (n // heads for n in stats.query_exchange)  # R + Dr and R
    rows = min(queries, max(1, ATTN_SLOTS // k))
    slots = rows * k
    scores = rows * heads * k * 4
    routing = slots * 16
    held = queries * (heads * latent * 4 + k * 8)
    if autograd:
        return held + slots * (2 * row + latent) * 4 + routing + 2 * scores + queries * heads * row * 4
    return held + slots * row * 4 + max(min(ROUTE_ROWS, slots) * row * 4 + routing, 3 * scores)


def dsa_bytes(stats: ModelStats, queries: int, keys: int, autograd: bool, device: str = "cuda") -> int:
    """What `glm_moe_dsa`'s attention holds for `queries` query tokens over `keys` prompt keys beyond the activation
    multiples: on CUDA the fitted selection term (`dsa_selection_bytes`, which the multiples were fitted beside; they
    cover the sparse attention); on CPU the larger of the selection and the sparse attention
    (`sparse_attention_bytes`), which never coexist. 0 for other models."""
    selection = dsa_selection_bytes(stats, queries, keys, device)
    if device != "cpu" or not selection:
        return selection
    return max(selection, sparse_attention_bytes(stats, queries, autograd))


# The no-grad prefill of a dense model, per chunk token, from what its code holds at the peak (traced allocation by
# allocation on CPU: `benchmarks/calibrate_planner.py --trace FAMILY`): RoPE's cos and sin (fp32 `[T, head_dim]`) and
# the larger of one layer's two phases:
# - the gated MLP: the residual stream's tensors `[T, H]` (`PREFILL_RESIDUAL_TENSORS`: the embeddings, which the
#   backbone's forward keeps referenced, the layer's input, the residual after attention and the normed MLP input)
#   and act(gate), up and their product `[T, I]`, in a layer after the first (the last runs no MLP);
# - the torch fallback of Gated DeltaNet (`qwen3_5.torch_gated_delta_rule`, where fla is absent): the residual
#   stream's tensors before the MLP (`DELTA_RULE_RESIDUAL_TENSORS`: the embeddings, the layer's input and its normed
#   input), the projections (qkv `[T, conv_dim]` and its conv output, z `[T, Hv, Dv]`) and its fp32 work tensors per
#   value head. Without autograd the delta rule converts its inputs and builds its block terms group by group, a
#   group being `delta_rule_group` tokens (whole blocks of 64 positions, about `T * Dv / 64`): these scale with the
#   group, not the chunk. Their peak is the larger of:
#   - a group's intra-block terms: the group's inputs (`DELTA_RULE_KEY_VECTORS` `[Dk]`: the fp32 query and key, the
#     L2-normed key, the scaled query, k_beta; `DELTA_RULE_VALUE_VECTORS` `[Dv]`: v_beta) and either
#     `DELTA_RULE_BLOCK_MATRICES` `[block, block]` per block (decays, UT system, scores) or, the larger moments where
#     `Dv > block` or `Dk + Dv > 2 block`, the UT solve's new values `[Dv]` beside two of them
#     (`DELTA_RULE_SOLVE_MATRICES`), then beside the decayed key `[Dk]` and the scores alone; from the second group on,
#     also the previous group's terms, which the scan's loop variables keep (`DELTA_RULE_TERMS`: decayed query and key,
#     k_cumdecay `[Dk]`, new values `[Dv]`, the intra-block scores), and the earlier groups' block outputs `[Dv]` per
#     token (the largest over the groups: the last one may be shorter);
#   - the final stack: the block outputs and their stack `[Dv]` per chunk token, and the last group's terms.
# On a later rank of a context-parallel round (`qwen3_5._round_core`) the rule runs on values widened by `Dk` zero
# columns `[T, Hv, Dv + Dk]` (`segment_gated_delta_rule`): the same work tensors with `Dv + Dk` for `Dv` (groups
# included), and the widened values themselves in the compute dtype (traced: `segment_gated_delta_rule` alone, the
# no-grad peak within 1.5% of this count at `Dk = Dv = 32`, `Dk = 64, Dv = 96` and `Dk = Dv = 128`, widened or not).
PREFILL_RESIDUAL_TENSORS = 4
PREFILL_MLP_TENSORS = 3
DELTA_RULE_RESIDUAL_TENSORS = 3
DELTA_RULE_KEY_VECTORS, DELTA_RULE_VALUE_VECTORS, DELTA_RULE_BLOCK_MATRICES = 5, 1, 3
DELTA_RULE_SOLVE_MATRICES = 2
DELTA_RULE_TERMS = (3, 1, 1)  # `([Dk] vectors, [Dv] vectors, block matrices)` of one group's block terms


def delta_rule_group(tokens: int, v_dim: int) -> int:
    """Tokens per group of the no-grad delta rule's block terms (`qwen3_5.torch_gated_delta_rule`) in a chunk of
    `tokens`: `max(1, blocks * Dv // 64)` blocks of 64 positions, at most the chunk."""
    from .qwen3_5 import DELTA_RULE_BLOCK

    blocks = -(-tokens // DELTA_RULE_BLOCK)
    return min(tokens, max(1, blocks * v_dim // DELTA_RULE_BLOCK) * DELTA_RULE_BLOCK)


def delta_rule_prefill_bytes(chunk: int, heads: int, k_dim: int, v_dim: int) -> int:
    """Bytes of the fp32 work tensors of the no-grad delta rule over a `chunk`-token chunk (see
    `PREFILL_RESIDUAL_TENSORS`): `heads` value heads of key width `k_dim` and value width `v_dim`. The largest over
    the chunk's groups (the last one may be shorter) and the final stack."""
    from .qwen3_5 import DELTA_RULE_BLOCK

    group = delta_rule_group(chunk, v_dim)
    sizes = [min(group, chunk - start) for start in range(0, chunk, group)]
    key, value, blocks = DELTA_RULE_TERMS
    terms = key * k_dim + value * v_dim + blocks * DELTA_RULE_BLOCK
    inputs = DELTA_RULE_KEY_VECTORS * k_dim + DELTA_RULE_VALUE_VECTORS * v_dim
    # Per token of a group, the largest of three moments of its intra-block terms: before the UT solve, after it (the
    # new values beside two block matrices), and after the decays (also the decayed key, the scores alone left).
    within = inputs + max(
        DELTA_RULE_BLOCK_MATRICES * DELTA_RULE_BLOCK,
        v_dim + DELTA_RULE_SOLVE_MATRICES * DELTA_RULE_BLOCK,
        k_dim + v_dim + DELTA_RULE_BLOCK,
    )
    peak = sizes[0] * within
    for i in range(1, len(sizes)):
        # The group's terms, the previous group's terms and the earlier groups' block outputs.
        peak = max(peak, sizes[i] * within + sizes[i - 1] * terms + sum(sizes[:i]) * v_dim)
    stack = 2 * chunk * v_dim + sizes[-1] * terms
    return heads * 4 * max(peak, stack)


def prefill_bytes(
    stats: ModelStats, compute_bytes: int, chunk: int, widened: bool = False, mixers: bool = True
) -> int | None:
    """Bytes of the no-grad prefill of a `chunk`-token chunk (see `PREFILL_RESIDUAL_TENSORS`), or None for MoE
    models, whose routed experts' dispatch buffers are not itemized (`ACTIVATION_MULTIPLES` covers them).

    `widened`: on a later rank of a context-parallel round, whose Gated DeltaNet layers run the delta rule on values
    widened to `[chunk, Hv, Dv + Dk]` (`qwen3_5.segment_gated_delta_rule`); no effect on a model without them.
    `mixers=False`: the gated MLP's phase alone (without the Gated DeltaNet's)."""
    if stats.num_experts or not stats.intermediate_size:
        return None
    s, b = stats, compute_bytes
    rope = chunk * 2 * s.head_dim * 4
    # The last layer runs no MLP in a prompt pass (`Engine._records_only`), so the peak is in an earlier layer: the
    # chunk's records of a last attention layer (counted in the prompt state) are not written yet, and in a two-layer
    # model the layer is the first, whose input is the embeddings themselves.
    residuals = PREFILL_RESIDUAL_TENSORS - (s.num_layers < 3)
    unwritten = 2 * s.kv_width * b if s.layer_kinds and s.layer_kinds[-1] == "attention" else 0
    peak = chunk * (residuals * s.hidden_size + PREFILL_MLP_TENSORS * s.intermediate_size) * b
    heads, k_dim, v_dim, conv_dim = s.delta_rule
    if heads and mixers:
        projections = chunk * (DELTA_RULE_RESIDUAL_TENSORS * s.hidden_size + 2 * conv_dim + heads * v_dim) * b
        width = v_dim + k_dim if widened else v_dim
        if widened:  # the widened values, beside the projections they come from
            projections += chunk * heads * width * b
        peak = max(peak, projections + delta_rule_prefill_bytes(chunk, heads, k_dim, width))
    return rope + peak - chunk * unwritten


def round_states_bytes(stats: ModelStats, world: int) -> int:
    """Bytes of the all-gather of every rank's final state and transition `[W, Hv, Dk, Dv + Dk]` fp32 that one Gated
    DeltaNet layer of a context-parallel round of `world` ranks holds (`qwen3_5._round_core`); 0 without one."""
    heads, k_dim, v_dim, _ = stats.delta_rule
    return world * heads * k_dim * (v_dim + k_dim) * 4


# The exact-mode reverse pass of a dense model on CPU, checkpointed with the attention outputs kept (the defaults),
# per chunk token, from what its code holds at the allocated peak (traced allocation by allocation:
# `benchmarks/calibrate_planner.py --trace FAMILY`, at two sets of widths per family). The peak is in the backward of
# the gated MLP of the last layer but one (layer L-2), while two sets of tensors are live:
# - the chunk's own (`REVERSE_CHUNK_RESIDUALS` + L tensors `[T, H]`: the embeddings, each layer's output kept by the
#   checkpoint; each attention layer's kept output and fp32 log-sum-exp, and its recomputed K and V records
#   `[T, Hkv * D]`; RoPE's cos and sin, fp32; the position ids);
# - layer L-2's recomputed graph and the MLP backward's gradients (`REVERSE_LIVE_RESIDUALS` `[T, H]` with the
#   incoming gradient, `REVERSE_MLP_LIVE` `[T, I]`: gate, up, act(gate) and three gradients), and its token mixer's
#   saved tensors: an attention layer's (`REVERSE_ATTENTION_QUERY_TENSORS` `[T, q_proj width]`-sized query-side
#   tensors, per model type, and K and V), or Gated DeltaNet's with its hand-written backward
#   (`qwen3_5._DeltaRuleFunction`): what the function saves (`delta_rule_saved_bytes`) and what the layer's graph
#   keeps around it (`REVERSE_DELTA_RULE`: the conv window and its output `[T, conv_dim]`; `[T, Hv, Dv]`: z, its
#   activation, the gated norm's three and the fp32 value; `[T, Hv, Dk]` fp32: the L2-normalized query and key; and
#   per-head scalars: g, beta and the L2 and gated norms' temporaries).
# The last layer adds little at the peak: in a prompt pass it computes its records alone (`Engine._records_only`: no
# MLP, final norm or token-mixer output, whose graph the backward would never consume), and the backward consumes
# the graph of its records before reaching layer L-2 (traced: the 4 `[T, H]` and 4 `[T, I]` tensors and the last
# mixer's saved tensors that it kept before are gone, and so are the final norm's input and output). A last
# attention layer's output projection returns zeros too, so a gated attention's query projection, gate and gated
# output are freed at once (traced: they were live at the peak before, 10 MiB of qwen3_5's 137 at `CPU_WIDTHS`).
# The CUDA reverse pass keeps the activation multiples (`ACTIVATION_MULTIPLES`), calibrated on the GPU check.
REVERSE_CHUNK_RESIDUALS = 1
REVERSE_LIVE_RESIDUALS = 6
REVERSE_MLP_LIVE = 6
# Query-side tensors `[T, Hq * D]` of an attention layer's recomputed graph (llama: the contiguous query and output
# copies; qwen3_5: also the query projection with its gate `[T, 2 Hq D]`, the q-norm's normalized query, the rotated
# query, the gate's sigmoid and the gated output). Model types without an entry use llama's.
REVERSE_ATTENTION_QUERY_TENSORS = {"llama": 2, "qwen3_5_text": 7, "qwen3_5": 7}
# Around the hand-written delta rule (traced, `--trace qwen3_5` at two sets of widths; was `conv=3, value=8, key=12,
# blocks=5, scalars=10` with autograd through the plain rule, which saved more).
REVERSE_DELTA_RULE = dict(conv=2, value=6, key=2, scalars=6)
# What `qwen3_5._DeltaRuleFunction` saves (`qwen3_5._SAVED_TERMS`, `v_new` and the states), per token and value head:
# `[Dk]` vectors (key, scaled query, k_beta, k_beta exp(c), w, k_d, q exp(c)), `[block]` rows (the decays `P`, the UT
# system, the intra-block scores), scalars (beta, exp(c), exp(c_last - c)), `REVERSE_WIDENED_VALUES` `[Dv]` vectors,
# and the state at the start of every block `[Dk, Dv]` (with the final one) and its decay.
DELTA_RULE_SAVED = dict(key=7, blocks=3, scalars=3)
# A later rank of a context-parallel round (`qwen3_5._round_core`) runs the rule on values widened by `Dk` zero columns
# (`segment_gated_delta_rule`), with autograd: its saved `[T, Hv, Dv]` fp32 tensors, `REVERSE_WIDENED_VALUES` (the
# values, the UT-transformed values and the new values), are `Dv + Dk` wide there, and so is the state at the start of
# each block; beside them the widened values `[T, Hv, Dv + Dk]` (compute dtype) and the resumed output `[T, Hv, Dv]`
# fp32 (traced: `segment_gated_delta_rule` and `resume_gated_delta_rule` against `torch_gated_delta_rule`, what the
# graph keeps after the forward at `Dk = 48, Dv = 24`: the count exactly).
REVERSE_WIDENED_VALUES = 3


def delta_rule_value_work(heads: int, k_dim: int, width: int) -> int:
    """Per token, bytes of the delta rule's value-wide fp32 tensors that its graph keeps (`REVERSE_WIDENED_VALUES`
    `[Hv, width]` and the state after each block, `[Hv, Dk, width]` per `DELTA_RULE_BLOCK` tokens): `width` is `Dv`,
    or `Dv + Dk` on a later rank of a context-parallel round."""
    from .qwen3_5 import DELTA_RULE_BLOCK

    return heads * (REVERSE_WIDENED_VALUES * width * DELTA_RULE_BLOCK + k_dim * width) * 4 // DELTA_RULE_BLOCK


def delta_rule_saved_bytes(tokens: int, heads: int, k_dim: int, v_dim: int) -> int:
    """Bytes that `qwen3_5._DeltaRuleFunction` saves for its backward over `tokens` tokens of `heads` value heads
    (see `DELTA_RULE_SAVED`), fp32: the per-token tensors, and per block of `DELTA_RULE_BLOCK` the state at its start
    (and the final state) and its decay."""
    from .qwen3_5 import DELTA_RULE_BLOCK

    c, blocks = DELTA_RULE_SAVED, -(-tokens // DELTA_RULE_BLOCK)
    per_token = c["key"] * k_dim + REVERSE_WIDENED_VALUES * v_dim + c["blocks"] * DELTA_RULE_BLOCK + c["scalars"]
    return heads * 4 * (blocks * DELTA_RULE_BLOCK * per_token + (blocks + 1) * k_dim * v_dim + blocks)


def _reverse_mixer_bytes(stats: ModelStats, kind: str, b: int, widened: bool = False) -> int:
    """Per chunk token, the saved tensors of one recomputed token mixer (`kind`: "attention" or "linear_attention")
    in the CPU reverse pass (see `REVERSE_CHUNK_RESIDUALS`); `widened`: a Gated DeltaNet's on a later rank of a
    context-parallel round (see `REVERSE_WIDENED_VALUES`), whose value-wide work tensors are `(Dv + Dk) / Dv` times
    the plain rule's (`delta_rule_value_work`), beside the widened values and the resumed output."""
    from .qwen3_5 import DELTA_RULE_BLOCK

    if kind == "linear_attention":
        heads, k_dim, v_dim, conv_dim = stats.delta_rule
        c, saved = REVERSE_DELTA_RULE, DELTA_RULE_SAVED
        keys, scalars = c["key"] + saved["key"], c["scalars"] + saved["scalars"]
        base = (
            c["conv"] * conv_dim * b
            + heads * (c["value"] * v_dim + keys * k_dim + saved["blocks"] * DELTA_RULE_BLOCK + scalars) * 4
        )
        if not widened:
            return base + delta_rule_value_work(heads, k_dim, v_dim)
        beside = heads * ((v_dim + k_dim) * b + v_dim * 4)
        return base + delta_rule_value_work(heads, k_dim, v_dim + k_dim) + beside
    queries = REVERSE_ATTENTION_QUERY_TENSORS.get(stats.model_type, REVERSE_ATTENTION_QUERY_TENSORS["llama"])
    return (queries * stats.attention_heads * stats.head_dim + 2 * stats.kv_width) * b


def reverse_bytes(
    stats: ModelStats, compute_bytes: int, device: str, widened: bool = False, mixers: tuple[str, ...] = ()
) -> int | None:
    """Bytes per chunk token of the exact-mode reverse pass (checkpointed, attention outputs kept) where it is
    itemized: dense models on CPU (see `REVERSE_CHUNK_RESIDUALS`). None elsewhere: the CUDA reverse pass and MoE
    models use the activation multiples (`ACTIVATION_MULTIPLES`). `widened`: on a later rank of a context-parallel
    round, whose Gated DeltaNet layers run the widened delta rule (`REVERSE_WIDENED_VALUES`). `mixers`: the token
    mixer kinds to take for the recomputed layer (default: those of the layers before the last)."""
    s, b = stats, compute_bytes
    if device != "cpu" or s.num_experts or not s.intermediate_size or not s.layer_kinds:
        return None
    outputs, lses = s.kept_attention
    attention_layers = s.layer_kinds.count("attention")
    chunk = (
        (REVERSE_CHUNK_RESIDUALS + s.num_layers) * s.hidden_size * b
        + outputs * b
        + lses * 4
        + attention_layers * 2 * s.kv_width * b
        + 2 * s.head_dim * 4
        + 8
    )
    last, earlier = s.layer_kinds[-1], set(s.layer_kinds[:-1])
    live = (
        REVERSE_LIVE_RESIDUALS * s.hidden_size * b
        + REVERSE_MLP_LIVE * s.intermediate_size * b
        + max(_reverse_mixer_bytes(s, kind, b, widened) for kind in mixers or earlier or {last})
    )
    return chunk + live


# What a rank holds beside an attention layer's exchange in a context-parallel round of the CPU reverse pass
# (`sharding._ShardedPrefixAttention.backward`, at its final all-to-all), besides the chunk's own tensors and the
# exchange (`context_parallel_exchange`): the layer's recomputed graph (the residual stream's
# `REVERSE_EXCHANGE_RESIDUALS` `[T, H]`: the recomputed input norm's two, the incoming gradient, the gradients of the
# norm's product and of the output projection's input, and the layer input's gradient accumulator; the token mixer's
# saved query-side tensors and K and V, `_reverse_mixer_bytes`) and the attention backward's own gradients
# (`REVERSE_EXCHANGE_QUERY` `[T, Hq * D]`: the own causal part's dq and the repeated keys' and values' dK and dV, the
# repeated keys and values, the fp32 dq accumulator and its sum; `REVERSE_EXCHANGE_KV` `[T, Hkv * D]`: dK and dV and
# their sums, the recomputed K projection and RoPE's output and their gradients). The MLP's tensors of the same layer
# are gone by then (traced: `benchmarks/calibrate_planner.py --trace llama --sharded 8192`, both ranks; the
# inventory of the MLP's phase, `reverse_bytes`, with the exchange on top was 12-19% above the measured peaks).
REVERSE_EXCHANGE_RESIDUALS = 6
REVERSE_EXCHANGE_QUERY = 7
REVERSE_EXCHANGE_KV = 6


def reverse_exchange_bytes(stats: ModelStats, compute_bytes: int, device: str) -> int | None:
    """Bytes per chunk token that a rank holds in the CPU reverse pass beside an attention layer's exchange of a
    context-parallel round (`REVERSE_EXCHANGE_RESIDUALS`), the exchange itself excluded; None where `reverse_bytes`
    is (the CUDA multiples take the exchange as a sum)."""
    full = reverse_bytes(stats, compute_bytes, device, mixers=("attention",))
    if full is None:
        return None
    s = stats
    mlp_phase = REVERSE_LIVE_RESIDUALS * s.hidden_size + REVERSE_MLP_LIVE * s.intermediate_size
    exchange_phase = (
        REVERSE_EXCHANGE_RESIDUALS * s.hidden_size
        + REVERSE_EXCHANGE_QUERY * s.attention_heads * s.head_dim
        + REVERSE_EXCHANGE_KV * s.kv_width
    )
    return full + (exchange_phase - mlp_phase) * compute_bytes


def exchange_rows(stats: ModelStats, rows: int) -> int:
    """Query rows of every rank that one attention layer gathers at once when a round of the sharded prompt state
    exchanges `rows` in all: `glm_moe_dsa` slices its exchanges (`glm_moe_dsa.EXCHANGE_ROWS`), the others do not."""
    if stats.model_type != "glm_moe_dsa":
        return rows
    from .glm_moe_dsa import EXCHANGE_ROWS

    return min(rows, EXCHANGE_ROWS)


# On CPU, GLM's rest of a layer beside its DSA selection and sparse attention (`dsa_bytes`), per chunk token and matmul
# element as `ACTIVATION_MULTIPLES`: fitted on benchmarks/CALIBRATION.md's traced CPU rows, after the prompt passes
# stopped running the last layer's attention and MLP (implied 0.29 no grad, 0.66 with autograd; the held-out widths
# imply 0.45 and 0.58). The CUDA multiples (0.5, 2.0), fitted on GPU steps that ran that last layer, are 3x too high
# with autograd there.
CPU_ACTIVATION_MULTIPLES = {"glm_moe_dsa": (0.5, 0.7)}


def activation_multiples(model_type: str, device: str = "cuda") -> tuple[float, float]:
    """`(no grad, with autograd)` activation multiples of a model type (see `ACTIVATION_MULTIPLES`), on CPU
    `CPU_ACTIVATION_MULTIPLES` where a model type has them."""
    if device == "cpu" and model_type in CPU_ACTIVATION_MULTIPLES:
        return CPU_ACTIVATION_MULTIPLES[model_type]
    return ACTIVATION_MULTIPLES.get(model_type, ACTIVATION_MULTIPLES["llama"])


@dataclass(frozen=True)
class ModelStats:
    """What the budget needs to know about a model. Built by `model_stats` from a real or meta model.

    Attributes:
        total_params: all parameters.
        trainable_params: parameters that get gradients and optimizer state.
        root_params: parameters outside the decoder layers (embeddings, final norm, LM head).
        largest_layer_params: parameters of the largest decoder layer.
        largest_layer_trainable: trainable parameters of the largest decoder layer.
        num_layers: decoder layers.
        hidden_size: width of the residual stream.
        layer_activation_elems: per token, the largest over layers of the matmul inputs and outputs.
        total_activation_elems: per token, the same summed over layers.
        state_per_token: prompt-state bytes per prompt token (bf16 records).
        state_fixed: prompt-state bytes independent of the length (recurrent states).
        root_trainable: trainable parameters outside the decoder layers.
        query_exchange: `(query elements, output elements)` per token of one attention layer as a branch round of the
            sharded prompt state exchanges them: all heads' queries, and their outputs (the latent for MLA).
        kept_attention: `(output elements, log-sum-exp elements)` per token, all layers, that the checkpointed
            reverse pass keeps for the recompute (`kept_attention`).
        num_experts: routed experts per MoE layer (0 for dense models).
        expert_params, expert_trainable: parameters of the routed experts (fused `[E, out, in]` weights), all layers.
        largest_layer_dense_params, largest_layer_dense_trainable: the largest decoder layer without its routed
            experts (what FSDP2 gathers per layer under expert parallelism, where experts are never gathered).
        largest_layer_expert_params: the routed experts of the layer that has the most.
        model_type: the config's, for its activation multiples (`ACTIVATION_MULTIPLES`).
        attention_heads, head_dim: query heads and their width, for the score tiles of the portable attention path.
        index_heads, index_topk, index_dim: the DSA indexer's heads, top-k and key width (`glm_moe_dsa`), for its
            selection buffers.
        head_trainable: elements of the LM head's weight `[V, H]` when it is trained (0 under LoRA or frozen), for
            the fp32 weight gradient of TRL's fused LM head (`head_gradient_bytes`).
        intermediate_size: the widest MLP intermediate of a layer (the dense MLP's, or the shared and routed
            experts' of a token), for the no-grad prefill's transients (`prefill_bytes`).
        delta_rule: Gated DeltaNet's `(value heads, key head dim, value head dim, conv channels)` (qwen3_5), else 0s.
        context_parallel_heads: see `context_parallel_heads` (0: context-parallel prompt passes for any shard group).
        round_row_elems: per token, the record elements of one layer that a context-parallel round gathers from
            every rank (`glm_moe_dsa`: the MLA row and the index key, `glm_moe_dsa.round_rows`); 0 for others.
        kv_width: key (and value) elements per token of one attention layer, `Hkv * head_dim`.
        layer_kinds: each layer's token mixer, "attention" or "linear_attention" (Gated DeltaNet), for the CPU
            reverse pass's inventory (`reverse_bytes`).
        round_kv_elems: per token, the key and value elements of one attention layer that a context-parallel round
            gathers with the queries (`sharding._RoundSplit`); 0 for `glm_moe_dsa`.
    """

    total_params: int
    trainable_params: int
    root_params: int
    largest_layer_params: int
    largest_layer_trainable: int
    num_layers: int
    hidden_size: int
    layer_activation_elems: int
    total_activation_elems: int
    state_per_token: int
    state_fixed: int
    root_trainable: int = 0
    query_exchange: tuple[int, int] = (0, 0)
    kept_attention: tuple[int, int] = (0, 0)
    num_experts: int = 0
    expert_params: int = 0
    expert_trainable: int = 0
    largest_layer_dense_params: int = 0
    largest_layer_dense_trainable: int = 0
    largest_layer_expert_params: int = 0
    model_type: str = ""
    attention_heads: int = 0
    head_dim: int = 0
    index_heads: int = 0
    index_topk: int = 0
    index_dim: int = 0
    head_trainable: int = 0
    intermediate_size: int = 0
    delta_rule: tuple[int, int, int, int] = (0, 0, 0, 0)
    context_parallel_heads: int = 0
    round_row_elems: int = 0
    kv_width: int = 0
    layer_kinds: tuple[str, ...] = ()
    round_kv_elems: int = 0


def decoder_layers(causal_lm: nn.Module) -> nn.ModuleList:
    """The decoder layers of a transformers causal LM (`causal_lm.base_model.layers`)."""
    layers = getattr(causal_lm.base_model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(causal_lm).__name__} has no base_model.layers: trl_longstraw cannot plan it")
    return layers


def _activation_elems(layer: nn.Module, top_k: int) -> int:
    elems = 0
    for module in layer.modules():
        if isinstance(module, nn.Linear):
            elems += module.in_features + module.out_features
        elif isinstance(module, nn.Conv1d):
            elems += module.in_channels + module.out_channels
        else:
            # Fused experts `[E, out, in]`: a token passes through `top_k` of them.
            for p in module.parameters(recurse=False):
                if p.ndim == 3:
                    elems += top_k * (p.shape[1] + p.shape[2])
    return elems


def model_stats(
    causal_lm: nn.Module,
    config=None,
    lora_rank: int | None = None,
    state_dtype_bytes: int = 2,
    lora_targets: list[str] | None = None,
) -> ModelStats:
    """Counts a causal LM's parameters and per-token activations (works on the meta device).

    With `lora_rank`, only LoRA adapters of that rank are trainable: on every `nn.Linear` of the decoder layers
    (PEFT's `target_modules="all-linear"`), or with `lora_targets` on those whose name ends with one of them (PEFT's
    `target_modules` list); otherwise the model's `requires_grad` flags decide. The prompt state's records are counted
    at `state_dtype_bytes` per element (the compute dtype).
    """
    config = config if config is not None else causal_lm.config.get_text_config()
    layers = decoder_layers(causal_lm)
    top_k = getattr(config, "num_experts_per_tok", None) or 1

    def targeted(name: str) -> bool:
        return lora_targets is None or name.rsplit(".", 1)[-1] in lora_targets

    def lora(module: nn.Module) -> int:
        return sum(
            lora_rank * (m.in_features + m.out_features)
            for name, m in module.named_modules()
            if isinstance(m, nn.Linear) and targeted(name)
        )

    def trainable(module: nn.Module) -> int:
        return lora(module) if lora_rank else sum(p.numel() for p in module.parameters() if p.requires_grad)

    # A DTensor (FSDP2) reports its global size, so a sharded model counts as a whole one.
    layer_params = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    largest = max(range(len(layers)), key=layer_params.__getitem__)
    base = sum(p.numel() for p in causal_lm.parameters())
    adapters = sum(lora(layer) for layer in layers) if lora_rank else 0
    acts = [_activation_elems(layer, top_k) for layer in layers]
    # Routed experts: fused `[E, out, in]` weights (transformers' `*Experts` modules); LoRA never targets them.
    experts = [
        [
            p
            for m in layer.modules()
            if not isinstance(m, (nn.Linear, nn.Conv1d))
            for p in m.parameters(recurse=False)
            if p.ndim == 3
        ]
        for layer in layers
    ]
    expert_counts = [sum(p.numel() for p in ps) for ps in experts]
    expert_trained = [0 if lora_rank else sum(p.numel() for p in ps if p.requires_grad) for ps in experts]
    dense = [n - e for n, e in zip(layer_params, expert_counts, strict=True)]
    dense_trainable = [trainable(layer) - e for layer, e in zip(layers, expert_trained, strict=True)]
    per_token, fixed = prompt_state_bytes(config, state_dtype_bytes)
    head = causal_lm.get_output_embeddings()
    return ModelStats(
        total_params=base + adapters,
        trainable_params=adapters if lora_rank else trainable(causal_lm),
        root_params=base - sum(layer_params),
        largest_layer_params=layer_params[largest],
        largest_layer_trainable=trainable(layers[largest]),
        num_layers=len(layers),
        hidden_size=config.hidden_size,
        layer_activation_elems=max(acts),
        total_activation_elems=sum(acts),
        state_per_token=per_token,
        state_fixed=fixed,
        root_trainable=0 if lora_rank else trainable(causal_lm) - sum(trainable(layer) for layer in layers),
        query_exchange=query_exchange(config),
        kept_attention=kept_attention(config),
        num_experts=max((ps[0].shape[0] for ps in experts if ps), default=0),
        expert_params=sum(expert_counts),
        expert_trainable=sum(expert_trained),
        largest_layer_dense_params=max(dense),
        largest_layer_dense_trainable=max(dense_trainable),
        largest_layer_expert_params=max(expert_counts),
        model_type=config.model_type,
        attention_heads=config.num_attention_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        index_heads=getattr(config, "index_n_heads", 0) or 0,
        index_dim=getattr(config, "index_head_dim", 0) or 0,
        index_topk=getattr(config, "index_topk", 0) or 0,
        head_trainable=head.weight.numel() if head is not None and not lora_rank and head.weight.requires_grad else 0,
        intermediate_size=getattr(config, "intermediate_size", 0) or 0,
        delta_rule=_delta_rule_dims(config),
        context_parallel_heads=context_parallel_heads(config),
        round_row_elems=(
            config.kv_lora_rank + config.qk_rope_head_dim + config.index_head_dim
            if config.model_type == "glm_moe_dsa"
            else 0
        ),
        kv_width=key_value_width(config),
        layer_kinds=tuple(
            "linear_attention" if t == "linear_attention" else "attention"
            for t in (getattr(config, "layer_types", None) or ["full_attention"] * len(layers))
        ),
        round_kv_elems=0 if config.model_type == "glm_moe_dsa" else 2 * key_value_width(config),
    )


def _delta_rule_dims(config) -> tuple[int, int, int, int]:
    """`(Hv, Dk, Dv, conv channels)` of a config's Gated DeltaNet layers, or zeros when it has none."""
    if "linear_attention" not in (getattr(config, "layer_types", None) or []):
        return 0, 0, 0, 0
    heads, k_dim, v_dim = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
    return heads, k_dim, v_dim, 2 * config.linear_num_key_heads * k_dim + heads * v_dim


def meta_model(config) -> nn.Module:
    """The causal LM of a text config, built on the meta device (shapes only, no memory, no download)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


# ------------------------------------------------------------------------------------------------------ budget
@dataclass(frozen=True)
class Setup:
    """The run being planned. Byte sizes are per element.

    Attributes:
        positions: prompt length in tokens; the prompt state holds `positions - 1` of them.
        completion_length: tokens per completion (one branch).
        group_size: completions per prompt; branches are replayed one at a time, so only the score tensors grow
            with it.
        prefill_chunk_size: prompt tokens per prefill and reverse chunk.
        mode: "exact" or "detached".
        gpus: processes (one GPU each).
        gpu_memory: bytes per GPU (default 80 GB).
        shard_prompt_state: the prompt state and its gradient are split over the GPUs of a shard group.
        shard_group: GPUs per shard group (`prompt_shard_group_size`); 0 means all of them. Under FSDP2 every setup
            gathers layer by layer (smaller groups pad their passes to the world's, as the ranks do unsharded).
        fsdp: weights, gradients and optimizer state are sharded over the GPUs (FSDP2 full sharding); otherwise
            replicated (DDP).
        gradient_checkpointing: decoder layers keep only their input and are recomputed in backward.
        reverse_checkpointing: exact mode under gradient checkpointing: the reverse pass's chunks are checkpointed
            too (`LongStrawGRPOConfig.reverse_checkpointing`); False keeps a chunk's whole graph.
        trainable_weight_bytes, frozen_weight_bytes, grad_bytes, optimizer_bytes: per parameter, as stored
            (optimizer: AdamW's two moments). Default: mixed precision as Accelerate's FSDP2 sets it up
            (trainable weights upcast to fp32, frozen ones kept in bf16, fp32 gradients and AdamW states).
        compute_bytes: activations and all-gathered weights (bf16).
        headroom: fraction of `gpu_memory` left for the CUDA context, NCCL buffers and allocator fragmentation.
        expert_parallel: routed experts split by expert over an EP group of `ep_size` GPUs (0: all of them), through
            transformers' expert parallelism; never all-gathered. The other parameters stay under FSDP2.
        offload: FSDP2's CPUOffloadPolicy: the sharded parameters (fp32 master weights), their gradients and the
            optimizer state live in host memory, and the optimizer steps there.
        offload_boundary_states: exact mode: the recurrent chunk-boundary states wait in pinned host memory
            (`LongStrawGRPOConfig.offload_boundary_states`).
        attention_reuse: exact mode under gradient checkpointing: the reverse pass keeps each attention layer's
            output for the recompute (`LongStrawGRPOConfig.reverse_attention_reuse`).
        prefill_attention_reuse: exact mode, unsharded: the prefill keeps each attention layer's output and
            log-sum-exp for every prompt token until the reverse pass's forward takes them
            (`LongStrawGRPOConfig.prefill_attention_reuse`). Nothing in detached mode or with a sharded state.
        gpus_per_node: processes per node, for the host memory of a node.
        host_memory: host bytes per node for the offloaded items; None: not checked (the CLI's default is
            `default_host_memory`).
        device: "cuda" (the planner's case) or "cpu", which attention kernels run (`score_tiles`).
    """

    positions: int
    completion_length: int = 512
    group_size: int = 8
    prefill_chunk_size: int = 4096
    mode: str = "exact"
    gpus: int = 1
    gpu_memory: int = 80 * 10**9
    shard_prompt_state: bool = False
    shard_group: int = 0
    fsdp: bool = True
    gradient_checkpointing: bool = True
    reverse_checkpointing: bool = True
    trainable_weight_bytes: int = 4
    frozen_weight_bytes: int = 2
    grad_bytes: int = 4
    optimizer_bytes: int = 8
    compute_bytes: int = 2
    headroom: float = 0.05
    expert_parallel: bool = False
    ep_size: int = 0
    offload: bool = False
    offload_boundary_states: bool = False
    attention_reuse: bool = True
    prefill_attention_reuse: bool = False
    gpus_per_node: int = 8
    host_memory: int | None = None
    device: str = "cuda"

    def __post_init__(self):
        if self.expert_parallel and self.ep_size and self.gpus % self.ep_size:
            raise ValueError(f"ep_size={self.ep_size} must divide the {self.gpus} GPUs")
        if self.mode not in ("exact", "detached"):
            raise ValueError(f"mode={self.mode!r}: use 'exact' or 'detached'")
        for name in ("positions", "completion_length", "group_size", "prefill_chunk_size", "gpus", "gpu_memory"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be positive")


@dataclass(frozen=True)
class Item:
    """One line of a budget: `nbytes` per GPU.

    `resident`: already allocated before the first training step (weights). `phase`: items with a phase never
    coexist; only the largest of them counts.
    """

    name: str
    nbytes: int
    detail: str = ""
    resident: bool = False
    phase: str | None = None


@dataclass(frozen=True)
class Budget:
    """Per-GPU peak memory of one training step, line by line."""

    stats: ModelStats
    setup: Setup
    items: list[Item] = field(default_factory=list)
    host: list[Item] = field(default_factory=list)

    @property
    def peak(self) -> int:
        """Bytes at the peak: every item without a phase, plus the largest phased item."""
        phased = [i.nbytes for i in self.items if i.phase is not None]
        return sum(i.nbytes for i in self.items if i.phase is None) + max(phased, default=0)

    @property
    def to_allocate(self) -> int:
        """Bytes still to be allocated at the first training step: the peak minus the resident weights."""
        return self.peak - sum(i.nbytes for i in self.items if i.resident)

    @property
    def host_per_node(self) -> int:
        """Host bytes per node that the step keeps there (offloaded items, `setup.gpus_per_node` processes)."""
        return sum(i.nbytes for i in self.host) * min(self.setup.gpus, self.setup.gpus_per_node)

    @property
    def fits_host(self) -> bool:
        """Whether the host items fit `setup.host_memory` per node (True when no budget is given)."""
        return self.setup.host_memory is None or self.host_per_node <= self.setup.host_memory

    @property
    def fits(self) -> bool:
        return self.peak <= self.setup.gpu_memory and self.fits_host


def state_tokens(positions: int) -> int:
    """Prompt tokens held in the prompt state: all but the last, which starts every branch."""
    return positions - 1


def estimate(stats: ModelStats, setup: Setup) -> Budget:
    """The per-GPU memory of one LongStraw GRPO training step at its peak.

    A step holds the weights, gradients and optimizer state (sharded under FSDP, plus the all-gathered root module
    and two layers, current and prefetched), the prompt state of one prompt (exact mode: also its gradient, and the
    fixed part of the state once per chunk boundary, as the reverse pass restarts from each; with a sharded prompt
    state, this GPU's share of the boundaries, the final one and one broadcast copy), and then one of: a branch
    graph (a completion replayed with autograd), one chunk's activations (the exact-mode reverse pass, or the no-grad
    prefill), generation's decode tail (this GPU's rows' decoded tokens against the prompt state), or TRL's copies of
    the batch (concatenations, shuffle): those never coexist. The batch itself (ids and masks) is held throughout.

    With a sharded state whose prompt passes are context-parallel rounds, the GPU is the one with the largest peak: a
    later rank of a round, which also holds the round's exchanges and, for Gated DeltaNet layers, runs the delta rule
    on values widened by Dk (`qwen3_5.segment_gated_delta_rule`) and holds the round's recurrent records.
    """
    s, u = stats, setup
    exact = u.mode == "exact"
    shards = u.gpus if u.fsdp else 1
    ep = (u.ep_size or u.gpus) if u.expert_parallel else 1
    if u.expert_parallel and (not s.num_experts or s.num_experts % ep):
        raise ValueError(
            f"expert parallelism over {ep} GPUs needs a MoE model whose routed experts divide evenly among them "
            f"(this model has {s.num_experts or 'no'} routed experts per layer)"
        )

    def share(n: int, parts: int) -> int:
        return -(-n // parts)

    # Under expert parallelism the routed experts are split by expert over the EP group (never all-gathered); the
    # other parameters stay under FSDP2. Without it, every parameter is under FSDP2.
    moved = s.expert_params if u.expert_parallel else 0
    moved_trainable = s.expert_trainable if u.expert_parallel else 0
    fsdp_trainable, fsdp_frozen = s.trainable_params - moved_trainable, s.total_params - s.trainable_params
    fsdp_frozen -= moved - moved_trainable
    # The experts of an EP rank are sharded by FSDP2 over the ranks that hold the same experts (`gpus / ep` of them),
    # so every GPU holds 1/gpus of them, as without expert parallelism (trl_longstraw/expert_parallel.py).
    fsdp_weights = share(fsdp_trainable * u.trainable_weight_bytes + fsdp_frozen * u.frozen_weight_bytes, shards)
    ep_weights = share(
        moved_trainable * u.trainable_weight_bytes + (moved - moved_trainable) * u.frozen_weight_bytes, shards
    )
    sharded = f", sharded /{shards}" if shards > 1 else ""
    experts = ""
    if moved:
        sharded = f", sharded /{shards} but the routed experts" if shards > 1 else ", but the routed experts"
        experts = f", which are split by expert /{ep} ({s.num_experts // ep} of {s.num_experts} per GPU)"
        if ep < shards:
            experts += f" and sharded /{shards // ep} by FSDP2"
    # FSDP2's CPUOffloadPolicy keeps the sharded parameters (the fp32 master weights), their gradients and the
    # optimizer state in host memory and steps the optimizer there; experts outside FSDP2 stay on the GPU.
    host = []
    where = "on the host (FSDP2 CPU offload)" if u.offload else ""
    frozen = s.total_params - s.trainable_params
    weights_detail = (
        f"{_count(s.trainable_params)} trainable x {u.trainable_weight_bytes} B"
        + (f" + {_count(frozen)} frozen x {u.frozen_weight_bytes} B" if frozen else "")
        + sharded
        + experts
    )
    plain = f", sharded /{shards}" if shards > 1 else ""
    grad_detail = f"{u.grad_bytes} B per trainable parameter" + (sharded + experts if moved_trainable else plain)
    optim_detail = f"AdamW exp_avg + exp_avg_sq, {u.optimizer_bytes} B per trainable parameter" + (
        sharded + experts if moved_trainable else plain
    )
    fsdp = {
        "weights": fsdp_weights,
        "gradients": share(fsdp_trainable * u.grad_bytes, shards),
        "optimizer state": share(fsdp_trainable * u.optimizer_bytes, shards),
    }
    local = {
        "weights": ep_weights,
        "gradients": share(moved_trainable * u.grad_bytes, shards),
        "optimizer state": share(moved_trainable * u.optimizer_bytes, shards),
    }
    details = {"weights": weights_detail, "gradients": grad_detail, "optimizer state": optim_detail}
    items = []
    for name in ("weights", "gradients", "optimizer state"):
        if u.offload:
            host.append(Item(name, fsdp[name], details[name]))
            on_gpu = local[name]
            detail = f"{_size(fsdp[name])} {where}" + (" but the routed experts' share" if local[name] else "")
        else:
            on_gpu, detail = fsdp[name] + local[name], details[name]
        items.append(Item(name, on_gpu, detail, resident=name == "weights"))
    state_parts = (u.shard_group or u.gpus) if u.shard_prompt_state else 1
    if shards > 1:
        # Lockstep passes (the sharded state's over all GPUs, or equal pass counts per rank over the world, without a
        # sharded state or with smaller shard groups): FSDP2 gathers and frees layer by layer
        # (distributed.fsdp2_gathered); the root's own parameters stay gathered, its gradient accumulates unreduced
        # until the micro-batch's sync pass. Routed experts under expert parallelism are never gathered.
        layer, layer_trainable = s.largest_layer_params, s.largest_layer_trainable
        if u.expert_parallel:
            # With EP groups smaller than the GPUs, FSDP2 gathers a layer's local experts over their replicas.
            local_experts = share(s.largest_layer_expert_params, ep) if ep < shards else 0
            layer = s.largest_layer_dense_params + local_experts
            layer_trainable = s.largest_layer_dense_trainable
        gathered = s.root_params + s.root_trainable + 2 * layer + layer_trainable
        detail = (
            "per pass: root module (embeddings, head) and its unreduced gradient + 2 largest layers (current, "
            f"prefetched) + 1 layer's unsharded gradient, {u.compute_bytes} B each"
        )
        if u.expert_parallel:
            detail += ", routed experts excluded" if ep == shards else f", each layer's local experts (1/{ep})"
        staged = 0
        if u.offload:
            # The current and prefetched layers' shards are copied to the GPU before their all-gather, and one
            # layer's reduce-scattered gradient shard waits there for its copy to the host.
            staged = share(2 * layer * u.trainable_weight_bytes + layer_trainable * u.grad_bytes, shards)
            detail += f" + {_size(staged)} of shards staged from and to the host"
        items.append(Item("FSDP all-gathered", gathered * u.compute_bytes + staged, detail))
    tokens = state_tokens(u.positions)
    chunks = -(-tokens // u.prefill_chunk_size)
    # Per-token records (attention K/V, MLA latents) are split over the shard group. The fixed recurrent records
    # (Gated DeltaNet): the final one on every GPU, and in exact mode one per chunk boundary. Sharded, a boundary
    # stays on the owner of its chunk and the reverse pass holds one more, broadcast from its owner
    # (see docs/distributed.md).
    # With `offload_boundary_states`, the superseded boundaries wait in host memory (this GPU's share of them when
    # sharded): the GPU keeps the newest, and the reverse pass holds the chunk's own, the restored previous one and
    # the one in flight (or a broadcast copy).
    offloaded = exact and u.offload_boundary_states and s.state_fixed > 0
    if not exact:
        copies = 1
    elif offloaded:
        copies = min(chunks, 3)
    elif state_parts > 1:
        copies = min(chunks, share(chunks - 1, state_parts) + 2)
    else:
        copies = chunks
    per_token = share(tokens * s.state_per_token, state_parts)
    detail = f"{tokens:,} tokens x {_size(s.state_per_token)}"
    if state_parts > 1:
        detail += f" sharded /{state_parts}"
    if s.state_fixed:
        detail += f" + {copies:,} x {_size(s.state_fixed)} fixed"
        if offloaded:
            detail += f" (of {chunks:,} chunk boundaries: the rest wait on the host)"
        elif exact and state_parts > 1:
            detail += f" (of {chunks:,} chunk boundaries: this GPU's share, the final one and one broadcast copy)"
        elif exact:
            detail += " (one per chunk boundary)"
        elif state_parts > 1:
            detail += ", replicated"
    items.append(Item("prompt state", per_token + copies * s.state_fixed, detail))
    # The config refuses the switch in detached mode and with a sharded state (a suggestion may lead there).
    if exact and u.prefill_attention_reuse and not u.shard_prompt_state:
        outputs, lses = s.kept_attention
        per = outputs * u.compute_bytes + lses * 4
        items.append(
            Item(
                "prefill attention outputs",
                tokens * per,
                f"{tokens:,} tokens x {_size(per)} (prefill_attention_reuse: each attention layer's output and "
                "log-sum-exp, until the reverse pass takes them)",
            )
        )
    if offloaded:
        held = share(chunks - 1, state_parts)
        host.append(
            Item(
                "boundary states",
                held * s.state_fixed,
                f"{held:,} x {_size(s.state_fixed)} (offload_boundary_states"
                + (f": this GPU's share of {chunks - 1:,}" if state_parts > 1 else "")
                + ", pinned)",
            )
        )
    # Every branch reads every per-token record, so their gradients accumulate over the whole prompt; a recurrent
    # record's gradient lives only while the reverse pass crosses its chunk boundary (two at a time).
    boundary_grads = min(chunks, 2)
    items.append(
        Item(
            "prompt state gradient",
            per_token + boundary_grads * s.state_fixed if exact else 0,
            (
                "exact mode: the per-token records' gradients"
                + (f" + {boundary_grads} boundary state gradients in flight" if s.state_fixed else "")
            )
            if exact
            else "detached mode: none",
        )
    )
    no_grad, autograd = activation_multiples(s.model_type, u.device)
    layer = int(autograd * s.layer_activation_elems * u.compute_bytes)
    # Under gradient checkpointing, each attention layer's output and log-sum-exp over the prompt, kept from a
    # reverse chunk's forward for the recompute.
    outputs, lses = s.kept_attention
    kept = outputs * u.compute_bytes + lses * 4 if u.gradient_checkpointing else 0
    if u.gradient_checkpointing:
        graph_per_token = s.num_layers * s.hidden_size * u.compute_bytes + layer
        how = "checkpointed: layer inputs + one recomputed layer and its gradients"
    else:
        graph_per_token = int(autograd * s.total_activation_elems * u.compute_bytes)
        how = "every layer's activations and their gradients"
    branch = u.completion_length * graph_per_token
    detail = f"{u.completion_length:,} tokens x {_size(graph_per_token)} ({how})"
    if state_parts > 1:
        # A branch round gathers every rank's queries for one attention layer at a time, and returns fp32 partial
        # outputs (computed, sent, received: three copies).
        queries, outputs = s.query_exchange
        rows = exchange_rows(s, state_parts * u.completion_length)
        exchange = rows * (queries * u.compute_bytes + 3 * (outputs + 1) * 4)
        branch += exchange
        detail += f" + {_size(exchange)} exchanged by one attention layer across the {state_parts} ranks' branches"
        if rows < state_parts * u.completion_length:
            detail += f" ({rows:,} queries at a time)"
    # One branch at a time (see `Setup.group_size`): its completion's tokens are the queries.
    tiles = score_tiles(s, u.compute_bytes, u.completion_length, autograd=True, device=u.device)
    if tiles:
        branch += tiles
        detail += f" + {_size(tiles)} of fp32 score tiles (portable attention path)"
    selection = dsa_bytes(s, u.completion_length, tokens, autograd=True, device=u.device)
    if selection:
        branch += selection
        detail += f" + {_size(selection)} of DSA top-k candidates" + (
            " or sparse attention" if u.device == "cpu" else ""
        )
    head = head_gradient_bytes(s, u)
    if head:
        branch += head
        detail += f" + {_size(head)} of LM head weight gradient (fused head: fp32 [V, H])"
    items.append(Item("branch graph", branch, detail, phase="activations"))
    chunk = min(u.prefill_chunk_size, max(tokens, 1))
    tiles = score_tiles(s, u.compute_bytes, chunk, autograd=exact, device=u.device)
    scored = f" + {_size(tiles)} of fp32 score tiles (portable attention path)" if tiles else ""
    selection = dsa_bytes(s, chunk, tokens, autograd=exact, device=u.device)
    if selection:
        tiles += selection
        scored += f" + {_size(selection)} of DSA top-k candidates" + (
            " or sparse attention" if u.device == "cpu" else ""
        )
    heads = s.context_parallel_heads
    context_parallel = state_parts > 1 and (heads == 0 or (heads > 0 and heads % state_parts == 0))
    # The rank whose peak this is: a later rank of a context-parallel round, whose Gated DeltaNet layers run the delta
    # rule on values widened by Dk zero columns (`qwen3_5.segment_gated_delta_rule`); the first runs the plain one.
    widened = context_parallel and s.delta_rule[0] > 0
    # The attention layers' exchange of a context-parallel round, when it is not simply added to the chunk's phase.
    cp_exchange = 0
    if context_parallel:
        # Context-parallel prompt passes: each rank runs its own chunk of a round, and one attention layer at a
        # time exchanges the round's queries and partial outputs.
        cp_exchange = context_parallel_exchange(s, state_parts, chunk, u.compute_bytes, autograd=exact)
        scored += f" + {_size(cp_exchange)} exchanged by one attention layer in a round of {state_parts} chunks"
        if not widened and not exact:
            tiles, cp_exchange = tiles + cp_exchange, 0
    if widened:
        # One DeltaNet layer's all-gather of every rank's final state and transition.
        gathered = round_states_bytes(s, state_parts)
        tiles += gathered
        scored += f" + {_size(gathered)} of one DeltaNet layer's gathered round states and transitions"
        if exact and s.state_fixed:
            # The reverse pass's recompute of a round emits the recurrent records of each of its chunks on every rank
            # (`Pass.emit_round`), and seeds the backward with zeros for the W - 1 of them without a gradient here;
            # one process keeps its chunk's record only.
            records = 2 * (state_parts - 1) * s.state_fixed
            tiles += records
            scored += (
                f" + {_size(records)} of the round's other {state_parts - 1} chunks' recomputed recurrent records "
                "and their zero gradients"
            )
    if state_parts > 1 and s.round_row_elems:
        # A context-parallel round of MLA + DSA: every rank's chunk rows (with their gradient in the reverse pass),
        # and the branch-round exchange of the prefix for one layer, in slices of gathered queries.
        queries, outputs = s.query_exchange
        rows = exchange_rows(s, state_parts * chunk)
        gathered = state_parts * chunk * s.round_row_elems * u.compute_bytes * (2 if exact else 1)
        exchange = gathered + rows * (queries * u.compute_bytes + 3 * (outputs + 1) * 4)
        tiles += exchange
        scored += (
            f" + {_size(exchange)} exchanged by one attention layer across the {state_parts} ranks' chunks of a "
            f"context-parallel round ({rows:,} queries at a time, and the round's rows)"
        )
    if exact:
        checkpointed = u.gradient_checkpointing and u.reverse_checkpointing
        reuse = kept if checkpointed and u.attention_reuse else 0
        itemized = reverse_bytes(s, u.compute_bytes, u.device, widened) if reuse else None
        # With `prefill_attention_reuse` the chunk's kept outputs are the prefill's, which the reverse pass takes
        # instead of allocating its own: counted once, in "prefill attention outputs" (every prompt token's).
        allocated = 0 if u.prefill_attention_reuse and not u.shard_prompt_state else reuse
        if allocated and context_parallel:
            # A round's attention (`sharding._ShardedPrefixAttention`) keeps its output in the accumulation dtype
            # (fp32 for a bf16 model), where one process's fused path keeps it in the compute dtype.
            allocated += s.kept_attention[0] * (max(u.compute_bytes, 4) - u.compute_bytes)
        if itemized is not None:
            # The CPU reverse pass's own inventory (`reverse_bytes`), attention outputs included.
            reverse_per_token = itemized - reuse + allocated
        elif checkpointed:
            # Each attention layer's output and log-sum-exp, kept from the forward for the recompute.
            reverse_per_token = graph_per_token + allocated
        else:
            reverse_per_token = int(autograd * s.total_activation_elems * u.compute_bytes)
        if widened and itemized is None:
            # The activation multiples cover the plain rule: add what the widened one keeps beyond it, in the one
            # recomputed layer (checkpointed) or in every DeltaNet layer.
            wider = _reverse_mixer_bytes(s, "linear_attention", u.compute_bytes, widened=True)
            wider -= _reverse_mixer_bytes(s, "linear_attention", u.compute_bytes)
            reverse_per_token += wider * (1 if checkpointed else s.layer_kinds.count("linear_attention"))
        activations = chunk * reverse_per_token + tiles + cp_exchange
        if cp_exchange and itemized is not None:
            # The attention layers' exchange happens in their backward, beside their own graph and gradients, after
            # the MLP's tensors of the same layer and before the next layer's (`reverse_exchange_bytes`, traced): the
            # larger of the two phases. The CUDA multiples, per layer of any kind, take the sum.
            attention = reverse_exchange_bytes(s, u.compute_bytes, u.device)
            other_phase = chunk * reverse_per_token + tiles
            activations = max(other_phase, chunk * (attention - reuse + allocated) + tiles + cp_exchange)
        items.append(
            Item(
                "chunk activations",
                activations,
                f"{chunk:,} tokens x {_size(reverse_per_token)} (reverse pass, with autograd"
                + (", CPU inventory" if itemized is not None else "")
                + (", a later rank of a round: its delta rule on values widened by Dk" if widened else "")
                + (
                    ", attention outputs kept for the recompute"
                    + (" in fp32)" if context_parallel and u.compute_bytes < 4 else ")")
                    if allocated
                    else ", the prefill's attention outputs kept for the recompute)"
                    if reuse
                    else ")"
                )
                + ("" if checkpointed or not u.gradient_checkpointing else ", not checkpointed: every layer's graph")
                + scored,
                phase="activations",
            )
        )
    else:
        forward = prefill_bytes(s, u.compute_bytes, chunk, widened)
        if forward is None:
            forward = chunk * int(no_grad * s.layer_activation_elems * u.compute_bytes)
        activations = forward + tiles
        if cp_exchange:
            # The Gated DeltaNet phase and an attention layer's exchange never coexist: the exchange goes beside the
            # gated MLP's phase (which the attention layer's own tensors stay below).
            mlp = prefill_bytes(s, u.compute_bytes, chunk, mixers=False)
            activations = max(activations, mlp + tiles + cp_exchange)
        later = ", a later rank of a round: its delta rule on values widened by Dk" if widened else ""
        items.append(
            Item(
                "chunk activations",
                activations,
                f"{chunk:,} tokens x {_size(forward // chunk)} (no-grad prefill, one layer at a time{later}){scored}",
                phase="activations",
            )
        )
    # Generation decodes this GPU's rows against the prompt state (held for the loss pass): each row's records of its
    # decoded tokens and its own copy of the fixed recurrent state. With a sharded state a prompt's G rows are spread
    # over its shard group (`sharding.shard_group_size` makes G a multiple of the group's rows), so a GPU decodes at
    # most G / group of them; the decoded tokens' records stay on the rank that decodes them.
    rows = share(u.group_size, state_parts)
    items.append(
        Item(
            "decode tail",
            rows * (u.completion_length * s.state_per_token + s.state_fixed),
            f"{rows} row{'s' if rows > 1 else ''} x ({u.completion_length:,} tokens x {_size(s.state_per_token)}"
            + (f" + {_size(s.state_fixed)} fixed" if s.state_fixed else "")
            + ")"
            + (f" (generation; {u.group_size} rows over {state_parts} GPUs)" if state_parts > 1 else " (generation)"),
            phase="activations",
        )
    )
    # TRL's batch of these rows: the left-padded prompt ids and mask and the completion ids and mask, int64, from
    # generation to the end of the loss pass. TRL also concatenates prompt and completion (ids and mask) when it
    # assembles the batch after generation and when it computes the loss, and shuffles the batch into a copy:
    # transients of the same size, while no chunk or branch is in flight.
    width = u.positions + u.completion_length
    batch = 2 * rows * width * 8
    items.append(Item("batch ids", batch, f"prompt + completion ids and masks [{rows}, {width:,}], int64"))
    items.append(
        Item(
            "batch copies",
            batch,
            f"TRL's prompt + completion concatenations (ids and mask [{rows}, {width:,}], int64), or the shuffled "
            "batch",
            phase="activations",
        )
    )
    # The loss pass scores the rows this GPU holds: G / group of a prompt's rows when sharded (as decoded above).
    items.append(
        Item(
            "scores",
            4 * rows * u.completion_length * 4,
            f"log-probs, entropies and their gradients [{rows}, {u.completion_length}], fp32",
        )
    )
    items.append(
        Item(
            "headroom",
            int(u.headroom * u.gpu_memory),
            f"{u.headroom:.0%} of the GPU: CUDA context, NCCL buffers, allocator fragmentation",
        )
    )
    return Budget(stats, setup, items, host)


MAX_POSITIONS = 1 << 40


def largest_positions(stats: ModelStats, setup: Setup, fits=None) -> int:
    """The largest prompt length whose budget fits (0 if none does, `MAX_POSITIONS` if every length checked does).

    `fits(budget) -> bool` defaults to "the peak fits in `setup.gpu_memory`". The budget grows with the length, so
    the answer is exact: planning at it fits, one more position does not.
    """
    fits = fits or (lambda b: b.fits)

    def ok(p: int) -> bool:
        return fits(estimate(stats, replace(setup, positions=p)))

    if not ok(1):
        return 0
    lo, hi = 1, 2
    while ok(hi):
        lo, hi = hi, hi * 2
        if hi > MAX_POSITIONS:
            return MAX_POSITIONS
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def suggestions(budget: Budget, free_bytes: int | None = None) -> list[str]:
    """Concrete changes to a budget that does not fit, each with its new estimate and whether it then fits.

    Planner (`free_bytes` None): the peak against `setup.gpu_memory`. Memory guard: the bytes still to allocate
    (`Budget.to_allocate`) against `free_bytes`.
    """
    if free_bytes is None:

        def fits(b: Budget) -> bool:
            return b.fits

        def line(change: str, b: Budget) -> str:
            return f"{change}: peak {_size(b.peak)} ({'fits' if fits(b) else 'does not fit'})"
    else:

        def fits(b: Budget) -> bool:
            return b.to_allocate <= free_bytes

        def line(change: str, b: Budget) -> str:
            return f"{change}: needs {_size(b.to_allocate)} ({'fits' if fits(b) else 'does not fit'})"

    s, u = budget.stats, budget.setup
    out = []
    changes = {}
    if u.mode == "exact":
        changes["prompt_gradient='detached' (biased gradient)"] = {"mode": "detached"}
    if not u.shard_prompt_state and u.gpus > 1:
        changes["shard_prompt_state=True"] = {"shard_prompt_state": True}
    if u.mode == "exact" and s.state_fixed and not u.offload_boundary_states:
        changes["offload_boundary_states=True"] = {"offload_boundary_states": True}
    if (
        u.mode == "exact"
        and u.gradient_checkpointing
        and u.reverse_checkpointing
        and u.attention_reuse
        and any(s.kept_attention)
    ):
        changes["reverse_attention_reuse=False (slower reverse pass)"] = {"attention_reuse": False}
    if u.prefill_attention_reuse and any(s.kept_attention):
        changes["prefill_attention_reuse=False (slower reverse pass)"] = {"prefill_attention_reuse": False}
    if not u.offload and u.fsdp and u.gpus > 1:
        changes["FSDP2 CPU offload of the weights, gradients and optimizer state"] = {"offload": True}
    if s.num_experts and not u.expert_parallel and u.gpus > 1 and s.num_experts % u.gpus == 0:
        changes["expert parallelism"] = {"expert_parallel": True}
    chunk = _best_chunk(s, u, fits)
    if chunk != u.prefill_chunk_size:
        changes[f"prefill_chunk_size={chunk}"] = {"prefill_chunk_size": chunk}
    for change, fields in changes.items():
        out.append(line(change, estimate(s, replace(u, **fields))))
    if len(changes) > 1:
        together = replace(u, **{k: v for fields in changes.values() for k, v in fields.items()})
        together = replace(together, prefill_chunk_size=_best_chunk(s, together, fits))
        out.append(line(f"all of these (prefill_chunk_size={together.prefill_chunk_size})", estimate(s, together)))
    gpus = _fewest_gpus(s, u, fits)
    if gpus is not None:
        out.append(line(f"{gpus} GPUs", estimate(s, replace(u, gpus=gpus))))
    elif not u.shard_prompt_state and u.gpus > 1 and fits(estimate(s, replace(u, shard_prompt_state=True))):
        pass  # sharding alone fits, as listed above
    elif not u.shard_prompt_state and (gpus := _fewest_gpus(s, replace(u, shard_prompt_state=True), fits)):
        sharded = replace(u, gpus=gpus, shard_prompt_state=True)
        out.append(line(f"{gpus} GPUs with shard_prompt_state=True", estimate(s, sharded)))
    else:
        out.append(f"more GPUs: no count up to {MAX_GPUS:,} fits")
    longest = largest_positions(s, u, fits)
    out.append(f"a shorter prompt: at most {longest:,} positions fit" if longest else "no prompt length fits")
    return out


def _best_chunk(stats: ModelStats, setup: Setup, fits) -> int:
    """A power-of-two chunk size (256 to 64Ki): the largest that fits, else the one with the lowest peak.

    Smaller chunks shrink the chunk activations but make more prefill steps; in exact mode they also add chunk
    boundaries, each keeping the fixed part of the state (recurrent layers), so the best size depends on the model
    and the length.
    """
    candidates = sorted({setup.prefill_chunk_size} | {2**k for k in range(8, 17)})
    budgets = {c: estimate(stats, replace(setup, prefill_chunk_size=c)) for c in candidates}
    fitting = [c for c in candidates if fits(budgets[c])]
    if fitting:
        return max(fitting)
    return min(candidates, key=lambda c: (budgets[c].peak, c != setup.prefill_chunk_size))


MAX_GPUS = 4096


def _fewest_gpus(stats: ModelStats, setup: Setup, fits) -> int | None:
    """The fewest GPUs, from `setup.gpus` to `MAX_GPUS`, at which the budget fits; None if none.

    A linear scan: the budget is not monotonic in the GPU count (a sharded branch round exchanges every rank's
    queries, which grows with the ranks while the state shrinks).
    """
    for gpus in range(setup.gpus, MAX_GPUS + 1):
        try:
            budget = estimate(stats, replace(setup, gpus=gpus))
        except ValueError:
            continue  # e.g. an expert-parallel group that does not divide the experts
        if fits(budget):
            return gpus
    return None


# ---------------------------------------------------------------------------------------------------- parsing
_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def parse_count(text: str) -> int:
    """`"2.1M"` -> 2100000. Suffixes K, M, G (powers of 1000) and Ki, Mi, Gi (powers of 1024)."""
    return _parse(text, "")


def parse_bytes(text: str) -> int:
    """`"96GB"` -> 96e9 and `"96GiB"` -> 96 * 2**30 (also K/M/T, with or without the trailing B)."""
    return _parse(text, "B")


def _parse(text: str, unit: str) -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?)?" + (r"B?" if unit else "") + r"\s*", text, re.IGNORECASE)
    if m is None:
        kind = "a byte size like 96GB or 80GiB" if unit else "a count like 2.1M, 512K or 131072"
        raise ValueError(f"cannot read {text!r}: expected {kind}")
    value = float(m.group(1)) * _UNITS[(m.group(2) or "").upper()]
    return int(round(value))


# Host memory per GPU of a node when --host-memory is not given: a DGX H100 or DGX H200 has 2 TB of system memory for
# its 8 GPUs (NVIDIA's data sheets), which the common 8-GPU HGX servers (H20 included) match or exceed.
HOST_MEMORY_PER_GPU = 250 * 10**9
NO_HOST_CHECK = -1


def parse_host_memory(text: str) -> int:
    """`--host-memory`: a byte size (`parse_bytes`), or `none` for no check (`NO_HOST_CHECK`)."""
    return NO_HOST_CHECK if text.strip().lower() == "none" else parse_bytes(text)


def default_host_memory(gpus: int, gpus_per_node: int) -> int:
    """The planner's host memory per node when none is given: `HOST_MEMORY_PER_GPU` per process of the node."""
    return HOST_MEMORY_PER_GPU * min(gpus, gpus_per_node)


def _size(n: int | float) -> str:
    """Human-readable bytes, binary units."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _count(n: int) -> str:
    for unit, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


# --------------------------------------------------------------------------------------------------------- CLI
def format_budget(budget: Budget, title: str) -> str:
    """The budget as aligned text lines: header, one line per item, peak and verdict."""
    u = budget.setup
    width = max(len(i.name) for i in budget.items)
    lines = [title]
    for item in budget.items:
        lines.append(f"  {item.name:<{width}}  {_size(item.nbytes):>11}  {item.detail}")
    phased = [i.name for i in budget.items if i.phase]
    largest = f"{', '.join(phased[:-1])} and {phased[-1]}" if len(phased) > 1 else "".join(phased)
    lines.append(f"  {'peak':<{width}}  {_size(budget.peak):>11}  (only the largest of {largest} counts)")
    lines.append(f"  {'GPU memory':<{width}}  {_size(u.gpu_memory):>11}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- recipes
@dataclass(frozen=True)
class Recipe:
    """A recipe YAML (`recipes/configs/*.yaml`) as `recipes/grpo_long.py` parses it: its three argument objects."""

    path: str
    script_args: object
    training_args: object
    model_args: object


def read_recipe(path: str | Path) -> Recipe:
    """Parses a recipe YAML with the recipe's own parser (`trl_longstraw.recipe.make_parser`), so that its keys are
    checked as the recipe checks them. `bf16` is read as off: the planner runs without a GPU, and TrainingArguments
    refuses bf16 there; the planner's `--precision` decides the bytes instead. The training arguments are those of a
    one-process run: `recipe_training_args` has them for the planned GPUs.

    Raises:
        ValueError: for a missing file or keys that the recipe does not know.
    """
    if not Path(path).is_file():
        raise ValueError(f"--config {str(path)!r}: no such file")
    import yaml

    try:
        script_args, training_args, model_args = _parse_recipe(path)
    except yaml.YAMLError as e:
        raise ValueError(f"--config {str(path)!r} is not valid YAML: {e}") from None
    except SystemExit:
        raise ValueError(f"--config {str(path)!r} is not a recipe config that recipes/grpo_long.py reads") from None
    return Recipe(str(path), script_args, training_args, model_args)


def _parse_recipe(path: str | Path, flags: tuple[str, ...] = (), config_class: type | None = None) -> tuple:
    """The recipe parser's three argument objects for the YAML at `path` and command-line `flags`."""
    from .recipe import make_parser

    parser = make_parser() if config_class is None else make_parser(config_class)
    return parser.parse_args_and_config(args=["--config", str(path), "--bf16", "false", "--fp16", "false", *flags])


def recipe_training_args(recipe: Recipe, gpus: int, num_generations: int | None = None):
    """The recipe's training arguments as each of `gpus` trainer processes has them (a `LongStrawGRPOConfig`).

    TRL's `GRPOConfig.__post_init__` derives `steps_per_generation` and `generation_batch_size` from the number of
    processes (a recipe's global `generation_batch_size` is spread over them; without either key
    `steps_per_generation` is `gradient_accumulation_steps`), and with them the rows that each process holds
    (`per_device_train_batch_size * steps_per_generation`) and of a group (`trainer._local_group_size`). The
    recipe's one-process parse (`read_recipe`) cannot know them: the recipe is parsed again, by TRL's own code, with
    the config's `world_size` set to `gpus`. `num_generations`: the planner's group size (`--group-size` overrides
    the recipe's), None for the recipe's.

    Raises:
        ValueError: TRL's refusal of the recipe on `gpus` processes, e.g. a `generation_batch_size` that the
            processes' batch does not divide.
    """
    from .config import LongStrawGRPOConfig

    # TrainingArguments' `world_size` is a property of the launch (the distributed state): a subclass that reports
    # the planned processes instead, so that TRL derives the batch as each of them does.
    config_class = type(LongStrawGRPOConfig.__name__, (LongStrawGRPOConfig,), {"world_size": property(lambda _: gpus)})
    flags = () if num_generations is None else ("--num_generations", str(num_generations))
    return _parse_recipe(recipe.path, flags, config_class)[1]


def recipe_model(name: str) -> str:
    """The planner's `--model` for a recipe's `model_name_or_path`: a preset when its last path component names one
    (`Qwen/Qwen3.6-27B` -> `qwen3.6-27b`), else the name itself (a local folder)."""
    last = name.rstrip("/").rsplit("/", 1)[-1].lower()
    return last if last in PRESETS and not Path(name).exists() else name


TINY_MODEL_PREFIX = "longstraw/tiny-"


def tiny_recipe_config(name: str, hidden_size: int):
    """The config of the tiny random model that the recipe builds for `longstraw/tiny-<family>`
    (`trl_longstraw.recipe.resolve_model_path`), without building it."""
    from .testing import build_tokenizer, tiny_config

    family = name[len(TINY_MODEL_PREFIX) :]
    config = tiny_config(
        family,
        vocab_size=len(build_tokenizer()),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        head_dim=hidden_size // 4,
    )
    return config.get_text_config()


def recipe_defaults(recipe: Recipe) -> dict:
    """The planner's argument values that a recipe sets: model, positions (built-in tasks' `prompt_tokens`), mode,
    prefill chunk, group size, completion length, LoRA rank and targets, gradient checkpointing, sharding."""
    from .tasks import TASK_NAMES

    s, t, m = recipe.script_args, recipe.training_args, recipe.model_args
    out = {
        "model": recipe_model(m.model_name_or_path),
        "mode": t.prompt_gradient,
        "prefill_chunk_size": t.prefill_chunk_size,
        "group_size": t.num_generations,
        "completion_length": t.max_completion_length,
        "shard_prompt_state": t.shard_prompt_state,
        "prompt_shard_group_size": t.prompt_shard_group_size,
        "no_gradient_checkpointing": not t.gradient_checkpointing,
        "lora_rank": m.lora_r if m.use_peft else None,
        "offload_boundary_states": t.offload_boundary_states,
        "no_attention_reuse": not getattr(t, "reverse_attention_reuse", True),
        "prefill_attention_reuse": bool(getattr(t, "prefill_attention_reuse", False)),
        "no_reverse_checkpointing": not getattr(t, "reverse_checkpointing", True),
        # Expert parallelism and FSDP2's CPU offload, where the config has them (`expert_parallel_size`,
        # `fsdp_cpu_offload`); accelerate's own `fsdp_offload_params` lives in the accelerate config: pass --offload.
        "cpu_offload": bool(getattr(t, "fsdp_cpu_offload", False)),
    }
    ep = getattr(t, "expert_parallel_size", 1) or 1
    if ep > 1:
        out.update(expert_parallel=True, ep_size=ep)
    if s.dataset_name in TASK_NAMES:
        out["positions"] = s.prompt_tokens
    targets = m.lora_target_modules
    if m.use_peft and targets is not None and targets != "all-linear":
        out["lora_targets"] = [targets] if isinstance(targets, str) else list(targets)
    return out


def _init_kwargs(model_init_kwargs: dict | None) -> dict:
    """The config keys of a recipe's `model_init_kwargs`: under `text_config` for Qwen3.5/3.6, else top level."""
    kwargs = dict(model_init_kwargs or {})
    return dict(kwargs.get("text_config") or {}) if "text_config" in kwargs else kwargs


def apply_model_init_kwargs(config, model_init_kwargs: dict | None):
    """A copy of the text `config` with a recipe's `model_init_kwargs` applied as `from_pretrained` applies them to
    the config (keys that are not config attributes, such as `dtype`, are left out).

    A `rope_parameters` override is laid over the config's own mapping, so that the model can still be built when
    it drops a key such as `rope_theta`; `rope_override_refusal` reports such an override, which the recipe refuses.
    """
    config = copy.deepcopy(config)
    for key, value in _init_kwargs(model_init_kwargs).items():
        if key == "rope_parameters" and isinstance(value, dict):
            value = {**(config.rope_parameters or {}), **value}
        if hasattr(config, key):
            setattr(config, key, copy.deepcopy(value))
    return config


def rope_override_refusal(config, model_init_kwargs: dict | None) -> str | None:
    """The recipe's refusal of a `rope_parameters` override that drops or changes a key outside the scaling keys
    (`trl_longstraw.recipe.check_rope_override`), checked against `config` (the preset's or local config's values);
    None when there is none or it is fine."""
    wanted = _init_kwargs(model_init_kwargs).get("rope_parameters")
    if wanted is None:
        return None
    from .recipe import _SCALING_KEYS

    original = dict(config.rope_parameters or {})
    problems = [
        f"{key}: model {original[key]!r}, override {wanted.get(key, '<missing>')!r}"
        for key in sorted(set(original) - _SCALING_KEYS)
        if key not in wanted or wanted[key] != original[key]
    ]
    if not problems:
        return None
    return (
        "model_init_kwargs' rope_parameters replaces the checkpoint's whole mapping but differs from it outside the "
        f"scaling keys ({'; '.join(problems)}): copy those values from the checkpoint's config.json."
    )


# -------------------------------------------------------------------------------------------------- refusals
def rows_per_process(recipe: Recipe, gpus: int) -> int:
    """Rows of a generation batch that TRL gives each of `gpus` processes under a recipe
    (`per_device_train_batch_size * steps_per_generation`, `recipe_training_args`).

    Raises:
        ValueError: TRL's refusal of the recipe on `gpus` processes.
    """
    args = recipe_training_args(recipe, gpus)
    return args.per_device_train_batch_size * args.steps_per_generation


def default_group_size(gpus: int, shard_prompt_state: bool, shard_group: int = 0) -> int:
    """The CLI's default G (`--group-size`): 8, or with a prompt state sharded over more than one GPU the smallest
    multiple of the shard group's GPUs (`shard_group`, 0 for all of them) that is at least 8, the fewest completions
    with which the trainer accepts that group at one row per process (`sharding.shard_group_size`)."""
    size = (shard_group or gpus) if shard_prompt_state else 1
    return size * -(-8 // size)


def trainer_refusals(
    config, causal_lm: nn.Module, setup: Setup, recipe: Recipe | None = None, original_config=None
) -> list[str]:
    """What `LongStrawGRPOTrainer` (and the recipe) would refuse at construction for this model and setup, each as
    the trainer's own message: prompts beyond an unscaled RoPE window, per-call RoPE it cannot pin, a shard group
    that G does not cover (`sharding.shard_group_size`), a sharded prompt state the adapter lacks, active dropout, and
    with a recipe its training arguments as each of `setup.gpus` processes has them (`recipe_training_args`: TRL's
    own refusals, `trainer._check_args`, the MoE router's auxiliary loss, LoRA dropout, a `rope_parameters` override
    that differs from `original_config`, the config before the recipe's `model_init_kwargs`)."""
    from .adapters import ADAPTERS
    from .guards import active_dropout, check_positions
    from .rope import rotary_modules
    from .sharding import shard_group_size

    out = []
    # The recipe's training arguments on the planned GPUs, with the planned G; None where TRL itself refuses them.
    args = None
    if recipe is not None:
        try:
            args = recipe_training_args(recipe, setup.gpus, setup.group_size)
        except ValueError as e:
            out.append(str(e))
    try:
        check_positions(config, setup.positions + setup.completion_length)
    except ValueError as e:
        out.append(str(e))
    try:
        rotary_modules(causal_lm)
    except ValueError as e:
        out.append(str(e))
    if setup.shard_prompt_state and setup.gpus > 1 and (recipe is None or args is not None):
        # The trainer's rule for the shard group (`sharding.shard_group_size`, in `_make_prompt_shards`): G must be a
        # multiple of the group's rows. Rows per process: the recipe's on these GPUs, else 1 (the fewest TRL allows).
        rows = 1 if args is None else args.per_device_train_batch_size * args.steps_per_generation
        try:
            shard_group_size(setup.gpus, setup.shard_group, setup.group_size, rows)
        except ValueError as e:
            out.append(str(e))
    adapter = ADAPTERS.get(config.model_type)
    if setup.shard_prompt_state and adapter is not None and not getattr(adapter, "shards_prompt_state", False):
        out.append(
            f"shard_prompt_state is not supported by the {config.model_type!r} adapter yet: set "
            "shard_prompt_state=False (and use more GPUs or prompt_gradient='detached' for capacity)."
        )
    dropout = active_dropout(causal_lm)
    if recipe is not None and recipe.model_args.use_peft and recipe.model_args.lora_dropout:
        dropout.append(f"LoRA adapters (lora_dropout={recipe.model_args.lora_dropout:g})")
    if dropout:
        out.append(
            f"dropout is active in {', '.join(dropout[:4])}: the trainer scores, replays and recomputes each token in "
            "separate passes, each with its own dropout mask. Set attention_dropout=0.0 and lora_dropout=0."
        )
    if recipe is not None:
        from .trainer import _check_args

        trained = recipe.training_args if args is None else args
        rope = rope_override_refusal(original_config or config, trained.model_init_kwargs)
        if rope is not None:
            out.append(rope)
        # The trainer checks expert parallelism against its processes: here, the planned GPUs.
        ep = getattr(trained, "expert_parallel_size", 1)
        if ep > 1:
            from . import expert_parallel

            for check in (
                lambda: expert_parallel.check_args(trained, setup.gpus),
                lambda: expert_parallel.check_model_config(config, ep),
            ):
                try:
                    check()
                except ValueError as e:
                    out.append(str(e))
            trained = copy.copy(trained)
            trained.expert_parallel_size = 1
        if args is not None:  # else TRL refuses the arguments (above) before the trainer checks them
            try:
                _check_args(trained, world_size=setup.gpus)
            except ValueError as e:
                out.append(str(e))
        coef = trained.router_aux_loss_coef
        coef = getattr(config, "router_aux_loss_coef", 0.0) if coef is None else coef
        if hasattr(config, "output_router_logits") and coef != 0.0:
            out.append(
                "the MoE router auxiliary loss is not supported by LongStrawGRPOTrainer (the prompt is shared by the "
                "group, so its routing would be counted once instead of G times): set router_aux_loss_coef=0.0."
            )
    return out


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def format_host(budget: Budget, default: bool = False) -> str:
    """The host-memory part of a budget: the offloaded items per GPU, and their total per node (`default`: the
    budget is the planner's default, `default_host_memory`)."""
    u = budget.setup
    width = max(len(i.name) for i in budget.items)
    procs = min(u.gpus, u.gpus_per_node)
    lines = [f"host memory per node ({procs} processes), offloaded:"]
    for item in budget.host:
        lines.append(f"  {item.name:<{width}}  {_size(item.nbytes * procs):>11}  {item.detail}, per GPU x {procs}")
    total = f"  {'total':<{width}}  {_size(budget.host_per_node):>11}  "
    total += "(not counted: the processes' own memory, e.g. libraries, CUDA context, data)"
    lines.append(total)
    budget_line = _size(u.host_memory) if u.host_memory is not None else "not checked (--host-memory none)"
    if default:
        budget_line += (
            f"  (default: {HOST_MEMORY_PER_GPU / 1e9:g} GB per process, a DGX H100/H200 node's 2 TB over 8 GPUs; "
            "pass --host-memory)"
        )
    lines.append(f"  {'host memory':<{width}}  {budget_line:>11}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trl_longstraw.plan",
        description="Per-GPU memory budget of a LongStraw GRPO step, its verdict, and the longest prompt that fits. "
        "Exit code 0 when it fits, 3 when it does not, 4 when it fits but the trainer refuses the setup, 2 for an "
        "error in the arguments (unknown preset, unsupported model).",
    )
    p.add_argument(
        "--config",
        default=None,
        help="a recipe YAML (recipes/configs/*.yaml): model, positions (prompt_tokens of the built-in tasks), mode, "
        "prefill chunk, group size, completion length, LoRA and sharding come from it; flags override them",
    )
    p.add_argument("--model", default=None, help=f"a preset ({', '.join(PRESETS)}) or a local config.json / folder")
    p.add_argument("--positions", type=parse_count, default=None, help="prompt length in tokens, e.g. 2.1M")
    p.add_argument("--gpus", type=int, default=8, help="GPUs (one process each); default 8")
    p.add_argument("--gpu-memory", type=parse_bytes, default="96GB", help="memory per GPU, e.g. 96GB or 80GiB")
    p.add_argument("--mode", choices=["exact", "detached"], default="exact", help="prompt_gradient; default exact")
    p.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="completions per prompt (num_generations); default 8, or with --shard-prompt-state the smallest "
        "multiple of the shard group's GPUs that is at least 8 (the trainer needs a multiple of them)",
    )
    p.add_argument("--completion-length", type=parse_count, default=512, help="tokens per completion; default 512")
    p.add_argument("--prefill-chunk-size", type=parse_count, default=4096, help="default 4096")
    p.add_argument(
        "--shard-prompt-state",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="split the prompt state over the GPUs",
    )
    p.add_argument(
        "--prompt-shard-group-size",
        type=int,
        default=0,
        help="GPUs per prompt shard group (prompt_shard_group_size); default 0, all of them",
    )
    p.add_argument(
        "--precision",
        choices=["mixed", "bf16"],
        default="mixed",
        help="mixed (default): fp32 trainable weights, gradients and AdamW states, as Accelerate's FSDP2 sets up "
        "bf16 mixed precision; bf16: everything stored in bf16",
    )
    p.add_argument(
        "--expert-parallel",
        action="store_true",
        help="MoE models: split the routed experts by expert over the GPUs (transformers' expert parallelism); they "
        "are never all-gathered",
    )
    p.add_argument("--ep-size", type=int, default=0, help="GPUs per expert-parallel group; default 0, all of them")
    p.add_argument(
        "--offload",
        action="store_true",
        help="host memory for what is cold during a step: FSDP2 CPU offload of the sharded fp32 master weights, "
        "gradients and optimizer state, and in exact mode the recurrent chunk-boundary states "
        "(offload_boundary_states)",
    )
    p.add_argument(
        "--host-memory",
        type=parse_host_memory,
        default=None,
        help="host memory per node for the offloaded items, e.g. 1TB, or 'none' to skip the check; default "
        f"{HOST_MEMORY_PER_GPU / 1e9:g} GB per process of a node (--gpus-per-node), as on a DGX H100/H200 "
        "(2 TB for 8 GPUs)",
    )
    p.add_argument("--gpus-per-node", type=int, default=8, help="processes per node, for host memory; default 8")
    p.add_argument("--lora-rank", type=int, default=None, help="train LoRA adapters of this rank on all linears")
    p.add_argument(
        "--no-gradient-checkpointing",
        action="store_true",
        help="gradient_checkpointing=False: a branch and a reverse-pass chunk keep every layer's activations",
    )
    p.add_argument(
        "--no-attention-reuse",
        action="store_true",
        help="exact mode: the reverse pass attends again in each checkpoint recompute instead of keeping the "
        "attention outputs (reverse_attention_reuse=False): less memory, slower",
    )
    p.add_argument(
        "--prefill-attention-reuse",
        action="store_true",
        help="exact mode, unsharded: the prefill keeps each attention layer's output for the reverse pass, which "
        "does not attend again in its forward (prefill_attention_reuse=True): faster, more memory",
    )
    p.add_argument(
        "--no-reverse-checkpointing",
        action="store_true",
        help="exact mode: the reverse pass keeps each chunk's whole graph instead of recomputing its layers "
        "(reverse_checkpointing=False): one forward less per chunk, more memory",
    )
    p.add_argument("--headroom", type=float, default=0.05, help="fraction of GPU memory kept free; default 0.05")
    p.set_defaults(lora_targets=None, offload_boundary_states=False, cpu_offload=False)
    return p


def main(argv: list[str] | None = None) -> int:
    """The CLI. Returns the exit code: 0 fits, 3 does not fit, 4 fits but the trainer refuses, 2 bad arguments."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return _main(parser, args, argv)
    except ValueError as e:
        # One line, no traceback: an unknown preset, an unsupported model, an unreadable recipe.
        print(f"{parser.prog}: error: {_one_line(e)}", file=sys.stderr)
        return 2


def _main(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str] | None) -> int:
    recipe = None
    if args.config is not None:
        recipe = read_recipe(args.config)
        parser.set_defaults(**recipe_defaults(recipe))
        args = parser.parse_args(argv)  # flags override the recipe
    for flag in ("model", "positions"):
        if getattr(args, flag) is None:
            raise ValueError(f"--{flag} is required (or a --config recipe that sets it)")
    if args.prompt_shard_group_size < 0 or (args.prompt_shard_group_size and args.gpus % args.prompt_shard_group_size):
        parser.error(f"--prompt-shard-group-size must divide --gpus ({args.gpus}), or be 0 for all of them")
    defaulted = args.group_size is None
    if defaulted:
        args.group_size = default_group_size(args.gpus, args.shard_prompt_state, args.prompt_shard_group_size)
    needed = args.positions + args.completion_length
    if args.model.lower() in PRESETS:
        name = PRESETS[args.model.lower()][0]
        # With a recipe, its model_init_kwargs decide the RoPE scaling, as when the trainer loads the model.
        original = preset_config(args.model, None if recipe is not None else needed)
    elif recipe is not None and args.model.startswith(TINY_MODEL_PREFIX):
        original = tiny_recipe_config(args.model, recipe.script_args.tiny_hidden_size)
        name = args.model
    else:
        original = load_config(args.model)
        name = Path(args.model).name
    config = original
    if recipe is not None:
        config = apply_model_init_kwargs(original, recipe.training_args.model_init_kwargs)
    prompt_state_bytes(config)  # refuses a model type without an adapter, naming the supported ones
    model = meta_model(config)
    stats = model_stats(model, config, lora_rank=args.lora_rank, lora_targets=args.lora_targets)
    weight = 2 if args.precision == "bf16" else 4
    host_memory = args.host_memory
    if host_memory is None:
        host_memory = default_host_memory(args.gpus, args.gpus_per_node)
    elif host_memory == NO_HOST_CHECK:
        host_memory = None
    setup = Setup(
        positions=args.positions,
        completion_length=args.completion_length,
        group_size=args.group_size,
        prefill_chunk_size=args.prefill_chunk_size,
        mode=args.mode,
        gpus=args.gpus,
        gpu_memory=args.gpu_memory,
        shard_prompt_state=args.shard_prompt_state,
        shard_group=args.prompt_shard_group_size,
        gradient_checkpointing=not args.no_gradient_checkpointing,
        trainable_weight_bytes=weight,
        grad_bytes=weight,
        optimizer_bytes=2 * weight,
        headroom=args.headroom,
        expert_parallel=args.expert_parallel,
        ep_size=args.ep_size,
        offload=args.offload or args.cpu_offload,
        offload_boundary_states=args.mode == "exact" and (args.offload or args.offload_boundary_states),
        attention_reuse=not args.no_attention_reuse,
        prefill_attention_reuse=args.prefill_attention_reuse,
        reverse_checkpointing=not args.no_reverse_checkpointing,
        gpus_per_node=args.gpus_per_node,
        host_memory=host_memory,
    )
    budget = estimate(stats, setup)
    refused = trainer_refusals(config, model, setup, recipe, original)

    window, native = rope_window(config)
    if window is None:
        rope = "RoPE: no position window"
    elif rope_scaled(config):
        factor = _rope_dicts(config)[0].get("factor")
        rope = f"RoPE: native window {native:,}, scaled ({_rope_dicts(config)[0]['rope_type']} factor {factor:g}) to "
        rope += f"{window:,}" + (" -- STILL TOO SHORT for" if needed > window else " for") + f" {needed:,} positions"
    else:
        rope = f"RoPE: window {window:,}" + (
            f" -- {needed:,} positions exceed it without RoPE scaling; the trainer refuses (see plan.with_yarn)"
            if needed > window
            else f", enough for {needed:,} positions"
        )
    lora = f", LoRA rank {args.lora_rank}" if args.lora_rank else ""
    if args.lora_rank and args.lora_targets:
        lora += f" on {', '.join(args.lora_targets)}"
    header = [f"recipe: {recipe.path} (flags override it)"] if recipe is not None else []
    header += [
        f"{name} ({config.model_type}): {_count(stats.total_params)} parameters, {_count(stats.trainable_params)} "
        f"trainable{lora}, {stats.num_layers} layers",
        f"  prompt state: {_size(stats.state_per_token)} per token + {_size(stats.state_fixed)} fixed",
        f"  {rope}",
        f"run: {args.positions:,} prompt positions, {args.mode} mode, {args.group_size} x {args.completion_length:,}-"
        "token completions"
        + (
            " (G: the smallest multiple of the shard group, the trainer's rule)"
            if defaulted and args.group_size != 8
            else ""
        )
        + f", prefill chunk {args.prefill_chunk_size:,}, gradient checkpointing "
        + ("off" if args.no_gradient_checkpointing else "on"),
        f"  {args.gpus} GPU(s) x {args.gpu_memory / 1e9:g} GB ({_size(args.gpu_memory)}), FSDP full sharding"
        + (f", expert parallel over {args.ep_size or args.gpus} GPUs" if args.expert_parallel else "")
        + (", FSDP2 CPU offload" if args.offload or args.cpu_offload else "")
        + f", {args.precision} precision, prompt state "
        + (
            f"sharded over groups of {args.prompt_shard_group_size or args.gpus} GPUs"
            if args.shard_prompt_state
            else "not sharded (data-parallel mode: ranks run equal numbers of engine passes, FSDP2 gathers layer by "
            "layer)"
        ),
        "",
    ]
    print("\n".join(header) + format_budget(budget, "per-GPU budget at the peak of a step:"))
    if budget.host:
        print(format_host(budget, default=args.host_memory is None))
    longest = largest_positions(stats, setup)
    print()
    if budget.fits and refused:
        print(
            f"verdict: REFUSED -- fits in memory ({_size(budget.peak)} of {_size(setup.gpu_memory)}), but the "
            "trainer refuses this setup at construction:"
        )
        for reason in refused:
            print(f"  - {reason}")
    elif budget.fits:
        print(f"verdict: FITS ({_size(budget.peak)} of {_size(setup.gpu_memory)})")
    elif budget.peak > setup.gpu_memory:
        print(f"verdict: DOES NOT FIT (needs {_size(budget.peak)}, has {_size(setup.gpu_memory)})")
    else:
        print(
            f"verdict: DOES NOT FIT in host memory (needs {_size(budget.host_per_node)} per node, has "
            f"{_size(setup.host_memory)}; GPU {_size(budget.peak)} of {_size(setup.gpu_memory)})"
        )
        if refused:
            print("the trainer would also refuse this setup at construction:")
            for reason in refused:
                print(f"  - {reason}")
    if longest == 0:
        print("largest prompt that fits: none -- even a 1-token prompt does not fit with these settings")
    elif longest >= MAX_POSITIONS:
        print(f"largest prompt that fits: more than {MAX_POSITIONS:,} positions")
    else:
        rope_note = ""
        if native is not None and longest + args.completion_length > native:
            rope_note = f"; RoPE needs YaRN factor {yarn_factor(longest + args.completion_length, native)} for it"
        print(f"largest prompt that fits: {longest:,} positions ({_count(longest)}){rope_note}")
    if not budget.fits:
        print("to fit:")
        for s in suggestions(budget):
            print(f"  - {s}")
    if recipe is None and hasattr(config, "output_router_logits"):
        print(
            "note: the trainer refuses the MoE router's auxiliary loss: set router_aux_loss_coef=0.0 (the recipes do)"
        )
    if not budget.fits:
        return 3
    return 4 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
