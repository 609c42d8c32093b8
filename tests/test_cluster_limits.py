"""The cluster's real limits, read before anything is queued (slurm/cluster/limits.py), against the dev cluster's
slurmctld with accounting enforced (slurm/dev-cluster/up.sh): QOS `limited` lets a user hold 2 GPUs and
queue 3 jobs, partition `short` has a MaxTime of 10 minutes. SLURM itself would accept the first two
kinds of job and leave them pending forever, and refuse a fourth job halfway through a plan."""

from __future__ import annotations

import subprocess
from pathlib import Path

import launch
from tests.conftest import squeue_ids, write_cluster_yaml
from tests.helpers import holding_sbatch, start_launcher, tiny_sql_base, wait_until

EXPERIMENT = """\
name: {name}
inherits: _tiny-sql.yaml
adapter: {{max_trainable_percent: 40}}
train: {{epochs: 500}}
resources: {{gpus: {gpus}, time: "{time}"}}
"""


def folder_with(tmp: Path, cluster: dict, **experiments: dict) -> Path:
    folder = tmp / "configs"
    folder.mkdir(exist_ok=True)
    write_cluster_yaml(folder, tmp, **cluster)
    tiny_sql_base(folder)
    for name, fields in experiments.items():
        fields = {"gpus": 0, "time": "00:05:00", **fields}
        (folder / f"{name}.yaml").write_text(EXPERIMENT.format(name=name, **fields))
    return folder


def launched(folder: Path, capsys) -> tuple[int, str]:
    code = launch.main(["--all", "--config-dir", str(folder), "--backend", "slurm", "--no-preflight"])
    return code, " ".join(capsys.readouterr().err.split())


def test_more_gpus_than_the_qos_lets_a_user_hold_is_refused_before_queueing(
    repo_root, tmp_path, tiny, slurm_cluster, capsys
):
    folder = folder_with(tmp_path, {"qos": "limited"}, big={"gpus": 3})
    code, said = launched(folder, capsys)
    assert code == 2, said
    assert "big.yaml: resources.gpus: big/train asks 3 GPU(s), over the QOS limited MaxTRESPerUser" in said
    assert "(QOSMaxGRESPerUser); ask 2 or fewer" in said and "nothing was submitted" in said
    assert not squeue_ids(under=tmp_path) and not (tmp_path / "runs" / "big" / "train" / "job.json").exists()


def test_a_time_over_the_partitions_max_time_is_refused_at_its_line(
    repo_root, tmp_path, tiny, slurm_cluster, capsys
):
    folder = folder_with(tmp_path, {"partition": "short"}, long={"time": "00:20:00"})
    code, said = launched(folder, capsys)
    assert code == 2, said
    assert (
        "long.yaml: resources.time: long/train asks 00:20:00, over the partition short MaxTime 00:10:00"
        in said
    )
    assert "(PartitionTimeLimit); set resources.time to 00:10:00 or less" in said
    assert not squeue_ids(under=tmp_path)


def test_a_plan_over_the_users_submit_limit_is_refused_whole_not_halfway(
    repo_root, tmp_path, tiny, slurm_cluster, capsys
):
    # a's two points would be one job array: each of its tasks counts as a job, as SLURM counts them.
    folder = folder_with(tmp_path, {"qos": "limited"}, b={}, c={})
    (folder / "a.yaml").write_text(
        EXPERIMENT.format(name="a", gpus=0, time="00:05:00") + "sweep: {seeds: [1, 2]}\n"
    )
    code, said = launched(folder, capsys)
    assert code == 2, said
    assert "this launch queues 4 job(s) and you have 0 queued under QOS limited" in said
    assert "QOS limited MaxSubmitJobsPerUser is 3" in said and "You may queue 3 now" in said
    assert not squeue_ids(under=tmp_path)  # before: a, b, c queued, then sbatch refused d


def test_a_job_pending_on_a_limit_it_is_over_shows_as_will_never_start(
    repo_root, tmp_path, tiny, slurm_cluster, capsys
):
    folder = folder_with(tmp_path, {"partition": "short"}, waits={"time": "00:05:00"})
    env = holding_sbatch(tmp_path / "hold")  # queued held: it cannot start before the limit changes
    first = start_launcher(folder, tmp_path / "first.log", "--backend", "slurm", env=env)
    assert first.wait(timeout=300) == 0, (tmp_path / "first.log").read_text()
    (job_id,) = squeue_ids(under=tmp_path)
    try:
        # The partition's limit drops under the job's, as an admin may do: a real PartitionTimeLimit.
        subprocess.run(["scontrol", "update", "PartitionName=short", "MaxTime=1"], check=True)
        subprocess.run(["scontrol", "release", job_id], check=True)

        def reason() -> str:
            done = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%r"], capture_output=True, text=True)
            return done.stdout.strip()

        wait_until(lambda: reason() == "PartitionTimeLimit", "the job to pend on the partition's limit", 60)
        capsys.readouterr()
        assert launch.main(["--status", "--config-dir", str(folder)]) == 0
        shown = " ".join(capsys.readouterr().out.split())
        assert "will never start: PartitionTimeLimit" in shown, shown  # the reason column
        assert "waits/train: PENDING, will never start (slurm job" in shown
        assert "PartitionTimeLimit: its time limit is above the partition's MaxTime); cancel it" in shown
    finally:
        subprocess.run(["scontrol", "update", "PartitionName=short", "MaxTime=10"], check=True)
        subprocess.run(["scancel", job_id], check=False)


def test_a_job_waiting_for_the_users_other_gpus_is_not_called_never_starting(
    repo_root, tmp_path, tiny, slurm_cluster, capsys
):
    # Three one-GPU jobs under a 2-GPU cap per user: the third pends on QOSMaxGRESPerUser until one of the
    # others ends. Before: --status said it would never start, and --wait gave up on it.
    folder = folder_with(tmp_path, {"qos": "limited"}, a={"gpus": 1}, b={"gpus": 1}, c={"gpus": 1})
    code, said = launched(folder, capsys)
    assert code == 0, said
    try:

        def reasons() -> list[str]:
            done = subprocess.run(
                ["squeue", "-h", "-q", "limited", "-o", "%r"], capture_output=True, text=True
            )
            return done.stdout.split()

        wait_until(lambda: "QOSMaxGRESPerUser" in reasons(), "a job to wait for the user's GPUs", 60)
        assert launch.main(["--status", "--config-dir", str(folder)]) == 0
        shown = " ".join(capsys.readouterr().out.split())
        assert "QOSMaxGRESPerUser" in shown and "will never start" not in shown, shown
    finally:
        launch.main(["--cancel", "--all", "--config-dir", str(folder)])
