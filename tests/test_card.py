"""The model card that LongStrawGRPOTrainer saves (trl_longstraw/card.py): base model, method, mode, planner."""

from pathlib import Path

import pytest
import yaml

from tests.helpers import make_trainer

GIB = 2**30


def saved_card(trainer, **kwargs) -> str:
    trainer.create_model_card(**kwargs)
    return (Path(trainer.args.output_dir) / "README.md").read_text()


def front_matter(card: str) -> dict:
    return yaml.safe_load(card.split("---\n")[1])


@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_card_names_base_model_method_and_mode(tiny_model_path, mode):
    trainer = make_trainer(tiny_model_path("llama"), prompt_gradient=mode, prefill_chunk_size=64)
    trainer.base_model_name = "Qwen/Qwen3.6-27B"
    card = saved_card(trainer, model_name="my-run", dataset_name="me/long-docs")
    meta = front_matter(card)
    assert meta["base_model"] == "Qwen/Qwen3.6-27B" and meta["datasets"] == ["me/long-docs"]
    assert {"trl", "grpo", "longstraw"} <= set(meta["tags"])
    assert "fine-tuned version of [Qwen/Qwen3.6-27B](https://huggingface.co/Qwen/Qwen3.6-27B)" in card
    assert "None" not in card
    assert f'pipeline("text-generation", model="{trainer.args.output_dir}")' in card
    # The method is LongStraw's; DeepSeekMath is credited with GRPO only.
    assert "trained with LongStrawGRPO" in card and "LongStraw method" in card
    assert "LongStrawGRPO, a method introduced in" not in card and "GRPO (Group Relative Policy Optimization" in card
    assert f"mode (`prompt_gradient`): `{mode}`" in card and "chunks of 64 tokens" in card
    assert "hardware: 1 process on CPU" in card
    assert "planner (`trl_longstraw.plan`) for this hardware: not estimated (the run was not on GPU" in card


def test_card_of_a_local_model_names_its_folder(tiny_model_path):
    trainer = make_trainer(tiny_model_path("llama"))
    card = saved_card(trainer)
    assert "base_model" not in front_matter(card)
    assert f"fine-tuned version of `{tiny_model_path('llama')}`" in card
    assert f"# Model Card for {Path(trainer.args.output_dir).name}" in card


def test_card_gives_the_planner_verdict_when_the_memory_guard_ran(tiny_model_path):
    trainer = make_trainer(tiny_model_path("llama"))
    trainer.memory_estimate = {
        "peak": 60 * GIB,
        "to_allocate": 40 * GIB,
        "free": 70 * GIB,
        "gpu_memory": 96 * GIB,
        "positions": 131072,
        "completion_length": 512,
    }
    card = saved_card(trainer)
    assert (
        "planner (`trl_longstraw.plan`) for this hardware: fits: about 60.0 GiB per GPU at the peak of a step (of "
        "96.0 GiB; 40.0 GiB to allocate, 70.0 GiB free) for 131,072 prompt positions and 512-token completions."
    ) in card


def test_memory_guard_estimate_reaches_the_card(tiny_model_path, monkeypatch):
    """The memory guard's check before the first GPU step (its device query faked here, on CPU) keeps the planner's
    estimate, which the card then gives as the verdict for the run's hardware."""
    from trl_longstraw import guards

    trainer = make_trainer(tiny_model_path("llama"))
    monkeypatch.setattr(guards, "device_free_memory", lambda device: (80 * GIB, 96 * GIB))
    trainer._check_memory(trainer.model, prompt_length=100, completion_length=9)
    estimate = trainer.memory_estimate
    assert estimate["free"] == 80 * GIB and estimate["gpu_memory"] == 96 * GIB
    assert estimate["positions"] == 100 and estimate["completion_length"] == 9
    assert 0 < estimate["to_allocate"] <= estimate["peak"] < 80 * GIB  # a tiny model (the planner adds fixed costs)
    card = saved_card(trainer)
    peak = estimate["peak"] / GIB
    assert f"for this hardware: fits: about {peak:.1f} GiB per GPU at the peak of a step (of 96.0 GiB;" in card
    assert "for 100 prompt positions and 9-token completions." in card


def test_usage_of_the_grpo_command_lists_the_fields(capsys):
    from trl_longstraw import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["grpo", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--prefill_chunk_size" in out and "--reward_funcs" in out and "--model_name_or_path" in out
    assert out.startswith("usage: trl-longstraw grpo [-h]"), "the help names the command, not the file cli.py"
