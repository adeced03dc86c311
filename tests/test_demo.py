"""The CPU demo learns the task: the supervised warm-up and held-out accuracy of trl_longstraw.warmup, and the
embedded default of recipes/grpo_long.py raising the held-out needle accuracy at its own prompt length."""

import json
import random
import string
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.test_recipes import load_script
from tests.tolerances import LOGP_ATOL
from trl_longstraw.recipe import LongStrawScriptArguments, summarize
from trl_longstraw.warmup import (
    ACCURACY_KEY,
    HeldOutAccuracy,
    _answer_batch,
    _answer_logits,
    heldout_accuracy,
    supervised_warmup,
)

ROOT = Path(__file__).resolve().parents[1]


def ragged_rows(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """(prompt, answer) pairs with prompts of 3 to 20 words, so a batch of them is left-padded to different depths."""
    rng = random.Random(seed)
    return [(" ".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 20))), "") for _ in range(n)]


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_path):
    path = tiny_model_path("llama")
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def greedy(model, tokenizer, prompt: str, k: int) -> list[str]:
    """Reference: the first `k` tokens that `generate` writes greedily after `prompt` alone (no padding)."""
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, min_new_tokens=k, do_sample=False)
    return tokenizer.convert_ids_to_tokens(out[0, ids.shape[1] :].tolist())


