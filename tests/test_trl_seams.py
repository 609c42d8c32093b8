"""TRL is pinned to the minor whose names we touch (train/trl_seams.py): each one is still where it was read
from, or this fails naming it. Before, an override of a renamed TRL method would never be called again,
silently (the step would run TRL's own sampler, or its model card would land in every checkpoint)."""

from __future__ import annotations

import importlib
import inspect
from importlib.metadata import version

import pytest
import trl

from train import trl_seams

pytestmark = pytest.mark.slow  # imports TRL (seconds)


def test_the_installed_trl_is_the_minor_the_seams_were_read_from():
    assert version("trl").startswith(trl_seams.TESTED_TRL + "."), (
        f"trl {version('trl')} is installed; train/trl_seams.py was read from {trl_seams.TESTED_TRL}: re-read "
        "every name it lists in the new version, then move the pin in pyproject.toml"
    )


@pytest.mark.parametrize(
    "trainer, method", [(t, m) for t, methods in trl_seams.OVERRIDDEN.items() for m in methods]
)
def test_every_overridden_trl_method_still_exists_on_the_trainer(trainer, method):
    base = getattr(trl, trainer)
    assert callable(getattr(base, method, None)), f"trl.{trainer}.{method} is gone: our override is dead code"


@pytest.mark.parametrize(
    "trainer, attribute", [(t, a) for t, attributes in trl_seams.SET_IN_INIT.items() for a in attributes]
)
def test_every_attribute_we_read_is_still_set_by_the_trainers_init(trainer, attribute):
    source = inspect.getsource(getattr(trl, trainer).__init__)
    assert f"self.{attribute} =" in source, f"trl.{trainer}.__init__ no longer sets self.{attribute}"


@pytest.mark.parametrize("module, name", trl_seams.IMPORTED)
def test_every_imported_trl_helper_is_still_there(module, name):
    assert hasattr(importlib.import_module(module), name), f"{module}.{name} is gone"


@pytest.mark.parametrize(
    "trainer, argument", [(t, a) for t, arguments in trl_seams.EXPERIMENTAL.items() for a in arguments]
)
def test_every_experimental_argument_is_still_taken(trainer, argument):
    assert argument in inspect.signature(getattr(trl, trainer).__init__).parameters


def test_a_helper_not_listed_is_refused():
    with pytest.raises(KeyError, match="not listed in train/trl_seams.py"):
        trl_seams.imported("trl.trainer.utils", "selective_log_softmax")
