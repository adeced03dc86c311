"""Shared-prompt generation: one prefill per distinct prompt; greedy equals stock, sampling is stock's sampler."""

from types import SimpleNamespace

import pytest
import torch
from grpo_pair import PROMPTS, generation_inputs, make_pair
from peft import LoraConfig
from tolerances import LOGP_ATOL
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from tests.helpers import selected, torchrun
from trl_longstraw.engine import PromptGroup
from trl_longstraw.generation import generation_config_for_decoder, shared_prompt_decoder
from trl_longstraw.testing import save_tiny_model

GREEDY = {"do_sample": False}
# The 2-process decoding test (tests/decode_worker.py): its families, and seconds for their one launch, which runs
# beside the single-process tests (it was 360 s per family).
DECODE_FAMILIES = ["llama", "qwen3_5", "glm_moe_dsa"]
DECODE_TIMEOUT = 1200


@pytest.fixture(scope="module", autouse=True)
def decode_launch(request, tiny_model_path, tmp_path_factory):
    """tests/decode_worker.py on 2 processes for every decoding family, in one launch, started with the module's first
    test so that it runs while the single-process tests do (if the session runs the 2-process test)."""
    if not selected(request, "test_decoding_against_a_sharded_prompt_state"):
        yield None
        return
    cases = {family: ("decode_worker", [tiny_model_path(family)]) for family in DECODE_FAMILIES}
    tmp = tmp_path_factory.mktemp("decode")
    with torchrun("the 2-process decoding", cases, tmp, nproc=2, timeout=DECODE_TIMEOUT) as run:
        yield run


def tokenize(trainer, prompts):
    return [trainer.processing_class(text=p)["input_ids"] for p in prompts]


# Rows of one prompt are not adjacent; prompts of 1 to 7 tokens, so rows are left-padded by different amounts.
ROWS = ["a b c d e", "x", "h i j k l m n", "a b c d e", "x", "key value is 3", "h i j k l m n", "a b c d e"]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("pad_to_multiple_of", [None, 4])
def test_greedy_completions_equal_stock(tiny_model_path, family, pad_to_multiple_of):
    settings = dict(generation_kwargs=GREEDY, max_completion_length=9, pad_to_multiple_of=pad_to_multiple_of)
    stock, ours = make_pair(tiny_model_path(family), **settings)
    ids = tokenize(stock, ROWS)
    expected, _ = stock._generate_single_turn(ids, None, {}, 3)
    got, logprobs = ours._generate_single_turn(ids, None, {}, 3)
    assert logprobs is None
    assert got == expected
    lengths = {len(c) for c in got}
    assert 1 in lengths and 9 in lengths, "the prompts should cover EOS at once and no EOS at all"
    assert any(c[-1] == stock.eos_token_ids[0] and len(c) > 1 for c in got), "and EOS midway"


class Recorder(LogitsProcessor):
    """Records the processed scores of every step; changes nothing."""

    def __init__(self):
        self.scores = []

    def __call__(self, input_ids, scores):
        self.scores.append(scores.clone())
        return scores


def stock_and_ours(trainer, text: str, pad: int, rows: int, seed: int = 123, offset: int = 0, **settings):
    """`generate` on `rows` copies of `text` left-padded by `pad`, with stock's `_sample` loop and with the
    shared-prompt decoder (placing the first prompt token at `offset`), from the same seed. Returns per loop the
    output ids `[rows, width + T]` and the processed scores `[rows, V]` of every step."""
    model = trainer.model
    prompt = trainer.processing_class(text=text)["input_ids"]
    ids = torch.tensor([[0] * pad + prompt] * rows)
    mask = torch.tensor([[0] * pad + [1] * len(prompt)] * rows)
    config = GenerationConfig(pad_token_id=0, eos_token_id=[1], disable_compile=True, **settings)
    outputs = []
    for custom in (None, shared_prompt_decoder(trainer._engine(model), torch.tensor(prompt), offset=offset)):
        recorder = Recorder()
        torch.manual_seed(seed)
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                generation_config=generation_config_for_decoder(config) if custom else config,
                logits_processor=LogitsProcessorList([recorder]),
                custom_generate=custom,
            )
        outputs.append((out, recorder.scores))
    return outputs


def assert_same_steps(stock, ours) -> None:
    """Same tokens, and at every step the same processed distribution (log-probs within LOGP_ATOL)."""
    (stock_out, stock_scores), (our_out, our_scores) = stock, ours
    assert torch.equal(our_out, stock_out)
    assert len(our_scores) == len(stock_scores) > 0
    for a, b in zip(stock_scores, our_scores, strict=True):
        torch.testing.assert_close(b.log_softmax(-1), a.log_softmax(-1), atol=LOGP_ATOL, rtol=0)


