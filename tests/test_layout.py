"""The names the pipeline writes beside experiments and stages (core/layout.py) are the names refused for
them: the writers run here for real, and whatever they leave must be a name validation refuses."""

from __future__ import annotations

import json
from pathlib import Path

from core.layout import taken_experiment_name, taken_stage_name
from core.rundir import write_spec
from core.runs import ReportInput
from core.speeds import book_of, eval_book_of
from eval.report import write_report
from slurm.cluster.profile import load_profile
from slurm.planning.experiments import load_experiments
from slurm.planning.plan import build_plan, calibration_plan
from slurm.planning.preflight_books import record_exact_tokens
from slurm.queueing.decisions import archive_stale
from slurm.queueing.lock import launch_lock
from slurm.queueing.snapshot import take_snapshot
from slurm.watching.reporting import job_runs
from tests.conftest import write_cluster_yaml

EXPERIMENT = """\
name: exp
model: {{name_or_path: org/m, kind: causal}}
data: {{train: {data}, eval: {data}, input_field: q, target_field: a}}
eval: {{metrics: [exact_match], after_each_stage: true}}
stages: [{{name: one}}, {{name: two}}]
resources: {{mem_gb: 4, cpus: 1}}
"""


def make_everything_a_run_makes(tmp_path: Path) -> None:
    """A plan of two stages, each evaluated, then everything that writes into the run root and the log
    root beside them: the report, the launch lock, preflight's token counts, the speed book, an archive,
    a --calibrate plan and a code snapshot."""
    configs = tmp_path / "configs"
    configs.mkdir()
    write_cluster_yaml(configs, tmp_path)
    data = tmp_path / "d.jsonl"
    data.write_text('{"q": "x", "a": "y"}\n')
    (configs / "exp.yaml").write_text(EXPERIMENT.format(data=data))
    profile, _ = load_profile(configs)
    plan = build_plan(load_experiments(configs, profile), profile)
    runs, first = tmp_path / "runs", plan.jobs[0]
    Path(first.run_dir).mkdir(parents=True)
    (Path(first.run_dir) / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    written = write_report(ReportInput(job_runs(plan), runs))
    with launch_lock(runs, lambda holder: None):
        pass
    record_exact_tokens(runs, [(first.spec, 1, 10)])
    write_spec(Path(first.run_dir), {"another": "config"})
    written += [archive_stale(first), book_of(first.spec)]
    written += [eval_book_of(j.spec.out_dir, j.experiment) for j in plan.jobs if j.kind == "eval"]
    written += [Path(j.run_dir) for j in (*plan.jobs, *calibration_plan(plan, 3).jobs)]
    take_snapshot(Path(profile.log_dir))
    for path in written:  # some are only named yet: a folder a job will make, the book it will append to
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()


def test_every_name_written_beside_experiments_and_stages_is_refused_for_them(tmp_path):
    make_everything_a_run_makes(tmp_path)
    runs, logs = tmp_path / "runs", tmp_path / "logs"
    beside_experiments = {p.name for root in (runs, logs) for p in root.iterdir()} - {"exp"}
    beside_stages = {p.name for p in (runs / "exp").iterdir()} - {"one", "two"}
    assert {n for n in beside_experiments if not taken_experiment_name(n)} == set()
    assert {n for n in beside_stages if not taken_stage_name(n)} == set()
    # What the writers left, so that this test cannot pass on an empty run root.
    assert {"speeds.jsonl", "report.md", "loss_curves.png", ".launch.lock", ".code"} <= beside_experiments
    assert {"eval", "eval-one", "loss.png", "one-calibrate"} <= beside_stages
    assert any(".old-" in name for name in beside_stages)
