"""The installed `trl-longstraw` command (trl_longstraw/cli.py) and the recipe script that wraps it."""

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trl_longstraw import cli
from trl_longstraw.hub import export
from trl_longstraw.testing import WORDS

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "configs" / "tiny_cpu.yaml"


@pytest.mark.parametrize(
    ("argv", "status", "stream", "text"),
    [
        ([], 2, "out", "usage: trl-longstraw grpo --config"),
        (["--help"], 0, "out", "usage: trl-longstraw grpo --config"),
        (["sft", "--config", "x.yaml"], 2, "err", "unknown command 'sft' (commands: grpo)"),
        (["grpo"], 2, "err", "give a recipe config"),
    ],
)
def test_usage_errors(capsys, argv, status, stream, text):
    assert cli.main(argv) == status
    assert text in getattr(capsys.readouterr(), stream)


def test_parse_reads_the_yaml_and_flags_override_it():
    script_args, training_args, model_args = cli.parse(["--config", str(TINY), "--max_steps", "2"])
    assert training_args.max_steps == 2 and training_args.prefill_chunk_size == 128
    assert model_args.model_name_or_path == "longstraw/tiny-llama" and script_args.prompt_tokens == 384


@pytest.mark.slow
@pytest.mark.timeout(1300)  # about a minute on an idle machine; the two runs' limits are for a crowded one
def test_installed_command_runs_outside_the_checkout(tmp_path):
    """`pip install .` (here into a target folder, without dependencies: they are this environment's), then
    `trl-longstraw grpo --config tiny_cpu.yaml --max_steps 2` from a folder outside the checkout, which must import
    the installed copy: two steps of the tiny config (warm-up and held-out accuracy included) through the real
    command line, with its progress bar, metrics, summary, a checkpoint and the final model in its output_dir; then
    the launch line of the config's Hub card (`accelerate launch --cpu -m trl_longstraw.cli grpo ...`)."""
    source = tmp_path / "source"
    shutil.copytree(ROOT / "trl_longstraw", source / "trl_longstraw", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    site = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
    result = subprocess.run([*install, "--target", str(site), str(source)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]

    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(TINY, work / "tiny_cpu.yaml")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(site), OMP_NUM_THREADS="1")
    where = subprocess.run(
        [sys.executable, "-c", "import importlib.util; print(importlib.util.find_spec('trl_longstraw').origin)"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
    )
    assert where.stdout.strip() == str(site / "trl_longstraw" / "__init__.py"), where.stderr

    command = [str(site / "bin" / "trl-longstraw"), "grpo", "--config", "tiny_cpu.yaml", "--max_steps", "2"]
    command += ["--num_prompts", "8", "--save_strategy", "steps"]
    result = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "trl_longstraw run summary" in result.stdout
    assert "prompt positions        383 prefilled per micro-batch" in result.stdout
    assert "peak RSS" in result.stdout
    assert "prefill:" in result.stderr, "the prefill progress bar shows for prompts of several chunks"
    assert "reverse:" in result.stderr, "so does the exact-mode reverse pass's"
    assert "decode:" in result.stderr and "branches:" in result.stderr, "and the decoding steps' and branches' between"
    output_dir = work / "outputs" / "tiny-cpu"
    state = json.loads((output_dir / "checkpoint-2" / "trainer_state.json").read_text())
    logged = [h for h in state["log_history"] if "reward" in h]
    assert len(logged) == 2
    for entry in logged:
        # The loss pass takes generation's prompt state (one prompt per micro-batch, all of the same length).
        assert entry["longstraw/prompt_positions"] == 0 and entry["longstraw/prompt_positions_reused"] == 383
        assert entry["longstraw/peak_rss_gib"] > 0 and entry["longstraw/state_gib"] > 0
        assert entry["longstraw/reverse_s"] > 0
    assert (output_dir / "model.safetensors").exists()

    # The launch line of the config's Hub card, under `accelerate launch -m trl_longstraw.cli`, on the exported copy.
    export(TINY, work / "tiny_cpu")
    card = (work / "tiny_cpu" / "README.md").read_text()
    line = next(line for line in card.splitlines() if "trl_longstraw.cli grpo" in line)
    assert line == "accelerate launch --cpu -m trl_longstraw.cli grpo --config tiny_cpu/config.yaml"
    # With `--num_processes 2` added: accelerate's CPU launcher starts one process, which the command says.
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", *line.split()[2:]]
    command += ["--max_steps", "1", "--num_prompts", "8", "--output_dir", "launched"]
    command += ["--warmup_sft_steps", "0", "--heldout_prompts", "0"]  # the run above had both
    result = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "trl_longstraw run summary" in result.stdout
    assert "accelerate launch asked for 2 processes, but 1 runs" in result.stderr
    assert "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2" in result.stderr
    assert (work / "launched" / "model.safetensors").exists()


# ------------------------------------------------------------------------------------------------ processes
@pytest.mark.parametrize(
    ("cmdline", "requested"),
    [
        ("/venv/bin/accelerate launch --cpu --num_processes 2 recipes/grpo_long.py --config x.yaml", 2),
        ("/venv/bin/accelerate launch --num-processes=4 -m trl_longstraw.cli grpo --config x.yaml", 4),
        ("python -m accelerate.commands.launch --multi_gpu --num_processes=8 -m trl_longstraw.cli grpo", 8),
        ("/venv/bin/accelerate-launch --cpu --num_processes 3 train.py", 3),
        ("/venv/bin/accelerate launch --cpu recipes/grpo_long.py --num_processes 2", None),  # the script's flag
        ("/venv/bin/accelerate launch --cpu recipes/grpo_long.py", None),
        ("/usr/bin/python -m pytest tests/test_cli.py", None),
        ("bash -c trl-longstraw grpo --num_processes 2", None),
    ],
)
def test_requested_processes(cmdline, requested):
    assert cli.requested_processes(cmdline.split()) == requested


def test_fewer_processes_than_asked_warns(caplog):
    launch = "/venv/bin/accelerate launch --cpu --num_processes 2 recipes/grpo_long.py".split()
    with caplog.at_level(logging.WARNING, logger="trl_longstraw.cli"):
        cli.check_processes(2, launch)
        cli.check_processes(1, launch[:3] + launch[5:])
        cli.check_processes(1)  # pytest's parent process is no launcher
        assert not caplog.records
        cli.check_processes(1, launch)
    (record,) = caplog.records
    assert "asked for 2 processes, but 1 runs" in record.message
    assert "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 ..." in record.message


# ------------------------------------------------------------------------------------------------ saving, resuming
def small(tmp_path, *flags: str) -> list[str]:
    """The tiny config's arguments, cut down to a few seconds a step (64-token prompts in 2 chunks, groups of 4; no
    warm-up or held-out accuracy, which tests/test_demo.py covers)."""
    return [
        "--config", str(TINY), "--output_dir", str(tmp_path), "--prompt_tokens", "64", "--prefill_chunk_size", "32",
        "--num_prompts", "8", "--num_generations", "4", "--per_device_train_batch_size", "4",
        "--gradient_accumulation_steps", "1", "--prefill_progress", "false", "--warmup_sft_steps", "0",
        "--heldout_prompts", "0", *flags,
    ]  # fmt: skip


def saving_warnings(caplog, argv) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trl_longstraw.cli"):
        cli.check_saving(cli.parse(argv)[1])
    return [r.message for r in caplog.records if r.name == "trl_longstraw.cli"]


def test_save_steps_without_save_strategy_warns(tmp_path, caplog):
    (message,) = saving_warnings(caplog, small(tmp_path, "--save_steps", "2"))
    assert "save_steps=2 writes no checkpoint while save_strategy is 'no'" in message
    assert "--save_strategy steps" in message
    assert saving_warnings(caplog, small(tmp_path, "--save_steps", "2", "--save_strategy", "steps")) == []
    assert saving_warnings(caplog, small(tmp_path)) == []


def test_resume_target(tmp_path):
    def target(value, output_dir=tmp_path):
        return cli.resume_target(cli.parse(small(output_dir, "--resume_from_checkpoint", value))[1])

    with pytest.raises(ValueError, match=r"holds none: give the output_dir of the run to resume"):
        target("true")
    with pytest.raises(ValueError, match="holds none"):
        target("true", tmp_path / "missing")
    for step in (2, 10, 9):
        (tmp_path / f"checkpoint-{step}").mkdir()
    for value in ("true", "True", "yes", "1"):
        assert target(value) == str(tmp_path / "checkpoint-10")
    for value in ("false", "no", "0"):
        assert target(value) is None
    assert target(str(tmp_path / "checkpoint-2")) == str(tmp_path / "checkpoint-2")


def test_resume_from_the_last_checkpoint(tmp_path):
    """A 2-step run saving each step, then `--resume_from_checkpoint true --max_steps 3`: the resumed run starts from
    checkpoint-2 (its log history is the checkpoint's, marked here, not recomputed) and runs one more step."""
    first = cli.train(*cli.parse(small(tmp_path, "--max_steps", "2", "--save_strategy", "steps", "--save_steps", "1")))
    assert first.state.global_step == 2 and (tmp_path / "model.safetensors").exists()
    state_path = tmp_path / "checkpoint-2" / "trainer_state.json"
    state = json.loads(state_path.read_text())
    state["log_history"][0]["reward"] = 123.0  # a value no run computes
    state_path.write_text(json.dumps(state))
    resumed = cli.train(*cli.parse(small(tmp_path, "--max_steps", "3", "--resume_from_checkpoint", "true")))
    steps = [h for h in resumed.state.log_history if "reward" in h]
    assert [h["step"] for h in steps] == [1, 2, 3]
    assert steps[0]["reward"] == 123.0


def test_recipe_saves_the_final_model_and_its_card(tmp_path):
    """The tiny config (save_strategy "no") still saves the final model, with a card naming the model it was given."""
    cli.train(*cli.parse(small(tmp_path, "--max_steps", "1")))
    assert (tmp_path / "model.safetensors").exists() and not list(tmp_path.glob("checkpoint-*"))
    card = (tmp_path / "README.md").read_text()
    assert "fine-tuned version of `longstraw/tiny-llama`" in card and "None" not in card
    assert "mode (`prompt_gradient`): `exact`" in card and "chunks of 32 tokens" in card
    assert "hardware: 1 process on CPU" in card


def test_peft_warmup_trains_the_adapter_not_the_base(tmp_path):
    """With --use_peft the warm-up trains the adapter (what is saved and resumed); the base weights stay the ones
    loaded from the model's path. GRPO's learning rate is 0, so the adapter's change is the warm-up's."""
    from transformers import AutoModelForCausalLM

    argv = small(
        tmp_path, "--max_steps", "1", "--use_peft", "--lora_r", "4", "--lora_target_modules", "q_proj", "v_proj"
    )
    argv += ["--warmup_sft_steps", "2", "--warmup_sft_batch_size", "4", "--learning_rate", "0"]
    trainer = cli.train(*cli.parse(argv))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny-model").state_dict()
    base = trainer.accelerator.unwrap_model(trainer.model).get_base_model().state_dict()
    lora_b = [value for name, value in base.items() if "lora_B" in name]
    assert lora_b and all(value.abs().sum() > 0 for value in lora_b), "the warm-up trained the adapter"
    for name, value in loaded.items():
        key = re.sub(r"([qv]_proj)\.weight", r"\1.base_layer.weight", name)
        assert torch.equal(base[key], value), f"{name} changed"


# ------------------------------------------------------------------------------------------------ summary
def test_describe_lengths():
    assert cli.describe_lengths([]) is None
    assert cli.describe_lengths([211, 211]) == "211 tokens"
    assert cli.describe_lengths([180, 240, 213]) == "180-240 tokens (mean 211 of 3 sampled)"


def test_summary_gives_a_local_dataset_real_prompt_length(tmp_path, capsys):
    """A local dataset of 211-token prompts: the summary says 211, not the built-in tasks' `prompt_tokens` (384)."""
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"prompt": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(211))} for i in range(4)]
    (data / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    flags = ["--dataset_name", str(data), "--reward_funcs", "tests.helpers.zero_reward", "--reward_weights", "1.0"]
    cli.train(*cli.parse(small(tmp_path / "out", "--max_steps", "1", *flags)))
    assert f"task                    {data}, prompts of 211 tokens, prefill chunks of 32" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------ CPU threads
def test_threads_chosen():
    launcher = ("/venv/bin/accelerate launch --cpu recipes/grpo_long.py".split(), {"PATH": "/bin"})
    assert not cli.threads_chosen({}, None)
    assert cli.threads_chosen({"OMP_NUM_THREADS": "4"}, None)
    assert cli.threads_chosen({"OMP_NUM_THREADS": "4"}, (["bash"], {}))
    # accelerate launch sets OMP_NUM_THREADS (cores per process) when its own environment lacks it: not chosen.
    assert not cli.threads_chosen({"OMP_NUM_THREADS": "2"}, launcher)
    assert cli.threads_chosen({"OMP_NUM_THREADS": "2"}, (launcher[0], {"OMP_NUM_THREADS": "2"}))
    flag = "/venv/bin/accelerate launch --cpu --num_cpu_threads_per_process 2 x.py".split()
    assert cli.threads_chosen({"OMP_NUM_THREADS": "2"}, (flag, {}))


def test_configure_cpu_threads(caplog):
    import torch

    model = torch.nn.Linear(4, 4)
    before = torch.get_num_threads()
    try:
        with caplog.at_level(logging.WARNING, logger="trl_longstraw.cli"):
            assert cli.configure_cpu_threads(model, tiny=True, on_cpu=False, chosen=False) is None
            torch.set_num_threads(2)
            assert cli.configure_cpu_threads(model, tiny=False, on_cpu=True, chosen=True).startswith(
                "CPU run of a small model with 2 intra-op threads per process"
            )
            line = cli.configure_cpu_threads(model, tiny=True, on_cpu=True, chosen=False)
            assert line.startswith("CPU run of a tiny model: 1 intra-op thread instead of 2")
            assert torch.get_num_threads() == 1
            assert cli.configure_cpu_threads(model, tiny=False, on_cpu=True, chosen=True) is None  # one thread
        assert [r.message for r in caplog.records if r.name == "trl_longstraw.cli"][-1] == line
    finally:
        torch.set_num_threads(before)