# Prompts of 1 to 11 tokens: left-padded by different amounts, most longer than one prefill chunk (3, which divides
# none of them), one with no prefix at all.
LONG_ROWS = ["a b c d e f g h i j k", "x", "h i j k l m n", "a b c d e f g h i j k", "key value is 3", "x"]


def capture_prompt_states(engine) -> list:
    """Wraps `engine.prefill` to keep each prompt state it returns, with a copy of its tensors at that time."""
    states, prefill = [], engine.prefill

    def recording(*args, **kwargs):
        state = prefill(*args, **kwargs)
        states.append((state, [t.clone() for t in state.tensors()]))
        return state

    engine.prefill = recording
    return states


@pytest.mark.parametrize("family", ["qwen3_5", "glm_moe_dsa"])
def test_greedy_decoding_against_the_prompt_state_equals_stock(tiny_model_path, family):
    """Greedy completions equal transformers' `generate` token for token, and decoding never writes the prompt
    state: each row starts from its records (Gated DeltaNet: the final conv tail and recurrent state) and keeps
    its own."""
    settings = dict(generation_kwargs=GREEDY, max_completion_length=8, longstraw={"prefill_chunk_size": 3})
    stock, ours = make_pair(tiny_model_path(family), **settings)
    assert ours._shared_generation
    ids = tokenize(stock, LONG_ROWS)
    states = capture_prompt_states(ours._engine(ours.model))
    expected, _ = stock._generate_single_turn(ids, None, {}, 2)
    got, _ = ours._generate_single_turn(ids, None, {}, 2)
    assert got == expected
    assert len(states) == len({tuple(p) for p in ids}), "one prefill per distinct prompt"
    assert max(state.num_chunks for state, _ in states) > 1
    for state, before in states:
        after = list(state.tensors())
        assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert len({len(c) for c in got}) > 1, "completions of different lengths (EOS midway)"
    # Step by step: the decoded distribution is stock's, not only its argmax.
    steps = stock_and_ours(ours, LONG_ROWS[0], pad=3, rows=2, max_new_tokens=6, do_sample=False)
    assert_same_steps(*steps)


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "glm_moe_dsa"])
def test_decoding_at_the_loss_pass_positions_follows_stock(tiny_model_path, tmp_path, family):
    """A left-padded prompt whose state is offered to the loss pass is prefilled after its padding, where the loss
    pass places it, and decodes at the positions that follow: every step's processed distribution is `generate`'s
    (positions from 0) within LOGP_ATOL, with the same greedy and sampled tokens; the offered state is the loss
    pass's own prefill, bit for bit. (GLM samples with a dense top-k, as in `test_sampling_is_stocks_sampler`.)"""
    text = LONG_ROWS[0]
    _, ours = make_pair(tiny_model_path(family), longstraw={"prefill_chunk_size": 3})
    assert_same_steps(*stock_and_ours(ours, text, pad=5, rows=2, offset=5, max_new_tokens=6, do_sample=False))
    dense = save_tiny_model(tmp_path, family, index_topk=64) if family == "glm_moe_dsa" else tiny_model_path(family)
    _, sampler = make_pair(dense, longstraw={"prefill_chunk_size": 3})
    sampled = stock_and_ours(sampler, text, pad=5, rows=3, offset=5, max_new_tokens=6, do_sample=True, temperature=1.3)
    assert_same_steps(*sampled)
    engine = ours._engine(ours.model)
    prompt = torch.tensor(ours.processing_class(text=text)["input_ids"])
    decoder = shared_prompt_decoder(engine, prompt, offer=True, boundaries=True, offset=5)
    ids = torch.cat([torch.zeros(5, dtype=torch.long), prompt])[None]
    mask = torch.tensor([[0] * 5 + [1] * len(prompt)])
    config = generation_config_for_decoder(GenerationConfig(max_new_tokens=3, pad_token_id=0, eos_token_id=[1]))
    with torch.no_grad():
        ours.model.generate(input_ids=ids, attention_mask=mask, generation_config=config, custom_generate=decoder)
    ((key, offered),) = engine.held().items()
    assert key[0] == 5
    with torch.no_grad():
        expected = engine.prefill(PromptGroup(tokens=prompt, pad=5, rows=[0]), boundaries=True)
    assert offered.chunk_lengths == expected.chunk_lengths and offered.boundaries
    got, want = list(offered.tensors()), list(expected.tensors())
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_greedy_with_repetition_penalty_equals_stock(tiny_model_path):
    # The penalty reads the padded input_ids, pad tokens included, so the rows must be padded as stock pads them.
    kwargs = {**GREEDY, "repetition_penalty": 1.5}
    stock, ours = make_pair(tiny_model_path("llama"), generation_kwargs=kwargs, max_completion_length=9)
    ids = tokenize(stock, ROWS)
    assert ours._generate_single_turn(ids, None, {}, 3)[0] == stock._generate_single_turn(ids, None, {}, 3)[0]


