"""Issue 38, rule 3: no write follows a link planted after the start check. The launch and the job refuse
links once, at their start; a link planted later (`runs/.rungs`, a stage's `checkpoints/`) was followed:
rung records and checkpoints written outside the run root, and checkpoint rotation deleted the
`checkpoint-*` folders it pointed at. Every write is now checked when it happens (core/below.py). Real
files, real links, the real trainer."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest

from core.below import LinkBelowRoot, check, open_file
from core.config import PruneJob
from core.files import append_json_line
from core.pruning import judged
from tests.train_helpers import make_job

PRUNE = PruneJob(rungs=[1], keep=0.5, sweep="sw", measured_under="m")


def fingerprint(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(folder.rglob("*"))
    }


def victim(tmp_path: Path) -> Path:
    """Another user's folder, which the planted link points at."""
    folder = tmp_path / "victim"
    for step in (1, 2):
        (folder / f"checkpoint-{step}").mkdir(parents=True)
        (folder / f"checkpoint-{step}" / "COMMITTED").write_text('{"world_size": 1}\n')
        (folder / f"checkpoint-{step}" / "trainer_state.json").write_text("{}\n")
        (folder / f"checkpoint-{step}" / "adapter_model.safetensors").write_text("precious\n")
    return folder


def test_link_planted_at_rungs_after_start_is_not_followed(tmp_path):
    run_root, target = tmp_path / "runs", victim(tmp_path)
    judged(run_root, "sw", "a", "h", 1, 1.0, PRUNE)  # the sweep is under way
    before = fingerprint(target)
    (run_root / ".rungs").rename(tmp_path / "aside")
    (run_root / ".rungs").symlink_to(target)
    with pytest.raises(LinkBelowRoot, match=r"\.rungs"):
        judged(run_root, "sw", "b", "h", 1, 2.0, PRUNE)
    (run_root / ".rungs").unlink()
    (run_root / ".rungs").mkdir()
    (run_root / ".rungs" / "sw").symlink_to(target)  # one level down: the sweep's own folder
    with pytest.raises(LinkBelowRoot, match="sw"):
        judged(run_root, "sw", "b", "h", 1, 2.0, PRUNE)
    assert fingerprint(target) == before


def test_link_planted_at_a_stage_folder_after_start_gets_no_metrics_row(tmp_path):
    run_root, target = tmp_path / "runs", victim(tmp_path)
    (run_root / "exp").mkdir(parents=True)
    (run_root / "exp" / "stage").symlink_to(target)
    with pytest.raises(LinkBelowRoot, match="stage"):
        append_json_line(run_root / "exp" / "stage" / "metrics.jsonl", {"step": 1}, root=run_root)
    assert not (target / "metrics.jsonl").exists()


def test_checkpoint_rotation_through_a_link_planted_at_checkpoints_deletes_nothing(tmp_path):
    from train.checkpoints import discard_incomplete, rotate

    target = victim(tmp_path)
    stage = tmp_path / "runs" / "exp" / "stage"
    stage.mkdir(parents=True)
    (stage / "checkpoints").symlink_to(target)
    before = fingerprint(target)
    with pytest.raises(LinkBelowRoot, match="checkpoints"):
        rotate(stage / "checkpoints", keep=set())
    with pytest.raises(LinkBelowRoot, match="checkpoints"):
        discard_incomplete(stage / "checkpoints")
    assert fingerprint(target) == before


