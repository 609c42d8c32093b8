"""Packed allocations on the dev cluster, for real: one SLURM job whose lanes run a seed-like scenario
(two single-stage experiments, a 3-stage and a 2-stage curriculum, one `after:` another), a requeue of
that job mid-run (its adapters and scores then equal those of the same jobs run one by one in the test's
process), a unit that fails, and a budget that cannot hold the plan.

Waiting is always for a condition (a file, a state), never a fixed sleep.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

from submitit.core.utils import JobPaths

import launch
from bench.packing import SCENARIO, scenario
from core.states import State
from slurm.cluster.profile import load_profile
from slurm.planning.experiments import load_experiments, parse_overrides
from slurm.planning.plan import build_plan
from slurm.watching.status import query_slurm
from tests.conftest import squeue_ids
from tests.helpers import holding_sbatch, slurm_id, wait_until
from tests.train_helpers import assert_every_step_logged_once, assert_same_adapter, one_torch_thread
from train.checkpoints import latest_valid_checkpoint


def launch_slurm(folder: Path, *extra: str) -> int:
    return launch.main(["--all", "--config-dir", str(folder), "--backend", "slurm", "--no-preflight", *extra])


def train_units(folder: Path) -> list[str]:
    profile, _ = load_profile(folder)
    plan = build_plan(load_experiments(folder, profile, parse_overrides([]), None), profile)
    return [job.id for job in plan.jobs]


def run_here(folder: Path) -> None:
    """Every job of `folder`'s plan, run in this process one after another in dependency order, by what a
    separate job runs (slurm/queueing/jobs.py: TrainStage → train.stage.run_stage, EvalStage →
    eval.job.run_eval) on the same specs, on one torch thread as a `cpus: 1` job trains. No SLURM job, so
    no Python start-up per job: the unpacked reference a packed run is compared with."""
    from eval.job import run_eval
    from train.stage import run_stage

    profile, _ = load_profile(folder)
    plan = build_plan(load_experiments(folder, profile, parse_overrides([]), None), profile)
    with one_torch_thread():
        for job in sorted(plan.jobs, key=lambda j: j.wave):
            if job.kind == "train":
                assert run_stage(job.spec) == "completed", job.id
            else:
                assert run_eval(job.spec) is not None, job.id


# The seed-like scenario with its long stage 5 epochs (150 steps) instead of the benchmark's 12: long
# enough that the requeue sent at its first checkpoint (step 8) lands while it trains, and every step
# beyond that is paid twice (packed, and the reference).
SHORT_SCENARIO = SCENARIO | {"three": SCENARIO["three"].replace("epochs: 12", "epochs: 5")}
assert SHORT_SCENARIO != SCENARIO


def pack_log(tmp: Path, pack_id: str) -> str:
    return JobPaths(tmp / "logs" / "packs", pack_id).stdout.read_text()


def test_a_packed_run_survives_a_requeue_and_equals_the_unpacked_run(
    repo_root, tmp_path, slurm_cluster, tiny
):
    plain = scenario(repo_root, tmp_path / "plain", SHORT_SCENARIO)
    packed = scenario(repo_root, tmp_path / "packed", SHORT_SCENARIO)
    jobs = train_units(packed)
    assert len(jobs) == 9  # 8 training stages and single-a's eval
    assert launch_slurm(packed, "--pack", "2", "--budget", "00:40:00") == 0
    runs = tmp_path / "packed" / "runs"
    pack_id = slurm_id(tmp_path / "packed", jobs[0])
    assert {slurm_id(tmp_path / "packed", job) for job in jobs} == {pack_id}  # one allocation for all

    long = runs / "three" / "long"
    wait_until(lambda: latest_valid_checkpoint(long / "checkpoints"), "three/long's first checkpoint", 480)
    finished = {job for job in jobs if (runs / job / "DONE").exists()}
    subprocess.run(["scontrol", "requeue", pack_id], check=True)
    # The unpacked reference, here, while the requeued pack runs on the cluster.
    run_here(plain)
    assert launch_slurm(packed, "--pack", "2", "--budget", "00:40:00", "--wait") == 0  # nothing new queued

    log = pack_log(tmp_path / "packed", pack_id)
    assert finished >= {"three/easy", "three/medium"}  # the long stage ran after them
    for job in finished:
        assert log.count(f": started {job}\n") == 1, job  # never run twice
    assert log.count(": started three/long\n") == 2  # interrupted once, resumed once
    summary = json.loads((long / "summary.json").read_text())
    assert summary["resumed_from"] is not None
    assert_every_step_logged_once(long, summary["global_step"])

    # In each allocation (the requeue starts a new one, whose GPUs SLURM may number differently) the two
    # lanes had two different GPUs, and each unit saw one GPU: its lane's in the allocation that ran it.
    allocations = re.split(r"unit\(s\) on 2 lane\(s\) \(GPUs (\S+)\)", log)[1:]
    assert len(allocations) == 4  # GPUs, starts; GPUs, starts: two allocations
    for gpus, starts in zip(allocations[::2], allocations[1::2], strict=True):
        assert len(set(gpus.split(","))) == 2, gpus
        lanes = set(re.findall(r"lane (\d+) \(GPU (\S+)\): started", starts))
        assert lanes and lanes <= {(str(i), gpu) for i, gpu in enumerate(gpus.split(","))}, (gpus, lanes)
    for job in jobs:
        lane = json.loads((runs / job / "lane.json").read_text())
        unit_log = JobPaths(tmp_path / "packed" / "logs" / job, pack_id).stdout.read_text()
        seen = re.findall(r"unit of packed job on lane (\d+), CUDA_VISIBLE_DEVICES=(\S+)", unit_log)
        assert seen and seen[-1] == (str(lane["lane"]), lane["gpu"]), (job, seen)
        assert all("," not in gpu for _, gpu in seen)  # one GPU, never the allocation's two
        assert len(seen) == 1 or job not in finished  # finished before the requeue: started once

    # The same results as the separate jobs: every adapter, and the eval's scores.
    for job in jobs:
        if job.endswith("/eval"):
            continue
        assert_same_adapter(tmp_path / "plain" / "runs" / job, runs / job)
    scores = [
        json.loads((r / "single-a" / "eval" / "results.json").read_text())
        for r in (runs, tmp_path / "plain" / "runs")
    ]
    assert scores[0]["exact_match"] == scores[1]["exact_match"] and scores[0]["n"] == scores[1]["n"] == 8


def test_a_failing_unit_blocks_only_the_units_that_need_its_adapter(
    repo_root, tmp_path, slurm_cluster, tiny, capsys
):
    doomed = tmp_path / "doomed.jsonl"
    doomed.write_text((repo_root / "data" / "demo" / "sql" / "easy.jsonl").read_text())
    folder = scenario(
        repo_root,
        tmp_path,
        {
            "ok": "",
            # starts after `ok` ended (after: orders), by when its data file is gone (deleted below)
            "bad": f"after: [ok]\nstages:\n  - {{{{name: first, data: {{{{train: {doomed}}}}}}}}}\n  - {{{{name: second}}}}\n",
            "other": "after: [bad]\n",  # ordering only: it runs although bad failed
        },
    )
    assert launch_slurm(folder, "--pack", "2", "--budget", "00:30:00") == 0
    text = doomed.read_text()
    doomed.unlink()  # a fault the launcher could not see: the file vanished after validation
    pack_id = slurm_id(tmp_path, "ok/train")
    wait_until(lambda: pack_id not in squeue_ids(tmp_path), "the packed job to end", 300)
    # Accounting records the end a moment after squeue lets the job go: wait for sacct to have it too.
    ended = wait_until(
        lambda: (info := query_slurm([pack_id])[pack_id]).state.live is False and info,
        "sacct to record it",
        60,
    )
    assert ended.state is State.FAILED  # it says that units failed
    doomed.write_text(text)  # back, so that --status loads bad.yaml again
    capsys.readouterr()
    states = {job: (tmp_path / "runs" / job / "DONE").exists() for job in ("ok/train", "other/train")}
    assert states == {"ok/train": True, "other/train": True}
    for job in ("bad/first", "bad/second"):
        assert not (tmp_path / "runs" / job / "DONE").exists()
    assert json.loads((tmp_path / "runs" / "bad" / "first" / "lane.json").read_text())["state"] == "FAILED"
    assert json.loads((tmp_path / "runs" / "bad" / "second" / "lane.json").read_text()) | {"at": ""} == {
        "started_s": None,
        "ended_s": None,
        "pack_job": pack_id,
        "lane": None,
        "gpu": None,
        "state": "BLOCKED",
        "reason": "parent bad/first FAILED",
        "at": "",
    }
    assert launch.main(["--status", "--config-dir", str(folder)]) == 0
    status = capsys.readouterr().out
    assert re.search(
        r"bad/first .*FAILED.*exit code 1, see its log \(lane \d \(GPU \d\) of packed job", status
    ), status
    assert re.search(r"bad/second .*BLOCKED.*parent bad/first FAILED", status), status
    assert re.search(r"other/train .*COMPLETED", status), status


def test_an_impossible_budget_is_refused_before_anything_is_queued(
    repo_root, tmp_path, slurm_cluster, tiny, capsys
):
    folder = scenario(repo_root, tmp_path, {name: "" for name in ("p", "q", "r", "s")})
    assert launch.main(["--all", "--config-dir", str(folder), "--dry-run", "--json"]) == 0
    estimates = {j["estimate"]["seconds"] for j in json.loads(capsys.readouterr().out)["jobs"]}
    assert len(estimates) == 1  # four copies of one job: one estimate each, e
    (each,) = estimates
    # Four jobs: 4e on one GPU, 2e on two; the units work until SLURM's stop signal, which comes
    # signal_delay_s (60) + up to 30 s before the budget ends.
    budget = round(2.5 * each) + 60 + 30
    clock = f"{budget // 3600:02d}:{budget % 3600 // 60:02d}:{budget % 60:02d}"
    before = squeue_ids(tmp_path)
    assert launch_slurm(folder, "--pack", "1", "--budget", clock) == 2
    err = capsys.readouterr().err
    assert "--budget: the 4 job(s) need about" in err and "they would fit on 2 GPUs (--pack 2)" in err
    assert "nothing was submitted" in err and "Traceback" not in err
    assert squeue_ids(tmp_path) == before
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").rglob("job.json"))


def test_cancelling_one_experiment_of_a_pack_refuses_to_stop_the_others(
    repo_root, tmp_path, slurm_cluster, tiny, capsys, monkeypatch
):
    folder = scenario(repo_root, tmp_path, {"a": "", "b": ""})
    holding_sbatch(tmp_path / "hold")  # the pack waits, held, in the real queue while we cancel
    monkeypatch.setenv("PATH", f"{tmp_path / 'hold'}:{os.environ['PATH']}")
    assert launch_slurm(folder, "--pack", "2", "--budget", "00:30:00") == 0
    pack_id = slurm_id(tmp_path, "a/train")
    capsys.readouterr()
    assert launch.main(["--cancel", "--exp", "a", "--config-dir", str(folder)]) == 2
    err = capsys.readouterr().err
    assert f"packed job {pack_id} also runs b/train: cancelling it stops them too" in err
    assert pack_id in squeue_ids(tmp_path)  # nothing was cancelled
    assert launch.main(["--cancel", "--exp", "a", "b", "--config-dir", str(folder)]) == 0
    assert "Cancelled 2 job(s)" in capsys.readouterr().out
    wait_until(lambda: pack_id not in squeue_ids(tmp_path), "the pack to leave the queue", 60)


def test_the_shipped_relative_run_and_log_folders_work_packed_plain_and_local(
    repo_root, tmp_path, slurm_cluster, tiny, monkeypatch
):
    # Before: with configs/cluster.yaml's `run_dir: runs` and `log_dir: logs`, every unit of a pack died at
    # once (FileNotFoundError: logs/EXP/STAGE/<job>_unit.json: its process starts in the code snapshot).
    limits = "max_gpus_per_node: 4\nmax_cpus_per_node: 8\nmax_mem_gb_per_node: 15\n"
    for how, extra in (("packed", ["--pack", "2", "--budget", "00:20:00"]), ("plain", []), ("local", [])):
        folder = scenario(repo_root, tmp_path / how, {"one": "", "two": ""})
        (folder / "cluster.yaml").write_text(f"run_dir: runs\nlog_dir: logs\n{limits}")  # as shipped
        monkeypatch.chdir(tmp_path / how)  # where the user runs launch.py
        argv = ["--all", "--config-dir", "configs", "--no-preflight", *extra]
        backend = ["--backend", "local"] if how == "local" else ["--backend", "slurm", "--wait"]
        assert launch.main([*argv, *backend]) == 0, how
        for name in ("one", "two"):
            assert (tmp_path / how / "runs" / name / "train" / "DONE").is_file(), (how, name)
        assert list((tmp_path / how / "logs" / "one" / "train").glob("*_log.out")), how
