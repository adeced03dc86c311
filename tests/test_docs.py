"""The user-facing documentation of `LongStrawGRPOConfig`: every field of its own is described where users look, with
its real default (the class docstring, the `--help` of the recipe command, and README's config table)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
from pathlib import Path

import pytest
from trl import GRPOConfig

from trl_longstraw import LongStrawGRPOConfig

README = Path(__file__).resolve().parents[1] / "README.md"
OWN = [
    f
    for f in dataclasses.fields(LongStrawGRPOConfig)
    if f.name not in {g.name for g in dataclasses.fields(GRPOConfig)}
]


def readme_table() -> dict[str, str]:
    """README's config table: field name -> its default column (as written, without backticks)."""
    rows = re.findall(r"^\| `(\w+)` \| `([^`|]*)` \|", README.read_text(), flags=re.MULTILINE)
    return dict(rows)


def test_the_config_adds_fields():
    assert len(OWN) >= 15


@pytest.mark.parametrize("field", OWN, ids=lambda f: f.name)
def test_each_field_is_documented_with_its_default(field):
    default = repr(field.default) if isinstance(field.default, str) else str(field.default)
    default = default.replace("'", '"')
    help_text = field.metadata.get("help", "")
    assert help_text and "%" not in help_text, f"{field.name}: help string missing or with '%' (argparse)"
    docstring = LongStrawGRPOConfig.__doc__
    # HfArgumentParser replaces the annotation strings by the types once a parser is built (other tests build some).
    kind = getattr(field.type, "__name__", field.type)
    assert f"{field.name} (`{kind}`, *optional*, defaults to `{default}`):" in docstring, field.name
    table = readme_table()
    assert field.name in table, f"README's config table lacks {field.name}"
    assert table[field.name] == default, f"README gives {field.name} the default {table[field.name]}"


def test_readme_table_names_only_real_fields():
    """No row of README's config table for a field that does not exist (a renamed or removed one)."""
    assert set(readme_table()) <= {f.name for f in OWN}


def _messages(function) -> list[list[str]]:
    """The messages of the `ValueError`s that `function` raises, each as its literal fragments (placeholders cut)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    messages = []
    for node in ast.walk(tree):
        raised = getattr(getattr(node, "exc", None), "func", None)
        if (
            isinstance(node, ast.Raise)
            and isinstance(node.exc, ast.Call)
            and getattr(raised, "id", "") == "ValueError"
        ):
            message = node.exc.args[0]
            parts = message.values if isinstance(message, ast.JoinedStr) else [message]
            messages.append([p.value for p in parts if isinstance(p, ast.Constant) and len(p.value.strip()) > 12])
    return messages


def test_failure_modes_lists_the_config_refusals():
    """docs/failure_modes.md, which README calls the list of exact messages, holds every refusal of
    `LongStrawGRPOConfig` (add a row for a new one)."""
    doc = (README.parent / "docs" / "failure_modes.md").read_text()
    messages = _messages(LongStrawGRPOConfig.__post_init__)
    assert len(messages) >= 8
    for fragments in messages:
        for fragment in fragments:
            assert fragment.strip() in doc, f"docs/failure_modes.md lacks the config's message {fragment!r}"
