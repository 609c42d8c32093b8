"""TensorBoard (default) and W&B (opt-in) through the HF Trainer's callbacks, read back with their own
readers: the curves equal metrics.jsonl, a resumed run shows no step twice, a curriculum is one axis."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.train_helpers import (
    ROOT,
    StopAfter,
    assert_same_curve,
    logged_losses,
    make_job,
    tensorboard_losses,
)
from train.recipe import run_stage
from train.tracking import StageTensorBoard, wandb_run_id


@pytest.mark.slow
def test_tensorboard_is_on_by_default_and_equals_metrics_jsonl(tiny, tmp_path):
    run_dir = tmp_path / "run"
    assert run_stage(make_job(tiny, run_dir, max_steps=6)) == "completed"
    assert_same_curve(tensorboard_losses(run_dir), logged_losses(run_dir))
    assert len(logged_losses(run_dir)) == 6


def test_a_resumed_run_hides_the_steps_the_interrupted_one_logged_after_its_checkpoint(tiny, tmp_path):
    # The interrupted run logged steps 5 and 6 after its checkpoint at 4 (killed before it saved again);
    # the resumed run logs them again. TensorBoard must show each step once, the resumed run's values.
    tb = tmp_path / "tb"

    class Args:  # what the callback reads of TrainingArguments before it writes
        pass

    first = StageTensorBoard(tb, offset=0, resume_step=None)
    first._init_summary_writer(Args())
    for step in range(1, 7):
        first.tb_writer.add_scalar("train/loss", 10.0 + step, step)
    first.tb_writer.close()
    resumed = StageTensorBoard(tb, offset=0, resume_step=4)
    resumed._init_summary_writer(Args())
    for step in range(5, 9):
        resumed.tb_writer.add_scalar("train/loss", 20.0 + step, step)
    resumed.tb_writer.close()
    assert tensorboard_losses(tmp_path) == [(1, 11.0), (2, 12.0), (3, 13.0), (4, 14.0)] + [
        (5, 25.0),
        (6, 26.0),
        (7, 27.0),
        (8, 28.0),
    ]


@pytest.mark.slow
def test_an_interrupted_and_resumed_stage_shows_each_step_once(tiny, tmp_path):
    run_dir = tmp_path / "run"
    job = make_job(tiny, run_dir, max_steps=10, save_every_steps=4)
    assert run_stage(job, StopAfter(6)) == "interrupted"
    assert run_stage(job) == "completed"
    assert_same_curve(tensorboard_losses(run_dir), logged_losses(run_dir))
    assert [step for step, _ in tensorboard_losses(run_dir)] == list(range(1, 11))


@pytest.mark.slow
def test_a_curriculum_continues_one_step_axis(tiny, tmp_path):
    first, second = tmp_path / "part1", tmp_path / "part2"
    assert run_stage(make_job(tiny, first, max_steps=3)) == "completed"
    job = make_job(tiny, second, max_steps=4).model_copy(update={"init_adapter": str(first / "adapter")})
    assert run_stage(job) == "completed"
    assert json.loads((second / "summary.json").read_text())["step_offset"] == 3
    assert_same_curve(tensorboard_losses(second), logged_losses(second, offset=3))
    assert [step for step, _ in tensorboard_losses(second)] == [4, 5, 6, 7]


def test_no_tracking_writes_no_event_files(tiny, tmp_path):
    run_dir = tmp_path / "run"
    job = make_job(tiny, run_dir).model_copy(update={"tracking": []})
    assert run_stage(job) == "completed"
    assert not (run_dir / "tb").exists()


@pytest.mark.slow
def test_wandb_offline_keeps_one_run_id_across_a_resume(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_RUN_ID", "WANDB_RESUME", "WANDB_RUN_GROUP", "WANDB_NAME", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)  # the recipe sets them; monkeypatch restores them after
    run_dir = tmp_path / "run"
    job = make_job(tiny, run_dir, max_steps=8, save_every_steps=4).model_copy(update={"tracking": ["wandb"]})
    assert run_stage(job, StopAfter(5)) == "interrupted"
    # The requeued allocation is a new process, as on the cluster.
    resume = "import sys; from core.config import TrainJob; from train.recipe import run_stage; "
    resume += "sys.exit(run_stage(TrainJob.model_validate_json(sys.argv[1])) != 'completed')"
    done = subprocess.run([sys.executable, "-c", resume, job.model_dump_json()], cwd=ROOT, check=False)
    assert done.returncode == 0
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2  # one per allocation, both the same W&B run
    assert all(path.name.endswith(f"-{wandb_run_id(job)}") for path in runs)
    assert wandb_run_id(job) != wandb_run_id(
        job.model_copy(update={"train": job.train.model_copy(update={"learning_rate": 1e-3})})
    )


def test_sync_uploads_offline_runs_or_says_why_it_could_not(tmp_path, monkeypatch, capsys):
    import launch
    from tests.conftest import write_cluster_yaml

    configs = tmp_path / "configs"
    configs.mkdir()
    write_cluster_yaml(configs, tmp_path)
    assert launch.main(["--sync", "--config-dir", str(configs)]) == 0
    assert "No offline W&B runs to sync" in capsys.readouterr().out

    # A real offline run, synced without credentials (and no network here): wandb refuses, we say why.
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))  # no stored login either
    import wandb

    run = wandb.init(project="p", id="t-s-0", dir=str(tmp_path / "runs" / "t" / "s"))
    run.log({"loss": 1.0})
    run.finish()
    assert launch.main(["--sync", "--config-dir", str(configs)]) == 1
    printed = capsys.readouterr()
    assert "Syncing 1 offline W&B run(s)" in printed.out and "wandb login" in printed.err


class TrainingArgs:  # what the callbacks read of TrainingArguments before they write
    pass


def test_a_tb_link_planted_while_the_job_trains_is_never_written_through(tmp_path):
    """H3: TensorBoard reopened its event file by path at each flush, so a `tb/` link planted after the
    job's start check took the writes out of the run root, and the job ended COMPLETED. The event file
    is one descriptor now, opened below the root; a link there before the writer exists fails the job."""
    from core.below import LinkBelowRoot

    root, outside = tmp_path / "runs", tmp_path / "outside"
    tb = root / "exp" / "train" / "tb"
    outside.mkdir()
    first = StageTensorBoard(tb, offset=0, resume_step=None, root=root)
    first._init_summary_writer(TrainingArgs())
    first.tb_writer.add_scalar("train/loss", 1.0, 1)
    first.tb_writer.flush()
    tb.rename(tb.with_name("tb.moved"))
    tb.symlink_to(outside)
    for step in range(2, 6):
        first.tb_writer.add_scalar("train/loss", float(step), step)
        first.tb_writer.flush()
    first.tb_writer.close()
    assert list(outside.iterdir()) == []
    tb.unlink()
    tb.with_name("tb.moved").rename(tb)  # the file the writer kept: every step in it
    assert tensorboard_losses(tb.parent) == [(s, float(s)) for s in range(1, 6)]
    tb.rename(tb.with_name("tb.moved"))
    tb.symlink_to(outside)
    second = StageTensorBoard(tb, offset=0, resume_step=None, root=root)
    with pytest.raises(LinkBelowRoot, match="never written through"):
        second._init_summary_writer(TrainingArgs())
    assert list(outside.iterdir()) == []


def test_a_wandb_folder_replaced_by_a_link_fails_the_job_at_its_start_and_at_a_checkpoint(tmp_path):
    from core.below import LinkBelowRoot
    from train.tracking import StageWandb

    root, outside = tmp_path / "runs", tmp_path / "outside"
    folder = root / "exp" / "train" / "wandb"
    folder.parent.mkdir(parents=True)
    outside.mkdir()
    folder.symlink_to(outside)
    callback = StageWandb(root, folder)
    for event in (callback.on_train_begin, callback.on_save):
        with pytest.raises(LinkBelowRoot):
            event(TrainingArgs(), None, None)
