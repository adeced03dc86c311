"""GLM-5 / GLM-5.2 (`glm_moe_dsa`): MLA + DSA + MoE, against the transformers model and GRPOTrainer.

The tiny model (see `trl_longstraw.testing.TINY_FAMILY_OVERRIDES`) has `index_topk=5` and prompts of up to 13
tokens, so the DSA selection drops keys; its indexer weights are spread (`spread_indexer_weights`) so that top-k
cut-offs are not within float noise, which `_assert_clear_cutoffs` checks on the stock model's own scores.
"""

from __future__ import annotations

import copy

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, DynamicCache, GlmMoeDsaConfig
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import add_fused_lm_head

import trl_longstraw.glm_moe_dsa as glm
from tests.tolerances import ATTN_ATOL_FP32, DSA_MIN_CUTOFF_GAP, GRAD_RTOL, LOGP_ATOL, LOSS_ATOL
from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer
from trl_longstraw.adapters import get_adapter
from trl_longstraw.engine import Engine, Pass, group_prompts, use_pass
from trl_longstraw.testing import build_tokenizer, random_micro_batch, save_tiny_model

FAMILY = "glm_moe_dsa"
VOCAB = len(build_tokenizer())
# Odd prompt lengths (13 and 7 exceed index_topk=5; a prompt of one token has an empty prefix), ragged completions
# with one of length 1, groups whose rows are not adjacent.
PROMPTS, COMPLETIONS, GROUP_OF_ROW = [13, 7, 1], [9, 1, 5, 3, 4], [0, 1, 0, 2, 1]
CHUNK = 5  # divides neither 12 nor 6 prefix tokens


@pytest.fixture(scope="module")
def glm_path(tiny_model_path):
    return tiny_model_path(FAMILY)


@pytest.fixture(scope="module")
def micro_batch():
    return random_micro_batch(PROMPTS, COMPLETIONS, GROUP_OF_ROW, VOCAB, seed=1)


def _tiny_blocks(monkeypatch):
    """Block constants so small that every loop of the selection and the attention runs many times."""
    monkeypatch.setattr(glm, "INDEX_KEY_BLOCK", 3)
    monkeypatch.setattr(glm, "INDEX_TILE", 2 * 8 * 3)  # two queries per tile with 8 indexer heads
    monkeypatch.setattr(glm, "ATTN_SLOTS", 2 * 5)  # two queries per block with index_topk=5


def _load(path, **kwargs):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    return model


def _full_sequence(mb):
    ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], dim=1)
    mask = torch.cat([mb["prompt_mask"], mb["completion_mask"]], dim=1)
    width = mb["completion_ids"].shape[1]
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-width] = -100
    return ids, mask, labels, width


def _stock_scores(model, mb):
    """Per-token log-probs and entropies `[B, C]` of the stock padded full-sequence forward, as GRPOTrainer runs it."""
    ids, mask, labels, width = _full_sequence(mb)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    keep = mb["completion_mask"]
    return out.log_probs[:, -width:] * keep, out.entropy[:, -width:] * keep


def _assert_clear_cutoffs(model, mb):
    """The stock indexer scores of every real query that sees more than `index_topk` real keys have a gap between the
    k-th and the (k+1)-th of at least DSA_MIN_CUTOFF_GAP of its largest score, so float noise cannot flip the
    selection."""
    ids, mask, _, _ = _full_sequence(mb)
    gaps = []

    def hook(module, args):
        hidden, q_resid, (cos, sin) = args[0], args[1], args[2]
        for b in range(hidden.shape[0]):
            rows = [x if x.shape[0] == 1 else x[b : b + 1] for x in (cos, sin)]
            q, w, k = glm._indexer(module, hidden[b : b + 1], q_resid[b : b + 1], *rows)
            real = mask[b].bool()
            scores = glm._index_scores(q, w, k, module.softmax_scale)[real][:, real]
            n = scores.shape[0]
            if n <= module.index_topk:
                continue
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            largest = scores.masked_fill(scores.isinf(), 0).abs().amax(dim=1)[module.index_topk :]
            top = scores.sort(dim=1, descending=True).values[module.index_topk :]
            gaps.append((top[:, module.index_topk - 1] - top[:, module.index_topk]) / largest)

    handles = [
        layer.self_attn.indexer.register_forward_pre_hook(hook)
        for layer in model.model.layers
        if layer.self_attn.indexer is not None
    ]
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    finally:
        for handle in handles:
            handle.remove()
    gaps = torch.cat(gaps)
    assert gaps.numel() > 0, "no query sees more than index_topk keys: the selection is not exercised"
    assert gaps.min() >= DSA_MIN_CUTOFF_GAP, gaps.min()