def test_each_distinct_prompt_is_prefilled_once(tiny_model_path):
    stock, ours = make_pair(tiny_model_path("llama"), generation_kwargs=GREEDY)
    ids = tokenize(stock, ROWS)
    processed = {}
    for name, trainer in (("stock", stock), ("ours", ours)):
        calls = []
        embed = trainer.model.get_input_embeddings()
        handle = embed.register_forward_hook(lambda m, args, out, calls=calls: calls.append(args[0].numel()))
        try:
            completions, _ = trainer._generate_single_turn(ids, None, {}, 3)
        finally:
            handle.remove()
        processed[name] = (calls, completions)
    calls, completions = processed["ours"]
    groups = {}
    for row, prompt in enumerate(ids):
        groups.setdefault(tuple(prompt), []).append(row)
    # Exactly: prompt[:-1] of each distinct prompt once, then one token per row and step of its group (the first
    # step feeds prompt[-1]); a group decodes until its longest completion ends.
    prefill = sum(len(p) - 1 for p in groups)
    decode = sum(len(rows) * max(len(completions[r]) for r in rows) for rows in groups.values())
    assert sum(calls) == prefill + decode
    # Stock's first forward runs every row's whole padded prompt: each prompt G times.
    stock_calls, _ = processed["stock"]
    assert stock_calls[0] == len(ROWS) * max(len(p) for p in groups)


def closed_bars(text: str, name: str) -> list[str]:
    """The last line of each progress bar named `name` in `text` (tqdm ends a bar with a newline when it closes)."""
    return [line.rsplit("\r", 1)[-1] for line in text.split("\n") if f"{name}:" in line]


def test_progress_bars_of_decoding_and_branches(tiny_model_path, capsys):
    """`prefill_progress` (main process) shows, beside each prefill bar of a prompt of several chunks, a bar over its
    decoding steps, and in the loss pass one over its branches; none for a prompt of one chunk, none when off."""
    _, ours = make_pair(tiny_model_path("llama"), generation_kwargs=GREEDY, longstraw={"prefill_progress": True})
    engine = ours._engine(ours.model)
    assert engine.progress
    ids = tokenize(ours, ROWS)
    long = {tuple(p) for p in ids if len(p) - 1 > engine.chunk_size}
    assert 0 < len(long) < len(set(map(tuple, ids))), "prompts of one chunk and of several"
    capsys.readouterr()
    completions, _ = ours._generate_single_turn(ids, None, {}, 3)
    err = capsys.readouterr().err
    assert len(closed_bars(err, "decode")) == len(closed_bars(err, "prefill")) == len(long)
    # Tokens of every row of the prompt (G per step) until its longest completion ends.
    groups = [[r for r, p in enumerate(ids) if tuple(p) == prompt] for prompt in long]
    decoded = sorted(len(rs) * max(len(completions[r]) for r in rs) for rs in groups)
    assert sorted(int(bar.split("|")[2].split("/")[0]) for bar in closed_bars(err, "decode")) == decoded

    # The loss pass, exact mode: two rows of a long prompt, one of a one-chunk prompt.
    rows = [ids[0], ids[0], ids[1]]
    assert tuple(ids[0]) in long and tuple(ids[1]) not in long
    width = max(map(len, rows))
    prompt_ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    prompt_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    completion_ids = torch.tensor([[5, 6, 7]] * 3)
    mask, grad = torch.ones(3, 3, dtype=torch.long), torch.ones(3, 3)
    engine.backward(prompt_ids, prompt_mask, completion_ids, mask, grad, None, True, torch.Tensor.backward)
    (bar,) = closed_bars(capsys.readouterr().err, "branches")
    assert "| 2/2 [" in bar

    engine.progress = False
    ours._generate_single_turn(ids, None, {}, 3)
    engine.backward(prompt_ids, prompt_mask, completion_ids, mask, grad, None, True, torch.Tensor.backward)
    err = capsys.readouterr().err
    assert not any(f"{name}:" in err for name in ("prefill", "decode", "branches"))


