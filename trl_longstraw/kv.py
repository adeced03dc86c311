"""Adapter for standard KV-cache causal LMs (Llama, Mistral, Qwen2, Qwen3 and their MoE variants).

These models call the attention function registered under `config._attn_implementation` with post-RoPE keys and
values `[B, Hkv, T, D]`. While the engine runs, the model is switched to the `"longstraw"` attention function below:
it attends to the prompt records of the active pass through `prefix_merge_attention` (or its sharded form) and emits
the chunk's own keys and values as its record. Nothing goes through `past_key_values`, so gradient checkpointing,
which drops the cache in training, has nothing to drop.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface, PreTrainedModel

from .attention import autocast_inputs
from .engine import active_pass
from .sharding import attend

ATTN_IMPLEMENTATION = "longstraw"


def longstraw_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: `query` `[B, Hq, T, D]`, `key`/`value` `[B, Hkv, T, D]` -> `[B, T, Hq, D]`."""
    if dropout:
        raise ValueError("attention dropout is not supported by trl_longstraw: set attention_dropout=0.0")
    if sliding_window is not None or softcap is not None or kwargs.get("s_aux") is not None:
        raise ValueError(
            "sliding-window attention, attention logit softcapping and attention sinks are not supported by "
            "trl_longstraw's generic adapter: train this model with trl.GRPOTrainer (a sliding window that every "
            "sequence fits in changes nothing: load the model with sliding_window=None)"
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    p = active_pass()
    if p.outputs_unread(module.layer_idx):
        # The last layer of a prompt pass: its keys and values are all that later tokens read, as `attend` records
        # them (sharded: on the chunk's owner, every rank of the group skipping the same attention and its
        # collectives); the output is zeros (a view) that nothing reads.
        p.emit(module.layer_idx, autocast_inputs(key, value), sharded=True)
        batch, heads, length, _ = query.shape
        return query.new_zeros(()).expand(batch, length, heads, value.shape[-1]), None
    out = attend(p, module.layer_idx, query, key, value, scale)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPLEMENTATION, longstraw_attention)


@contextlib.contextmanager
def attention_switched(causal_lm: PreTrainedModel):
    """Routes the model's attention layers through `longstraw_attention` for the duration of the block."""
    config = causal_lm.config
    previous = config._attn_implementation
    config._attn_implementation = ATTN_IMPLEMENTATION
    try:
        yield
    finally:
        config._attn_implementation = previous


def sliding_window(causal_lm: PreTrainedModel) -> int | None:
    """The sliding window of a generic-adapter model's attention layers, or None when they attend to every earlier
    token. Qwen2/Qwen3 and Qwen3-MoE attention layers carry their own `sliding_window` (set where `layer_types` says
    `"sliding_attention"`, or from `use_sliding_window`); Mistral's read `config.sliding_window` on every layer."""
    windows = [m.sliding_window for m in causal_lm.modules() if hasattr(m, "sliding_window") and m is not causal_lm]
    if not windows:
        windows = [getattr(causal_lm.config, "sliding_window", None)]
    return next((w for w in windows if w is not None), None)


