"""Issue 38, rule 11: what a newcomer met on a first run, written from the README alone."""

from __future__ import annotations


def test_the_wait_for_the_run_roots_lock_says_how_to_use_a_run_root_of_ones_own(tmp_path):
    """Before: a newcomer's first launch waited for `make demo`'s lock on runs/ with no word on how not to.
    The cluster.yaml it suggests is read as the folder's profile: its run root is the one it names."""
    from slurm.cluster.profile import load_profile
    from slurm.queueing.submit import waiting_text

    said = waiting_text("runs", "pid 4242 on login1")
    assert said.startswith("waiting for the launch lock of runs/: held by pid 4242 on login1")
    assert "run_dir: my-runs" in said and "cluster.yaml beside their YAMLs" in said
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "cluster.yaml").write_text("run_dir: my-runs\nlog_dir: my-logs\n")
    assert load_profile(folder)[0].run_dir.endswith("my-runs")


def test_the_readmes_first_run_yaml_is_a_valid_experiment(tmp_path, capsys, monkeypatch):
    """The README's short "your own chat model" path near its top: its YAML, as printed, passes the dry run
    (a stale key there would fail a newcomer's very first command)."""
    import json
    import re
    from pathlib import Path

    import launch

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("## Your own chat model", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```yaml\n(.*?)```", section, re.S)
    folder = tmp_path / "my-chat"
    folder.mkdir()
    (folder / "chat.yaml").write_text(block)
    (folder / "cluster.yaml").write_text(
        f"run_dir: {tmp_path / 'my-runs'}\nlog_dir: {tmp_path / 'my-logs'}\n"
    )
    chats = tmp_path / "data" / "my-chats"
    chats.mkdir(parents=True)
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    for name in ("train.jsonl", "dev.jsonl"):
        (chats / name).write_text(json.dumps(chat) + "\n")
    monkeypatch.chdir(tmp_path)
    code = launch.main(["--exp", "my-chat", "--config-dir", str(folder), "--dry-run"])
    assert code == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    # Its untuned model's row beside it: before, the example had none (no base.yaml, baseline false).
    assert "my-chat/train" in out and "_base-SmolLM2_135M_Instruct-" in out


def test_inheriting_base_yaml_from_a_folder_of_ones_own_names_the_projects_file_and_only_that(
    tmp_path, capsys, monkeypatch
):
    """Before: `inherits: base.yaml` outside configs/ failed "not found", and a second, misleading error
    followed: "--exp: no experiment named 'mine'" (the file that names it had failed to load)."""
    from pathlib import Path

    import launch

    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "mine.yaml").write_text("name: mine\ninherits: base.yaml\n")
    monkeypatch.chdir(tmp_path)
    code = launch.main(["--exp", "mine", "--config-dir", str(folder), "--dry-run"])
    err = " ".join(capsys.readouterr().err.split())
    shipped = Path(__file__).resolve().parent.parent / "configs" / "base.yaml"
    assert code == 2 and f"the project's own base.yaml is {shipped}: write inherits: {shipped}" in err
    assert "no experiment named" not in err and "1 problem(s)" in err


def test_a_sweep_with_fewer_runs_than_min_points_is_told_it_can_never_prune(tmp_path, capsys):
    """Before: a 2-point sweep with prune.min_points 3 validated silently, and never stopped a run."""
    from tests.helpers import dry_run, experiment_folder

    sweep = "sweep:\n  grid: {train.learning_rate: [1.0e-4, 3.0e-4]}\n  prune: {rungs: [1], keep: 0.5}\n"
    folder = experiment_folder(tmp_path, more=sweep)
    code, err = dry_run(folder, capsys, "train.epochs=2")
    assert code == 0, err
    said = " ".join(err.split())
    assert (
        "warning:" in said and "sweep.prune: this sweep has 2 run(s), fewer than prune.min_points 3" in said
    )
    code, err = dry_run(folder, capsys, "train.epochs=2", "sweep.prune.min_points=2")
    assert code == 0 and "min_points" not in err, err
