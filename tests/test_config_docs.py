"""configs/README.md is where users look a key up: every key the schema accepts is there."""

from __future__ import annotations

import typing
from pathlib import Path

from pydantic import BaseModel

from core.config import Experiment
from slurm.cluster.profile import ClusterProfile

DOC = Path(__file__).resolve().parent.parent / "configs" / "README.md"


def keys(model: type[BaseModel], prefix: str = "", seen: frozenset = frozenset()):
    """(dotted key, its own name) of every field, nested sections and lists of sections included."""
    for name, field in model.model_fields.items():
        yield prefix + name, name
        for outer in (field.annotation, *typing.get_args(field.annotation)):
            for inner in (outer, *typing.get_args(outer)):
                if isinstance(inner, type) and issubclass(inner, BaseModel) and inner not in seen:
                    yield from keys(inner, f"{prefix}{name}.", seen | {inner})


def test_every_key_of_an_experiment_and_of_cluster_yaml_is_documented():
    text = DOC.read_text()
    documented = lambda name: f"`{name}`" in text or f"{name}:" in text  # noqa: E731 (a table cell or an example)
    missing = sorted(
        {
            dotted
            for model in (Experiment, ClusterProfile)
            for dotted, name in keys(model)
            if not documented(name)
        }
    )
    assert missing == []
    assert len(list(keys(Experiment))) > 50  # the walk reaches the nested sections
