"""Every method's trainer carries the pieces every stage needs (train/recipe.py stage_trainer), found from the
schema's methods through the methods' table (train/stage.py recipe_of), so a new method is held to them
unedited. Before: the DPO trainer listed its pieces by hand, missed the checked saves, and a link planted at a
running DPO stage's checkpoints/ was written through."""

from __future__ import annotations

import typing
from types import SimpleNamespace

import pytest

from core.below import LinkBelowRoot
from core.config import TrainSpec
from train.checkpoints import CheckedSaves
from train.recipe import ReproducibleSampling, StopsAtTheTimeLimit
from train.stage import recipe_of

METHODS = typing.get_args(TrainSpec.model_fields["method"].annotation)


@pytest.mark.parametrize("method", METHODS)
def test_every_methods_trainer_checks_its_saves_outermost_and_samples_reproducibly(method):
    classes = recipe_of(method).trainer_classes()
    assert classes
    for trainer in classes:
        # Outermost: a method's own _save_checkpoint (DPO's skips TRL's model card) runs inside the check.
        assert trainer.__mro__[1] is CheckedSaves, [c.__name__ for c in trainer.__mro__]
        assert ReproducibleSampling in trainer.__mro__ and StopsAtTheTimeLimit in trainer.__mro__


@pytest.mark.parametrize("method", METHODS)
def test_a_link_planted_at_checkpoints_stops_every_methods_save_before_it_writes(method, tmp_path):
    """The save itself, through the class's own dispatch; the trainer object carries only what the check
    reads (its output folder and step), so a save that skipped the check fails otherwise, not on the link."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    stage = tmp_path / "runs" / "exp" / method
    stage.mkdir(parents=True)
    (stage / "checkpoints").symlink_to(elsewhere)
    for trainer_class in recipe_of(method).trainer_classes():
        trainer = trainer_class.__new__(trainer_class)
        trainer.args = SimpleNamespace(output_dir=str(stage / "checkpoints"))
        trainer.state = SimpleNamespace(global_step=2)
        with pytest.raises(LinkBelowRoot):
            trainer._save_checkpoint(None, None)
    assert not any(elsewhere.iterdir())
