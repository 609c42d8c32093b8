"""The plan is data: jobs, dependencies and hashes can be checked without submitting anything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurm.cluster.profile import load_profile
from tests.helpers import plan_for, sized, write_experiments


def test_shipped_experiments_plan_stages_evals_and_chains():
    plan = plan_for()
    ids = [j.id for j in plan.jobs]
    for name in ("flan-t5-small-qg", "flan-t5-base-qg", "t5-base-qg", "t5-small-sql"):
        assert f"{name}/train" in ids and f"{name}/eval" in ids
    edges = set(plan.edges())
    assert ("qwen-curriculum3/part1", "qwen-curriculum3/part2", "afterok") in edges
    assert ("qwen-curriculum3/part2", "qwen-curriculum3/part3", "afterok") in edges
    assert ("qwen-curriculum3/part3", "qwen-curriculum3/eval", "afterok") in edges
    assert ("qwen-random/eval", "qwen-sequential/train", "afterany") in edges
    # every dependency points backwards: the plan can be submitted in order
    position = {job_id: i for i, job_id in enumerate(ids)}
    assert all(position[a] < position[b] for a, b, _ in plan.edges())


def test_a_stage_starts_from_the_previous_stage_adapter():
    plan = plan_for(names=["qwen-curriculum2"])
    part1, part2 = plan.job("qwen-curriculum2/part1"), plan.job("qwen-curriculum2/part2")
    assert part1.spec.init_adapter is None
    assert part2.spec.init_adapter == f"{part1.run_dir}/adapter"
    assert part2.spec.train.learning_rate == pytest.approx(1e-4)  # the stage's own change
    assert part1.spec.train.learning_rate == pytest.approx(2e-4)  # inherited
    assert plan.job("qwen-curriculum2/eval").spec.adapter_dir == f"{part2.run_dir}/adapter"


def test_changing_only_the_first_stage_changes_the_hash_of_what_starts_from_it(tmp_path):
    before = plan_for(folder=write_experiments(tmp_path, "2.0e-4"))
    after = plan_for(folder=write_experiments(tmp_path, "1.25e-4"))  # the same files, stage one edited
    one, two, evaluation = "chain/one", "chain/two", "chain/eval"
    assert before.job(one).spec != after.job(one).spec
    # Stage two's own spec is equal, adapter path included: only what it starts from changed.
    assert before.job(two).spec == after.job(two).spec
    for job_id in (one, two, evaluation):
        assert before.job(job_id).config_hash != after.job(job_id).config_hash, job_id
    assert before.job("other/train").config_hash == after.job("other/train").config_hash
    assert before.job("other/eval").config_hash == after.job("other/eval").config_hash


def test_a_stage_finished_on_one_gpu_is_not_done_for_two(tmp_path):
    # The hash ignored resources.gpus: a stage finished on 1 GPU counted as done for gpus: 2, though the
    # global batch, the steps per epoch and the schedule all change with the number of ranks.
    folder = write_experiments(tmp_path)
    hashes = {
        gpus: {j.id: j.config_hash for j in plan_for([f"resources.gpus={gpus}"], ["other"], folder).jobs}
        for gpus in (0, 1, 2, 4)
    }
    assert hashes[0] == hashes[1]  # one process either way: stages finished before this rule keep their hash
    assert len({h["other/train"] for h in hashes.values()}) == 3
    assert hashes[1]["other/eval"] != hashes[2]["other/eval"]  # it scores another adapter


def eval_resources_folder(tmp_path: Path) -> Path:
    big = '{gpus: 4, cpus: 16, mem_gb: 64, time: "06:00:00", partition: gpu, constraint: "a100&ib"}'
    own = '{metrics: [exact_match], resources: {gpus: 0, cpus: 2, time: "00:20:00", partition: short}}'
    return write_experiments(
        tmp_path,
        cluster="account: lab\n",
        big=sized("big", big),
        cpuonly=sized("cpuonly", '{gpus: 0, cpus: 4, mem_gb: 8, time: "02:00:00"}'),
        own=sized("own", '{gpus: 4, cpus: 16, mem_gb: 64, time: "06:00:00"}', own),
        wide=sized("wide", '{gpus: 2, nodes: 2, cpus: 8, mem_gb: 32, time: "06:00:00", partition: multi}'),
    )


def test_eval_jobs_get_one_gpu_with_the_training_jobs_cpus_memory_and_placement(tmp_path):
    plan = plan_for(folder=eval_resources_folder(tmp_path))
    train, evaluation = plan.job("big/train").resources, plan.job("big/eval").resources
    assert (train.gpus, train.time) == (4, "06:00:00")
    assert (evaluation.gpus, evaluation.cpus, evaluation.mem_gb) == (1, 16, 64)
    assert (evaluation.partition, evaluation.constraint, evaluation.account) == ("gpu", "a100&ib", "lab")
    assert evaluation.signal_delay_s + 30 < evaluation.time_s  # the default passes Resources' own check


def test_eval_jobs_time_limit_comes_from_their_estimate_not_a_fixed_hour(tmp_path):
    from slurm.planning.estimate import GUESSED_EVAL_FLOOR_S, auto_time_limit_s

    folder = eval_resources_folder(tmp_path)
    plan, (profile, _) = plan_for(folder=folder), load_profile(folder)
    for job_id in ("big/eval", "cpuonly/eval"):
        job = plan.job(job_id)
        assert job.estimate.seconds is not None, job_id
        guessed = job.estimate.source == "guess"
        floor = (
            GUESSED_EVAL_FLOOR_S if guessed else 0
        )  # a guessed eval's limit leaves room for a slow machine
        expected = auto_time_limit_s(
            job.estimate.seconds, job.resources.signal_delay_s, profile.max_time_s, guessed, floor
        )
        assert job.resources.time_s == expected, job_id
        assert expected == 3600 if guessed and job.estimate.seconds < 600 else expected != 3600, job_id
    assert plan.job("own/eval").resources.time == "00:20:00"  # written in the YAML: kept
    # An hf: dataset is fetched on the node, so there is nothing to estimate from: the old hour.
    remote = sized("remote", "{gpus: 1}").replace("eval: DATA}", "eval: hf:org/set:validation}")
    evaluation = plan_for(folder=write_experiments(tmp_path / "remote", remote=remote)).job("remote/eval")
    assert evaluation.resources.time == "01:00:00"


def test_a_cpu_experiments_eval_asks_for_no_gpu(tmp_path):
    evaluation = plan_for(folder=eval_resources_folder(tmp_path)).job("cpuonly/eval").resources
    assert (evaluation.gpus, evaluation.cpus, evaluation.mem_gb) == (0, 4, 8)


def test_eval_resources_set_in_yaml_win_and_the_rest_comes_from_training(tmp_path):
    evaluation = plan_for(folder=eval_resources_folder(tmp_path)).job("own/eval").resources
    assert (evaluation.gpus, evaluation.cpus, evaluation.time, evaluation.partition) == (
        0,
        2,
        "00:20:00",
        "short",
    )
    assert (evaluation.mem_gb, evaluation.account) == (64, "lab")


def test_eval_resources_are_not_part_of_the_eval_jobs_identity(tmp_path):
    folder = eval_resources_folder(tmp_path)
    before = plan_for(folder=folder).job("own/eval")
    after = plan_for(["eval.resources.time=00:40:00"], folder=folder).job("own/eval")
    assert after.resources.time == "00:40:00"
    assert after.config_hash == before.config_hash  # a finished eval is not run again for a new time limit


def test_eval_resources_reach_the_sbatch_parameters(tmp_path):
    from slurm.queueing.backends import SlurmBackend
    from slurm.queueing.snapshot import CodeSnapshot

    folder = eval_resources_folder(tmp_path)
    plan = plan_for(folder=folder)
    profile, _ = load_profile(folder)
    backend = SlurmBackend(profile, tmp_path, CodeSnapshot(tmp_path, None, None))
    big = backend.sbatch_parameters(plan.job("big/eval"), [("123", "afterok")])
    expected = (plan.job("big/eval").resources.timeout_min, 1, 16, "gpu")
    assert (big["time"], big["gpus_per_node"], big["cpus_per_task"], big["partition"]) == expected
    assert "gpus_per_node" not in backend.sbatch_parameters(plan.job("cpuonly/eval"), [])
    assert backend.sbatch_parameters(plan.job("big/train"), [])["gpus_per_node"] == 4


def test_jobs_run_offline_unless_the_nodes_download(tmp_path):
    """hub_downloads: login (default) puts the offline switches first in every job's setup, where a
    user's own setup line can still override them; nodes leaves the jobs online."""
    from slurm.queueing.backends import SlurmBackend
    from slurm.queueing.snapshot import CodeSnapshot

    offline = ["export HF_HUB_OFFLINE=1", "export HF_DATASETS_OFFLINE=1"]
    cases = [("", offline), ("setup: ['export X=1']", [*offline, "export X=1"]), ("hub_downloads: nodes", [])]
    for lines, expected in cases:
        folder = write_experiments(tmp_path, cluster=lines + "\n", big=sized("big", "{gpus: 1}"))
        profile, _ = load_profile(folder)
        backend = SlurmBackend(profile, tmp_path, CodeSnapshot(tmp_path, None, None))
        for job_id in ("big/train", "big/eval"):
            assert backend.sbatch_parameters(plan_for(folder=folder).job(job_id), [])["setup"] == expected


