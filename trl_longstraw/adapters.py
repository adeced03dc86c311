"""Architecture adapters, looked up by `config.model_type`.

An adapter knows what a layer must keep of a prompt chunk (its *record*) and routes the model's layers through the
engine's active pass while `activate()` is entered. It also reports the size of that state for the planner.
"""

from __future__ import annotations

from transformers import PreTrainedModel

from .glm_moe_dsa import GlmMoeDsaAdapter
from .kv import KVCacheAdapter

ADAPTERS = {
    "llama": KVCacheAdapter,
    "mistral": KVCacheAdapter,
    "qwen2": KVCacheAdapter,
    "qwen3": KVCacheAdapter,
    "qwen3_moe": KVCacheAdapter,
    "glm_moe_dsa": GlmMoeDsaAdapter,
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