SAMPLING = [
    {"temperature": 0.7},
    {"temperature": 1.3, "top_k": 5},
    {"top_p": 0.8, "repetition_penalty": 1.3},
    {"min_p": 0.05, "top_k": 0},
]


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "glm_moe_dsa"])
@pytest.mark.parametrize("settings", SAMPLING)
def test_sampling_is_stocks_sampler(tiny_model_path, tmp_path, family, settings):
    """Same rows and seed: stock's `_sample` and the shared-prompt decoder draw the same tokens, step by step from
    the same processed distribution (temperature, top-k, top-p, min-p, repetition penalty, EOS then padding).

    GLM with a DSA top-k above every length here (dense attention): sampled rows feed the pad token (after EOS, or
    drawn), whose zero embedding gives indexer scores of exactly 0, so its keys tie at the top-k cut-off, where
    stock's `torch.topk` order is unspecified (see glm_moe_dsa.py). The selection at decode is tested on its own
    (tests/test_glm_moe_dsa.py) and by the greedy test above."""
    dense = {"index_topk": 64} if family == "glm_moe_dsa" else None
    _, ours = make_pair(save_tiny_model(tmp_path, family, **dense) if dense else tiny_model_path(family))
    stock_run, our_run = stock_and_ours(
        ours, "h i j k l m n", pad=2, rows=5, max_new_tokens=12, do_sample=True, **settings
    )
    assert_same_steps(stock_run, our_run)
    # The five rows share one prompt but not their samples.
    width = 2 + len(ours.processing_class(text="h i j k l m n")["input_ids"])
    assert len({tuple(r) for r in our_run[0][:, width:].tolist()}) > 1


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "glm_moe_dsa"])
def test_sampled_batch_has_stocks_shapes_and_masks(tiny_model_path, family):
    """EOS, the maximum length and padding after EOS, through `_generate_and_score_completions`."""
    stock, ours = make_pair(tiny_model_path(family), per_device_train_batch_size=6, max_completion_length=9)
    inputs = generation_inputs(["h i j k l m n", "x"], 3)
    for t in (stock, ours):
        t.model.train()
    torch.manual_seed(0)
    expected = stock._generate_and_score_completions(inputs)
    torch.manual_seed(0)
    batch = ours._generate_and_score_completions(inputs)
    for key in ("prompt_ids", "prompt_mask"):
        torch.testing.assert_close(batch[key], expected[key], rtol=0, atol=0)
    eos = ours.eos_token_ids[0]
    ids, mask = batch["completion_ids"], batch["completion_mask"]
    assert ids.shape[1] <= 9 and ids.shape == mask.shape
    for row in range(ids.shape[0]):
        n = int(mask[row].sum())
        assert mask[row, :n].all() and not mask[row, n:].any()
        assert (ids[row, n:] == ours.processing_class.pad_token_id).all()
        real = ids[row, :n].tolist()
        assert eos not in real[:-1]
        assert real[-1] == eos or n == 9


def test_peft_greedy_equals_stock(tiny_model_path):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    stock, ours = make_pair(tiny_model_path("llama"), peft_config=lora, generation_kwargs=GREEDY)
    ids = tokenize(stock, PROMPTS)
    assert ours._generate_single_turn(ids, None, {}, 3)[0] == stock._generate_single_turn(ids, None, {}, 3)[0]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_beams": 2, "do_sample": False}, "beam"),
        ({"guidance_scale": 2.0}, "guidance_scale=2.0.*extra model forwards"),
        ({"return_dict_in_generate": True}, "return_dict_in_generate"),
        ({"num_return_sequences": 2}, "num_return_sequences=2.*num_generations"),
        ({"output_scores": True}, "output_scores"),
        ({"max_time": 5.0}, "max_time.*max_completion_length"),
        ({"stop_strings": ["."]}, "stop_strings.*eos_token_id"),
        ({"length_penalty": 2.0}, "length_penalty=2.0"),
        ({"diversity_penalty": 0.5}, "diversity_penalty=0.5"),
        ({"top_kk": 3}, "top_kk=3"),
    ],
)
def test_unsupported_generation_settings_are_refused(tiny_model_path, kwargs, match):
    with pytest.raises(ValueError, match=match) as refused:
        make_pair(tiny_model_path("llama"), generation_kwargs=kwargs)
    assert "shared_generation=False" in str(refused.value)


# Logits processors other than the sampling settings: `generate` builds them and the decoder runs them unchanged.
OTHER_PROCESSORS = [
    {"suppress_tokens": [3, 4, 5], "begin_suppress_tokens": [6]},
    {"no_repeat_ngram_size": 2, "min_new_tokens": 4},
    {"bad_words_ids": [[7], [8, 9]], "sequence_bias": {(10,): 5.0}},
    {"typical_p": 0.9, "epsilon_cutoff": 1e-3},
    {"eta_cutoff": 1e-3, "min_length": 12},
]