def test_mail_reaches_sbatch_for_training_and_eval_jobs_unless_the_eval_says_otherwise(tmp_path):
    from slurm.queueing.backends import SlurmBackend
    from slurm.queueing.snapshot import CodeSnapshot

    folder = write_experiments(
        tmp_path,
        cluster="mail_user: ada@uni.example\n",
        mailed=sized("mailed", "{gpus: 1, mail: [END, FAIL]}"),
        quiet_eval=sized(
            "quiet_eval", "{gpus: 1, mail: [FAIL]}", "{metrics: [exact_match], resources: {mail: []}}"
        ),
    )
    plan = plan_for(folder=folder)
    profile, _ = load_profile(folder)
    backend = SlurmBackend(profile, tmp_path, CodeSnapshot(tmp_path, None, None))
    for job_id in ("mailed/train", "mailed/eval"):
        params = backend.sbatch_parameters(plan.job(job_id), [])
        assert (params["mail_type"], params["mail_user"]) == ("END,FAIL", "ada@uni.example")
    assert backend.sbatch_parameters(plan.job("quiet_eval/train"), [])["mail_type"] == "FAIL"
    assert "mail_type" not in backend.sbatch_parameters(plan.job("quiet_eval/eval"), [])
    assert "mail_type" not in backend.sbatch_parameters(plan.job("chain/one"), [])  # no mail unless asked


