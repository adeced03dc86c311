"""The pinned stack in pyproject.toml is the one the tests run on."""

import re
from importlib.metadata import version
from pathlib import Path

from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_torch_trl_and_transformers_are_pinned_to_the_installed_minor():
    dependencies = re.search(r"^dependencies = \[(.*?)^\]", PYPROJECT.read_text(), re.M | re.S).group(1)
    requirements = {}
    for line in re.findall(r'"([^"]+)"', dependencies):
        requirement = Requirement(line)
        requirements[requirement.name] = requirement.specifier
    for name in ("torch", "trl", "transformers"):
        installed = version(name)
        assert str(requirements[name]) == f"=={'.'.join(installed.split('.')[:2])}.*", (name, installed)
        assert requirements[name].contains(installed), (name, installed)