# ----------------------------------------------------------------------------------------------------- accounting
def test_state_bytes_real_glm_5_2_shape():
    config = GlmMoeDsaConfig(
        num_hidden_layers=78,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        index_head_dim=128,
        index_topk=2048,
        n_routed_experts=256,
    )
    per_token, fixed = glm.GlmMoeDsaAdapter.state_bytes(config)
    assert per_token == 78 * (512 + 64 + 128) * 2 == 109824
    assert per_token / 1024 == 107.25 and fixed == 0
    # Layers that reuse the previous selection keep no indexer keys.
    shared = GlmMoeDsaConfig(num_hidden_layers=78, indexer_types=["full", "shared"] * 39)
    assert glm.GlmMoeDsaAdapter.state_bytes(shared, dtype_bytes=4)[0] == (78 * 576 + 39 * 128) * 4


def test_retained_state_matches_accounting(glm_path):
    model = _load(glm_path)
    adapter = get_adapter(model)
    assert isinstance(adapter, glm.GlmMoeDsaAdapter)
    prompt = torch.randint(3, VOCAB, (14,))
    (group,) = group_prompts(prompt[None], torch.ones(1, 14, dtype=torch.long))
    state = Engine(model, model, adapter, chunk_size=4).prefill(group)
    expected = 13 * adapter.state_bytes(model.config, dtype_bytes=4)[0]
    assert state.nbytes() == expected
    # The records own their storage: nothing larger (e.g. the projection they were split from) stays alive.
    assert sum(t.untyped_storage().nbytes() for t in state.tensors()) == expected
    widths = [tuple(t.shape[1] for t in chunks[0]) for _, chunks in sorted(state.records.items())]
    assert widths == [(12 + 4, 8), (12 + 4,), (12 + 4, 8)]  # "shared" layer 1 keeps no indexer keys


# ------------------------------------------------------------------------------------------------------ selection
def _random_selection_inputs(seed: int, sizes: list[int], integer: bool = False):
    g = torch.Generator().manual_seed(seed)
    s, heads, dim = sizes[-1], 3, 4
    q = torch.randn(s, heads, dim, generator=g)
    weights = torch.randn(s, heads, generator=g)
    keys = [torch.randn(n, dim, generator=g) for n in sizes]
    if integer:  # many exactly equal scores, including exact zeros from the ReLU
        q, weights, keys = q.round(), weights.round(), [k.round() for k in keys]
    return q, weights, keys