GRPO = {
    "method": "grpo",
    "batch_size": 2,
    "grpo": {
        "num_generations": 2,
        "max_completion_length": 8,
        "rewards": [{"score": "rouge_l"}],
        "from_base": True,
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["sft", "grpo"])
def test_link_planted_at_checkpoints_after_start_is_not_followed(tiny, tmp_path, method):
    # The job started (its links were checked, the trainer set up); then `checkpoints/` became a link.
    # The Trainer's first save is checked immediately before it writes, and fails naming it: every method's
    # trainer comes from the one factory (train/recipe.py stage_trainer), the GRPO stage's too.
    from train.stage import recipe_of

    target = victim(tmp_path)
    stage = tmp_path / "runs" / "t" / "s"
    job = make_job(tiny, stage, save_every_steps=1, **(GRPO if method == "grpo" else {}))
    recipe = recipe_of(method)(job, threading.Event())
    recipe.setup()
    before = fingerprint(target)
    if (stage / "checkpoints").exists():
        (stage / "checkpoints").rename(tmp_path / "aside")
    (stage / "checkpoints").symlink_to(target)
    with pytest.raises(LinkBelowRoot, match="checkpoints"):
        recipe.train()
    assert fingerprint(target) == before


@pytest.mark.slow  # trains a GRPO step
def test_link_planted_at_a_grpo_stages_completions_after_start_gets_no_row(tiny, tmp_path):
    from train.grpo import GrpoRecipe

    target = tmp_path / "outside.jsonl"
    target.write_text("")
    stage = tmp_path / "runs" / "t" / "s"
    recipe = GrpoRecipe(make_job(tiny, stage, **GRPO, max_steps=2), threading.Event())
    recipe.setup()
    (stage / "completions.jsonl").symlink_to(target)
    with pytest.raises(LinkBelowRoot, match="completions.jsonl"):
        recipe.train()
    assert target.read_text() == ""
    assert not (stage / "tb").is_symlink() and any((stage / "tb").rglob("events.out.tfevents.*"))


def test_safe_path_below_a_root_allows_a_root_that_is_itself_a_link(tmp_path):
    # Where the run root lives is the user's choice: only what is below it is checked.
    (tmp_path / "real").mkdir()
    (tmp_path / "runs").symlink_to(tmp_path / "real")
    os.close(open_file(tmp_path / "runs", tmp_path / "runs" / "a" / "b.txt", os.O_WRONLY | os.O_CREAT))
    check(tmp_path / "runs", tmp_path / "runs" / "a" / "b.txt")
    assert (tmp_path / "real" / "a" / "b.txt").is_file()


# ---- the log and cache roots, and the eval's and the speed book's files (issue 38's remaining writers) ----
def test_link_planted_at_a_unit_log_folder_after_the_pack_started_gets_no_order_and_no_log(tmp_path):
    # A packed allocation's lane writes each unit's order file and log below the log root when it starts it.
    from core.states import State
    from slurm.planning.pack import Unit
    from slurm.queueing.lanes import Lanes

    target = victim(tmp_path)
    unit = Unit(
        id="exp/st",
        kind="train",
        spec={},
        config_hash="h",
        run_dir=str(tmp_path / "runs/exp/st"),
        log_folder=str(tmp_path / "logs/exp/st"),
        seconds=1.0,
        depends_on=(),
    )
    lanes = Lanes([unit], ["0"], "77", str(tmp_path), str(tmp_path))
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "exp").symlink_to(target)  # after the launch's check, before the lane starts it
    before = fingerprint(target)
    with pytest.raises(LinkBelowRoot, match="exp"):
        lanes.start(unit, 0)
    (tmp_path / "runs" / "exp").mkdir(parents=True)
    (tmp_path / "runs" / "exp" / "st").symlink_to(target)
    with pytest.raises(LinkBelowRoot, match="st"):
        lanes.write_lane(unit, 0, State.RUNNING)
    assert fingerprint(target) == before


def test_link_planted_at_a_job_log_folder_gets_no_controller_log(tmp_path):
    # A local job's controller log (and, checked just before submitit is handed the folder, its files).
    from core.files import stderr_into

    target = victim(tmp_path)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "exp").symlink_to(target)
    before = fingerprint(target)
    with (
        pytest.raises(LinkBelowRoot, match="exp"),
        stderr_into(tmp_path / "logs/exp/st/c.err", tmp_path / "logs"),
    ):
        pass
    with pytest.raises(LinkBelowRoot, match="exp"):
        check(tmp_path / "logs", tmp_path / "logs/exp/st")
    assert fingerprint(target) == before


def test_link_planted_below_the_token_cache_gets_no_tokenized_dataset(tmp_path, monkeypatch):
    import datasets

    from core.layout import cache_root
    from train import data as data_lib

    monkeypatch.setenv("LORA_CACHE_DIR", str(tmp_path / "cache"))
    target = victim(tmp_path)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "tokenized").symlink_to(target)  # planted while another job tokenizes
    before = fingerprint(target)
    with pytest.raises(LinkBelowRoot, match="tokenized"):
        data_lib.save_atomic(
            datasets.Dataset.from_dict({"input_ids": [[1, 2]]}), cache_root() / "tokenized" / "k"
        )
    assert fingerprint(target) == before


def test_link_planted_at_the_preflight_cache_gets_no_result_and_no_log(tmp_path, monkeypatch, capsys):
    from core.preflight import JobPreflight
    from slurm.planning.preflight import keep, library_output_into, preflight_log

    monkeypatch.setenv("LORA_CACHE_DIR", str(tmp_path / "cache"))
    target = victim(tmp_path)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "preflight").symlink_to(target)
    before = fingerprint(target)
    keep(tmp_path / "cache" / "preflight" / "k.json", JobPreflight("t/s", 1.0, 1, 100, {}, 100.0))
    assert "symbolic link" in capsys.readouterr().err  # a cache: warned, computed again next time
    with pytest.raises(LinkBelowRoot, match="preflight"), library_output_into(preflight_log()):
        pass
    assert fingerprint(target) == before


