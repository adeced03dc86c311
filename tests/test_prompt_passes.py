"""Done-when (a): how many times one full training step runs each distinct prompt, per model.

A full step with beta > 0 and num_iterations = 2 generates, scores old-policy log-probs, scores reference log-probs
and computes the loss. Each prompt position is counted every time a model's backbone runs it: the prompt tokens of
the prompts are all distinct, so a prompt token (before the last) run at its own position identifies one position of
one prompt. A prompt shorter than the longest of its generation batch is left-padded by `pad` tokens, and its token
`j` counts at position `j` (`generate`'s numbering) and at `pad + j` (the loss pass's, stock's forward over the
padded row). Stock runs every prompt G times in each of the four passes.
"""

import pytest
import torch
from grpo_pair import assert_grads_close, make_pair, position_reward
from peft import LoraConfig
from tolerances import SHARDED_GRAD_RTOL
from transformers import TrainerCallback, set_seed

from tests.helpers import selected, torchrun

# Seven tokens each, no token shared: positions 0..5 (prompt[:-1]) of each prompt are counted.
PROMPTS = ["a b c d e f g", "h i j k l m n"]
G = 3
# Seconds for the one launch of the 2-process test, tests/offer_worker.py, over every decoding family, which runs
# beside the single-process tests (it was 560 s per family).
OFFER_TIMEOUT = 1500


class PositionCounter:
    """Counts, per prompt token id, how often a backbone runs it at one of its positions (`positions[token]`)."""

    def __init__(self, backbone, positions: dict[int, set[int]]):
        self.positions = positions
        self.counts: dict[int, int] = {}
        self.handle = backbone.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        positions = kwargs.get("position_ids")
        if positions is None:  # stock's scoring forward, without a cache: positions 0..T-1 of the padded rows
            positions = torch.arange(input_ids.shape[1])[None]
        positions = positions.expand_as(input_ids)
        for token, position in zip(input_ids.flatten().tolist(), positions.flatten().tolist(), strict=True):
            if position in self.positions.get(token, ()):
                self.counts[token] = self.counts.get(token, 0) + 1


class MlpPromptTokens:
    """Counts the prompt tokens (counted positions, as `PositionCounter`) that the MLPs of a backbone's first and last
    decoder layers compute, forward or recomputed: each MLP call is charged the counted positions of the backbone
    call in progress (a gradient-checkpointing recompute runs in the backward of the pass that ran the forward).
    Also those that the last layer's attention output projection computes (`"last o_proj"`), where it has one."""

    def __init__(self, backbone, positions: dict[int, set[int]]):
        self.counter = PositionCounter(backbone, positions)
        self.current = 0
        self.counts = {"first": 0, "last": 0, "last o_proj": 0}
        self.handles = [backbone.register_forward_pre_hook(self.call, with_kwargs=True)]
        for name, layer in (("first", backbone.layers[0]), ("last", backbone.layers[-1])):
            # The MLP's first linear layer (a MoE block's shared experts' run every token): it runs when the MLP
            # computes, where the MLP module's own hooks run even when its forward is replaced.
            linear = next(m for m in layer.mlp.modules() if isinstance(m, torch.nn.Linear))
            self.handles.append(linear.register_forward_hook(lambda *_, name=name: self.charge(name)))
        projection = getattr(getattr(backbone.layers[-1], "self_attn", None), "o_proj", None)
        if projection is not None:
            # Its hooks run even when its forward is replaced (by the 0-dim zero): charged when it computes a row.
            self.handles.append(projection.register_forward_hook(self.projected))

    def projected(self, module, args, output) -> None:
        if output.dim() > 0:
            self.charge("last o_proj")

    def call(self, module, args, kwargs):
        before = sum(self.counter.counts.values())
        self.counter.hook(module, args, kwargs)
        self.current = sum(self.counter.counts.values()) - before

    def charge(self, name: str) -> None:
        self.counts[name] += self.current


def prompt_positions(prompt_tokens: list[list[int]], width: int | None = None) -> dict[int, set[int]]:
    """Where each counted token (all but the last of each prompt) runs: at `j` and, left-padded to `width` (default
    the longest prompt), at `pad + j`."""
    width = width or max(map(len, prompt_tokens))
    assert len({t for ts in prompt_tokens for t in ts}) == sum(map(len, prompt_tokens)), "prompt tokens must differ"
    return {t: {j, width - len(ts) + j} for ts in prompt_tokens for j, t in enumerate(ts[:-1])}


