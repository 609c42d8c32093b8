"""Packing (slurm/planning/pack.py) as data: the lanes' rule simulated on estimates, the budget check, the refusals,
the allocation a pack asks for. No cluster: the dev-cluster runs are in tests/test_cluster_pack.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import launch
from core.problems import ConfigError
from core.states import State, lane_state
from slurm.cluster.profile import load_profile
from slurm.planning.estimate import Estimate
from slurm.planning.experiments import load_experiments, parse_overrides
from slurm.planning.pack import Unit, pack_plan, pack_resources, simulate
from slurm.planning.plan import build_plan
from tests.helpers import sized

SECONDS = {"a/one": 1000, "a/two": 1000, "b/train": 1500, "c/train": 500}


def fixed(spec, gpus, gpu=None, gpu_mem_gb=None) -> Estimate:
    return Estimate(SECONDS[f"{spec.experiment}/{spec.stage}"], "measured", "fixed by the test")


def folder_with(tmp_path: Path, **files: str) -> Path:
    data = tmp_path / "train.jsonl"
    data.write_text('{"input": "q", "target": "a"}\n')
    (tmp_path / "cluster.yaml").write_text(
        f"run_dir: {tmp_path / 'runs'}\nmax_gpus_per_node: 4\nmax_cpus_per_node: 6\nmax_mem_gb_per_node: 20\n"
    )
    for name, text in files.items():
        (tmp_path / f"{name}.yaml").write_text(text.replace("DATA", str(data)))
    return tmp_path


CHAIN = """\
name: a
model: {name_or_path: org/some-model, kind: causal}
data: {train: DATA}
eval: {metrics: []}
resources: {gpus: 1, cpus: 2, mem_gb: 8, time: "01:00:00"}
stages: [{name: one}, {name: two}]
"""


def abc_plan(tmp_path: Path, b_resources: str = '{gpus: 1, cpus: 4, mem_gb: 12, time: "01:00:00"}'):
    folder = folder_with(
        tmp_path,
        a=CHAIN,
        b=sized("b", b_resources, "{metrics: []}"),
        c=sized("c", '{gpus: 1, cpus: 1, mem_gb: 4, time: "01:00:00"}', "{metrics: []}"),
    )
    profile, _ = load_profile(folder)
    plan = build_plan(load_experiments(folder, profile, parse_overrides([]), None), profile, fixed)
    return plan, profile


def test_free_lanes_take_the_longest_ready_job_and_chains_wait_for_their_parents(tmp_path):
    plan, _ = abc_plan(tmp_path)
    packing = simulate(list(plan.jobs), 2)
    # t=0: b (1500 s) and a/one (1000 s) are the longest ready; c waits. t=1000: a/two (now ready, 1000 s)
    # beats c (500 s) for lane 1. t=1500: c on lane 0. t=2000: a/two ends.
    assert packing.lanes == (("b/train", "c/train"), ("a/one", "a/two"))
    assert packing.starts == {"b/train": 0, "a/one": 0, "a/two": 1000, "c/train": 1500}
    assert packing.makespan_s == 2000
    assert packing.utilisation == pytest.approx(4000 / (2 * 2000))
    one_lane = simulate(list(plan.jobs), 1)
    assert one_lane.makespan_s == 4000 and one_lane.lanes == (("b/train", "a/one", "a/two", "c/train"),)


def test_a_budget_the_estimates_exceed_is_refused_with_the_gpus_that_would_fit(tmp_path):
    plan, profile = abc_plan(tmp_path)
    # The units can work until SLURM's stop signal: the budget less signal_delay_s (120) and 30 s.
    with pytest.raises(ConfigError) as refused:
        pack_plan(list(plan.jobs), 1, "00:52:30", profile)  # 4000 s of work on one lane, 3000 s usable
    message = str(refused.value.problems[0])
    assert "--budget" in message
    assert "need about 01:06:40 on 1 GPU(s), 00:16:40 over the 00:50:00 the budget 00:52:30 leaves" in message
    assert "they would fit on 2 GPUs (--pack 2)" in message
    with pytest.raises(ConfigError) as never:
        pack_plan(list(plan.jobs), 1, "00:34:10", profile)  # 1900 s usable; the a chain alone takes 2000
    assert "no pack of up to 4 GPUs fits, as its longest chain alone takes 00:33:20" in str(
        never.value.problems[0]
    )
    assert pack_plan(list(plan.jobs), 2, "00:35:50", profile).makespan_s == 2000  # exactly fits
    with pytest.raises(ConfigError) as too_long:
        pack_plan(list(plan.jobs), 2, "3-00:00:00", profile)
    assert "longer than cluster.yaml's max_time 2-00:00:00" in str(too_long.value.problems[0])


def test_a_pack_asks_for_one_node_with_each_lane_sized_for_its_hungriest_job(tmp_path):
    plan, profile = abc_plan(tmp_path, b_resources='{gpus: 1, cpus: 4, mem_gb: 9, time: "01:00:00"}')
    packing = pack_plan(list(plan.jobs), 2, "06:00:00", profile)
    resources = pack_resources(list(plan.jobs), packing, profile)
    assert resources.gpus == 2 and resources.time == "06:00:00"
    assert resources.cpus == 6  # 2 lanes x b's 4 CPUs, capped at the node's 6
    assert resources.mem_gb == 18  # 2 x b's 9 GB
    assert resources.tasks == 2  # Resources' own count; the pack's sbatch asks for one task (submit_pack)


def test_lanes_that_need_more_memory_than_a_node_has_are_refused_with_the_lanes_that_fit(tmp_path):
    plan, profile = abc_plan(tmp_path)  # b asks for 12 GB, the node has 20
    packing = pack_plan(list(plan.jobs), 2, "06:00:00", profile)
    with pytest.raises(ConfigError) as refused:
        pack_resources(list(plan.jobs), packing, profile)
    message = str(refused.value.problems[0])
    assert "2 lanes x 12 GB (b/train's mem_gb) is more memory than a node has (20 GB)" in message
    assert "pack on 1 GPU(s)" in message


def test_a_multi_gpu_job_cannot_take_a_lane(tmp_path):
    plan, profile = abc_plan(tmp_path, b_resources='{gpus: 2, cpus: 4, mem_gb: 8, time: "01:00:00"}')
    with pytest.raises(ConfigError) as refused:
        pack_plan(list(plan.jobs), 4, "06:00:00", profile)
    message = str(refused.value.problems[0])
    assert "b/train trains on 2 GPUs (DDP), and a lane is one GPU" in message
    assert "--exp b" in message


def run_cli(folder: Path, capsys, *extra: str) -> tuple[int, str, str]:
    code = launch.main(["--all", "--config-dir", str(folder), "--backend", "slurm", *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_dry_run_prints_the_lanes_and_its_json_carries_them(tmp_path, capsys):
    folder = folder_with(
        tmp_path,
        b=sized("b", '{gpus: 1, cpus: 1, mem_gb: 2, time: "00:30:00"}', "{metrics: []}"),
        c=sized("c", '{gpus: 1, cpus: 1, mem_gb: 2, time: "00:30:00"}', "{metrics: []}"),
    )
    code, out, _ = run_cli(folder, capsys, "--dry-run", "--json", "--pack", "2", "--budget", "2:00:00")
    assert code == 0
    packing = json.loads(out)["packing"]
    assert packing["gpus"] == 2 and packing["budget_s"] == 7200
    assert sorted(map(tuple, packing["lanes"])) == [("b/train",), ("c/train",)]
    code, out, _ = run_cli(folder, capsys, "--dry-run", "--pack", "2", "--budget", "2:00:00")
    assert code == 0 and "Pack: one allocation of 2 GPU(s) for 02:00:00" in out
    assert "lane 0: " in out and "lane 1: " in out


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--budget", "1:00:00"], "--budget: is the time of a packed allocation: add --pack G"),
        (["--pack", "2", "--budget", "6h"], "--budget: '6h' must look like HH:MM:SS"),
        (["--pack", "9"], "--pack 9: a pack is one node, and nodes here have 1 to 4 GPUs"),
    ],
)
def test_pack_mistakes_on_the_command_line_are_named(tmp_path, capsys, extra, expected):
    folder = folder_with(
        tmp_path, c=sized("c", '{gpus: 1, cpus: 1, mem_gb: 2, time: "00:30:00"}', "{metrics: []}")
    )
    code, _, err = run_cli(folder, capsys, "--dry-run", *extra)
    assert code == 2
    assert expected in err and "Traceback" not in err


def test_cluster_yaml_can_set_the_pack_and_an_unquoted_budget(tmp_path, capsys):
    folder = folder_with(
        tmp_path, c=sized("c", '{gpus: 1, cpus: 1, mem_gb: 2, time: "00:30:00"}', "{metrics: []}")
    )
    with (folder / "cluster.yaml").open("a") as fh:
        fh.write("pack: 3\nbudget: 5:00:00\n")  # YAML reads 5:00:00 as 18000 (base 60)
    code, out, _ = run_cli(folder, capsys, "--dry-run", "--json")
    assert code == 0
    packing = json.loads(out)["packing"]
    assert packing["gpus"] == 3 and packing["budget_s"] == 5 * 3600
    code, out, _ = run_cli(folder, capsys, "--dry-run", "--json", "--pack", "0")  # this launch unpacked
    assert code == 0 and "packing" not in json.loads(out)


def test_each_lane_gets_its_own_gpu_and_cores(monkeypatch):
    from slurm.queueing.lanes import lane_cpus, lane_devices

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,5,6")  # what SLURM gave the allocation on a shared node
    assert lane_devices(4) == ["2", "3", "5", "6"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert lane_devices(2) == ["0", "1"]  # no binding from SLURM: the first GPUs
    assert lane_cpus(list(range(8)), 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lane_cpus([0, 1, 2], 2) == [[0], [1]]
    assert lane_cpus([4, 5], 4) == [[4], [5], [4], [5]]  # fewer cores than lanes: shared round-robin


def lane_units(tmp_path: Path) -> list[Unit]:
    """Units as the allocation gets them: a chain one → two, and lone, whose adapter parent `up` ran as a
    job of its own outside the pack."""

    def unit(name: str, depends_on=(), outside=()):
        return {
            "id": name,
            "kind": "train",
            "spec": {},
            "config_hash": f"hash-{name}",
            "run_dir": str(tmp_path / "runs" / name),
            "log_folder": str(tmp_path / "logs" / name),
            "seconds": 10.0,
            "depends_on": [list(d) for d in depends_on],
            "outside": list(outside),
            "gpus": 1,
        }

    up = {"id": "up", "kind": "afterok", "run_dir": str(tmp_path / "runs" / "up"), "config_hash": "hash-up"}
    # As an allocation queued before units were typed pickled them: dicts, read through Unit.of.
    units = [unit("one"), unit("two", [("one", "afterok")]), unit("lone", [("up", "afterok")], [up])]
    return [Unit.of(u) for u in units]


def lane_record(tmp_path: Path, name: str) -> dict:
    return json.loads((tmp_path / "runs" / name / "lane.json").read_text())


def test_how_a_unit_ended_decides_whether_it_resumes_fails_or_blocks(tmp_path):
    import signal

    from core.rundir import mark_done
    from slurm.queueing.lanes import Lanes

    lanes = Lanes(lane_units(tmp_path), ["0", "1"], "77", str(tmp_path), str(tmp_path))
    lanes.ended("one", 0, -signal.SIGUSR2, stopping=False)  # killed by SLURM's signal while starting
    assert lanes.state["one"] is State.PENDING  # interrupted: resumes when requeued
    lanes.ended("one", 0, 1, stopping=True)  # any end after the stop: resumes on requeue
    assert lanes.state["one"] is State.PENDING
    lanes.ended("one", 0, 1, stopping=False)  # a real failure
    assert lanes.state["one"] is State.FAILED and lane_record(tmp_path, "one")["reason"].startswith(
        "exit code 1"
    )
    lanes.block_orphans()  # two needs one's adapter; lone needs up's, which never completed
    assert (
        lanes.state["two"] is State.BLOCKED and lane_record(tmp_path, "two")["reason"] == "parent one FAILED"
    )
    assert lane_record(tmp_path, "lone")["reason"] == "parent up did not complete"
    mark_done(tmp_path / "runs" / "one", "hash-one")
    lanes.ended("one", 0, 0, stopping=True)  # it finished before it saw the stop
    assert lanes.state["one"] is State.COMPLETED


def test_a_requeued_allocation_skips_done_keeps_failed_and_runs_the_rest_again(tmp_path):
    from core.rundir import mark_done
    from slurm.queueing.lanes import Lanes

    units = lane_units(tmp_path)
    first = Lanes(units, ["0"], "77", str(tmp_path), str(tmp_path))
    first.ended("one", 0, 1, stopping=False)  # failed in the allocation's first run
    first.write_lane(units[1], 0, State.RUNNING)  # two was running when the node was lost
    (tmp_path / "runs" / "lone").mkdir(parents=True)
    mark_done(tmp_path / "runs" / "up", "hash-up")
    mark_done(tmp_path / "runs" / "lone", "hash-lone")

    again = Lanes(units, ["0"], "77", str(tmp_path), str(tmp_path))  # the same job id after the requeue
    again.resume_states()
    assert again.state == {"one": State.FAILED, "lone": State.COMPLETED}
    assert lane_record(tmp_path, "two")["state"] == "PENDING"  # not RUNNING: it waits for a lane
    other = Lanes(units, ["0"], "78", str(tmp_path), str(tmp_path))  # another allocation: a fresh try
    other.resume_states()
    assert other.state == {"lone": State.COMPLETED}


SWEEP = """\
name: grid
model: {name_or_path: org/some-model, kind: causal}
data: {train: DATA}
eval: {metrics: []}
resources: {gpus: 1, cpus: 1, mem_gb: 4, time: "02:00:00"}
sweep:
  grid: {train.epochs: [1, 4, 2, 3]}