def test_link_planted_at_an_eval_folder_after_start_gets_no_predictions(tmp_path):
    from eval.predictions import PartialPredictions, write_final

    target = victim(tmp_path)
    run_root, out = tmp_path / "runs", tmp_path / "runs" / "exp" / "eval"
    partial = PartialPredictions(out, "fp", run_root)
    partial.resume(["q"])  # the eval started: its partial file is there
    (run_root / "exp").rename(tmp_path / "aside")
    (run_root / "exp").symlink_to(target)  # a linked folder above the file, not a link at it
    before = fingerprint(target)
    with pytest.raises(LinkBelowRoot, match="exp"):
        partial.append([{"id": 0, "input": "q", "prediction": "a"}])
    with pytest.raises(LinkBelowRoot, match="exp"):
        write_final(out, [{"id": 0, "prediction": "a"}], run_root)
    assert fingerprint(target) == before


def test_link_planted_at_the_speed_book_after_start_gets_no_row(tmp_path, capsys):
    # The book's only folder is the run root, which may itself be a link: the file is what is refused.
    from core import speeds

    target = tmp_path / "theirs.txt"
    target.write_text("precious\n")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "speeds.jsonl").symlink_to(target)
    row = speeds.EvalSpeedRecord("m", "cpu", 1, 1, 1, 1, 1.0, 0.1, 0.0, 1.0)
    speeds.append(tmp_path / "runs" / "speeds.jsonl", row)
    assert "symbolic link" in capsys.readouterr().err and target.read_text() == "precious\n"


def test_link_planted_at_the_code_snapshots_folder_gets_no_copy_and_no_job_starts_from_it(tmp_path):
    # The launch copies the code its jobs run into LOG_DIR/.code/<hash>; `.code` -> elsewhere since the
    # launch's check would have received the copy, or handed jobs code that is not this launch's.
    from core.layout import CODE_SNAPSHOTS
    from slurm.queueing.snapshot import take_snapshot

    target = victim(tmp_path)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / CODE_SNAPSHOTS).symlink_to(target)
    before = fingerprint(target)
    with pytest.raises(LinkBelowRoot, match=CODE_SNAPSHOTS):
        take_snapshot(tmp_path / "logs")
    assert fingerprint(target) == before


def test_a_relative_stage_folder_below_an_absolute_root_is_written_not_refused(tmp_path, monkeypatch):
    # Before: cluster.yaml's shipped `run_dir: runs` gave a pack's units `runs/EXP/STAGE` beside an absolute
    # run root, and every unit died at its first write (ValueError: not in the subpath).
    from core.files import write_atomic

    monkeypatch.chdir(tmp_path)
    write_atomic(Path("runs/one/train/lane.json"), "{}", root=tmp_path / "runs")
    assert (tmp_path / "runs" / "one" / "train" / "lane.json").read_text() == "{}"
    with pytest.raises(ValueError):
        write_atomic(Path("elsewhere/lane.json"), "{}", root=tmp_path / "runs")


def test_link_planted_at_a_stage_folder_gets_no_done_no_job_record_no_config_and_no_origin(tmp_path):
    # Before: DONE, job.json, config.yaml and origin.json were written with a plain path: a stage (or an
    # experiment) folder swapped for a link after the start check had them written where the link pointed.
    from core.job_records import JobRecord, write_jobs
    from core.rundir import mark_done, record_origin, write_spec

    run_root, target = tmp_path / "runs", victim(tmp_path)
    before = fingerprint(target)
    (run_root / "exp").mkdir(parents=True)
    (run_root / "exp" / "stage").symlink_to(target)
    stage = run_root / "exp" / "stage"
    writes = (
        lambda: mark_done(stage, "0" * 64),
        lambda: write_jobs(stage, [JobRecord(job_id="1", backend="local")]),
        lambda: write_spec(stage, {"experiment": "exp"}),
    )
    for write in writes:
        with pytest.raises(LinkBelowRoot, match="stage"):
            write()
    (run_root / "other").symlink_to(target)
    with pytest.raises(LinkBelowRoot, match="other"):
        record_origin(run_root / "other", tmp_path / "a.yaml", tmp_path)
    assert fingerprint(target) == before
