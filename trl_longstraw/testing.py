"""Tiny offline models, a tokenizer built in code, and hand-built GRPO micro-batches, for tests, demos and benchmarks.

Nothing here downloads anything: models are built from transformers config classes with random weights and saved
to a local folder together with a tokenizer made with the `tokenizers` library.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

# Standard deviation of the DSA indexer weights of tiny glm_moe_dsa models (see `spread_indexer_weights`).
INDEXER_STD = 1.0
SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]
# Word-level vocabulary: single characters, digits and a few words, enough for the synthetic tasks.
WORDS = (
    list(string.ascii_lowercase)
    + [str(i) for i in range(10)]
    + [
        "key",
        "value",
        "is",
        "the",
        "of",
        "what",
        "?",
        ":",
        ".",
        "=",
        ";",
        "answer",
    ]
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer (whitespace split) with pad and eos, padding and truncating on the left."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
        truncation_side="left",
    )


# Settings of tiny models that differ from the common base, per family.
TINY_FAMILY_OVERRIDES = {
    # Full attention, as Mistral v0.2 and later (MistralConfig defaults to v0.1's 4096-token sliding window, which the
    # generic adapter refuses).
    "mistral": dict(sliding_window=None),
    # MLA with odd latent/head sizes, a DSA top-k of 5 (prompts exceed it, so selection happens), a "shared" indexer
    # layer reusing the previous selection, one dense then two MoE layers (4 experts, 2 per token). MLA expands its
    # latent into one key head per query head, so num_key_value_heads must equal num_attention_heads.
    "glm_moe_dsa": dict(
        num_hidden_layers=3,
        num_key_value_heads=4,
        q_lora_rank=16,
        kv_lora_rank=12,
        qk_rope_head_dim=4,
        qk_nope_head_dim=6,
        v_head_dim=5,
        index_head_dim=8,
        index_n_heads=8,
        index_topk=5,
        indexer_types=["full", "shared", "full"],
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        router_aux_loss_coef=0.0,
    ),
}
# Tiny Qwen3.5 hybrid: DeltaNet layers around a gated-attention layer, grouped value heads (3 per key head, as in
# Qwen3.6-27B) and partial mRoPE (8 of 16 dims rotate: 4 frequencies split 2/1/1 between the t/h/w streams).
QWEN3_5_TINY = dict(
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=6,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [2, 1, 1],
    },
)


def tiny_config(family: str, vocab_size: int, **overrides):
    """A transformers config of a tiny random model of `family` (`llama`, `qwen3`, `qwen3_5`, ...).

    `qwen3_5` builds the text config (`qwen3_5_text`), which is what `Qwen3_5ForCausalLM` runs on.
    """
    from transformers import AutoConfig

    if family == "qwen3_5":
        family = "qwen3_5_text"
        overrides = {**QWEN3_5_TINY, **overrides}
    base = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=1 << 20,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    base.update(TINY_FAMILY_OVERRIDES.get(family, {}))
    base.update(overrides)
    return AutoConfig.for_model(family, **base)


def tiny_rope(family: str, rope_type: str, window: int, **overrides) -> dict:
    """`tiny_config` overrides that give a tiny `family` model RoPE of `rope_type` (any of transformers'
    `ROPE_INIT_FUNCTIONS`, or `default`) whose trained window is `window` positions.

    Scaled types get factor 2: `linear` and `dynamic` keep `max_position_embeddings = window` (dynamic NTK scales
    beyond it), the others extend it to `2 * window` from `original_max_position_embeddings = window`. LongRoPE's
    short and long factors differ per frequency, so the two sets rotate differently. `default` and `proportional`
    (on half of the rotary dimensions unless set) keep the family's own (large) window, which prompts must not
    exceed.
    """
    config = tiny_config(family, vocab_size=8, **overrides)
    params = {key: value for key, value in config.rope_parameters.items() if key != "rope_type"}
    if rope_type == "default":
        return {**overrides, "rope_parameters": {**params, "rope_type": rope_type}}
    if rope_type == "proportional":  # Gemma 4's partial rotation, on the first half of the frequencies
        return {**overrides, "rope_parameters": {"partial_rotary_factor": 0.5, **params, "rope_type": rope_type}}
    with torch.device("meta"):
        frequencies = AutoModelForCausalLM.from_config(config).model.rotary_emb.inv_freq.numel()
    params.update(rope_type=rope_type, factor=2.0)
    if rope_type in ("linear", "dynamic"):
        return {**overrides, "rope_parameters": params, "max_position_embeddings": window}
    params["original_max_position_embeddings"] = window
    if rope_type == "longrope":
        params.update(short_factor=[1.0] * frequencies, long_factor=[1.0 + i for i in range(frequencies)])
    elif rope_type == "llama3":
        params.update(low_freq_factor=1.0, high_freq_factor=4.0)
    return {**overrides, "rope_parameters": params, "max_position_embeddings": 2 * window}


def save_tiny_model(path: str | Path, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """Builds a tiny random `family` model in fp32 and saves it with the tokenizer to `path`."""
    path = Path(path)
    tokenizer = build_tokenizer()
    config = tiny_config(family, vocab_size=len(tokenizer), **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if config.model_type == "glm_moe_dsa":
        spread_indexer_weights(model)
    if config.model_type == "qwen3_5_text":
        _slow_decays(model)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def spread_indexer_weights(model, std: float = INDEXER_STD) -> None:
    """Redraws the DSA indexer projections of a `glm_moe_dsa` model with standard deviation `std`.

    A trained indexer's weights are far from the 0.02 init and its scores span a wide range; so do these. Whether a
    top-k cut-off falls within float noise is a property of the data too, so tests that compare selections also check
    the cut-off gaps of their batches.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".indexer." in name and name.endswith((".wq_b.weight", ".wk.weight", ".weights_proj.weight")):
                param.normal_(0.0, std)


