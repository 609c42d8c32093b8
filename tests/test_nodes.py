"""`resources.nodes: N`: where the ranks meet (slurm/cluster/rendezvous.py, on recorded scontrol output), what the
plan, the dry run and the limits make of N nodes, and what is refused before anything is queued."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm.cluster.rendezvous import (
    RendezvousError,
    first_node,
    gpus_on_node,
    master_address,
    rendezvous_port,
    same_on_every_node,
    tasks_per_node,
)
from tests.helpers import dry_run, experiment_folder, plan_for, sized, write_experiments

SCONTROL = Path(__file__).parent / "fixtures" / "scontrol"


def recorded_node(name: str, address: str) -> str:
    """`scontrol show node n1` as the two-node dev cluster printed it, renamed and readdressed: both dev
    nodes are 127.0.0.1, where a wrong choice (the name, the login node, localhost) would go unseen."""
    text = (SCONTROL / "node-n1-22.05.8.txt").read_text()
    return text.replace("NodeName=n1", f"NodeName={name}").replace(
        "NodeAddr=127.0.0.1", f"NodeAddr={address}"
    )


def test_the_master_is_the_first_nodes_nodeaddr_not_its_name_nor_the_login_node():
    hostnames = "gpu-a07\ngpu-a08\n"  # `scontrol show hostnames gpu-a[07-08]`
    shown = recorded_node("gpu-a07", "10.20.3.7") + recorded_node("gpu-a08", "10.20.3.8")
    node = first_node(hostnames)
    assert node == "gpu-a07"
    # The name would not resolve here; the address SLURM itself reaches the node by needs no resolving.
    assert master_address(node, shown, can_resolve=lambda name: False) == "10.20.3.7"
    assert master_address("gpu-a08", shown, can_resolve=lambda name: False) == "10.20.3.8"


def test_a_first_node_whose_address_does_not_resolve_is_refused_naming_it():
    # SLURM's default NodeAddr is the node's name; `.invalid` never resolves (RFC 2606), for real.
    shown = recorded_node("gpu-z99", "gpu-z99.invalid")
    with pytest.raises(RendezvousError) as refused:
        master_address("gpu-z99", shown)
    assert "gpu-z99" in str(refused.value) and "does not resolve" in str(refused.value)
    # A node scontrol does not describe at all: its name, when that resolves (the dev cluster's n1, n2).
    assert master_address("localhost", "") == "localhost"


def test_the_rendezvous_port_is_the_jobs_own_and_the_same_on_every_node():
    # Drawn from the job id alone: two nodes whose ephemeral port ranges differ still pick the same port.
    ports = {job: rendezvous_port(job) for job in map(str, range(1000, 3000))}
    assert all(10000 <= port < 32768 for port in ports.values())  # below Linux's ephemeral range
    assert len(set(ports.values())) > 1800  # spread: two jobs on a node rarely meet on one port
    assert rendezvous_port("1708") == ports["1708"]  # every task, every requeue: the same


def test_slurms_own_task_and_gpu_shapes_parse_and_uneven_nodes_are_refused_with_the_numbers():
    assert tasks_per_node("4(x2)") == [4, 4]
    assert tasks_per_node("2(x2),1") == [2, 2, 1]
    assert tasks_per_node("1") == [1]
    assert gpus_on_node("4") == 4
    assert gpus_on_node("a100:4") is None  # SLURM_GPUS_PER_NODE's typed form is not a count
    same_on_every_node([4, 4])
    with pytest.raises(RendezvousError, match=r"\[2, 2, 1\] tasks on the job's 3 nodes"):
        same_on_every_node(tasks_per_node("2(x2),1"))
    with pytest.raises(RendezvousError, match="SLURM_TASKS_PER_NODE"):
        tasks_per_node("4(x)")


def test_placement_line_names_rank_zeros_node_and_this_tasks(monkeypatch):
    from slurm.queueing.jobs import placement_line

    env = {
        "WORLD_SIZE": "2",
        "RENDEZVOUS_NODE": "n1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "12345",
        "RANK": "1",
        "SLURMD_NODENAME": "n2",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_GPUS_ON_NODE": "1",
    }
    assert placement_line(env) == (
        "rank 0 of 2 is on n1 (10.0.0.1:12345); this task is rank 1 on n2, node 1 of 2, 1 GPU(s) there"
    )


WIDE = '{gpus: 4, nodes: 2, cpus: 8, mem_gb: 32, time: "01:00:00", partition: multi}'


def test_a_two_node_job_is_two_nodes_x_gpus_ranks_and_counts_every_nodes_gpu_hours(tmp_path, capsys):
    folder = write_experiments(tmp_path, wide=sized("wide", WIDE))
    plan = plan_for(["train.batch_size=2"], ["wide"], folder=folder)
    train = plan.job("wide/train")
    assert (train.tasks, train.effective_batch) == (8, 2 * 8)  # 2 nodes x 4 GPUs: 8 ranks
    assert train.resources.placement() == "2 nodes x 4 GPUs"
    assert plan.job("wide/eval").resources.nodes == 1  # eval stays one process on one node
    seconds = train.seconds()
    assert seconds and plan.gpu_hours() == pytest.approx(
        (seconds * 8 + (plan.job("wide/eval").seconds() or 0) * 1) / 3600
    )
    rows = {row["id"]: row for row in plan.to_json()["jobs"]}
    assert rows["wide/train"]["placement"] == "2 nodes x 4 GPUs"
    # 2 nodes x 1 GPU and 1 node x 2 GPUs: the same world size, the same math, the same identity.
    hashes = []
    for shape in ("{gpus: 2", "{gpus: 1, nodes: 2"):
        written = sized("same", f'{shape}, cpus: 8, mem_gb: 32, time: "01:00:00"}}')
        hashes.append(plan_for(names=["same"], folder=write_experiments(tmp_path / "same", same=written)))
    assert hashes[0].job("same/train").config_hash == hashes[1].job("same/train").config_hash
    import launch

    capsys.readouterr()
    assert launch.main(["--all", "--config-dir", str(folder), "--dry-run"]) == 0
    assert "2 nodes x 4 gpu" in capsys.readouterr().out


def test_an_elastic_job_counts_its_largest_size_and_reaches_sbatch_as_a_range(tmp_path, capsys):
    """`nodes: 1-2` is planned, budgeted and hashed as 2 nodes (its global batch is theirs at every size)
    and reaches sbatch as --nodes=1-2: submitit's own `nodes` is an integer, and a `2` there would make
    SLURM wait for two nodes, losing what the range is for."""
    from slurm.cluster.profile import load_profile
    from slurm.queueing.backends import SlurmBackend
    from slurm.queueing.snapshot import CodeSnapshot

    shape = '{{gpus: 1, nodes: {nodes}, cpus: 8, mem_gb: 32, time: "01:00:00", partition: multi}}'
    folder = write_experiments(tmp_path, stretchy=sized("stretchy", shape.format(nodes='"1-2"')))
    plan = plan_for(["train.batch_size=2"], ["stretchy"], folder=folder)
    train = plan.job("stretchy/train")
    assert (train.tasks, train.effective_batch, train.resources.total_gpus) == (2, 4, 2)
    assert (train.resources.placement(), train.spec.global_ranks) == ("1-2 nodes x 1 GPU", 2)
    assert plan.job("stretchy/eval").resources.nodes == 1
    elastic = (folder / "stretchy.yaml").read_text()
    (folder / "stretchy.yaml").write_text(elastic.replace('nodes: "1-2"', "nodes: 2"))
    as_fixed = plan_for(["train.batch_size=2"], ["stretchy"], folder=folder).job("stretchy/train")
    assert as_fixed.spec.global_ranks is None and "global_ranks" not in as_fixed.spec.model_dump()
    assert as_fixed.config_hash == train.config_hash  # the same math: a range added later reruns nothing
    profile, _ = load_profile(folder)
    backend = SlurmBackend(profile, tmp_path, CodeSnapshot(tmp_path, None, None))
    params = backend.sbatch_parameters(train, [])
    # No --ntasks-per-node on the allocation (cons_tres would then always give the minimum, one node):
    # each node's CPUs as one task's, and srun starts a task per GPU on every node the job got.
    assert params["additional_parameters"]["nodes"] == "1-2" and "ntasks_per_node" not in params
    assert params["cpus_per_task"] == 8
    assert {"--ntasks-per-node=1", "--cpus-per-task=8", "--kill-on-bad-exit=1"} <= set(params["srun_args"])
    assert "nodes" not in backend.sbatch_parameters(as_fixed, [])["additional_parameters"]
    # Four GPUs a node: srun starts four tasks on each node the job got, each with a quarter of its CPUs (a
    # task per node would leave three GPUs idle; the node's CPUs per task would oversubscribe them 4x).
    (folder / "stretchy.yaml").write_text(elastic.replace("gpus: 1", "gpus: 4"))
    wide = plan_for(["train.batch_size=2"], ["stretchy"], folder=folder).job("stretchy/train")
    assert (wide.tasks, wide.resources.placement(), wide.spec.global_ranks) == (8, "1-2 nodes x 4 GPUs", 8)
    params = backend.sbatch_parameters(wide, [])
    assert (params["cpus_per_task"], params["gpus_per_node"]) == (8, 4) and "ntasks_per_node" not in params
    assert {"--ntasks-per-node=4", "--cpus-per-task=2"} <= set(params["srun_args"])
    import launch

    (folder / "stretchy.yaml").write_text(elastic)
    capsys.readouterr()
    assert launch.main(["--all", "--config-dir", str(folder), "--dry-run"]) == 0
    assert "1-2 nodes x 1 gpu" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("accum", "most", "now", "expected"),
    [(1, 2, 2, 1), (1, 2, 1, 2), (2, 3, 2, 3), (1, 3, 2, None), (4, 4, 3, None), (3, 4, 3, 4), (1, 8, 4, 2)],
)
def test_an_elastic_jobs_ranks_accumulate_what_keeps_its_global_batch(accum, most, now, expected):
    """Hand-computed: accum x most / now, or None where that is not whole (batch 8, accum 1, 3 nodes: on 2,
    each rank would take 1.5 steps, and the global batch could not stay 24)."""
    from core.split import elastic_accumulation

    assert elastic_accumulation(accum, most, now) == expected


def test_an_elastic_job_on_fewer_ranks_accumulates_more_and_a_fixed_one_is_left_alone(tmp_path):
    from train.recipe import at_world_size

    shape = '{gpus: 1, nodes: "1-2", cpus: 8, mem_gb: 32, time: "01:00:00", partition: multi}'
    folder = write_experiments(tmp_path, stretchy=sized("stretchy", shape))
    job = plan_for(["train.batch_size=2"], ["stretchy"], folder=folder).job("stretchy/train").spec
    assert job.fewest_ranks == 1  # where preflight judges its GRPO generation; the running job knows its own
    assert at_world_size(job, 2) == job.model_copy(update={"fewest_ranks": None})
    shrunk = at_world_size(job, 1)
    assert (shrunk.train.batch_size, shrunk.train.grad_accum) == (2, 2 * job.train.grad_accum)
    with pytest.raises(ValueError, match="cannot share grad_accum"):
        at_world_size(job.model_copy(update={"global_ranks": 3}), 2)
    fixed = job.model_copy(update={"global_ranks": None, "fewest_ranks": None})
    assert at_world_size(fixed, 1) is fixed


def test_a_multi_node_job_is_never_a_lane_of_a_one_node_pack(tmp_path):
    from core.problems import ConfigError
    from slurm.cluster.profile import load_profile
    from slurm.planning.pack import pack_plan

    folder = write_experiments(tmp_path, wide=sized("wide", WIDE.replace("gpus: 4", "gpus: 1")))
    plan = plan_for(["train.batch_size=2"], ["wide", "other"], folder=folder)
    profile, _ = load_profile(folder)
    with pytest.raises(ConfigError) as refused:
        pack_plan(plan.jobs, 4, "01:00:00", profile)
    assert "wide/train trains on 2 nodes x 1 GPU, and a pack is one node: run it unpacked" in str(
        refused.value
    )


def test_the_local_backend_refuses_two_nodes_and_says_how_to_run_them_on_one_machine(tmp_path):
    from slurm.cluster.local_gpus import VisibleGpus, too_many_gpus

    folder = write_experiments(tmp_path, wide=sized("wide", WIDE))
    plan = plan_for(["train.batch_size=2"], ["wide"], folder=folder)
    problems = too_many_gpus(plan.jobs, VisibleGpus((), "none"), {"wide": "wide.yaml"})
    assert [(p.file, p.key) for p in problems] == [("wide.yaml", "resources.nodes")]
    assert "runs every job on this one machine" in problems[0].message
    assert "resources.nodes=1 resources.gpus=8" in problems[0].message


@pytest.mark.parametrize(
    ("resources", "where", "said"),
    [
        (
            '{gpus: 1, nodes: 0, cpus: 1, mem_gb: 1, time: "00:05:00"}',
            "resources.nodes",
            "greater than or equal to 1",
        ),
        (
            '{gpus: 1, nodes: "1-3", cpus: 1, mem_gb: 1, time: "00:05:00"}',
            "resources.nodes",
            "on 2 node(s) each rank would accumulate 1 x 3 / 2 = 1.5 steps; make train.grad_accum a multiple of 2",
        ),
        (
            '{gpus: 1, nodes: "0-2", cpus: 1, mem_gb: 1, time: "00:05:00"}',
            "resources.nodes",
            "a job runs on 1 node at least",
        ),
        (
            '{gpus: 1, nodes: "3-2", cpus: 1, mem_gb: 1, time: "00:05:00"}',
            "resources.nodes",
            "starts above its end",
        ),
        (
            '{gpus: 1, nodes: 3, cpus: 1, mem_gb: 1, time: "00:05:00"}',
            "resources.nodes",
            "this cluster has 2",
        ),
    ],
    ids=[
        "zero",
        "a range whose sizes do not divide",
        "a range from 0",
        "a range upside down",
        "more than the cluster has",
    ],
)
def test_a_bad_nodes_value_is_named_at_its_line_before_anything_is_queued(
    tmp_path, capsys, resources, where, said
):
    folder = experiment_folder(tmp_path)
    (folder / "cluster.yaml").write_text((folder / "cluster.yaml").read_text() + "max_nodes: 2\n")
    text = (folder / "a.yaml").read_text()
    (folder / "a.yaml").write_text(text.replace('{gpus: 1, cpus: 1, mem_gb: 1, time: "00:05:00"}', resources))
    code, err = dry_run(folder, capsys)
    assert code == 2
    assert "a.yaml:7" in err and where in err and said in err, err


def test_nodes_on_an_eval_section_is_refused_eval_stays_one_node(tmp_path, capsys):
    folder = experiment_folder(tmp_path)
    text = (folder / "a.yaml").read_text()
    (folder / "a.yaml").write_text(
        text.replace(
            "eval: {metrics: [exact_match, sql_exec]",
            "eval: {resources: {nodes: 2}, metrics: [exact_match, sql_exec]",
        )
    )
    code, err = dry_run(folder, capsys)
    assert code == 2
    assert (
        "a.yaml:6" in err and "eval.resources.nodes" in err and "one process on one GPU of one node" in err
    ), err


def test_more_nodes_than_the_partition_has_never_start_named_with_the_clusters_figure(tmp_path):
    from slurm.cluster.limits import never_starting, parse_limits

    partitions = (SCONTROL / "partitions-two-nodes-22.05.8.txt").read_text()
    limits = parse_limits("normal", "", "association root/lab", "", partitions, "")
    assert {name: cap.value for name, cap in limits.partition_nodes.items()} == {
        "debug": 1,
        "short": 1,
        "multi": 2,
    }
    folder = write_experiments(
        tmp_path, wide=sized("wide", WIDE.replace("partition: multi", "partition: debug"))
    )
    plan = plan_for(["train.batch_size=2"], ["wide"], folder=folder)
    problems = never_starting([plan.job("wide/train")], limits, {"wide": "wide.yaml"})
    assert [(p.file, p.key) for p in problems] == [("wide.yaml", "resources.nodes")]
    assert "asks 2 nodes, over the partition debug TotalNodes=1" in problems[0].message


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    ("rank", "address", "said"),
    [
        (1, "192.0.2.1", "rank 1 on"),  # TEST-NET-1 (RFC 5737): an address no host answers at
        (0, "127.0.0.1", "rank 0 on"),  # rank 0 itself: the other rank never comes
    ],
    ids=["unreachable master", "a rank that never joins"],
)
@pytest.mark.slow
def test_a_group_that_cannot_form_fails_within_the_join_timeout_naming_rank_and_address(
    monkeypatch, rank, address, said
):
    import time

    from train.distributed import JoinError, joined_store

    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", address)
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("RANK", str(rank))
    started = time.monotonic()
    with pytest.raises(JoinError) as failed:
        joined_store(2, join_s=1)
    assert time.monotonic() - started < 1 + 10  # the join timeout, not torch's 30 minutes
    message = str(failed.value)
    assert said in message and f"{address}:{port}" in message and "join timeout (1 s" in message, message


def test_a_failed_multi_node_job_names_the_first_rank_and_node_srun_saw_end():
    from slurm.watching.status import first_failed_rank

    # Task 0's log as the two-node dev cluster wrote it: a requeued first attempt (both tasks ended by the
    # requeue), then a second attempt whose rank on n2 was killed.
    log = (
        "submitit INFO - Starting with JobEnvironment(job_id=22, hostname=n1, node=0(2), global_rank=0(2))\n"
        "srun: error: n2: task 1: Killed\nsrun: launch/slurm: _step_signal: Terminating StepId=22.0\n"
        "srun: error: n1: task 0: Killed\n"
        "submitit INFO - Starting with JobEnvironment(job_id=22, hostname=n1, node=0(2), global_rank=0(2))\n"
        "rank0 INFO train: step 5\n"
        "srun: error: n2: task 1: Killed\nsrun: error: n1: task 0: Terminated\n"
    )
    assert first_failed_rank(log) == "rank 1 on n2: Killed (srun then stopped the other ranks)"
    assert first_failed_rank(log.rsplit("rank0 INFO", 1)[0]) == ""  # the last attempt still running
