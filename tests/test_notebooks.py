"""The notebooks execute from top to bottom (they are committed without outputs; CI runs them)."""

import json
import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_notebooks_are_committed_without_outputs():
    assert [p.name for p in NOTEBOOKS] == ["01_quickstart.ipynb", "02_capacity.ipynb"]
    for path in NOTEBOOKS:
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "code":
                assert cell["outputs"] == [] and cell["execution_count"] is None, f"{path.name}: strip the outputs"


def test_capacity_notebook_runs_the_readme_planner_commands():
    """Notebook 02's planner cell runs the README's planner commands (with --shard-prompt-state etc.), so it prints
    what the README shows (tests/test_plan.py checks the README's blocks against the planner)."""
    notebook = json.loads((ROOT / "notebooks" / "02_capacity.ipynb").read_text())
    cell = next("".join(c["source"]) for c in notebook["cells"] if "PLANS = [" in "".join(c["source"]))
    namespace: dict = {}
    exec(cell.split("for plan in PLANS")[0], namespace)  # the plan definitions, not the loop that runs them
    readme = (ROOT / "README.md").read_text()
    assert len(namespace["PLANS"]) == 3
    for plan in namespace["PLANS"]:
        assert f"$ python -m trl_longstraw.plan {' '.join(plan)}\n" in readme, plan


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    ).execute()
