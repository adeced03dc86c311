"""Publishable configs: `LongStrawGRPOConfig` to and from JSON and YAML, and a Hub-ready folder for a recipe config.

    python -m trl_longstraw.hub export --config recipes/configs/tiny_cpu.yaml --out DIR

writes to `DIR`, without any network access:

- `config.yaml`: the recipe config, verbatim (its first lines give the launch command);
- `config.json`: the same mapping as JSON (JSON is YAML, so `--config config.json` works too);
- `accelerate.yaml`: the accelerate config that the launch line names (`--config_file`), if it has one;
- `README.md`: a config card with YAML front matter (`library_name: trl`, tags `trl`, `grpo`, `longstraw`), the launch
  line for an installed trl_longstraw (the `trl-longstraw` command, `python -m trl_longstraw.cli` under a launcher)
  and for a checkout, and the settings that matter for long prompts.

Upload the folder with `hf upload <user>/<repo> DIR` (or `huggingface_hub.HfApi().upload_folder`).

A recipe config is a flat YAML mapping over the fields of `LongStrawScriptArguments`, `LongStrawGRPOConfig` and TRL's
`ModelConfig`, as `recipes/grpo_long.py --config` reads it. Its launch command is given by a leading comment
`# Launch: <command>`, continued over the following comment lines while a line ends with a backslash.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import yaml

from .config import LongStrawGRPOConfig

LAUNCH_PREFIX = "# Launch:"
CARD_TAGS = ["trl", "grpo", "longstraw"]


# ------------------------------------------------------------------------------------------ LongStrawGRPOConfig
def config_to_dict(config: LongStrawGRPOConfig) -> dict[str, Any]:
    """The JSON-safe mapping of `config`'s constructor arguments, such that `config_from_dict` rebuilds it.

    Secrets (`*_token` fields) are left out. `generation_batch_size` is left out when it was derived from
    `steps_per_generation` (the config sets both after construction, but accepts only one of them).
    """
    values = config.to_dict()
    for key in [k for k in values if k.endswith("_token")]:
        del values[key]
    del values["generation_batch_size"]
    return json.loads(json.dumps(values))


def config_from_dict(values: dict[str, Any]) -> LongStrawGRPOConfig:
    """A `LongStrawGRPOConfig` from `config_to_dict`'s mapping (or any mapping of its constructor arguments)."""
    return LongStrawGRPOConfig(**values)


def save_config(config: LongStrawGRPOConfig, path: str | Path) -> Path:
    """Writes `config` to `path` as JSON (`.json`) or YAML (`.yaml`, `.yml`)."""
    path = Path(path)
    values = config_to_dict(config)
    if path.suffix == ".json":
        path.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
    elif path.suffix in (".yaml", ".yml"):
        path.write_text(yaml.safe_dump(values, sort_keys=True))
    else:
        raise ValueError(f"cannot tell the format of {path}: name it *.json, *.yaml or *.yml.")
    return path


def load_config(path: str | Path) -> LongStrawGRPOConfig:
    """Reads a `LongStrawGRPOConfig` written by `save_config` (JSON or YAML)."""
    path = Path(path)
    # Not yaml.safe_load for JSON: YAML 1.1 reads a float without a dot, such as 1e-08, as a string.
    text = path.read_text()
    return config_from_dict(json.loads(text) if path.suffix == ".json" else yaml.safe_load(text))


# ------------------------------------------------------------------------------------------------ recipe configs
def launch_command(text: str) -> str:
    """The launch command given by the `# Launch:` comment of a recipe config's text, joined into one line.

    Raises:
        ValueError: if the config has no `# Launch:` comment.
    """
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(LAUNCH_PREFIX):
            parts = [line[len(LAUNCH_PREFIX) :].strip()]
            while parts[-1].endswith("\\") and i + 1 < len(lines) and lines[i + 1].startswith("#"):
                parts[-1] = parts[-1][:-1].rstrip()
                i += 1
                parts.append(lines[i].lstrip("#").strip())
            return " ".join(parts)
    raise ValueError(f"the config has no '{LAUNCH_PREFIX} <command>' comment: add one as its first line.")


