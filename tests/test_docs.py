"""The user-facing documentation of `LongStrawGRPOConfig`: every field of its own is described where users look, with
its real default (the class docstring, the `--help` of the recipe command, and README's config table)."""

from __future__ import annotations

import dataclasses
import re
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
