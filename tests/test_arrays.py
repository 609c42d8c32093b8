"""Which jobs of a launch go to SLURM as one job array (slurm/planning/arrays.py), decided as data from real
plans of sweep YAMLs: hand-counted cases of sizes, stages, time limits and what is already done."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from slurm.planning.arrays import JobArray, submissions
from tests.conftest import write_cluster_yaml
from tests.helpers import plan_for

SWEEP = """\
name: lr
model: {{name_or_path: org/model, kind: causal}}
data: {{train: {data}, eval: {data}, input_field: q, target_field: a}}
eval: {{metrics: [exact_match], baseline: true}}
resources: {{mem_gb: 4, cpus: 1, gpus: {gpus}, time: "{time}"}}
{stages}
sweep:
  grid:
    train.learning_rate: [1.0e-4, 2.0e-4, 3.0e-4]
    train.epochs: [1, 2]
  seeds: [1, 2]
{parallel}
"""
TWO_STAGES = """\
stages:
  - {name: first}
  - {name: second}"""
PLAIN = """\
name: plain
model: {{name_or_path: org/model, kind: causal}}
data: {{train: {data}, input_field: q, target_field: a}}
eval: {{metrics: []}}
resources: {{mem_gb: 4, cpus: 1}}
"""


def sweep_plan(tmp_path: Path, gpus=1, time="01:00:00", stages="", parallel=""):
    """The 12-point sweep (3 rates x 2 epochs x 2 seeds) and one plain experiment, planned."""
    folder = tmp_path / "configs"
    folder.mkdir()
    write_cluster_yaml(folder, tmp_path)
    data = tmp_path / "d.jsonl"
    data.write_text('{"q": "x", "a": "y"}\n')
    text = SWEEP.format(data=data, gpus=gpus, time=time, stages=stages, parallel=parallel)
    (folder / "lr.yaml").write_text(text)
    (folder / "plain.yaml").write_text(PLAIN.format(data=data))
    return plan_for(folder=folder)


def arrays_of(batches) -> list[JobArray]:
    return [b for b in batches if isinstance(b, JobArray)]


def test_a_sweeps_twelve_trainings_are_one_array_and_its_evals_and_other_experiments_are_jobs(tmp_path):
    plan = sweep_plan(tmp_path)
    todo = list(plan.jobs)
    batches = submissions(todo, {j.id for j in todo}, plan.sweep_parallel)
    (array,) = arrays_of(batches)
    assert [j.id for j in array.jobs] == [j.id for j in todo if j.kind == "train" and j.sweep == "lr"]
    assert len(array.jobs) == 12 and array.parallel == 12 and array.follows is None
    singles = [b for b in batches if not isinstance(b, JobArray)]
    assert len(singles) == 12 + 1 + 1  # the points' evals, the plain experiment, the shared base eval
    assert all(j.kind == "eval" or j.sweep is None for j in singles)
    # Each eval is submitted after the array that runs its training (it waits on its task).
    position = {id(b): i for i, b in enumerate(batches)}
    assert all(position[id(array)] < position[id(e)] for e in singles if e.kind == "eval" and e.sweep)


def test_k_is_the_sweeps_parallel_and_at_most_the_gpus_the_qos_lets_a_user_hold(tmp_path):
    plan = sweep_plan(tmp_path, gpus=2, parallel="  parallel: 5")
    todo = list(plan.jobs)
    (array,) = arrays_of(submissions(todo, set(), plan.sweep_parallel))
    assert array.parallel == 5
    (capped,) = arrays_of(submissions(todo, set(), plan.sweep_parallel, gpus_per_user=6))
    assert capped.parallel == 3  # 6 GPUs a user may hold, 2 per task


def test_a_sweep_larger_than_max_array_size_is_split_and_its_next_stage_split_the_same_way(tmp_path):
    plan = sweep_plan(tmp_path, stages=TWO_STAGES)
    todo = list(plan.jobs)
    batches = submissions(todo, {j.id for j in todo}, plan.sweep_parallel, max_array_size=5)
    first = [a for a in arrays_of(batches) if a.jobs[0].stage == "first"]
    second = [a for a in arrays_of(batches) if a.jobs[0].stage == "second"]
    assert [len(a.jobs) for a in first] == [4, 4, 4] == [len(a.jobs) for a in second]  # even: never one alone
    for parents, children in zip(first, second, strict=True):
        assert children.follows is parents  # aftercorr: task i after task i
        for parent, child in zip(parents.jobs, children.jobs, strict=True):
            assert child.depends_on[0].job_id == parent.id


def test_a_later_stage_whose_first_stage_is_done_is_an_array_that_waits_on_nothing(tmp_path):
    plan = sweep_plan(tmp_path, stages=TWO_STAGES)
    todo = [j for j in plan.jobs if j.stage != "first"]  # every first stage done
    (second,) = arrays_of(submissions(todo, {j.id for j in todo}, plan.sweep_parallel))
    assert len(second.jobs) == 12 and second.follows is None and second.parents == ()


def test_a_later_stage_waits_by_index_only_on_an_array_of_this_launch(tmp_path):
    # Points 0-3 finished their first stage, 4-7 have it queued by an earlier launch, 8-11 run it now.
    plan = sweep_plan(tmp_path, stages=TWO_STAGES)
    points = plan.sweeps()["lr"]
    done = {f"{p}/first" for p in points[:4]}
    queued = {f"{p}/first" for p in points[4:8]}
    todo = [j for j in plan.jobs if j.id not in done | queued]
    batches = submissions(todo, {j.id for j in todo} | queued, plan.sweep_parallel)
    shapes = [(a.jobs[0].stage, [points.index(j.experiment) for j in a.jobs]) for a in arrays_of(batches)]
    assert shapes == [("second", [0, 1, 2, 3]), ("first", [8, 9, 10, 11]), ("second", [8, 9, 10, 11])]
    first, after_first = arrays_of(batches)[1:]
    assert arrays_of(batches)[0].follows is None and after_first.follows is first
    # aftercorr could not pair them with the earlier launch's jobs: each waits on its own parent's job.
    alone = [b for b in batches if not isinstance(b, JobArray) and b.kind == "train" and b.sweep]
    assert [points.index(j.experiment) for j in alone] == [4, 5, 6, 7]


def test_written_time_limits_that_differ_are_two_arrays_and_auto_limits_share_the_longest(tmp_path):
    # The limits are set by hand on the planned jobs: half the points 1 hour, half 2 hours.
    plan = sweep_plan(tmp_path)

    def with_limits(auto: bool):
        longer = plan.jobs[0].resources.model_copy(update={"time": "02:00:00"})
        return [
            replace(j, resources=longer if j.experiment.endswith("-s1") else j.resources, time_auto=auto)
            for j in plan.jobs
        ]

    arrays = arrays_of(submissions(with_limits(auto=False), set(), plan.sweep_parallel))
    assert sorted((a.resources.time, len(a.jobs)) for a in arrays) == [("01:00:00", 6), ("02:00:00", 6)]
    (array,) = arrays_of(submissions(with_limits(auto=True), set(), plan.sweep_parallel))
    assert array.resources.time == "02:00:00" and len(array.jobs) == 12


def test_one_point_left_to_run_is_a_job_not_an_array(tmp_path):
    plan = sweep_plan(tmp_path)
    todo = [plan.jobs[0]]
    assert submissions(todo, set(), plan.sweep_parallel) == todo


def test_a_killed_launchs_array_task_is_recorded_as_its_own_task_not_the_first_squeue_shows(tmp_path):
    # squeue lists every task of an array with the one token its comment carries: the intent's own task
    # index names the job (before: the last row squeue printed, another point's task).
    from core.job_records import JobRecord, pending_submission, record_intent

    record_intent(tmp_path, token="t0k", array_task=3)
    intent = pending_submission(tmp_path)
    assert intent.array_task == 3 and intent.job_id("77_11") == "77_3" and intent.job_id("77") == "77_3"
    assert JobRecord("77_3").array and not JobRecord("77").array and not JobRecord("77_3", "local").array


def test_max_array_size_is_read_from_scontrol_show_config():
    from slurm.cluster.limits import max_array_size

    text = "MaxArraySize            = 250\nMaxJobCount             = 10000\n"
    assert max_array_size(text) == 250 and max_array_size("MaxJobCount = 1\n") is None


def test_a_job_after_one_point_waits_for_the_shared_eval_that_scores_that_point(tmp_path):
    """Review of issue 50: a shared eval is placed where its last member was, so an experiment `after:` an
    earlier point came before it, and lost its wait (its parent had no SLURM id yet)."""
    from slurm.planning.arrays import slurm_submissions
    from slurm.planning.shared_evals import SharedEval

    first = sweep_plan(tmp_path).sweeps()["lr"][0]
    (tmp_path / "configs" / "after-one.yaml").write_text(
        PLAIN.format(data=tmp_path / "d.jsonl").replace("name: plain", "name: after-one")
        + f"after: [{first}]\n"
    )
    plan = plan_for(folder=tmp_path / "configs")
    todo = list(plan.jobs)
    batches = slurm_submissions(todo, {j.id for j in todo}, plan.sweep_parallel, None)
    ids = [b.id if not isinstance(b, JobArray | SharedEval) else b.name for b in batches]
    (shared,) = [i for i, b in enumerate(batches) if isinstance(b, SharedEval)]
    assert len(batches[shared].jobs) == 13  # the 12 points' evals and their base row
    assert ids.index("after-one/train") > shared
    assert sorted(j.id for b in batches for j in (b.jobs if hasattr(b, "jobs") else (b,))) == sorted(
        j.id for j in todo
    )
