"""Guarded conditions: each bad input or setting stops with a message naming the fix, and non-finite values are
caught before anything reaches the parameters' gradients (or the micro-batch is skipped, by choice)."""

import pytest
import torch
from datasets import Dataset
from transformers import AutoConfig, AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer

import trl_longstraw.trainer as trainer_module
from tests.tolerances import GRAD_RTOL, LOSS_ATOL
from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer
from trl_longstraw.testing import build_tokenizer, random_micro_batch
from trl_longstraw.trainer import shuffle_groups

VOCAB = len(build_tokenizer())
# random_micro_batch draws tokens from [3, VOCAB): id 2 (<unk>) appears only where a test puts it.
POISON = 2


def reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def common(tmp_path, **overrides):
    args = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        report_to=[],
        use_cpu=True,
        bf16=False,
        beta=0.0,
    )
    args.update(overrides)
    return args


def dataset():
    return Dataset.from_dict({"prompt": ["a b c", "d e f"] * 2})


def step_ready(trainer):
    """Lets training_step take a hand-built micro-batch."""
    trainer._prepare_inputs = lambda inputs: inputs
    trainer.current_gradient_accumulation_steps = 1
    return trainer


@pytest.fixture(scope="module")
def ours(tiny_model_path, tmp_path_factory):
    config = LongStrawGRPOConfig(
        **common(tmp_path_factory.mktemp("ours")), prefill_chunk_size=3, prefill_progress=False
    )
    return step_ready(LongStrawGRPOTrainer(str(tiny_model_path("llama")), reward, config, train_dataset=dataset()))


@pytest.fixture
def trainer(ours):
    """The module's trainer with clean gradients, metrics and settings."""
    ours.model.zero_grad(set_to_none=True)
    ours._metrics["train"].clear()
    ours.args.on_nonfinite = "raise"
    ours.mask_truncated_completions = False
    yield ours
    ours.args.on_nonfinite = "raise"
    ours.mask_truncated_completions = False


def micro_batch(seed=0):
    """Three prompts of odd lengths, ragged completions (one of length 1), rows of one prompt not adjacent."""
    return random_micro_batch([7, 4, 1], [5, 1, 3, 6], [0, 1, 0, 2], VOCAB, seed=seed)


def step(trainer, mb):
    return trainer.training_step(trainer.model, dict(mb), mb["num_items_in_batch"])


def grads(model):
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


# ------------------------------------------------------------------------------------------------- settings
def test_unsupported_model_type_names_the_supported_ones(tmp_path):
    config = AutoConfig.for_model("gpt2", vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=64)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"model_type 'gpt2' is not supported by trl_longstraw\. Supported: .*llama"):
        LongStrawGRPOTrainer(
            model,
            reward,
            LongStrawGRPOConfig(**common(tmp_path)),
            train_dataset=dataset(),
            processing_class=build_tokenizer(),
        )


@pytest.mark.parametrize("chunk", [0, -4096, True])
def test_prefill_chunk_size_must_be_positive(tmp_path, chunk):
    with pytest.raises(ValueError, match="must be a positive number of tokens, e.g. 4096"):
        LongStrawGRPOConfig(**common(tmp_path), prefill_chunk_size=chunk)


def test_on_nonfinite_choices(tmp_path):
    with pytest.raises(ValueError, match="on_nonfinite='ignore' is not supported: use 'raise'"):
        LongStrawGRPOConfig(**common(tmp_path), on_nonfinite="ignore")


def test_prompt_shard_group_size_needs_shard_prompt_state(tmp_path):
    """Without a sharded prompt state there are no shard groups: a group size would be silently ignored."""
    with pytest.raises(ValueError, match="prompt_shard_group_size=2 only applies to a sharded prompt state: set "):
        LongStrawGRPOConfig(**common(tmp_path), prompt_shard_group_size=2)
    assert LongStrawGRPOConfig(**common(tmp_path), prompt_shard_group_size=2, shard_prompt_state=True)


def test_skip_nonfinite_refused_with_several_processes(tmp_path, monkeypatch):
    config = LongStrawGRPOConfig(**common(tmp_path), on_nonfinite="skip")
    monkeypatch.setattr(LongStrawGRPOConfig, "world_size", property(lambda self: 2))
    with pytest.raises(ValueError, match="single-process runs only.*Use on_nonfinite='raise'"):
        trainer_module._check_args(config)