def test_answer_logits_of_left_padded_rows_match_each_row_alone(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    rows = [(p, "7 3") for p, _ in ragged_rows(6)]
    dataset = Dataset.from_dict({"prompt": [p for p, _ in rows], "answer": [a for _, a in rows]})
    input_ids, attention_mask, k = _answer_batch(dataset, tokenizer, torch.device("cpu"))
    assert k == 2 and attention_mask.sum(-1).unique().numel() > 1, "the rows must be padded to different depths"
    with torch.no_grad():
        batched = _answer_logits(model, input_ids, attention_mask, k)
        for i, (prompt, answer) in enumerate(rows):
            ids = torch.tensor([tokenizer(f"{prompt} {answer}", add_special_tokens=False)["input_ids"]])
            alone = model(input_ids=ids).logits[0, -k - 1 : -1]
            torch.testing.assert_close(batched[i], alone, atol=LOGP_ATOL, rtol=0)


def test_heldout_accuracy_is_greedy_generation_exact_match(model_and_tokenizer):
    """Half the rows get the answer that greedy generation writes (2 tokens), half differ in their second token: the
    accuracy must be exactly one half, whatever the padding."""
    model, tokenizer = model_and_tokenizer
    prompts, answers = [], []
    for i, (prompt, _) in enumerate(ragged_rows(8, seed=1)):
        first, second = greedy(model, tokenizer, prompt, 2)
        if i % 2:
            second = next(w for w in ("1", "2") if w != second)
        prompts.append(prompt)
        answers.append(f"{first} {second}")
    dataset = Dataset.from_dict({"prompt": prompts, "answer": answers})
    model.train()
    assert heldout_accuracy(model, tokenizer, dataset, batch_size=3) == 0.5
    assert model.training, "heldout_accuracy restores the model's training mode"


def test_answers_of_different_token_counts_are_refused(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    dataset = Dataset.from_dict({"prompt": ["a b", "c d"], "answer": ["1", "2 3"]})
    with pytest.raises(ValueError, match="same number of tokens"):
        heldout_accuracy(model, tokenizer, dataset)


def test_supervised_warmup_learns_its_rows(tiny_model_path):
    """A few dozen steps on 16 ragged rows with random one-digit answers: the model then answers them all."""
    path = tiny_model_path("llama")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    rng = random.Random(0)
    rows = ragged_rows(16, seed=2)
    dataset = Dataset.from_dict({"prompt": [p for p, _ in rows], "answer": [str(rng.randrange(10)) for _ in rows]})
    assert heldout_accuracy(model, tokenizer, dataset) < 0.5
    losses = supervised_warmup(model, tokenizer, dataset, steps=60, batch_size=8, learning_rate=1e-2, seed=0)
    assert len(losses) == 60 and losses[-1] < losses[0] / 10
    assert heldout_accuracy(model, tokenizer, dataset) == 1.0


def test_warmup_and_heldout_need_a_builtin_task():
    for name in ("warmup_sft_steps", "heldout_prompts"):
        with pytest.raises(ValueError, match="built-in task"):
            LongStrawScriptArguments(dataset_name="some/dataset", **{name: 8})
        with pytest.raises(ValueError, match="plain-text prompts"):
            LongStrawScriptArguments(conversational=True, **{name: 8})
    LongStrawScriptArguments(dataset_name="longstraw/needle", warmup_sft_steps=8, heldout_prompts=8)


def test_heldout_every_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        HeldOutAccuracy(None, Dataset.from_dict({"prompt": [], "answer": []}), every=0)


def test_summary_reads_the_heldout_accuracy():
    history = [{ACCURACY_KEY: 0.25, "step": 0}]
    history += [
        {"reward": 0.1 * s, "step": s, **({ACCURACY_KEY: 0.5 + s / 100} if s % 2 == 0 else {})} for s in (1, 2, 3, 4)
    ]
    summary = summarize(history, window=1)
    assert (summary["heldout_first_step"], summary["heldout_first"]) == (0, 0.25)
    assert (summary["heldout_last_step"], summary["heldout_last"]) == (4, 0.54)


@pytest.mark.slow
def test_demo_learns_the_needle(tmp_path):
    """The embedded default (`recipes/grpo_long.py` with no arguments), seed 0: GRPO raises the greedy accuracy on
    held-out prompts of the demo's own length (384 tokens) by at least 0.2 from its value after the warm-up, within
    the first 10 of its 60 steps (the learning rate is constant, so they are the full run's first 10: 0.43 -> 0.99 in
    benchmarks/DEMO.md; `make demo` runs all 60)."""
    script = load_script()
    script_args, training_args, model_args = script.parse([])
    assert script_args.prompt_tokens == 384 and script_args.warmup_sft_prompt_tokens == 32
    assert training_args.seed == 0 and script_args.heldout_prompts >= 200
    assert training_args.lr_scheduler_type == "constant" and training_args.max_steps == 60
    assert script_args.heldout_steps == 10
    training_args.output_dir = str(tmp_path)
    training_args.max_steps = 10
    trainer = script.main(script_args, training_args, model_args)
    curve = [(h["step"], h[ACCURACY_KEY]) for h in trainer.state.log_history if ACCURACY_KEY in h]
    steps = training_args.max_steps
    assert [s for s, _ in curve] == list(range(0, steps + 1, script_args.heldout_steps)), "logged during the run"
    (_, start), (_, end) = curve[0], curve[-1]
    assert end >= start + 0.2, f"held-out needle accuracy {start:.3f} -> {end:.3f}: the demo did not learn"


def test_demo_curve_writes_table_curves_and_plot(tmp_path):
    """benchmarks/demo_curve.py's report from two made-up runs: the command, one row per seed with its GRPO gain."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import demo_curve

    def fake(seed: int, curve: list[float]) -> dict:
        return {
            "seed": seed,
            "heldout": [[10 * i, a] for i, a in enumerate(curve)],
            "reward": [[1, 0.5]],
            "train_runtime_s": 42.0,
            "prompt_tokens": 384,
            "heldout_prompts": 256,
            "warmup": "80 steps on 64-token prompts",
        }

    demo_curve.write([fake(0, [0.25, 0.5, 0.75]), fake(1, [0.5, 0.5, 0.625])], tmp_path, "python demo --seeds 0,1")
    table = (tmp_path / "DEMO.md").read_text()
    assert "python demo --seeds 0,1" in table
    assert "| 0 | 0.250 | 0.500 | 0.750 | +0.500 | 42 s |" in table
    assert "| 1 | 0.500 | 0.500 | 0.625 | +0.125 | 42 s |" in table
    assert json.loads((tmp_path / "DEMO.json").read_text())["runs"][1]["heldout"][-1] == [20, 0.625]
    assert (tmp_path / "plots" / "demo_accuracy.png").stat().st_size > 0


def test_heldout_accuracy_through_a_run_and_its_resumption(tmp_path, monkeypatch):
    """A 2-step run with a warm-up and the held-out accuracy at every step, saving each step, then resumed to step 3:
    the accuracy is logged at steps 0, 1, 2 and, after resuming, 3 only (no second step 0), and the resumed run
    does not warm up again (its weights come from the checkpoint)."""
    from tests.test_cli import small
    from trl_longstraw import cli

    heldout = ["--warmup_sft_steps", "2", "--heldout_prompts", "8", "--heldout_steps", "1"]
    first = cli.train(*cli.parse(small(tmp_path, *heldout, "--max_steps", "2", "--save_strategy", "steps")))
    assert [h["step"] for h in first.state.log_history if ACCURACY_KEY in h] == [0, 1, 2]
    monkeypatch.setattr(cli, "warm_up", lambda *args, **kwargs: pytest.fail("the resumed run warmed up again"))
    resumed = cli.train(*cli.parse(small(tmp_path, *heldout, "--max_steps", "3", "--resume_from_checkpoint", "true")))
    assert [h["step"] for h in resumed.state.log_history if ACCURACY_KEY in h] == [0, 1, 2, 3]
