"""The installed `trl-longstraw` command (trl_longstraw/cli.py) and the recipe script that wraps it."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trl_longstraw import cli
from trl_longstraw.hub import export

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
@pytest.mark.timeout(300)
def test_installed_command_runs_outside_the_checkout(tmp_path):
    """`pip install .` (here into a target folder, without dependencies: they are this environment's), then
    `trl-longstraw grpo --config tiny_cpu.yaml --max_steps 2` from a folder outside the checkout, which must import
    the installed copy and leave the final model in its output_dir; then the launch line of the config's Hub card
    (`accelerate launch --cpu -m trl_longstraw.cli grpo ...`)."""
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
        [sys.executable, "-c", "import trl_longstraw; print(trl_longstraw.__file__)"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
    )
    assert where.stdout.strip() == str(site / "trl_longstraw" / "__init__.py"), where.stderr

    command = [str(site / "bin" / "trl-longstraw"), "grpo", "--config", "tiny_cpu.yaml", "--max_steps", "2"]
    result = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "trl_longstraw run summary" in result.stdout
    assert (work / "outputs" / "tiny-cpu" / "model.safetensors").exists()

    # The launch line of the config's Hub card, under `accelerate launch -m trl_longstraw.cli`, on the exported copy.
    export(TINY, work / "tiny_cpu")
    card = (work / "tiny_cpu" / "README.md").read_text()
    line = next(line for line in card.splitlines() if "trl_longstraw.cli grpo" in line)
    assert line == "accelerate launch --cpu -m trl_longstraw.cli grpo --config tiny_cpu/config.yaml"
    command = [sys.executable, "-m", "accelerate.commands.launch", *line.split()[2:]]
    command += ["--max_steps", "1", "--output_dir", "launched"]
    result = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "trl_longstraw run summary" in result.stdout
    assert (work / "launched" / "model.safetensors").exists()