def passes(counter: PositionCounter, prompt_tokens: list[list[int]]) -> list[int]:
    """Per prompt, how many times each of its counted positions ran (they must agree within a prompt)."""
    result = []
    for tokens in prompt_tokens:
        per_position = {counter.counts.get(t, 0) for t in tokens[:-1]}
        assert len(per_position) == 1, per_position
        result.append(per_position.pop())
    return result


class Snapshot(TrainerCallback):
    """Records the counters after each optimizer step."""

    def __init__(self, counters, prompt_tokens):
        self.counters, self.prompt_tokens, self.steps = counters, prompt_tokens, []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append({name: passes(c, self.prompt_tokens) for name, c in self.counters.items()})
        for c in self.counters.values():
            c.counts.clear()


def run(trainer, separate_ref: bool, prompts: list[str] = PROMPTS):
    """`trainer.train()`; per optimizer step, per model, how many times each prompt's positions ran. Every
    generation batch holds all of `prompts`."""
    tokens = [trainer.processing_class(text=p)["input_ids"] for p in prompts]
    positions = prompt_positions(tokens)
    policy = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    counters = {"policy": PositionCounter(policy.base_model, positions)}
    if separate_ref:
        counters["ref"] = PositionCounter(trainer.ref_model.base_model, positions)
    snapshot = Snapshot(counters, tokens)
    trainer.add_callback(snapshot)
    trainer.train()
    return snapshot.steps


def settings(**overrides):
    # One generation batch = both prompts (2 x G rows), split into 2 micro-batches of one group each; with
    # gradient_accumulation_steps=2 one optimizer step consumes the whole generation batch once (iteration 1),
    # the next one again (iteration 2). Old-policy log-probs are needed: 2 % (2 * 2) != 0.
    base = dict(
        prompts=PROMPTS,
        beta=0.1,
        num_iterations=2,
        num_generations=G,
        per_device_train_batch_size=G,
        gradient_accumulation_steps=2,
        max_steps=2,
        max_completion_length=4,
        shuffle_dataset=False,
    )
    base.update(overrides)
    return base


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_prompt_passes_separate_reference_model(tiny_model_path, mode):
    stock, ours = make_pair(
        tiny_model_path("llama"), longstraw={"prompt_gradient": mode, "prefill_chunk_size": 4}, **settings()
    )
    ours_steps = run(ours, separate_ref=True)
    stock_steps = run(stock, separate_ref=True)
    extra = 1 if mode == "exact" else 0
    models = 2
    # Step 1: generation, whose prompt state the loss pass takes (old-policy log-probs come from the loss pass),
    # and reference scoring.
    assert ours_steps[0] == {"policy": [1 + extra] * 2, "ref": [1, 1]}
    assert ours_steps[0]["policy"][0] + ours_steps[0]["ref"][0] <= models + extra
    # Step 2 (second iteration over the same completions, after an update): the loss pass prefills again.
    assert ours_steps[1] == {"policy": [1 + extra] * 2, "ref": [0, 0]}
    # Stock: G times in each pass (generation, old log-probs, loss; reference).
    assert stock_steps[0] == {"policy": [3 * G] * 2, "ref": [G, G]}
    assert stock_steps[1] == {"policy": [G] * 2, "ref": [0, 0]}


@pytest.mark.slow
def test_prompt_passes_peft_reference_is_the_same_model(tiny_model_path):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    stock, ours = make_pair(
        tiny_model_path("llama"), peft_config=lora, longstraw={"prompt_gradient": "exact"}, **settings()
    )
    ours_steps = run(ours, separate_ref=False)
    stock_steps = run(stock, separate_ref=False)
    # One network runs generation (whose state the loss pass takes), the reference (adapters disabled) and the exact
    # reverse pass.
    assert ours_steps[0] == {"policy": [3, 3]}
    assert stock_steps[0] == {"policy": [4 * G] * 2}


# Every family decodes against the engine's prompt state.
DECODING_FAMILIES = ["llama", "qwen3_5", "glm_moe_dsa"]