@pytest.mark.parametrize("settings", OTHER_PROCESSORS)
def test_other_logits_processors_are_stocks(tiny_model_path, settings):
    _, ours = make_pair(tiny_model_path("llama"), generation_kwargs=settings)
    steps = stock_and_ours(ours, "h i j k l m n", pad=2, rows=4, max_new_tokens=10, do_sample=True, **settings)
    assert_same_steps(*steps)


def test_shared_generation_off_is_stock(tiny_model_path):
    stock, ours = make_pair(tiny_model_path("llama"), generation_kwargs=GREEDY, longstraw={"shared_generation": False})
    engine = ours._engine(ours.model)
    engine.stats.reset()
    ids = tokenize(stock, ROWS)
    assert ours._generate_single_turn(ids, None, {}, 3)[0] == stock._generate_single_turn(ids, None, {}, 3)[0]
    assert engine.stats.prompt_positions == 0


@pytest.mark.parametrize(("fsdp", "shard_world"), [(True, 1), (True, None), (True, 2), (False, 1), (False, None)])
def test_generation_path_on_two_processes(tiny_model_path, monkeypatch, fsdp, shard_world):
    """The generation path the trainer picks on 2 processes is shared-prompt generation, without a warning, whatever
    the shard groups: under FSDP2 (accelerate's, or transformers' under expert parallelism), where every forward
    issues collectives, all ranks decode in one lockstep, with the prompt state sharded over both ranks, over shard
    groups of one rank (tests/test_shard_groups.py runs that on 4 processes) or not sharded; without FSDP2 forwards
    issue no collective (DDP)."""
    import trl_longstraw.trainer as trainer_module

    _, ours = make_pair(tiny_model_path("llama"), generation_kwargs=GREEDY)
    monkeypatch.setattr(trainer_module.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(trainer_module.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(ours, "is_fsdp_enabled", fsdp)
    ours._prompt_shards = None if shard_world is None else SimpleNamespace(world=shard_world)
    ours.args.shard_prompt_state = shard_world is not None
    warnings: list[str] = []
    monkeypatch.setattr(trainer_module.logger, "warning", warnings.append)
    ours._shared_generation = False
    ours._choose_generation()
    assert ours._shared_generation
    assert not warnings


@pytest.mark.slow
@pytest.mark.timeout(DECODE_TIMEOUT + 60)
@pytest.mark.parametrize("family", DECODE_FAMILIES)
def test_decoding_against_a_sharded_prompt_state(decode_launch, family):
    """2 processes (gloo), `shard_prompt_state=True`: each rank holds half of every prompt's attention records and
    decodes its own rows of the same prompts (tests/decode_worker.py). Greedy completions equal `generate`'s, on DDP
    and on FSDP2 (synced_gpus), and on FSDP2 without a sharded state (other prompts per rank, in lockstep); sampled
    rows follow `_sample` step by step on each rank's rows and seed; the prompt states are never written."""
    lockstep = False
    for rank, result in enumerate(decode_launch.result(family)):
        got, expected = result["greedy"]
        assert got == expected, f"rank {rank}"
        assert result["fsdp2_greedy"] == expected, f"rank {rank}: FSDP2 (synced_gpus, per-layer gathers)"
        assert result["peft_synced_gpus"], f"rank {rank}: generate would not run an FSDP2 PEFT model in lockstep"
        dp_got, dp_expected = result["fsdp2_data_parallel"]
        assert dp_got == dp_expected, f"rank {rank}: FSDP2 without a sharded state (data-parallel lockstep)"
        assert len({len(c) for c in got}) > 1, "completions of different lengths (EOS midway)"
        assert result["unchanged"], f"rank {rank}: decoding wrote the prompt state"
        # The 13-token prompt (4 chunks of 3 before its last token): this rank holds 2 of its chunks' records.
        assert result["held"][0] == (2, 4), result["held"]
        for prompt, sampled in enumerate(result["sampled"]):
            assert sampled["ours"] == sampled["stock"], f"rank {rank}, prompt {prompt}"
            assert sampled["logp_error"] <= LOGP_ATOL, f"rank {rank}, prompt {prompt}: {sampled['logp_error']}"
            ours_steps, stock_steps = sampled["steps"]
            assert ours_steps >= stock_steps
            lockstep |= ours_steps > stock_steps
    assert lockstep, "a rank whose rows finished first should step on with the other rank"
