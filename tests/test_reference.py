"""The references in docs/reference/ are generated from the code (docs/generate_reference.py): every key the
schema accepts and every command-line option has a meaning written where it is defined, and the committed
pages are what the generator writes now (a key added without rerunning it fails here)."""

from __future__ import annotations

import importlib.util
import typing
from pathlib import Path

from pydantic import BaseModel

import launch
from core.config import Experiment
from core.sweep import SweepSpec
from slurm.cluster.profile import ClusterProfile

ROOT = Path(__file__).resolve().parent.parent


def generator():
    spec = importlib.util.spec_from_file_location(
        "generate_reference", ROOT / "docs" / "generate_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def keys(model: type[BaseModel], prefix: str = "", seen: frozenset = frozenset()):
    """(dotted key, its field) of every field, nested sections and lists of sections included."""
    for name, field in model.model_fields.items():
        yield prefix + name, field
        for outer in (field.annotation, *typing.get_args(field.annotation)):
            for inner in (outer, *typing.get_args(outer)):
                if isinstance(inner, type) and issubclass(inner, BaseModel) and inner not in seen:
                    yield from keys(inner, f"{prefix}{name}.", seen | {inner})


def test_every_key_of_an_experiment_a_sweep_and_cluster_yaml_has_a_meaning_in_the_schema():
    every = [
        (dotted, field)
        for model, prefix in ((Experiment, ""), (SweepSpec, "sweep."), (ClusterProfile, ""))
        for dotted, field in keys(model, prefix)
    ]
    assert len(every) > 150  # the walk reaches the nested sections
    assert [dotted for dotted, field in every if not (field.description or "").strip()] == []


def test_every_command_line_option_has_a_meaning():
    actions = launch.argument_parser()._actions  # argparse keeps no public list of its arguments
    assert [a.dest for a in actions if not (a.help or "").strip()] == []


def test_the_committed_reference_pages_are_what_the_code_generates_now():
    pages = generator().pages()
    stale = [str(path.relative_to(ROOT)) for path, text in pages.items() if path.read_text() != text]
    assert stale == [], f"stale: run `python docs/generate_reference.py` ({', '.join(stale)})"
    configuration, command_line = (text for text in pages.values())
    every = {
        dotted
        for model, prefix in ((Experiment, ""), (SweepSpec, "sweep."))
        for dotted, _ in keys(model, prefix)
    }
    assert {dotted for dotted in every if f"| `{dotted}` |" not in configuration} == set()
    options = {
        o for a in launch.argument_parser()._actions for o in a.option_strings if o not in ("-h", "--help")
    }
    assert {o for o in options if f"`{o}`" not in command_line} == set()