def test_group_shuffle_needs_whole_groups_at_construction(tiny_model_path, tmp_path):
    # Groups of 3 cannot tile micro-batches of 2: refused before any generation, not at the first step.
    config = LongStrawGRPOConfig(
        **common(tmp_path, per_device_train_batch_size=2, num_generations=3, steps_per_generation=3)
    )
    with pytest.raises(
        ValueError,
        match="per_device_train_batch_size=2 is neither a multiple nor a divisor.*or set group_shuffle=False",
    ):
        LongStrawGRPOTrainer(str(tiny_model_path("llama")), reward, config, train_dataset=dataset())
    # The same batch layout is fine when groups are not kept whole.
    config = LongStrawGRPOConfig(
        **common(tmp_path, per_device_train_batch_size=2, num_generations=3, steps_per_generation=3),
        group_shuffle=False,
    )
    LongStrawGRPOTrainer(str(tiny_model_path("llama")), reward, config, train_dataset=dataset())


def test_shuffle_groups_refuses_ragged_groups():
    # Prompt 0 has 3 rows: not a whole number of groups of 2.
    batch = random_micro_batch([5, 3], [2] * 5, [0, 0, 0, 1, 1], VOCAB)
    with pytest.raises(ValueError, match=r"groups of sizes \[1, 2, 2\] for micro-batches of 2 rows.*group_shuffle="):
        shuffle_groups(batch, micro_batch_size=2, group_size=2)
    # Groups of 2 cannot tile micro-batches of 3.
    batch = random_micro_batch([5, 3, 4], [2] * 6, [0, 0, 1, 1, 2, 2], VOCAB)
    with pytest.raises(ValueError, match="for micro-batches of 3 rows"):
        shuffle_groups(batch, micro_batch_size=3, group_size=2)


def test_shuffle_groups_keeps_groups_whole_and_splits_repeated_prompts():
    # Prompt 0 occurs twice in the dataset: 4 rows, two groups of 2, which may land in different micro-batches.
    torch.manual_seed(1)
    batch = random_micro_batch([5, 3], [1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 0, 0], VOCAB)
    batch["row"] = list(range(6))
    shuffled = shuffle_groups(batch, micro_batch_size=2, group_size=2)
    rows = shuffled["row"]
    assert sorted(rows) == list(range(6))
    pairs = {tuple(rows[i : i + 2]) for i in range(0, 6, 2)}
    assert pairs == {(0, 1), (2, 3), (4, 5)}
    for key in ("prompt_ids", "completion_ids", "completion_mask", "advantages"):
        assert torch.equal(shuffled[key], batch[key][rows])


# --------------------------------------------------------------------------------------------------- inputs
def test_right_padded_prompt_is_refused(trainer):
    mb = micro_batch()
    # Row 1 (a 4-token prompt in a width of 7) padded on the right instead of the left.
    mb["prompt_ids"][1] = mb["prompt_ids"][1].roll(-3)
    mb["prompt_mask"][1] = mb["prompt_mask"][1].roll(-3)
    with pytest.raises(ValueError, match=r"row 1 has prompt_mask \[1, 1, 1, 1, 0, 0, 0\].*padding_side='left'"):
        step(trainer, mb)


def test_empty_prompt_is_refused(trainer):
    mb = micro_batch()
    mb["prompt_mask"][2] = 0
    with pytest.raises(ValueError, match="row 2 has an empty prompt"):
        step(trainer, mb)


def test_left_padded_completion_is_refused(trainer):
    mb = micro_batch()
    mb["completion_mask"][0] = mb["completion_mask"][0].flip(0)
    with pytest.raises(ValueError, match="row 0 has completion_mask .* must be right-padded"):
        step(trainer, mb)


def test_empty_completion_refused_unless_truncated_completions_are_masked(trainer):
    mb = random_micro_batch([7, 4], [5, 0, 3, 2], [0, 1, 0, 1], VOCAB)
    with pytest.raises(ValueError, match=r"rows \[1\] .* empty completion .* mask_truncated_completions=True"):
        step(trainer, mb)
    assert not grads(trainer.model)


