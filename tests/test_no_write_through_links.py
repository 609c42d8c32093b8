"""Issue 31, rule 1: never write through a symbolic link below the run and log roots. Anyone who can write
a shared runs/ can plant one (`speeds.jsonl` -> another user's file, a stage folder -> theirs) and make a
launch, its jobs or the report write into its target. Real files, real launches, real links."""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import launch
from core.files import links_below, open_append, open_lock, write_atomic_with
from slurm.queueing.jobs import refuse_links_in
from tests.helpers import configs

EXPERIMENT_WITH_EVAL = """\
name: one
inherits: _tiny-sql.yaml
model: {{name_or_path: {model}}}
train: {{epochs: 1}}
eval: {{metrics: [exact_match], split: train, max_new_tokens: 8}}
"""


def fingerprint(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.mark.slow
def test_a_link_planted_at_anything_a_run_wrote_is_refused_by_every_writing_command_and_its_target_untouched(
    tmp_path, repo_root, tiny, capsys
):
    folder = configs(tmp_path, repo_root)
    (folder / "one.yaml").write_text(EXPERIMENT_WITH_EVAL.format(model=repo_root / "models" / "tiny-llama"))
    assert launch.main(["--all", "--config-dir", str(folder), "--backend", "local"]) == 0
    assert launch.main(["--report", "--config-dir", str(folder)]) == 0
    written = [
        p
        for root in (tmp_path / "runs", tmp_path / "logs")
        for p in sorted(root.rglob("*"))
        if not p.is_symlink()
    ]
    assert any(p.name == "speeds.jsonl" for p in written) and any(p.name == ".launch.lock" for p in written)
    assert any(p.name == "metrics.jsonl" for p in written) and any(
        p.name == "loss_curves.png" for p in written
    )
    victim = tmp_path / "victim"  # another user's files, which the link points at
    (victim / "folder").mkdir(parents=True)
    (victim / "file").write_text("precious\n")
    (victim / "folder" / "inside").write_text("precious too\n")
    before = fingerprint(victim)
    capsys.readouterr()
    local = ["--backend", "local"]  # for the verbs that submit: the door refuses it for the others
    commands = (
        ["--all", *local],
        ["--report"],
        ["--export", "one", *local],
        ["--cancel"],
        ["--all", "--retry-failed", *local],
        ["--status"],
    )
    # Deepest first: a planted folder hides what is below it, which then is not planted itself.
    for path in sorted(written, key=lambda p: len(p.parts), reverse=True):
        aside = path.with_name(path.name + ".aside")
        path.rename(aside)
        path.symlink_to(victim / ("folder" if aside.is_dir() else "file"))
        try:
            for command in commands:
                assert launch.main([*command, "--config-dir", str(folder)]) == 2, (
                    path,
                    command,
                )
                assert f"{path.name}: is a symbolic link below the run or log root" in capsys.readouterr().err
        finally:
            path.unlink()
            aside.rename(path)
    assert fingerprint(victim) == before
    # Nothing was left planted, and the run root is as the run left it: a relaunch finds everything done.
    assert links_below(tmp_path / "runs") == [] and links_below(tmp_path / "logs") == []
    assert launch.main(["--all", "--config-dir", str(folder), "--backend", "local"]) == 0
    assert "Nothing to submit" in capsys.readouterr().out


def test_a_run_root_that_is_itself_a_link_is_the_users_choice_and_stays_allowed(tmp_path, repo_root, capsys):
    folder = configs(tmp_path, repo_root, one={})
    real = tmp_path / "elsewhere"
    real.mkdir()
    (tmp_path / "runs").symlink_to(real)
    assert launch.main(["--report", "--config-dir", str(folder)]) == 0
    assert (real / "report.md").is_file()


def test_appending_never_follows_a_link_planted_at_the_file(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    book = tmp_path / "speeds.jsonl"
    book.symlink_to(victim)
    with pytest.raises(OSError) as refused:
        open_append(book)
    assert refused.value.errno == errno.ELOOP and victim.read_text() == "precious\n"
    with open_append(tmp_path / "metrics.jsonl") as fh:  # an ordinary file: created, then appended to
        fh.write("a\n")
    with open_append(tmp_path / "metrics.jsonl") as fh:
        fh.write("b\n")
    assert (tmp_path / "metrics.jsonl").read_text() == "a\nb\n"


def test_the_launch_lock_never_truncates_a_linked_file(tmp_path):
    # Before: the lock opened with "a+" and truncated, so runs/.launch.lock -> a file emptied that file.
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / ".launch.lock").symlink_to(victim)
    with pytest.raises(OSError) as refused:
        open_lock(tmp_path / ".launch.lock")
    assert refused.value.errno == errno.ELOOP and victim.read_text() == "precious\n"


def test_a_plot_saved_where_a_link_stands_replaces_the_link_not_its_target(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    plot = tmp_path / "loss_curves.png"
    plot.symlink_to(victim)
    write_atomic_with(plot, lambda tmp: tmp.write_bytes(b"\x89PNG..."))
    assert victim.read_text() == "precious\n"
    assert not plot.is_symlink() and plot.read_bytes() == b"\x89PNG..."
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left


def test_a_job_refuses_a_link_planted_in_its_folder_after_its_launch(tmp_path):
    stage = tmp_path / "runs" / "one" / "train"
    (stage / "checkpoints").mkdir(parents=True)
    refuse_links_in(stage)  # nothing planted: the job goes on
    (tmp_path / "theirs").mkdir()
    os.symlink(tmp_path / "theirs", stage / "checkpoints" / "checkpoint-5")
    with pytest.raises(RuntimeError, match="checkpoint-5"):
        refuse_links_in(stage)
    (stage / "checkpoints" / "checkpoint-5").unlink()
    stage.rename(tmp_path / "moved")
    stage.symlink_to(tmp_path / "moved")  # the stage folder itself
    with pytest.raises(RuntimeError, match="train"):
        refuse_links_in(stage)


@pytest.mark.slow
def test_the_links_wandb_and_submitit_make_themselves_are_no_planted_links(tmp_path):
    # Found by the suite: submitit keeps .submission_file_UUID.sh in every SLURM job's log folder, and a
    # real offline W&B run leaves latest-run, debug.log and its logs' debug-core.log (to W&B's own cache).
    # In a process of its own: wandb.init in this one leaves state that changes later tests' W&B runs.
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config")}
    script = (
        "import sys, wandb; run = wandb.init(project='p', id='t-s-0', dir=sys.argv[1]); "
        "run.log({'loss': 1.0}); run.finish()"
    )
    folder = tmp_path / "runs" / "one" / "train"
    folder.mkdir(parents=True)
    subprocess.run([sys.executable, "-c", script, str(folder)], env=env, check=True, capture_output=True)
    runs = tmp_path / "runs"
    made = [p for p in runs.rglob("*") if p.is_symlink()]
    assert {p.name for p in made} >= {"latest-run", "debug.log"}
    logs = tmp_path / "logs" / "one" / "train"
    logs.mkdir(parents=True)
    (logs / "42_submission.sh").write_text("#!/bin/bash\n")
    (logs / ".submission_file_0a1b.sh").symlink_to(logs / "42_submission.sh")  # submitit keeps it
    assert links_below(runs) == [] and links_below(tmp_path / "logs") == []
    (tmp_path / "victim").write_text("precious\n")
    offline = next((runs / "one" / "train" / "wandb").glob("offline-run-*"))
    (offline / "files-elsewhere").symlink_to(tmp_path / "victim")  # not one W&B makes: planted
    (logs / ".submission_file_2c3d.sh").symlink_to(tmp_path / "victim")  # out of its folder: planted
    assert links_below(runs) == [offline / "files-elsewhere"]
    assert links_below(tmp_path / "logs") == [logs / ".submission_file_2c3d.sh"]


def test_a_link_planted_at_adapter_fails_the_save_naming_it_and_leaves_no_staging_folder(tiny, tmp_path):
    """L9: not written through (held), but the job failed with a bare `Cannot call rmtree on a symbolic
    link` naming no path, and left `.adapter.PID.tmp/` behind. The save of the real recipe, its model's
    weights stood in for by one file (what is tested is where the folder goes, not what it holds)."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from core.below import LinkBelowRoot
    from train.recipe import StageRecipe

    stage, outside = tmp_path / "runs" / "exp" / "train", tmp_path / "outside"
    stage.mkdir(parents=True)
    outside.mkdir()
    (stage / "adapter").symlink_to(outside)
    recipe = SimpleNamespace(
        run_dir=stage,  # as the recipe holds it
        tokenizer=AutoTokenizer.from_pretrained(tiny["tiny-llama"]),
        saved_padding_side="right",
        save_model=lambda folder: (
            folder.mkdir(parents=True),
            (folder / "adapter_model.safetensors").write_text("w"),
        ),
    )
    with pytest.raises(LinkBelowRoot) as refused:
        StageRecipe.write_adapter(recipe)
    assert str(stage / "adapter") in str(refused.value)
    assert list(outside.iterdir()) == [] and sorted(p.name for p in stage.iterdir()) == ["adapter"]
