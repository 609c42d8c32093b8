"""The cluster-limit readers (slurm/cluster/limits.py parse_limits and its parts) on text recorded from a dev cluster.

Recorded from slurm-wlm 22.05.8 (slurm/dev-cluster/up.sh, its 4 GPUs declared as `gpu:a100:4` and
AccountingStorageTRES=gres/gpu,gres/gpu:a100) with the launcher's own commands: `sacctmgr -n -P show qos
NAME format=QOS_FIELDS`, `sacctmgr -n -P show assoc where user=root account=lab format=ASSOC_FIELDS`,
`scontrol show partition -o` (tests/fixtures/scontrol/). The limits were set with `sacctmgr add qos typed
MaxTRESPerUser=gres/gpu:a100=2,gres/gpu=4 MaxTRESPerJob=gres/gpu:a100=1 MaxWall=1-12:00:00
MaxSubmitJobsPerUser=5`, `sacctmgr modify user root account=lab set MaxSubmitJobs=10 GrpTRES=gres/gpu=3
MaxTRES=cpu=16,gres/gpu:a100=2 MaxWall=02:00:00`, an association of partition `short` alone (MaxWall=5,
MaxTRES=gres/gpu=1), then `set DefaultQOS=-1` and `set MaxTRESPerUser=gres/gpu:a100=-1 MaxWall=-1
MaxSubmitJobsPerUser=-1` (SLURM clears a limit set to -1 and prints it empty). Expected values are worked
out by hand. No cluster needed.
"""

from __future__ import annotations

from pathlib import Path

from core.config import Resources
from slurm.cluster.client import gpu_counts, tres_counts
from slurm.cluster.limits import (
    Cap,
    ClusterLimits,
    association_row,
    default_qos,
    gpus_of,
    pack_never_starting,
    parse_limits,
    partition_times,
)
from slurm.watching.status import tres_gpus

FIXTURES = Path(__file__).parent / "fixtures" / "scontrol"
PARTITIONS = (FIXTURES / "partitions-22.05.8.txt").read_text()  # debug: MaxTime=UNLIMITED; short: 00:10:00
PARTITIONS_DAYS = (FIXTURES / "partitions-days-22.05.8.txt").read_text()  # short: MaxTime=1-12:00:00

QOS_TYPED = "typed|5|gres/gpu:a100=2,gres/gpu=4|gres/gpu:a100=1|1-12:00:00\n"
QOS_CLEARED = "typed||gres/gpu=4|gres/gpu:a100=1|\n"  # after MaxTRESPerUser=gres/gpu:a100=-1 MaxWall=-1 ...
QOS_NORMAL = "normal||||\n"
# The association of partition `short` comes first; the user's own (no partition) second.
ASSOC = "short||||gres/gpu=1|00:05:00|\n|10||gres/gpu=3|cpu=16,gres/gpu:a100=2|02:00:00|limited\n"
ASSOC_NO_QOS = "short||||gres/gpu=1|00:05:00|\n|10||gres/gpu=3|cpu=16,gres/gpu:a100=2|02:00:00|\n"
ASSOC_PLAIN = "||||||normal\n"  # a user's association with no limit at all (the dev cluster's own)
WHERE = "association root/lab"


def test_the_tighter_of_qos_and_association_binds_and_says_where_it_comes_from():
    limits = parse_limits("typed", QOS_TYPED, WHERE, ASSOC, PARTITIONS, "461\n462\n")
    assert limits.max_submit == Cap(
        5, "QOS typed MaxSubmitJobsPerUser", "QOSMaxSubmitJobPerUserLimit"
    )  # 5 < 10
    assert limits.gpus_per_user == Cap(2, "QOS typed MaxTRESPerUser gres/gpu", "QOSMaxGRESPerUser")  # 2 < 3
    assert limits.gpus_per_job == Cap(1, "QOS typed MaxTRESPerJob gres/gpu", "QOSMaxGRESPerJob")  # 1 < 2
    # 02:00:00 = 7,200 s, under the QOS's 1-12:00:00 = 129,600 s.
    assert limits.max_wall_s == Cap(7_200, f"{WHERE} MaxWall", "AssocMaxWallDurationPerJobLimit")
    assert limits.qos == "typed" and limits.queued == 2


def test_the_partition_association_listed_first_is_not_taken_for_the_users_own():
    """Its MaxWall 00:05:00 and gres/gpu=1 bind only jobs in `short`: taking the first row would refuse a
    6-minute job everywhere."""
    assert association_row(ASSOC) == [
        "",
        "10",
        "",
        "gres/gpu=3",
        "cpu=16,gres/gpu:a100=2",
        "02:00:00",
        "limited",
    ]
    limits = parse_limits("normal", QOS_NORMAL, WHERE, ASSOC, PARTITIONS, "")
    assert limits.max_wall_s.value == 7_200 and limits.gpus_per_user.value == 3
    assert limits.gpus_per_job == Cap(2, f"{WHERE} MaxTRES gres/gpu", "AssocMaxGRESPerJob")