@pytest.mark.parametrize("integer", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("topk", [1, 4, 9, 40])
def test_select_topk_matches_reference(monkeypatch, integer, topk):
    sizes = [3, 5, 2, 4, 7]  # four prefix chunks, then seven own tokens
    q, weights, keys = _random_selection_inputs(topk, sizes, integer)
    query_start = sum(sizes[:-1])
    full = glm._index_scores(q, weights, torch.cat(keys), 0.5)  # [S, T], for the references only
    expected = glm.reference_select(full, query_start, topk)
    tiles, index_scores = [], glm._index_scores

    def scores(q, weights, keys, scale):
        tiles.append((q.shape[0], keys.shape[0]))
        return index_scores(q, weights, keys, scale)

    monkeypatch.setattr(glm, "_index_scores", scores)
    # Tie ranks counted in slices of every size: all at once, one element, five query x key elements.
    for key_block, tile, ties in [(4096, 1 << 24, 1 << 20), (2, 12, 1), (3, 1, 5)]:
        monkeypatch.setattr(glm, "INDEX_KEY_BLOCK", key_block)
        monkeypatch.setattr(glm, "INDEX_TILE", tile)
        monkeypatch.setattr(glm, "TOPK_SLICE", ties)
        tiles.clear()
        got = glm.select_topk(q, weights, keys, query_start, topk, 0.5)
        assert torch.equal(got.sort(dim=1).values, expected.sort(dim=1).values), (key_block, tile)
        # Never the full score matrix: each tile holds at most INDEX_TILE (or one query's block of) head scores.
        heads = q.shape[1]
        assert all(k <= key_block and (n * heads * k <= tile or n == 1) for n, k in tiles), tiles
        if topk < query_start + sizes[-1]:  # else every visible key is selected without scoring
            assert len(tiles) > (1 if key_block < sum(sizes) else 0)
    if topk < query_start:
        # Wherever the k-th and (k+1)-th visible scores differ, the set is torch.topk's, as transformers computes it.
        visible = torch.arange(full.shape[1])[None] <= torch.arange(query_start, query_start + sizes[-1])[:, None]
        masked = full.masked_fill(~visible, float("-inf"))
        ordered = masked.sort(dim=1, descending=True).values
        clear = ordered[:, topk - 1] > ordered[:, topk]
        assert clear.any()
        stock = masked.topk(topk, dim=1).indices
        assert torch.equal(got[clear].sort(dim=1).values, stock[clear].sort(dim=1).values)


@pytest.mark.parametrize("integer", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("topk,prompt", [(1, [3, 5, 2]), (4, [3, 5, 2]), (9, [3, 5, 2]), (40, [3, 5, 2]), (4, [])])
def test_decode_select_topk_matches_reference(monkeypatch, integer, topk, prompt):
    """A decoding step: each of 3 rows selects among the shared prompt's keys and its own tail's (its current token
    last), as `reference_select` does on that row's whole key sequence."""
    q, weights, keys = _random_selection_inputs(topk, [*prompt, 3], integer)
    tails = torch.stack([torch.randn(4, 4, generator=torch.Generator().manual_seed(r)) for r in range(3)])
    if integer:
        tails = tails.round()
    monkeypatch.setattr(glm, "INDEX_KEY_BLOCK", 3)  # prompt blocks spanning chunks
    got = glm.decode_select_topk(q, weights, keys[:-1], tails, topk, 0.5)
    for row in range(3):
        full = glm._index_scores(q[row : row + 1], weights[row : row + 1], torch.cat([*keys[:-1], tails[row]]), 0.5)
        expected = glm.reference_select(full, full.shape[1] - 1, topk)
        assert torch.equal(got[row : row + 1].sort(dim=1).values, expected.sort(dim=1).values), row


def _plain_keep_topk(values: torch.Tensor, keys: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain reference of `glm._keep_topk` on concatenated candidates `[Q, m]`: the `k` best of each row, ties to the
    earlier column, in column order, by one mask over the whole row."""
    cutoff = values.topk(k, dim=1).values.amin(dim=1, keepdim=True)
    above, tied = values > cutoff, values == cutoff
    keep = above | (tied & (tied.cumsum(dim=1) <= k - above.sum(dim=1, keepdim=True)))
    cols = keep.nonzero()[:, 1].view(-1, k)
    return values.gather(1, cols), keys.gather(1, cols)


@pytest.mark.parametrize("ties", [1, 7, 1 << 20])
def test_keep_topk_merge_equals_plain_concatenation(monkeypatch, ties):
    """The merge of running candidates and a block of new ones (`glm._keep_topk`, tie ranks counted `TOPK_SLICE`
    elements at a time, nothing concatenated) returns the same values and key numbers, bitwise and in the same column
    order, as the plain keep of their concatenation: with many exact ties (integer scores, ReLU zeros), `-inf` (keys
    in the future, rows that see fewer than `k` keys), running sets wider than `k`, and none."""
    monkeypatch.setattr(glm, "TOPK_SLICE", ties)
    g = torch.Generator().manual_seed(ties)
    cases = 0
    for q, r, n, k in [(5, 0, 9, 4), (6, 4, 11, 4), (3, 8, 3, 4), (4, 1, 40, 7), (7, 12, 5, 12), (2, 3, 2, 4)]:
        for spread in (2, 1000):  # integer scores from a narrow range (ties everywhere) or a wide one
            running = torch.randint(-spread, spread, (q, r), generator=g).float().clamp(min=0)
            block = torch.randint(-spread, spread, (q, n), generator=g).float().clamp(min=0)
            block[torch.rand(q, n, generator=g) < 0.3] = float("-inf")
            block[0] = float("-inf")  # a row that sees none of the new keys
            running_keys = torch.randint(0, 50, (q, r), generator=g)
            numbers = torch.arange(50, 50 + n)[None, :]
            expected = _plain_keep_topk(
                torch.cat([running, block], dim=1), torch.cat([running_keys, numbers.expand(q, -1)], dim=1), k
            )
            got = glm._keep_topk(block, numbers, k, running=(running, running_keys) if r else None)
            assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), (q, r, n, k, spread)
            cases += 1
    assert cases == 12


def test_select_topk_refuses_nan_scores():
    q, weights, keys = _random_selection_inputs(0, [4, 3])
    weights[1, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        glm.select_topk(q, weights, keys, query_start=4, topk=2, scale=1.0)


def test_select_topk_ties_go_to_the_earlier_key():
    q, weights = torch.ones(1, 1, 1), torch.ones(1, 1)
    keys = [torch.tensor([[1.0], [2.0], [1.0]]), torch.tensor([[1.0], [1.0]])]
    got = glm.select_topk(q, weights, keys, query_start=4, topk=3, scale=1.0)
    assert sorted(got[0].tolist()) == [0, 1, 2]


# ----------------------------------------------------------------------------------------------- sparse attention
def test_sparse_latent_attention_matches_reference(monkeypatch):
    g = torch.Generator().manual_seed(0)
    sizes, heads, rank, rope, topk = [4, 6, 3, 5], 3, 7, 4, 6
    q = torch.randn(sizes[-1], heads, rank + rope, generator=g, requires_grad=True)
    kv_parts = [torch.randn(n, rank + rope, generator=g, requires_grad=True) for n in sizes]
    query_start = sum(sizes[:-1])
    sel = glm.reference_select(torch.randn(sizes[-1], sum(sizes), generator=g), query_start, topk)
    sel[sel.ge(0) & sel.lt(sizes[0])] = -1  # no query reads the first part; some rows have empty slots
    assert (sel < 0).any(dim=1).any() and (sel >= 0).any(dim=1).all()
    grad_out = torch.randn(sizes[-1], heads, rank, generator=g)
    ref = glm.reference_latent_attention(q, kv_parts, sel, 0.3, rank)
    ref_grads = torch.autograd.grad((ref * grad_out).sum(), [q, *kv_parts])
    assert ref_grads[1].abs().sum() == 0
    whole = None
    for slots in [1 << 16, topk, 1]:
        monkeypatch.setattr(glm, "ATTN_SLOTS", slots)
        # Rows copied to and from the record chunks all at once, or one and two at a time (bitwise the same).
        for route_rows in [1 << 14, 1, 2]:
            monkeypatch.setattr(glm, "ROUTE_ROWS", route_rows)
            out = glm.sparse_latent_attention(q, kv_parts, sel, 0.3, rank)
            torch.testing.assert_close(out, ref, atol=ATTN_ATOL_FP32, rtol=0)
            grads = torch.autograd.grad(
                (out * grad_out).sum(), [q, *kv_parts], allow_unused=True, materialize_grads=True
            )
            for got, want in zip(grads, ref_grads, strict=True):
                torch.testing.assert_close(got, want, atol=ATTN_ATOL_FP32, rtol=0)
            if route_rows == 1 << 14:
                whole = (out, *grads)
            assert all(torch.equal(a, b) for a, b in zip((out, *grads), whole, strict=True)), (slots, route_rows)


# -------------------------------------------------------------------------------------------------- vs the model
@pytest.mark.parametrize("blocks", ["default", "tiny"])
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_logps_match_stock_forward(glm_path, micro_batch, monkeypatch, attn_implementation, blocks):
    if blocks == "tiny":
        _tiny_blocks(monkeypatch)
    model = _load(glm_path, attn_implementation=attn_implementation)
    _assert_clear_cutoffs(model, micro_batch)
    ref_logps, ref_entropies = _stock_scores(model, micro_batch)
    dense = _load(glm_path, attn_implementation=attn_implementation, index_topk=64)
    dense_logps, _ = _stock_scores(dense, micro_batch)
    assert (dense_logps - ref_logps).abs().max() > 1e-3, "top-k selection has no effect on this batch"
    for chunk in [1, 3, CHUNK, 100]:
        engine = Engine(model, model, get_adapter(model), chunk_size=chunk)
        with torch.no_grad():
            logps, entropies = engine.score(
                micro_batch["prompt_ids"],
                micro_batch["prompt_mask"],
                micro_batch["completion_ids"],
                micro_batch["completion_mask"],
            )
        torch.testing.assert_close(logps, ref_logps, atol=LOGP_ATOL, rtol=0)
        torch.testing.assert_close(entropies, ref_entropies, atol=LOGP_ATOL, rtol=0)


def test_dense_when_keys_fit_top_k(glm_path, micro_batch):
    """With index_topk above every sequence length, the adapter is dense causal MLA, as stock is."""
    model = _load(glm_path, index_topk=64)
    ref_logps, _ = _stock_scores(model, micro_batch)
    engine = Engine(model, model, get_adapter(model), chunk_size=CHUNK)
    with torch.no_grad():
        logps, _ = engine.score(micro_batch["prompt_ids"], micro_batch["prompt_mask"], *_completion(micro_batch))
    torch.testing.assert_close(logps, ref_logps, atol=LOGP_ATOL, rtol=0)


def _completion(mb):
    return mb["completion_ids"], mb["completion_mask"]


def test_moe_routing_matches_stock(glm_path):
    """Every token is routed to the same experts in prefill chunks and branches as in the padded full sequence."""
    model = _load(glm_path)
    assert model.config.num_hidden_layers == 3
    mb = random_micro_batch([11], [6, 2, 4], [0, 0, 0], VOCAB, seed=3)
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    assert len(gates) == 2
    calls: dict[int, list[torch.Tensor]] = {id(gate): [] for gate in gates}

    def hook(module, args, output):
        calls[id(module)].append(output[2].sort(dim=-1).values)

    handles = [gate.register_forward_hook(hook) for gate in gates]
    try:
        ids, mask, _, _ = _full_sequence(mb)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
        stock = {key: value.pop().view(ids.shape[0], ids.shape[1], -1) for key, value in calls.items()}
        engine = Engine(model, model, get_adapter(model), chunk_size=4)
        with torch.no_grad():
            engine.score(mb["prompt_ids"], mb["prompt_mask"], *_completion(mb))
    finally:
        for handle in handles:
            handle.remove()
    for gate in gates:
        ours = calls[id(gate)]
        # Three prefill chunks of 10 prefix tokens, then three branches; the last layer's MoE runs no prefill chunk
        # (nothing reads its outputs at prompt positions).
        chunks = 0 if gate is gates[-1] else 3
        assert len(ours) == chunks + 3
        if chunks:
            torch.testing.assert_close(torch.cat(ours[:chunks]), stock[id(gate)][0, :10], rtol=0, atol=0)
        for row, n in enumerate([6, 2, 4]):
            torch.testing.assert_close(ours[chunks + row], stock[id(gate)][row, 10 : 10 + n], rtol=0, atol=0)


def test_gradient_reaches_latent_and_rope_records_not_indexer_keys(glm_path):
    model = _load(glm_path)
    adapter = get_adapter(model)
    prompt = torch.randint(3, VOCAB, (12,))
    (group,) = group_prompts(prompt[None], torch.ones(1, 12, dtype=torch.long))
    engine = Engine(model, model, adapter, chunk_size=CHUNK)
    state = engine.prefill(group)
    state.requires_grad_()
    completion = torch.randint(3, VOCAB, (4,))
    with adapter.activate(), use_pass(Pass(state, visible=state.num_chunks)):
        logps, _ = engine._forward_branch(*engine._branch(group, completion, 4))
        logps.sum().backward()
    assert not any(p.grad is not None for n, p in model.named_parameters() if ".indexer." in n)
    rank = model.config.kv_lora_rank
    for layer, chunks in state.records.items():
        # A chunk that no branch query selected (top-k of 5) gets no gradient at all.
        assert any(kv.grad is not None for kv, *_ in chunks), layer
        for kv, *index_key in chunks:
            if kv.grad is not None:  # both the latent and the rope-key columns
                assert kv.grad[:, :rank].abs().sum() > 0 and kv.grad[:, rank:].abs().sum() > 0, layer
            assert all(k.grad is None for k in index_key), layer
    assert any(kv.grad is None for chunks in state.records.values() for kv, *_ in chunks)
    # The same holds in transformers: its indexer runs under no_grad, so a backward leaves its weights without grad.
    ids = torch.cat([prompt, completion])[None]
    model.zero_grad(set_to_none=True)
    model(input_ids=ids).logits.sum().backward()
    for name, param in model.named_parameters():
        assert (param.grad is None) == (".indexer." in name), name


def test_activate_restores_forward(glm_path):
    model = _load(glm_path)
    adapter = get_adapter(model)
    attention = model.model.layers[0].self_attn
    with adapter.activate():
        assert "forward" in attention.__dict__
        with pytest.raises(RuntimeError, match="outside of an engine pass"):
            model(input_ids=torch.tensor([[3, 4]]))
    assert "forward" not in attention.__dict__
    model(input_ids=torch.tensor([[3, 4]]))


def test_lora_on_kv_b_proj(glm_path, micro_batch):
    """A PEFT LoRA on kv_b_proj is folded into the absorbed weights; its dropout is refused."""
    from peft import LoraConfig, get_peft_model

    model = _load(glm_path)
    lora = LoraConfig(target_modules=["kv_b_proj", "q_b_proj"], r=2, init_lora_weights=False, lora_dropout=0.0)
    peft_model = get_peft_model(model, lora)
    ref_logps, _ = _stock_scores(peft_model, micro_batch)
    causal_lm = peft_model.get_base_model()
    engine = Engine(peft_model, causal_lm, get_adapter(causal_lm), chunk_size=CHUNK)
    with torch.no_grad():
        logps, _ = engine.score(micro_batch["prompt_ids"], micro_batch["prompt_mask"], *_completion(micro_batch))
    torch.testing.assert_close(logps, ref_logps, atol=LOGP_ATOL, rtol=0)

    dropped = get_peft_model(_load(glm_path), LoraConfig(target_modules=["kv_b_proj"], r=2, lora_dropout=0.1))
    dropped.train()
    causal_lm = dropped.get_base_model()
    engine = Engine(dropped, causal_lm, get_adapter(causal_lm), chunk_size=CHUNK)
    with torch.no_grad(), pytest.raises(ValueError, match="lora_dropout=0.0"):
        engine.score(micro_batch["prompt_ids"], micro_batch["prompt_mask"], *_completion(micro_batch))


def test_attention_dropout_refused(tmp_path):
    path = save_tiny_model(tmp_path, FAMILY, attention_dropout=0.1)
    with pytest.raises(ValueError, match="attention_dropout=0.0"):
        get_adapter(_load(path))


# ----------------------------------------------------------------------------------------------------- trainers
def _reward(completions, **kwargs):
    return [0.0] * len(completions)


def _config(cls, tmp_path, **kwargs):
    return cls(
        output_dir=str(tmp_path),
        per_device_train_batch_size=5,
        num_generations=5,
        max_completion_length=9,
        report_to=[],
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        router_aux_loss_coef=0.0,
        **kwargs,
    )


def _trainer(cls, path, args):
    trainer = cls(str(path), _reward, args, train_dataset=Dataset.from_dict({"prompt": ["a b c"] * 5}))
    trainer._prepare_inputs = lambda x: x
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def _set_checkpointing(model, on: bool):
    if on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def _step(trainer, mb):
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.training_step(trainer.model, dict(mb), mb["num_items_in_batch"])
    return loss, {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def _assert_same_grads(ours, ref):
    assert set(ours) == set(ref), set(ours) ^ set(ref)
    assert not any(".indexer." in name for name in ref), "the indexer must get no gradient, as in transformers"
    for name, grad in ref.items():
        err = ((ours[name] - grad).norm() / grad.norm().clamp_min(1e-30)).item()
        assert err <= GRAD_RTOL, (name, err)


@pytest.mark.parametrize(
    "loss_type, beta, blocks",
    [(loss, beta, "default") for loss in ("dapo", "grpo", "bnpo") for beta in (0.0, 0.1)] + [("grpo", 0.1, "tiny")],
)
def test_exact_gradients_match_grpo_trainer(glm_path, micro_batch, tmp_path, monkeypatch, loss_type, beta, blocks):
    if blocks == "tiny":
        _tiny_blocks(monkeypatch)
    mb = dict(micro_batch)
    if beta:
        mb["ref_per_token_logps"] = -torch.rand(mb["completion_ids"].shape, generator=torch.Generator().manual_seed(2))
    common = dict(loss_type=loss_type, beta=beta)
    stock = _trainer(GRPOTrainer, glm_path, _config(GRPOConfig, tmp_path / "stock", **common))
    ours = _trainer(
        LongStrawGRPOTrainer,
        glm_path,
        _config(LongStrawGRPOConfig, tmp_path / "ours", **common, prefill_chunk_size=CHUNK, prompt_gradient="exact"),
    )
    for checkpointing in (False, True):
        _set_checkpointing(stock.model, checkpointing)
        _set_checkpointing(ours.model, checkpointing)
        ref_loss, ref_grads = _step(stock, mb)
        loss, grads = _step(ours, mb)
        assert abs(loss.item() - ref_loss.item()) <= LOSS_ATOL
        _assert_same_grads(grads, ref_grads)


def _reference_detached_step(trainer, mb):
    """Detached mode done plainly with transformers: each prompt[:-1] is run once without autograd into a
    `DynamicCache`; each completion runs with autograd against a fresh copy of it; TRL's loss on those per-token
    values is back-propagated in one go."""
    model = trainer.model
    model.zero_grad(set_to_none=True)
    width = mb["completion_ids"].shape[1]
    # Eval mode (no dropout here either way) so that gradient checkpointing keeps the cache: the reference runs
    # without it whatever the trainer's setting.
    model.eval()
    rows_lp, rows_ent = [], []
    for row in range(len(GROUP_OF_ROW)):
        mask = mb["prompt_mask"][row].bool()
        pad = int((~mask).sum())
        prompt = mb["prompt_ids"][row, pad:]
        cache = DynamicCache(config=model.config)
        if prompt.shape[0] > 1:
            with torch.no_grad():
                model.model(
                    input_ids=prompt[None, :-1],
                    position_ids=torch.arange(pad, pad + prompt.shape[0] - 1)[None],
                    past_key_values=cache,
                    use_cache=True,
                )
        n = int(mb["completion_mask"][row].sum())
        ids = torch.cat([prompt[-1:], mb["completion_ids"][row, : n - 1]])[None]
        out = model(
            input_ids=ids,
            position_ids=torch.arange(pad + prompt.shape[0] - 1, pad + prompt.shape[0] - 1 + n)[None],
            past_key_values=copy.deepcopy(cache),
            shift_labels=mb["completion_ids"][row, :n][None],
            fused_lm_head=True,
        )
        rows_lp.append(torch.nn.functional.pad(out.log_probs[0], (0, width - n)))
        rows_ent.append(torch.nn.functional.pad(out.entropy[0], (0, width - n)))
    logps, entropies = torch.stack(rows_lp), torch.stack(rows_ent)
    trainer._precomputed = (logps, entropies)
    try:
        loss = GRPOTrainer._compute_loss(trainer, model, dict(mb))
    finally:
        trainer._precomputed = None
    loss.backward()
    model.train()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_detached_matches_plain_reference(glm_path, micro_batch, tmp_path, beta):
    mb = dict(micro_batch)
    if beta:
        mb["ref_per_token_logps"] = -torch.rand(mb["completion_ids"].shape, generator=torch.Generator().manual_seed(2))
    ours = _trainer(
        LongStrawGRPOTrainer,
        glm_path,
        _config(LongStrawGRPOConfig, tmp_path, beta=beta, prefill_chunk_size=CHUNK, prompt_gradient="detached"),
    )
    for checkpointing in (False, True):
        _set_checkpointing(ours.model, checkpointing)
        loss, grads = _step(ours, mb)
        ref_loss, ref_grads = _reference_detached_step(ours, mb)
        assert abs(loss.item() - ref_loss.item()) <= LOSS_ATOL
        _assert_same_grads(grads, ref_grads)


def test_router_aux_loss_refused(glm_path, tmp_path):
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.0"):
        _trainer(
            LongStrawGRPOTrainer,
            glm_path,
            LongStrawGRPOConfig(
                output_dir=str(tmp_path),
                per_device_train_batch_size=5,
                num_generations=5,
                report_to=[],
                use_cpu=True,
                router_aux_loss_coef=0.01,
            ),
        )