def test_masked_truncated_completion_matches_stock(trainer, tiny_model_path, tmp_path):
    """With mask_truncated_completions=True an all-zero completion is legitimate: it contributes nothing, as in
    GRPOTrainer, even when every completion of a micro-batch is masked."""
    stock = step_ready(
        GRPOTrainer(
            str(tiny_model_path("llama")),
            reward,
            GRPOConfig(**common(tmp_path), mask_truncated_completions=True),
            train_dataset=dataset(),
        )
    )
    trainer.mask_truncated_completions = True
    for mb in (
        random_micro_batch([7, 4], [5, 0, 3, 2], [0, 1, 0, 1], VOCAB, completion_width=6),
        random_micro_batch([7, 4], [0, 0, 0, 0], [0, 1, 0, 1], VOCAB, completion_width=6),
    ):
        trainer.model.zero_grad(set_to_none=True)
        stock.model.zero_grad(set_to_none=True)
        loss = step(trainer, mb)
        stock_loss = step(stock, mb)
        assert torch.isfinite(loss)
        assert abs(loss.item() - stock_loss.item()) <= LOSS_ATOL
        ours_g, stock_g = grads(trainer.model), grads(stock.model)
        for name, ref in stock_g.items():
            got = ours_g.get(name, torch.zeros_like(ref))
            assert (got - ref).norm() <= GRAD_RTOL * ref.norm(), name
        if not mb["completion_mask"].any():
            assert all(g.count_nonzero() == 0 for g in stock_g.values())
            assert not ours_g


# ------------------------------------------------------------------------------------------------ non-finite
@pytest.fixture
def poisoned(trainer):
    """Embeds token POISON as NaN: every log-prob of a branch that reads it is NaN."""

    def hook(module, args, output):
        return output.masked_fill((args[0] == POISON)[..., None], float("nan"))

    handle = trainer.model.get_input_embeddings().register_forward_hook(hook)
    yield trainer
    handle.remove()


def poisoned_micro_batch():
    """Row 2's completion reads POISON as its second input token; no other row reads it."""
    mb = micro_batch()
    mb["completion_ids"][2, 0] = POISON
    return mb


def test_nonfinite_logps_raise_with_the_row_and_the_step(poisoned):
    micro_step = poisoned._step  # micro-batches this module's trainer has seen so far
    with pytest.raises(FloatingPointError) as info:
        step(poisoned, poisoned_micro_batch())
    message = str(info.value)
    assert "non-finite per-token log-probs in rows [2]," in message
    assert f"optimizer step 1 (global_step=0, micro-batch {micro_step} of this run)" in message
    assert "on_nonfinite='skip'" in message
    # Raised before anything was back-propagated.
    assert not grads(poisoned.model)


def test_nonfinite_poison_in_a_shared_prompt_names_its_rows(poisoned):
    mb = micro_batch()
    mb["prompt_ids"][[0, 2], -3] = POISON  # prompt 0, rows 0 and 2, before the prefill chunk boundary
    with pytest.raises(FloatingPointError, match=r"log-probs in rows \[0, 2\],"):
        step(poisoned, mb)


def test_nonfinite_loss_names_the_input_at_fault(trainer):
    mb = micro_batch()
    mb["advantages"][3] = float("nan")  # e.g. a reward function that returned NaN
    with pytest.raises(FloatingPointError) as info:
        step(trainer, mb)
    message = str(info.value)
    assert "the loss (nan)" in message
    assert "non-finite inputs: advantages in rows [3]" in message
    assert "per-token log-probs" not in message
    assert not grads(trainer.model)


def test_nonfinite_skip_warns_and_leaves_no_trace(poisoned, monkeypatch):
    warnings = []
    monkeypatch.setattr(trainer_module.logger, "warning", warnings.append)
    poisoned.args.on_nonfinite = "skip"
    loss = step(poisoned, poisoned_micro_batch())
    assert torch.isnan(loss)
    assert len(warnings) == 1 and "log-probs in rows [2]" in warnings[0] and "Skipping this micro-batch" in warnings[0]
    assert not grads(poisoned.model)
    # The skipped micro-batch's loss metrics are dropped; the step bookkeeping of training_step stays.
    assert set(poisoned._metrics["train"]) == {"longstraw/nonfinite_skipped", "step_time"}
    assert poisoned._metrics["train"]["longstraw/nonfinite_skipped"] == [1.0]
    # The next, clean micro-batch trains as if the skipped one had never been seen.
    clean = micro_batch(seed=1)
    loss = step(poisoned, clean)
    after_skip = {name: g.clone() for name, g in grads(poisoned.model).items()}
    poisoned.model.zero_grad(set_to_none=True)
    assert torch.equal(step(poisoned, clean), loss)
    assert after_skip and all(torch.equal(g, grads(poisoned.model)[name]) for name, g in after_skip.items())
    assert poisoned._metrics["train"]["longstraw/nonfinite_skipped"] == [1.0, 0.0, 0.0]
    assert len(warnings) == 1