def test_a_typed_gpu_limit_counts_as_a_gpu_limit():
    """`gres/gpu:a100=1` alone is the QOS's per-job cap: read only as `gres/gpu=`, it would be no cap."""
    assert gpus_of("gres/gpu:a100=1") == 1
    assert gpus_of("gres/gpu:a100=2,gres/gpu=4") == 2  # both bind a job of untyped GPUs on a100 nodes
    assert gpus_of("cpu=16,gres/gpu:a100=2") == 2
    assert gpus_of("cpu=16,mem=64G") is None and gpus_of("gres/gpumem=40G") is None  # no GPU count


def test_without_a_default_qos_the_association_is_under_slurms_normal():
    assert default_qos(ASSOC) == "limited"
    assert default_qos(ASSOC_NO_QOS) == "normal"  # DefaultQOS cleared: empty
    assert default_qos("") == "normal"  # no association at all


def test_a_qos_that_does_not_exist_leaves_the_association_limits():
    """`sacctmgr show qos nosuch` prints nothing and exits 0."""
    limits = parse_limits("nosuch", "", WHERE, ASSOC_NO_QOS, PARTITIONS, "")
    assert limits.max_submit == Cap(10, f"{WHERE} MaxSubmitJobs", "AssocMaxSubmitJobLimit")
    assert limits.gpus_per_user == Cap(3, f"{WHERE} GrpTRES gres/gpu", "AssocGrpGRES")


def test_a_cleared_limit_and_minus_one_are_no_limit_not_a_cap_below_every_job():
    """A -1 read as a number would make every job 'never start'. 22.05 prints a cleared limit empty
    (recorded); -1 is how one is cleared, and what a site's wrapper may print (written by hand)."""
    cleared = parse_limits("typed", QOS_CLEARED, WHERE, ASSOC_PLAIN, PARTITIONS, "")
    assert cleared.max_submit is None and cleared.max_wall_s is None
    assert cleared.gpus_per_user.value == 4 and cleared.gpus_per_job.value == 1
    minus_one = parse_limits("typed", "typed|-1|gres/gpu=-1|gres/gpu:a100=-1|-1\n", WHERE, "", "", "")
    assert minus_one == ClusterLimits("typed")


def test_empty_output_reads_as_no_limits_not_a_crash():
    assert parse_limits("normal", "", WHERE, "", "", "") == ClusterLimits("normal")
    assert parse_limits("normal", "\n", WHERE, "\n  \n", "\n", "\n").queued == 0
    assert association_row("") is None and partition_times("") == ({}, None)
    assert tres_counts("") == {} and gpus_of("") is None


def test_an_unlimited_partition_has_no_time_cap_and_the_default_is_found():
    times, default = partition_times(PARTITIONS)
    assert times == {"short": Cap(600, "partition short MaxTime", "PartitionTimeLimit")}  # 00:10:00
    assert default == "debug"  # MaxTime=UNLIMITED: no entry


def test_a_partition_max_time_in_days_keeps_its_days():
    """1-12:00:00 is 36 hours, not 12 (a clock that drops the day) and not unreadable."""
    times, _ = partition_times(PARTITIONS_DAYS)
    assert times["short"].value == 129_600


def test_one_tres_reader_min_for_a_limit_sum_for_what_a_job_held():
    """The same list, two rules: a job's AllocTRES (recorded: a 2-GPU job on the a100 node) lists its
    GPUs twice, typed and untyped; it held 2, not 4. A limit of both forms binds at the smaller."""
    held = "billing=1,cpu=1,gres/gpu:a100=2,gres/gpu=2,node=1"
    assert tres_counts(held) == {"billing": 1, "cpu": 1, "gres/gpu:a100": 2, "gres/gpu": 2, "node": 1}
    assert gpu_counts(tres_counts(held)) == {"gres/gpu:a100": 2, "gres/gpu": 2}
    assert tres_gpus(held) == 2
    assert tres_gpus("cpu=8,gres/gpu:a100=2,gres/gpu:v100=1") == 3  # only typed counts kept: their sum
    assert gpus_of("gres/gpu:a100=2,gres/gpu=4") == 2
    assert tres_counts("cpu=8,mem=64G,gres/gpu=4") == {"cpu": 8, "gres/gpu": 4}  # 64G is no count


def test_recorded_limits_refuse_the_pack_that_could_never_start():
    """End to end on text: an allocation of 2 GPUs for 3 hours in `short`, against the recorded limits."""
    limits = parse_limits("typed", QOS_TYPED, WHERE, ASSOC, PARTITIONS, "")
    resources = Resources(gpus=2, time="03:00:00", partition="short")
    problems = [f"{p.key}: {p.message}" for p in pack_never_starting(resources, limits)]
    assert problems == [
        "--pack: the allocation asks 2 GPU(s), over the QOS typed MaxTRESPerJob gres/gpu=1 (QOSMaxGRESPerJob): "
        "--pack 1",
        "--budget: 03:00:00 is over the partition short MaxTime 00:10:00 (PartitionTimeLimit): --budget 00:10:00 "
        "or less",
        f"--budget: 03:00:00 is over the {WHERE} MaxWall 02:00:00 (AssocMaxWallDurationPerJobLimit): --budget "
        "02:00:00 or less",
    ]