def test_a_multi_gpu_job_is_one_task_per_gpu_on_one_node_and_its_eval_one_task(tmp_path):
    from slurm.queueing.backends import SlurmBackend
    from slurm.queueing.snapshot import CodeSnapshot

    folder = eval_resources_folder(tmp_path)
    plan = plan_for(["train.batch_size=8", "train.grad_accum=2"], ["big"], folder=folder)
    profile, _ = load_profile(folder)
    backend = SlurmBackend(profile, tmp_path, CodeSnapshot(tmp_path, None, None))
    train = backend.sbatch_parameters(plan.job("big/train"), [])
    # 16 CPUs for the job: 4 for each of its 4 processes; the GPUs are the node's, shared by its tasks.
    assert (train["nodes"], train["ntasks_per_node"], train["cpus_per_task"], train["gpus_per_node"]) == (
        1,
        4,
        4,
        4,
    )
    assert "--kill-on-bad-exit=1" in train["srun_args"]  # a failed rank does not leave the others waiting
    evaluation = backend.sbatch_parameters(plan.job("big/eval"), [])
    assert (evaluation["ntasks_per_node"], evaluation["cpus_per_task"]) == (1, 16)
    assert "--kill-on-bad-exit=1" not in evaluation["srun_args"]
    assert (plan.job("big/train").effective_batch, plan.job("big/eval").effective_batch) == (64, None)
    rows = {row["id"]: row for row in plan.to_json()["jobs"]}
    assert (rows["big/train"]["tasks"], rows["big/train"]["effective_batch"]) == (4, 64)