"""


def test_a_sweep_over_the_budget_is_told_how_many_points_fit_dropping_the_dearest_first(tmp_path):
    folder = folder_with(tmp_path, grid=SWEEP)
    profile, _ = load_profile(folder)

    def by_epochs(spec, gpus, gpu=None, gpu_mem_gb=None) -> Estimate:  # 1000 s per epoch
        return Estimate(1000.0 * spec.train.epochs, "measured", "fixed by the test")

    plan = build_plan(load_experiments(folder, profile, parse_overrides([]), None), profile, by_epochs)
    # 10000 s of work on one lane; usable 6000 s (6150 less the stop signal's 120 + 30): without the
    # 4000 s point, 6000 s fit; dropping the cheapest first would keep it and never fit.
    with pytest.raises(ConfigError) as refused:
        pack_plan(list(plan.jobs), 1, "01:42:30", profile)
    message = str(refused.value.problems[0])
    assert "3 of the 4 sweep points fit on 1 GPU(s): drop the most expensive first (grid-ep4)" in message
    with pytest.raises(ConfigError) as tighter:
        pack_plan(list(plan.jobs), 1, "01:09:10", profile)  # 4000 s usable: ep4, then ep3 go (3000 s left)
    assert (
        "2 of the 4 sweep points fit on 1 GPU(s): drop the most expensive first (grid-ep4, grid-ep3)"
        in str(tighter.value.problems[0])
    )


def test_a_lane_json_an_earlier_version_wrote_in_its_own_words_is_read_as_our_states(tmp_path):
    # Lanes spoke their own vocabulary (done, interrupted, ...) before they spoke State: a pack queued
    # then, requeued now, must resume what it interrupted and keep what failed, not run it all again.
    from slurm.queueing.lanes import Lanes

    units = lane_units(tmp_path)
    old = {"one": "failed", "two": "interrupted"}
    for unit in units:
        if unit.id in old:
            Path(unit.run_dir).mkdir(parents=True, exist_ok=True)
            (Path(unit.run_dir) / "lane.json").write_text(
                json.dumps({"pack_job": "77", "state": old[unit.id]})
            )
    again = Lanes(units, ["0"], "77", str(tmp_path), str(tmp_path))
    again.resume_states()
    assert again.state == {"one": State.FAILED}
    assert lane_record(tmp_path, "two")["state"] == "PENDING"
    assert lane_state("done") is State.COMPLETED and lane_state("RUNNING") is State.RUNNING
    assert lane_state("sideways") is None and lane_state(3) is None


# Issue 33: a pruned sweep's GPU-hours at worst (no run stopped) and as expected, and the budget's basis.
PRUNED_SWEEP = """\
name: p
model: {name_or_path: org/some-model, kind: causal}
data: {train: DATA, eval: DATA}
train: {epochs: 3, eval_every_epochs: 1}
eval: {metrics: []}
resources: {gpus: 1, cpus: 1, mem_gb: 4, time: "02:00:00"}
sweep:
  grid: {train.learning_rate: [1.0e-4, 2.0e-4, 3.0e-4, 4.0e-4]}
  prune: {rungs: [1], keep: 0.5}
