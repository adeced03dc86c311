"""Architecture adapters, looked up by `config.model_type`.

An adapter knows what a layer must keep of a prompt chunk (its *record*) and routes the model's layers through the
engine's active pass while `activate()` is entered. It also reports the size of that state for the planner.
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