def test_dry_run_shows_each_jobs_resources(tmp_path, capsys, monkeypatch):
    import launch

    folder = eval_resources_folder(tmp_path)
    monkeypatch.chdir(folder)
    assert launch.main(["--all", "--dry-run", "--config-dir", "."]) == 0
    rows = {line.split()[1]: line for line in capsys.readouterr().out.splitlines() if "/" in line}
    assert "4 gpu 16 cpu 64G 06:00:00 gpu a100&ib" in rows["big/train"]
    plan = plan_for(folder=folder)
    big, cpu = plan.job("big/eval").resources.time, plan.job("cpuonly/eval").resources.time
    assert f"1 gpu 16 cpu 64G {big} gpu a100&ib" in rows["big/eval"]
    assert f"0 gpu 4 cpu 8G {cpu}" in rows["cpuonly/eval"]


def test_eval_after_each_stage_adds_intermediate_evals():
    plan = plan_for(["eval.after_each_stage=true"], names=["qwen-curriculum3"])
    ids = [j.id for j in plan.jobs]
    assert ids == [
        "qwen-curriculum3/part1",
        "qwen-curriculum3/eval-part1",
        "qwen-curriculum3/part2",
        "qwen-curriculum3/eval-part2",
        "qwen-curriculum3/part3",
        "qwen-curriculum3/eval",
        plan.base_of["qwen-curriculum3"],  # its base model, scored once (base.yaml: eval.baseline)
    ]


def test_a_base_model_eval_is_planned_once_for_every_experiment_that_shares_it():
    # The five Qwen QLoRA experiments share the base, the eval data, metrics and generation: one job.
    plan = plan_for([], names=None)
    qwen = ["qwen-curriculum2", "qwen-curriculum3", "qwen-random", "qwen-sequential"]
    bases = {plan.base_of[name] for name in qwen}
    assert len(bases) == 1
    (base,) = bases
    job = plan.job(base)
    assert [j.id for j in plan.jobs].count(base) == 1
    assert job.kind == "eval" and job.depends_on == () and job.spec.adapter_dir is None
    assert job.spec.adapter.method == "qlora"  # scored 4-bit, as its adapters are: the delta is theirs alone
    evals = [plan.job(f"{name}/eval").spec for name in qwen]
    assert {e.source for e in evals} == {job.spec.source}
    assert all(e.eval == job.spec.eval for e in evals)
    # Not part of any experiment's identity: turning the base row off reruns nothing.
    off = plan_for(["eval.baseline=false"], names=None)
    assert off.base_of == {} and not any(j.id.startswith("_base-") for j in off.jobs)
    assert {j.id: j.config_hash for j in off.jobs} == {
        j.id: j.config_hash for j in plan.jobs if not j.id.startswith("_base-")
    }


def test_dry_run_imports_no_torch(repo_root):
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "launch.py", "--all", "--dry-run"],
        cwd=repo_root,
        capture_output=True,
        text=True,
        check=True,
    )
    imported = {line.split("|")[-1].strip().split(".")[0] for line in done.stderr.splitlines() if "|" in line}
    assert "slurm" in imported and "pydantic" in imported  # the measurement itself works
    assert not imported & {"torch", "transformers", "peft", "datasets", "bitsandbytes"}
    assert "qwen-sequential/train" in done.stdout


