"""The package versions a GPU check actually ran with, against the package's pins (`benchmarks/gpu_check.sh`).

The GPU machine is offline and its image has its own torch (2.11 when last read, where `pyproject.toml` pins 2.13)
and an older transformers; `gpu_check.sh` installs our trl, transformers, peft, datasets, ... from wheels carried in
`.whl` (`benchmarks/gpu_wheels.sh`) into a target folder put first on `PYTHONPATH`, with `--no-deps`, so pip enforces
no pin, and a wheel that fails to install silently leaves the image's version in use. This script, run by
`gpu_check.sh` after the install with the same `PYTHONPATH`, records per package the version Python resolves, where it
comes from (the carried wheels or the environment) and whether it satisfies the package's pin:

- one `{"kind": "versions", ...}` record appended to `$OUT/gpu_results.jsonl` (beside every other figure);
- `$OUT/versions.md`, which `gpu_check.sh` appends to `gpu_results.md` after the summary.

    python benchmarks/gpu_versions.py --out gpu_out --site /tmp/site

Nothing is imported: versions from `importlib.metadata`, locations from `importlib.util.find_spec`, in `sys.path`
order (as an import would resolve them).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import sys
import time
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parent.parent
# Distribution name -> import name, for the packages a GPU check's stages use.
PACKAGES = {
    "torch": "torch",
    "triton": "triton",
    "transformers": "transformers",
    "trl": "trl",
    "accelerate": "accelerate",
    "peft": "peft",
    "datasets": "datasets",
    "tokenizers": "tokenizers",
    "safetensors": "safetensors",
    "huggingface-hub": "huggingface_hub",
    "regex": "regex",
    "fla-core": "fla",
}


def pins(root: Path = ROOT) -> dict[str, str]:
    """The version specifiers of `root`'s `pyproject.toml`: its dependencies, then the `cuda` extra's (the GPU's)."""
    if tomllib is None:
        return {}
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    out: dict[str, str] = {}
    for line in project["dependencies"] + project["optional-dependencies"].get("cuda", []):
        req = Requirement(line)
        out.setdefault(req.name.lower(), str(req.specifier))
    return out


def satisfies(version: str | None, specifier: str | None) -> bool | None:
    """Whether `version` meets the pin `specifier` (local labels such as `+cu130` ignored, as pip does); None when
    there is no pin or no version."""
    if not specifier or version is None:
        return None
    try:
        return SpecifierSet(specifier).contains(Version(version).public, prereleases=True)
    except InvalidVersion:
        return False


def source(origin: str | None, site: Path | None) -> str:
    """Where a module file comes from: `wheels` (the carried wheels' target folder), `environment`, or `missing`."""
    if origin is None:
        return "missing"
    if site is not None and Path(origin).resolve().is_relative_to(site.resolve()):
        return "wheels"
    return "environment"


def collect(site: Path | None, root: Path = ROOT) -> dict:
    """The `versions` record: Python's version, and per package its version, source, pin and whether it meets it."""
    specifiers = pins(root)
    packages = {}
    for dist, module in PACKAGES.items():
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            version = None
        pin = specifiers.get(dist)
        packages[dist] = dict(
            version=version if spec is not None else None,
            source=source(spec.origin if spec is not None else None, site),
            pin=pin,
            ok=satisfies(version if spec is not None else None, pin),
        )
    return dict(kind="versions", python=sys.version.split()[0], site=str(site) if site else None, packages=packages)


def markdown(record: dict) -> str:
    """The report section of a `versions` record, with a line per package outside its pin."""
    lines = [
        "",
        "## Versions this check ran with",
        "",
        f"Python {record['python']}; from `benchmarks/gpu_versions.py`, after the wheel install (`wheels`: installed "
        f"from `.whl` into {record['site'] or 'no folder'}; `environment`: the machine's own).",
        "",
        "| package | version | from | package pin | meets the pin |",
        "|---|---|---|---|---|",
    ]
    outside = []
    for name, p in record["packages"].items():
        meets = {True: "yes", False: "**no**", None: "-"}[p["ok"]]
        lines.append(f"| {name} | {p['version'] or '-'} | {p['source']} | {p['pin'] or '-'} | {meets} |")
        if p["ok"] is False:
            outside.append(f"{name} {p['version']}")
    if outside:
        lines += [
            "",
            f"Outside the package's pins: {', '.join(outside)}. The figures above are this environment's, not a "
            "pinned install's.",
        ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the GPU check's output folder")
    parser.add_argument("--site", default=None, help="the folder the carried wheels were installed into, if any")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = collect(Path(args.site) if args.site else None)
    record["time"] = time.strftime("%Y-%m-%d %H:%M:%S")
    with open(out / "gpu_results.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    text = markdown(record)
    (out / "versions.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