"""


def hour_each(spec, gpus, gpu=None, gpu_mem_gb=None) -> Estimate:
    return Estimate(3600, "measured", "fixed by the test")


def pruned_plan(tmp_path: Path):
    folder = folder_with(tmp_path, p=PRUNED_SWEEP)
    profile, _ = load_profile(folder)
    return build_plan(
        load_experiments(folder, profile, parse_overrides([]), None), profile, hour_each
    ), profile


def test_a_pruned_sweeps_expected_gpu_hours_count_its_early_runs_going_on_and_its_worst_case_stops_nothing(
    tmp_path,
):
    from slurm.watching.render import totals_text

    plan, _ = pruned_plan(tmp_path)
    # 4 runs of 3 epochs, rung 1, keep 0.5, min_points 3 (issue 38: the halving sum assumed every rung keeps
    # exactly half): the first two go on (below min_points), the third with a chance of 2/3, the fourth of
    # 2/4, so 19/24 go on: 1 + 19/24 x 2 = 31/12 epochs expected of 3, so 4 x 31/36 h.
    assert plan.gpu_hours() == 4.0
    assert plan.gpu_hours("expected") == pytest.approx(31 / 9)
    assert plan.sweep_totals(plan.sweeps()["p"])["expected_gpu_hours"] == pytest.approx(3.444, abs=1e-3)
    assert "4.0 GPU-hours at worst (no run pruned), 3.4 expected with pruning" in totals_text(plan)
    shown = plan.to_json()
    assert (shown["gpu_hours"], shown["expected_gpu_hours"]) == (4.0, pytest.approx(3.444, abs=1e-3))


def test_a_pack_budget_admits_a_pruned_sweep_on_its_worst_case_unless_asked_for_the_expected(tmp_path):
    plan, profile = pruned_plan(tmp_path)
    # Two lanes, two units each: 2 h at worst, over what 01:50:00 leaves; 2 x 51:40 as expected.
    with pytest.raises(ConfigError, match="--budget-basis expected counts what pruning"):
        pack_plan(list(plan.jobs), 2, "01:50:00", profile)
    packing = pack_plan(list(plan.jobs), 2, "01:50:00", profile, "expected")
    assert packing.makespan_s == pytest.approx(2 * 3600 * 31 / 36) and packing.basis == "expected"


def test_budget_basis_without_a_pack_is_refused_naming_what_it_is_for(tmp_path, capsys):
    folder = folder_with(tmp_path, p=PRUNED_SWEEP)
    assert launch.main(["--all", "--dry-run", "--config-dir", str(folder), "--budget-basis", "expected"]) == 2
    assert "--budget-basis: says how a packed allocation's budget counts a pruned sweep" in " ".join(
        capsys.readouterr().err.split()
    )