GOLDEN_SBATCH = Path(__file__).parent / "fixtures" / "sbatch"


def sbatch_script(tmp_path: Path, job_id: str, parents: list[tuple[str, str]]) -> str:
    """The job script sbatch would get for `job_id` of eval_resources_folder's plan, as submitit writes it,
    with this test's folders and the intent token made constant."""
    import submitit

    from slurm.queueing.backends import SlurmBackend, job_comment
    from slurm.queueing.snapshot import CodeSnapshot

    folder = eval_resources_folder(tmp_path)
    profile, _ = load_profile(folder)
    job = plan_for(folder=folder).job(job_id)
    backend = SlurmBackend(profile, tmp_path / "work", CodeSnapshot(tmp_path / "code", None, None))
    executor = submitit.SlurmExecutor(folder=backend.log_folder(job), max_num_timeout=3)
    executor.update_parameters(
        **backend.sbatch_parameters(job, parents), **job_comment("TOKEN", f"runs {job.run_dir}")
    )
    text = executor._make_submission_file_text("python -u -m submitit.core._submit FOLDER", "UID")
    return text.replace(str(tmp_path), "TMP")


@pytest.mark.parametrize(
    ("job_id", "parents", "golden"),
    [
        ("big/train", [], "train-4-gpus.sh"),
        ("big/eval", [("123", "afterok")], "eval-after-training.sh"),
        ("wide/train", [], "train-2-nodes-x-2-gpus.sh"),
    ],
)
def test_the_job_script_sbatch_gets_is_the_one_recorded(tmp_path, job_id, parents, golden):
    """A golden script, as submitit keeps `_sbatch_test_record.txt`: any change to what reaches sbatch
    (tasks, GPUs, CPUs per task, memory, signal, requeue, comment, setup lines, dependency) shows here
    as a diff to review. After an intended change: LORA_REGOLDEN=1 pytest tests/test_plan.py -k job_script."""
    text = sbatch_script(tmp_path, job_id, parents)
    path = GOLDEN_SBATCH / golden
    if os.environ.get("LORA_REGOLDEN"):
        path.write_text(text)
    assert text == path.read_text()


def test_the_sft_stages_eval_before_a_dpo_stage_scores_its_pairs_too(repo_root, tmp_path):
    """Base, SFT and DPO rows alike have the preference figure: the SFT stage's own eval (its SQL data)
    also gets the DPO stage's pairs; the DPO and base evals score pairs already, and every other eval job
    keeps its identity (the field is left out of the spec when unset)."""
    from core.config import EvalJob
    from tests.helpers import demo_configs

    configs = demo_configs(repo_root, tmp_path)
    demo = configs / "sql-llama-sft-dpo.yaml"
    text = demo.read_text().replace(
        '      prompt_template: "{schema} | {question} | SQL: "\n',
        '      prompt_template: "{schema} | {question} | SQL: "\n      eval: data/demo/sql/dev.jsonl\n',
    )
    demo.write_text(text + "eval: {after_each_stage: true}\n")
    plan = plan_for(names=["sql-llama-sft-dpo"], folder=configs)
    evals = {j.id: j.spec for j in plan.jobs if j.kind == "eval"}
    sft = evals["sql-llama-sft-dpo/eval-sft"]
    assert sft.data.format == "fields" and sft.preference_pairs.eval.endswith("pairs-dev.jsonl")
    assert evals["sql-llama-sft-dpo/eval"].preference_pairs is None  # its own data are the pairs
    assert "preference_pairs" not in evals[plan.base_of["sql-llama-sft-dpo"]].model_dump()
    read_back = EvalJob.model_validate(sft.model_dump())  # as the job reads its config.yaml
    assert read_back.preference_pairs == sft.preference_pairs