class KVTail:
    """The records of the tokens each decoded row adds after the shared prompt, for `generation.DecodePass`.

    Per layer, each tensor of the record with a capacity of `capacity` tokens along `time_dim` (keys and values
    `[G, Hkv, capacity, D]` on the generic adapter; `glm_moe_dsa`'s latent rows `[G, capacity, R + Dr]` with
    `time_dim=1`), allocated at the layer's first step and filled one token per step, so a step reads one tail record
    instead of one record per earlier step. Per recurrent layer (a record that supersedes the earlier ones, e.g.
    qwen3_5's `(conv_tail, state)`), the rows' latest record `[G, ...]`, replaced at every step (`replace`).
    """

    def __init__(self, capacity: int, time_dim: int = 2):
        self.capacity = capacity
        self.time_dim = time_dim
        self.buffers: dict[int, tuple[torch.Tensor, ...]] = {}
        self.lengths: dict[int, int] = {}
        self.latest: dict[int, tuple[torch.Tensor, ...]] = {}

    def records(self, layer_idx: int) -> list[tuple[torch.Tensor, ...]]:
        """The tail of `layer_idx` so far, as at most one record: its tensors up to the `t` tokens appended (e.g.
        `(keys, values)` `[G, Hkv, t, D]`), or the rows' latest recurrent record."""
        if layer_idx in self.latest:
            return [self.latest[layer_idx]]
        t = self.lengths.get(layer_idx, 0)
        if t == 0:
            return []
        return [tuple(x.narrow(self.time_dim, 0, t) for x in self.buffers[layer_idx])]

    def replace(self, layer_idx: int, record: tuple[torch.Tensor, ...]) -> None:
        """Stores the step's superseding record `[G, ...]` of a recurrent layer in place of the previous one."""
        self.latest[layer_idx] = record

    def append(self, layer_idx: int, record: tuple[torch.Tensor, ...]) -> None:
        """Appends the step's record of `layer_idx` (e.g. `(keys, values)` `[G, Hkv, n, D]`, `n` along `time_dim`)."""
        n = record[0].shape[self.time_dim]
        if layer_idx not in self.buffers:
            self.buffers[layer_idx] = tuple(
                x.new_empty(*x.shape[: self.time_dim], self.capacity, *x.shape[self.time_dim + 1 :]) for x in record
            )
            self.lengths[layer_idx] = 0
        t = self.lengths[layer_idx]
        if t + n > self.capacity:
            raise RuntimeError(f"decode tail of capacity {self.capacity} overflowed at layer {layer_idx}")
        for buffer, x in zip(self.buffers[layer_idx], record, strict=True):
            buffer.narrow(self.time_dim, t, n).copy_(x)
        self.lengths[layer_idx] = t + n


class KVCacheAdapter:
    """Records per attention layer and chunk: `(keys, values)`, each `[1, Hkv, n, D]`."""

    # Attention goes through `sharding.attend`, so the records can be spread over the ranks of a shard group.
    shards_prompt_state = True
    # Decoding against a sharded prompt state: attention through `sharding.sharded_decode_attention`.
    decodes_sharded = True
    # Its layers take several right-padded branches per forward against prompt records of batch 1 (no-grad scoring
    # in `Engine.score`); adapters without this attribute score one branch per forward.
    batches_branches = True

    def __init__(self, causal_lm: PreTrainedModel):
        window = sliding_window(causal_lm)
        if window is not None:
            # Refused here, when the trainer is built, rather than at the first forward of the first step.
            raise ValueError(
                f"{causal_lm.config.model_type} attends within a sliding window of {window} tokens "
                f"(config.sliding_window={window}), which trl_longstraw's generic adapter does not implement. If "
                f"every prompt + completion stays within {window} tokens the window changes nothing: load the model "
                "with sliding_window=None (from_pretrained(..., sliding_window=None), or model_init_kwargs: "
                "{sliding_window: null} in a recipe config). Longer sequences need the window: train this model "
                "with trl.GRPOTrainer."
            )
        self.causal_lm = causal_lm

    @staticmethod
    def context_parallel(world: int) -> bool:
        """Whether the prompt passes of a state sharded over `world` ranks can split their tokens (see
        `context_parallel`): always, as attention is the only token mixer and goes through `sharding.attend`."""
        return True

    def activate(self):
        return attention_switched(self.causal_lm)

    @staticmethod
    def decode_tail(capacity: int) -> KVTail:
        """Storage for up to `capacity` decoded tokens per row (see `generation.DecodePass`)."""
        return KVTail(capacity)

    @staticmethod
    def state_bytes(config, dtype_bytes: int = 2) -> tuple[int, int]:
        """`(bytes per prompt token, fixed bytes)` of the prompt state of a model with this text config."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return config.num_hidden_layers * 2 * kv_heads * head_dim * dtype_bytes, 0
