"""Issue 38, rule 11: what a newcomer met on a first run, written from the README alone."""

from __future__ import annotations


def test_the_wait_for_the_run_roots_lock_says_how_to_use_a_run_root_of_ones_own(tmp_path):
    """Before: a newcomer's first launch waited for `make demo`'s lock on runs/ with no word on how not to.
    The cluster.yaml it suggests is read as the folder's profile: its run root is the one it names."""
    from slurm.profile import load_profile
    from slurm.queueing import waiting_text

    said = waiting_text("runs", "pid 4242 on login1")
    assert said.startswith("waiting for the launch lock of runs/: held by pid 4242 on login1")
    assert "run_dir: my-runs" in said and "cluster.yaml beside their YAMLs" in said
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "cluster.yaml").write_text("run_dir: my-runs\nlog_dir: my-logs\n")
    assert load_profile(folder)[0].run_dir.endswith("my-runs")