@pytest.fixture(scope="module", autouse=True)
def offer_launch(request, tiny_model_path, tmp_path_factory):
    """tests/offer_worker.py on 2 processes for every decoding family, in one launch, started with the module's first
    test so that it runs while the single-process tests do (if the session runs the 2-process test)."""
    if not selected(request, "test_one_prefill_per_step_with_a_sharded_prompt_state"):
        yield None
        return
    cases = {family: ("offer_worker", [tiny_model_path(family)]) for family in DECODING_FAMILIES}
    tmp = tmp_path_factory.mktemp("offer")
    with torchrun("the 2-process run", cases, tmp, nproc=2, timeout=OFFER_TIMEOUT) as run:
        yield run


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["detached", "exact"])
@pytest.mark.parametrize("family", DECODING_FAMILIES)
def test_one_prefill_per_step_with_trl_defaults(tiny_model_path, family, mode):
    """TRL's defaults (`beta=0`, `num_iterations=1`): the loss pass takes generation's prompt state, so the policy
    runs each prompt once per step in detached mode and twice in exact mode (prefill, reverse); stock runs it G
    times to generate and G times in the loss forward. The last decoder layer's MLP runs no prompt token in ours (its
    outputs at prompt positions are never read), the first layer's runs each of them in every prompt pass."""
    stock, ours = make_pair(
        tiny_model_path(family),
        longstraw={"prompt_gradient": mode, "prefill_chunk_size": 4},
        **settings(beta=0.0, num_iterations=1),
    )
    mlps = {}
    for name, trainer in (("ours", ours), ("stock", stock)):
        tokens = [trainer.processing_class(text=p)["input_ids"] for p in PROMPTS]
        mlps[name] = MlpPromptTokens(trainer.model.base_model, prompt_positions(tokens))
    ours_steps = run(ours, separate_ref=False)
    stock_steps = run(stock, separate_ref=False)
    once = 1 if mode == "detached" else 2
    assert ours_steps == [{"policy": [once, once]}] * 2
    assert stock_steps == [{"policy": [2 * G, 2 * G]}] * 2
    positions = sum(len(p.split()) - 1 for p in PROMPTS)
    steps = len(ours_steps)
    # At least once per pass (a gradient-checkpointing recompute runs the first layer's MLP again).
    assert mlps["ours"].counts["last"] == 0 < steps * once * positions <= mlps["ours"].counts["first"]
    assert mlps["stock"].counts["last"] == mlps["stock"].counts["first"] >= steps * 2 * G * positions
    # Nor does its attention output projection, where the last layer is an attention layer (llama, glm_moe_dsa: GLM's
    # records-only attention returns before it; the tiny qwen3_5 ends with a Gated DeltaNet).
    attention_last = hasattr(ours.model.base_model.layers[-1], "self_attn")
    assert mlps["ours"].counts["last o_proj"] == 0
    assert (mlps["stock"].counts["last o_proj"] == mlps["stock"].counts["first"]) == attention_last


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["detached", "exact"])
@pytest.mark.parametrize("k", [2, 3])
def test_each_prompt_of_a_micro_batch_runs_once(tiny_model_path, k, mode):
    """A micro-batch of k distinct prompts: the scoring pass keeps every prompt's state for the backward pass, so
    each prompt is prefilled once per loss pass (not 2k-1 times for k prompts). Step 1 takes generation's states,
    step 2 (the second iteration, after an update) prefills each prompt in the loss pass itself."""
    prompts = ["a b c d e f g", "h i j k l m n", "o p q r s t u"][:k]
    _, ours = make_pair(
        tiny_model_path("llama"),
        longstraw={"prompt_gradient": mode, "prefill_chunk_size": 4},
        **settings(
            prompts=prompts,
            beta=0.0,
            num_iterations=2,
            per_device_train_batch_size=k * G,
            gradient_accumulation_steps=1,
        ),
    )
    once = 1 if mode == "detached" else 2
    assert run(ours, separate_ref=False, prompts=prompts) == [{"policy": [once] * k}] * 2


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["detached", "exact"])
@pytest.mark.parametrize("family", DECODING_FAMILIES)
def test_one_prefill_per_step_with_left_padded_prompts(tiny_model_path, family, mode):
    """TRL's defaults with prompts of different lengths in one generation batch (7 and 4 tokens, chunks of 4): the
    shorter one is left-padded by 3. Generation prefills it at the loss pass's positions (after its padding) and the
    loss pass takes that state, so each prompt still runs once per step (detached) or twice (exact)."""
    prompts = ["a b c d e f g", "h i j k"]
    _, ours = make_pair(
        tiny_model_path(family),
        longstraw={"prompt_gradient": mode, "prefill_chunk_size": 4},
        **settings(prompts=prompts, beta=0.0, num_iterations=1),
    )
    once = 1 if mode == "detached" else 2
    assert run(ours, separate_ref=False, prompts=prompts) == [{"policy": [once, once]}] * 2


