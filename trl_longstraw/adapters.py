"""Architecture adapters, looked up by `config.model_type`.

An adapter knows what a layer must keep of a prompt chunk (its *record*) and routes the model's layers through the
engine's active pass while `activate()` is entered. It also reports the size of that state for the planner.

The interface of an adapter (for a custom architecture, add its class to `ADAPTERS` under its `model_type`):

- `__init__(causal_lm)`: the unwrapped `PreTrainedModel`; raise ValueError naming the fix for what it cannot run.
- `activate()`: a context manager during which the model's token-mixing layers call `engine.active_pass()` and
    - read the records they may see with `pass.read(layer_idx)` (a list, one record, a tuple of tensors, per visible
      prompt chunk, then, while decoding, the rows' tail; `None` for chunks another rank holds when the state is
      sharded), and `pass.chunk_starts()` to number prompt positions;
    - hand their own record to `pass.emit(layer_idx, record, sharded=..., supersedes=...)`: `sharded=True` for
      per-token records that may live on one rank of a shard group, `supersedes=True` for a recurrent state that
      sums up every earlier record of its layer (later chunks then need only the newest).
    Everything else of the model (embeddings, norms, MLPs, RoPE) runs unchanged, so positions are the model's own.
- `state_bytes(config, dtype_bytes)`: `(bytes per prompt token, fixed bytes)` of the detached prompt state, which the
  planner uses and tests compare with the measured state.
- `decode_tail(capacity)` (optional): decoding against the prompt state for shared-prompt generation
  (`generation.DecodePass`). It returns the storage of the rows' own records, usually `kv.KVTail(capacity,
  time_dim)`: `records(layer_idx)` (at most one record, batch G), `append(layer_idx, record)` for per-token records
  and `replace(layer_idx, record)` for superseding ones. While decoding, a layer gets `G` rows of one token each;
  `pass.read` returns the prompt's records (batch 1, to broadcast, never to write) then the tail, and
  `DecodePass.prompt_records` the prompt's alone. An adapter without it generates with transformers' `generate`
  (with a warning).
- `decodes_sharded = True` (optional): its decoding also runs against a sharded prompt state, the ranks of a shard
  group in lockstep: its attention goes through `sharding.attend` (which then calls
  `sharding.sharded_decode_attention`) and its other records are whole on every rank after a sharded prefill.
- `shards_prompt_state = True` (optional): its layers attend over the prompt through `sharding.attend` (or their own
  collective form), so the state may be split over the ranks (`shard_prompt_state`).
- `batches_branches = True` (optional): its layers take several right-padded branches per forward against prompt
  records of batch 1 (batched no-grad scoring).

`kv.KVCacheAdapter` is the smallest example: its attention function is `sharding.attend`, which does all of the
above for layers whose attention fits `(query, key, value)`.
"""

from __future__ import annotations

from transformers import PreTrainedModel

from .glm_moe_dsa import GlmMoeDsaAdapter
from .kv import KVCacheAdapter
from .qwen3_5 import Qwen3_5Adapter

ADAPTERS = {
    "llama": KVCacheAdapter,
    "mistral": KVCacheAdapter,
    "qwen2": KVCacheAdapter,
    "qwen3": KVCacheAdapter,
    "qwen3_moe": KVCacheAdapter,
    "glm_moe_dsa": GlmMoeDsaAdapter,
    # Qwen3.5 / Qwen3.6 (e.g. Qwen3.6-27B). Loaded as Qwen3_5ForCausalLM, a composite "qwen3_5" checkpoint reports
    # its text config, "qwen3_5_text".
    "qwen3_5": Qwen3_5Adapter,
    "qwen3_5_text": Qwen3_5Adapter,
}


def get_adapter(causal_lm: PreTrainedModel):
    """The adapter instance for `causal_lm`.

    Raises:
        ValueError: for a model type without an adapter, listing the supported ones.
    """
    model_type = causal_lm.config.model_type
    if model_type not in ADAPTERS:
        raise ValueError(
            f"model_type {model_type!r} is not supported by trl_longstraw. Supported: {', '.join(sorted(ADAPTERS))}. "
            "Use trl.GRPOTrainer for other models."
        )
    return ADAPTERS[model_type](causal_lm)