def installed_launch_command(text: str, config_path: str, accelerate_config_path: str | None = None) -> str:
    """The launch command of a recipe config's text for an installed trl_longstraw, with the config at `config_path`.

    `recipes/grpo_long.py` becomes `trl-longstraw grpo` when the command runs it with `python` or alone, and
    `-m trl_longstraw.cli grpo` under a launcher (`accelerate launch`, `torchrun`); the `--config` value becomes
    `config_path`, and the `--config_file` value (the accelerate config) `accelerate_config_path` if given. For
    example, `accelerate launch --cpu recipes/grpo_long.py --config recipes/configs/tiny_cpu.yaml`
    gives `accelerate launch --cpu -m trl_longstraw.cli grpo --config tiny_cpu/config.yaml`.

    Raises:
        ValueError: if the launch command does not run `recipes/grpo_long.py` with `--config`.
    """
    words = launch_command(text).split()
    if "recipes/grpo_long.py" not in words or "--config" not in words[:-1]:
        raise ValueError("the config's launch line must run recipes/grpo_long.py --config <the config>.")
    words[words.index("--config") + 1] = config_path
    if accelerate_config_path is not None and "--config_file" in words[:-1]:
        words[words.index("--config_file") + 1] = accelerate_config_path
    script = words.index("recipes/grpo_long.py")
    if script == 0 or words[:script] == ["python"]:
        return " ".join(["trl-longstraw", "grpo", *words[script + 1 :]])
    return " ".join([*words[:script], "-m", "trl_longstraw.cli", "grpo", *words[script + 1 :]])


def parse_recipe_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()):
    """Parses a recipe config with the recipe's `TrlParser`: `(script_args, training_args, model_args)`.

    Unknown keys raise. On a machine without a bf16-capable GPU, a config with `bf16: true` is checked with
    `use_cpu=True`, which relaxes only the device check of `bf16` (so GPU configs can be checked and exported on a
    laptop); the returned `training_args.use_cpu` is then True.
    """
    from .recipe import make_parser

    args = ["--config", str(path), *overrides]
    mapping = yaml.safe_load(Path(path).read_text())
    if mapping.get("bf16") and not (torch.cuda.is_available() and torch.cuda.is_bf16_supported()):
        args += ["--use_cpu", "true"]
    return make_parser().parse_args_and_config(args)


def model_card(
    text: str, parsed: tuple, name: str, repo_id: str | None = None, accelerate_config: bool = False
) -> str:
    """The README.md config card of the recipe config `name` (its file name's stem), given its YAML `text` and
    `parsed = parse_recipe_config(...)`; `repo_id` is the Hub repository it goes to, if known; `accelerate_config`:
    whether the repository also holds the launch line's accelerate config as `accelerate.yaml`."""
    script_args, training_args, model_args = parsed
    model = model_args.model_name_or_path
    front = {"library_name": "trl", "tags": list(CARD_TAGS)}
    if model and not model.startswith("longstraw/"):
        front["base_model"] = model
    dataset = script_args.dataset_name
    if dataset and not dataset.startswith("longstraw/"):
        front["datasets"] = [dataset]
    rows = [
        ("model", f"`{model}`" + (f" ({model_args.dtype})" if model_args.dtype else "")),
        ("PEFT", f"LoRA r={model_args.lora_r}" if model_args.use_peft else "no (full fine-tuning)"),
        ("dataset", f"`{dataset}`"),
        ("prompt tokens", f"{script_args.prompt_tokens:,}" if dataset in _task_names() else "from the dataset"),
        ("prompt_gradient", f"`{training_args.prompt_gradient}`"),
        ("prefill_chunk_size", f"{training_args.prefill_chunk_size:,}"),
        ("num_generations", str(training_args.num_generations)),
        ("max_completion_length", str(training_args.max_completion_length)),
        ("loss_type", f"`{training_args.loss_type}`"),
        ("beta", str(training_args.beta)),
        ("learning_rate", f"{training_args.learning_rate:g}"),
        ("rewards", ", ".join(f"`{r}`" for r in script_args.reward_funcs)),
        ("bf16", str(training_args.bf16)),
        ("gradient checkpointing", str(training_args.gradient_checkpointing)),
    ]
    rope = _rope_override(yaml.safe_load(text).get("model_init_kwargs") or {})
    if rope:
        rows.append(("RoPE override", f"`{json.dumps(rope)}`"))
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    files = ["config.yaml", "accelerate.yaml"] if accelerate_config else ["config.yaml"]
    accelerate = f"{name}/accelerate.yaml" if accelerate_config else None
    return (
        "---\n"
        + yaml.safe_dump(front, sort_keys=False)
        + "---\n\n"
        + f"# {name}: `{model}` with LongStrawGRPO\n\n"
        + "A `trl_longstraw` recipe config: GRPO with `LongStrawGRPOTrainer`, a drop-in `trl.GRPOTrainer` that "
        + "prefills each distinct prompt once, in chunks, and replays each completion against the shared prompt "
        + "state.\n\n"
        + "## Launch\n\n"
        + "Install trl_longstraw from its source, as it is not published on PyPI: `pip install .` in a checkout of "
        + "its repository (or `pip install git+<repository URL>`), which installs the `trl-longstraw` command; then "
        + "download this repository's config and launch it:\n\n"
        + f"```bash\nhf download {repo_id or '<user>/<repo>'} {' '.join(files)} --local-dir {name}\n"
        + f"{installed_launch_command(text, f'{name}/config.yaml', accelerate)}\n```\n\n"
        + "`config.json` holds the same mapping (JSON is YAML, so `--config config.json` works too); flags after it "
        + "override its values. From a checkout of trl_longstraw the same run is:\n\n"
        + f"```bash\n{launch_command(text)}\n```\n\n"
        + "## Settings\n\n"
        + "| setting | value |\n|---|---|\n"
        + table
        + "\n"
    )