@pytest.mark.slow
@pytest.mark.timeout(OFFER_TIMEOUT + 60)
@pytest.mark.parametrize("family", DECODING_FAMILIES)
def test_one_prefill_per_step_with_a_sharded_prompt_state(offer_launch, family):
    """2 processes (gloo), `shard_prompt_state=True` (tests/offer_worker.py): `train()` with TRL's defaults, one
    prompt per step, left-padded. The ranks offer and take generation's sharded state together, so the policy runs
    each prompt position once per step in detached mode and twice in exact mode: on each rank when the passes are
    replicated, once over the group under context parallelism (each rank runs its own chunks). The gradients equal
    those of the loss pass that prefills the prompt itself (the offer turned off)."""
    ranks = offer_launch.result(family)
    assert len(ranks) == 2
    for name, once in (("detached", 1), ("exact", 2), ("exact_no_offer", 3)):
        runs = [rank[name] for rank in ranks]
        tokens, cp = runs[0]["tokens"], runs[0]["context_parallel"]
        assert all(pad > 0 for pad in runs[0]["pads"]), "both prompts should be left-padded"
        for step in range(2):
            for prompt, ts in enumerate(tokens):
                expected = once if prompt == step else 0
                per_rank = [[r["counts"][step].get(t, 0) for t in ts[:-1]] for r in runs]
                if cp:
                    assert [sum(column) for column in zip(*per_rank, strict=True)] == [expected] * (len(ts) - 1), (
                        name,
                        step,
                        per_rank,
                    )
                else:
                    assert per_rank == [[expected] * (len(ts) - 1)] * 2, (name, step, per_rank)
        offered = name != "exact_no_offer"
        for r in runs:
            assert all((p == 0) == offered for p in r["prompt_positions"]), (name, r["prompt_positions"])
            assert all((p > 0) == offered for p in r["prompt_positions_reused"]), name
    for rank in ranks:
        for step, (got, want) in enumerate(zip(rank["exact"]["grads"], rank["exact_no_offer"]["grads"], strict=True)):
            assert want, "no parameter received a gradient"
            assert got.keys() == want.keys()
            for n in want:
                err = ((got[n] - want[n]).norm() / want[n].norm().clamp_min(1e-30)).item()
                assert err <= SHARDED_GRAD_RTOL, f"step {step + 1}, {n}: {err}"


class GradsBeforeStep(TrainerCallback):
    """Records every parameter's gradient before each optimizer step, and the completions of each generation; with
    `feed`, generation runs (and offers its prompt states) but the completions of the `i`-th are `feed[i]`."""

    def __init__(self, trainer, feed: list | None = None):
        self.trainer, self.grads, self.completions = trainer, [], []
        generate = trainer._generate_single_turn

        def recording(*args, **kwargs):
            completions, logprobs = generate(*args, **kwargs)
            if feed is not None:
                completions = feed[len(self.completions)]
            self.completions.append(completions)
            return completions, logprobs

        trainer._generate_single_turn = recording

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        named = self.trainer.model.named_parameters()
        self.grads.append({n: p.grad.detach().clone() for n, p in named if p.grad is not None})


@pytest.mark.slow
@pytest.mark.parametrize("family", DECODING_FAMILIES)
def test_left_padded_offers_give_stocks_gradient(tiny_model_path, family):
    """Exact mode, TRL's defaults, prompts of 7 and 4 tokens in one generation batch: generation prefills the padded
    prompt at the loss pass's positions and the loss pass takes both prompts' states; each step's gradient equals
    stock `GRPOTrainer`'s. Stock samples the whole batch at once and ours prompt by prompt, so ours' generation runs
    (and offers) but its completions are replaced by stock's, as in tests/test_matrix.py (a prompt's state does not
    depend on them)."""
    prompts = ["a b c d e f g", "h i j k"]
    stock, ours = make_pair(
        tiny_model_path(family),
        longstraw={"prompt_gradient": "exact", "prefill_chunk_size": 4},
        reward=position_reward,
        **settings(prompts=prompts, beta=0.0, num_iterations=1),
    )
    records = {"stock": GradsBeforeStep(stock)}
    records["ours"] = GradsBeforeStep(ours, feed=records["stock"].completions)
    for name, trainer in (("stock", stock), ("ours", ours)):
        trainer.add_callback(records[name])
        set_seed(0)
        trainer.train()
    assert len({len(c) for c in records["stock"].completions[0]}) > 1, "ragged completions"
    assert len(records["ours"].grads) == len(records["stock"].grads) == 2
    for ref, got in zip(records["stock"].grads, records["ours"].grads, strict=True):
        assert sum(g.norm() ** 2 for g in ref.values()) ** 0.5 > 1e-4, "every step should train"
        assert_grads_close(ref, got)
    logs = [entry for entry in ours.state.log_history if "loss" in entry]
    assert all(entry["longstraw/prompt_positions"] == 0 for entry in logs), "the loss pass should take every state"
    assert all(entry["longstraw/prompt_positions_reused"] > 0 for entry in logs)
