"""configs/base.yaml sets only what it deliberately sets otherwise than the schema, each with a comment
saying why: a default restated there has two owners, and they drifted (issue 51: 28 restated, 4
contradicted, so experiments with and without `inherits: base.yaml` started from different values)."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import TypeAdapter

from core.config import Experiment

BASE = Path(__file__).resolve().parent.parent / "configs" / "base.yaml"


def leaves(mapping: dict, model, prefix: str = ""):
    """(dotted key, its field, the value base.yaml writes) for every key it sets, sections walked."""
    for name, value in mapping.items():
        field = model.model_fields[name]
        section = field.annotation if isinstance(field.annotation, type) else None
        if isinstance(value, dict) and section is not None and hasattr(section, "model_fields"):
            yield from leaves(value, section, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", field, value


def test_base_yaml_restates_no_default_of_the_schema_and_says_why_for_each_key():
    text = BASE.read_text()
    found = list(leaves(yaml.safe_load(text), Experiment))
    assert found, "base.yaml sets nothing: then it should not exist"
    restated = [
        dotted
        for dotted, field, value in found
        if TypeAdapter(field.annotation).validate_python(value)
        == field.get_default(call_default_factory=True)
    ]
    assert restated == []
    lines = text.splitlines()
    for dotted, _, _ in found:
        key = dotted.rsplit(".", 1)[-1]
        at = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{key}:"))
        assert lines[at - 1].strip().startswith("#") or "#" in lines[at], f"{dotted}: say why it differs"
