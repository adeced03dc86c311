"""Publishable configs: `LongStrawGRPOConfig` to and from JSON and YAML, and a Hub-ready folder for a recipe config.

    python -m trl_longstraw.hub export --config recipes/configs/tiny_cpu.yaml --out DIR

writes to `DIR`, without any network access:

- `config.yaml`: the recipe config, verbatim (its first lines give the launch command);
- `config.json`: the same mapping as JSON (JSON is YAML, so `--config config.json` works too);
- `README.md`: a config card with YAML front matter (`library_name: trl`, tags `trl`, `grpo`, `longstraw`), the exact
  launch line, and the settings that matter for long prompts.

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


def model_card(text: str, parsed: tuple, name: str, repo_id: str | None = None) -> str:
    """The README.md config card of the recipe config `name` (its file name's stem), given its YAML `text` and
    `parsed = parse_recipe_config(...)`; `repo_id` is the Hub repository it goes to, if known."""
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
    return (
        "---\n"
        + yaml.safe_dump(front, sort_keys=False)
        + "---\n\n"
        + f"# {name}: `{model}` with LongStrawGRPO\n\n"
        + "A `trl_longstraw` recipe config: GRPO with `LongStrawGRPOTrainer`, a drop-in `trl.GRPOTrainer` that "
        + "prefills each distinct prompt once, in chunks, and replays each completion against the shared prompt "
        + "state.\n\n"
        + "## Launch\n\n"
        + f"From a checkout of trl_longstraw:\n\n```bash\n{launch_command(text)}\n```\n\n"
        + "This repository's `config.yaml` is that config (`config.json` holds the same mapping). To use the copy "
        + "from the Hub, download it and pass it to `--config` in the launch line above:\n\n"
        + f"```bash\nhf download {repo_id or '<user>/<repo>'} config.yaml --local-dir {name}\n```\n\n"
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
    card = model_card(text, parsed, config_path.stem, repo_id)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(text)
    (out_dir / "config.json").write_text(json.dumps(yaml.safe_load(text), indent=2) + "\n")
    (out_dir / "README.md").write_text(card)
    return out_dir


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