def _slow_decays(model) -> None:
    """Makes the DeltaNet layers of a tiny Qwen3.5 remember for tens of tokens.

    The stock init draws the decay rate `A` from [0.01, 16], so most heads forget within a token or two and a test
    could not tell whether the recurrent state (and its gradient) crosses chunk boundaries. Rates in [0.01, 0.3] keep
    a per-token decay of 0.7 to 0.99.
    """
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, Qwen3_5GatedDeltaNet):
                module.A_log.copy_(torch.empty_like(module.A_log).uniform_(0.01, 0.3).log())


def random_micro_batch(
    prompt_lengths: list[int],
    completion_lengths: list[int],
    group_of_row: list[int],
    vocab_size: int,
    seed: int = 0,
    completion_width: int | None = None,
) -> dict[str, torch.Tensor]:
    """A GRPO micro-batch as `_generate_and_score_completions` returns it.

    Row `r` has prompt number `group_of_row[r]` (rows of one prompt get identical, identically padded prompts) of
    `prompt_lengths[group]` tokens, left-padded to the longest, and a completion of `completion_lengths[r]` tokens,
    right-padded. Advantages are random; `num_items_in_batch` counts the completion tokens.
    """
    g = torch.Generator().manual_seed(seed)
    width = max(prompt_lengths)
    cwidth = completion_width or max(completion_lengths)
    prompts = [torch.randint(3, vocab_size, (n,), generator=g) for n in prompt_lengths]
    rows = len(group_of_row)
    prompt_ids = torch.zeros(rows, width, dtype=torch.long)
    prompt_mask = torch.zeros(rows, width, dtype=torch.long)
    completion_ids = torch.zeros(rows, cwidth, dtype=torch.long)
    completion_mask = torch.zeros(rows, cwidth, dtype=torch.long)
    for r, group in enumerate(group_of_row):
        n = prompt_lengths[group]
        prompt_ids[r, width - n :] = prompts[group]
        prompt_mask[r, width - n :] = 1
        c = completion_lengths[r]
        completion_ids[r, :c] = torch.randint(3, vocab_size, (c,), generator=g)
        completion_mask[r, :c] = 1
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.randn(rows, generator=g),
        "num_items_in_batch": completion_mask.sum().float(),
    }