def export(config_path: str | Path, out_dir: str | Path, repo_id: str | None = None) -> Path:
    """Writes the Hub-ready folder of the recipe config at `config_path` to `out_dir` (see the module docstring).

    The config is parsed first, so an invalid config (unknown key, bad value, no launch line) exports nothing.
    """
    config_path, out_dir = Path(config_path), Path(out_dir)
    text = config_path.read_text()
    parsed = parse_recipe_config(config_path)
    accelerate_config = _accelerate_config(config_path, text)
    card = model_card(text, parsed, config_path.stem, repo_id, accelerate_config is not None)
    out_dir.mkdir(parents=True, exist_ok=True)
    if accelerate_config is not None:
        (out_dir / "accelerate.yaml").write_text(accelerate_config.read_text())
    (out_dir / "config.yaml").write_text(text)
    (out_dir / "config.json").write_text(json.dumps(yaml.safe_load(text), indent=2) + "\n")
    (out_dir / "README.md").write_text(card)
    return out_dir


def _accelerate_config(config_path: Path, text: str) -> Path | None:
    """The accelerate config file (`--config_file`) of the recipe config's launch line, if there is one and it is
    found: relative to the checkout holding `config_path` (`<root>/recipes/configs/X.yaml`), or to the working folder.
    """
    words = launch_command(text).split()
    if "--config_file" not in words[:-1]:
        return None
    value = words[words.index("--config_file") + 1]
    for candidate in (config_path.resolve().parents[2] / value, Path(value)):
        if candidate.is_file():
            return candidate
    return None


def _task_names() -> tuple[str, ...]:
    from .tasks import TASK_NAMES

    return TASK_NAMES


def _rope_override(model_init_kwargs: dict) -> dict | None:
    """The `rope_parameters` that `model_init_kwargs` sets, at the top level or under `text_config`."""
    if "rope_parameters" in model_init_kwargs:
        return model_init_kwargs["rope_parameters"]
    return (model_init_kwargs.get("text_config") or {}).get("rope_parameters")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trl_longstraw.hub", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    export_parser = commands.add_parser("export", help="write a Hub-ready folder for a recipe config")
    export_parser.add_argument("--config", required=True, help="the recipe config (YAML)")
    export_parser.add_argument("--out", required=True, help="the folder to write")
    export_parser.add_argument("--repo-id", help="the Hub repository the folder goes to, for the card (optional)")
    args = parser.parse_args(argv)
    out = export(args.config, args.out, args.repo_id)
    print(f"wrote {', '.join(sorted(p.name for p in out.iterdir()))} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
