"""Preflight (train/preflight.py, launch.py --preflight): what a job will find, known before it is queued.

Real tiny models and demo data; the real experiments' hub models from their config.json fixtures in a
Hugging Face cache of the test's own, offline."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import launch
from slurm.cluster.profile import load_profile
from slurm.planning.experiments import load_experiments
from slurm.planning.plan import build_plan
from tests.conftest import write_cluster_yaml
from tests.helpers import demo_configs, hub_cache, tiny_sql_base

EXPERIMENT = """\
name: {name}
inherits: _tiny-sql.yaml
adapter: {{rank: {rank}, alpha: 16, max_trainable_percent: 25}}
train: {{epochs: 1, batch_size: 8, learning_rate: {lr}}}
"""


def configs(tmp: Path, experiments: dict[str, dict], **cluster) -> Path:
    folder = tmp / "configs"
    folder.mkdir(exist_ok=True)
    write_cluster_yaml(folder, tmp, **cluster)
    tiny_sql_base(folder)
    for name, fields in experiments.items():
        values = {"rank": 8, "lr": "1.0e-3"} | fields
        (folder / f"{name}.yaml").write_text(EXPERIMENT.format(name=name, **values))
    return folder


def preflight_json(argv: list[str], capsys) -> list[dict]:
    assert launch.main([*argv, "--preflight", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_demo_preflight_equals_what_the_finished_jobs_write(repo_root, tiny, tmp_path, monkeypatch, capsys):
    """Trainable % and max_length of every demo training job, from configs only, are what the real job
    (run_stage, one step) writes to summary.json: one counting function, one tokenization path."""
    from train.stage import run_stage

    monkeypatch.chdir(repo_root)
    shutil.copytree(repo_root / "configs", tmp_path / "configs")  # the demo and the base it inherits
    demo = tmp_path / "configs" / "demo"
    write_cluster_yaml(demo, tmp_path)
    profile, _ = load_profile(demo)
    plan = build_plan(load_experiments(demo, profile, {}, None), profile)
    predicted = {r["job"]: r for r in preflight_json(["--all", "--config-dir", str(demo)], capsys)}
    jobs = [j for j in plan.jobs if j.kind == "train"]
    assert sorted(predicted) == sorted(
        j.id for j in jobs
    )  # 6 training jobs: three one-stage (one of them chat), a chain, 2 stages
    assert all(r["fetch"] == [] for r in predicted.values())  # local models and files: nothing to fetch
    for planned in jobs:
        fast = planned.spec.train.model_copy(update={"max_steps": 1, "eval_every_epochs": None})
        assert run_stage(planned.spec.model_copy(update={"train": fast})) == "completed"
        summary = json.loads((Path(planned.spec.run_dir) / "summary.json").read_text())
        assert predicted[planned.id]["trainable_percent"] == summary["trainable_percent"], planned.id
        assert predicted[planned.id]["max_length"] == summary["max_length"], planned.id
        assert predicted[planned.id]["max_target_length"] == summary["max_target_length"], planned.id
        assert predicted[planned.id]["tokens_skipped"] is None
        assert predicted[planned.id]["examples"] == summary["train_examples"], planned.id
        assert predicted[planned.id]["tokens_per_epoch"] == summary["train_tokens"], planned.id
        spread = predicted[planned.id]["length_percentiles"]
        assert spread["inputs"][-1] == summary["longest_example"] and spread["inputs"] == sorted(
            spread["inputs"]
        )
        if planned.spec.model.kind == "seq2seq":  # encoder inputs plus labels, as the speed book counts
            assert spread["targets"][-1] == summary["longest_target"]
            assert summary["train_tokens"] > sum(planned_inputs(planned.spec))
    # The dry run now estimates the training jobs from these exact counts, torch-free.
    capsys.readouterr()
    assert launch.main(["--all", "--config-dir", str(demo), "--dry-run", "--json"]) == 0
    estimates = {j["id"]: j["estimate"] for j in json.loads(capsys.readouterr().out)["jobs"]}
    for planned in jobs:
        assert estimates[planned.id]["tokens"] == "preflight", planned.id
        if planned.spec.train.max_steps:  # the GRPO demo stage: its steps, not epochs, set the tokens
            continue
        tokens = predicted[planned.id]["tokens_per_epoch"] * planned.spec.train.epochs
        assert estimates[planned.id]["basis"].startswith(f"{tokens:,.0f} tokens (counted by preflight)")


def planned_inputs(spec) -> list[int]:
    """Encoder input lengths only, from the job's own tokenization cache (what tokens per epoch once was)."""
    from train import data as data_lib
    from train.preflight import cached_tokenizer

    tokenizer = cached_tokenizer(spec.model.name_or_path, spec.model.revision, spec.model.kind)
    return data_lib.tokenized(spec.data.train, spec.data, tokenizer, spec.model.kind)["length"]


def test_a_rank_too_large_for_the_model_is_refused_before_anything_is_queued(
    repo_root, tiny, tmp_path, monkeypatch, capsys
):
    """No module name gives it away: rank 64 on every projection of a 156k-parameter model is ~46% LoRA."""
    monkeypatch.chdir(repo_root)
    folder = configs(tmp_path, {"huge-rank": {"rank": 64}})
    assert launch.main(["--all", "--config-dir", str(folder), "--backend", "local"]) == 2
    err = capsys.readouterr().err
    assert "huge-rank/train:" in err and "over the limit 25%" in err and "lower adapter.rank" in err
    assert "huge-rank.yaml: adapter.max_trainable_percent:" in err and "Traceback" not in err
    assert not (tmp_path / "runs" / "huge-rank").exists()  # nothing was submitted, not even a record


@pytest.mark.slow
def test_a_batch_that_does_not_fit_is_refused_with_the_batch_that_does(
    repo_root, tiny, tmp_path, monkeypatch, capsys
):
    from train.preflight import preflight_job

    monkeypatch.chdir(repo_root)
    folder = configs(tmp_path, {"big-batch": {}})
    profile, _ = load_profile(folder)
    job = build_plan(load_experiments(folder, profile, {}, None), profile).jobs[0].spec
    memory = preflight_job(job, None).memory
    # Room for 4.5 examples' activations on top of what any batch needs: batch 8 does not fit, 4 does.
    fixed = memory["total_gb"] - 8 * memory["activations_per_example_gb"]
    gpu = round(fixed + 4.5 * memory["activations_per_example_gb"], 6)
    folder = configs(tmp_path, {"big-batch": {}}, gpu_mem_gb=json.dumps({"default": gpu}))

    # The batch as written (micro_batch: N): auto would split it to fit (the test after this one).
    assert launch.main(["--all", "--config-dir", str(folder), *written(8), "--preflight"]) == 2
    err = capsys.readouterr().err
    assert f"over the {gpu:g} GB" in err and "largest batch that fits is train.batch_size: 4" in err
    assert "train.grad_accum: 2 keeps the effective batch 8" in err
    assert "train.micro_batch: auto" in err
    [result] = preflight_json(["--all", "--config-dir", str(folder), *written(4)], capsys)
    assert result["fits"] is True and result["gpu_mem_gb"] == gpu and result["largest_batch"] == 4
    # The other ways out it names hold too: each, applied with the batch it names, fits.
    suggested = {
        "train.gradient_checkpointing=true": re.search(
            r"gradient_checkpointing: true fits batch_size (\d+)", err
        ),
        "adapter.method=qlora": re.search(r"adapter.method: qlora fits batch_size (\d+)", err),
    }
    for change, found in suggested.items():
        assert found and int(found[1]) >= 1, change
        argv = ["--all", "--config-dir", str(folder), change, *written(int(found[1]))]
        [result] = preflight_json(argv, capsys)
        assert result["fits"] is True, change
        argv[-2:] = written(int(found[1]) + 1)  # the largest: one more does not fit
        assert launch.main([*argv, "--preflight"]) == 2, change
        capsys.readouterr()
    # micro_batch: auto admits the batch of 8 as micro-batches that fit, the effective batch kept
    [result] = preflight_json(["--all", "--config-dir", str(folder)], capsys)
    split = result["split"]
    assert result["fits"] is True and split["how"] == "auto" and split["micro_batch"] < 8
    assert split["micro_batch"] * split["grad_accum"] == 8


def written(batch: int) -> list[str]:
    """Overrides for a batch as written: micro_batch equal to batch_size, no accumulation."""
    return [f"train.batch_size={batch}", f"train.micro_batch={batch}"]


def test_experiments_sharing_model_and_data_cost_one_preflight(
    repo_root, tiny, tmp_path, monkeypatch, capsys
):
    """20 experiments that differ only in learning rate: one cache entry; a relaunch computes nothing."""
    monkeypatch.chdir(repo_root)
    monkeypatch.setenv("LORA_CACHE_DIR", str(tmp_path / "cache"))
    folder = configs(tmp_path, {f"lr-{i}": {"lr": f"{i + 1}.0e-4"} for i in range(20)})
    results = preflight_json(["--all", "--config-dir", str(folder)], capsys)
    assert len(results) == 20 and len({r["trainable_percent"] for r in results}) == 1
    assert {r["job"] for r in results} == {f"lr-{i}/train" for i in range(20)}
    entries = list((tmp_path / "cache" / "preflight").glob("*.json"))
    assert len(entries) == 1
    stamp = entries[0].stat().st_mtime_ns
    assert preflight_json(["--all", "--config-dir", str(folder)], capsys) == results
    assert entries[0].stat().st_mtime_ns == stamp  # read, not rewritten
    # A relaunch in a fresh process: every result from the cache, and torch is never imported.
    code = (
        f"import json, sys, launch; rc = launch.main(['--all', '--config-dir', {str(folder)!r}, '--preflight', "
        "'--json']); sys.exit(10 + rc if 'torch' in sys.modules else rc)"
    )
    env = os.environ | {"LORA_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=repo_root, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == results


def test_a_job_that_gains_an_in_training_eval_is_estimated_again_not_read_from_the_cache(
    repo_root, tiny, tmp_path, monkeypatch, capsys
):
    """The eval step (twice the batch, no gradients) has its own peak: an eval set or eval_every_epochs
    added to a cached job changes what must fit."""
    monkeypatch.chdir(repo_root)
    monkeypatch.setenv("LORA_CACHE_DIR", str(tmp_path / "cache"))
    folder = configs(tmp_path, {"one": {}})
    [without] = preflight_json(["--all", "--config-dir", str(folder)], capsys)
    assert without["memory"]["eval_gb"] is None
    evaluating = [f"data.eval={repo_root}/data/demo/sql/dev.jsonl", "train.eval_every_epochs=1"]
    [with_eval] = preflight_json(["--all", "--config-dir", str(folder), *evaluating], capsys)
    assert with_eval["memory"]["eval_batch_size"] == 16  # batch_size 8, evaluated at twice that
    assert with_eval["memory_gb"] == round(
        max(with_eval["memory"]["train_gb"], with_eval["memory"]["eval_gb"]), 3
    )
    assert len(list((tmp_path / "cache" / "preflight").glob("*.json"))) == 2


def test_a_broken_cache_entry_is_recomputed_not_reported(repo_root, tiny, tmp_path, monkeypatch, capsys):
    """A half-written or stale entry (a crash, an older version's fields) is a miss, not a config error."""
    monkeypatch.chdir(repo_root)
    monkeypatch.setenv("LORA_CACHE_DIR", str(tmp_path / "cache"))
    folder = configs(tmp_path, {"one": {}})
    [first] = preflight_json(["--all", "--config-dir", str(folder)], capsys)
    [entry] = (tmp_path / "cache" / "preflight").glob("*.json")
    for broken in ('{"job": "one/tr', json.dumps({"job": "one/train", "renamed_field": 1})):
        entry.write_text(broken)
        assert preflight_json(["--all", "--config-dir", str(folder)], capsys) == [first]
        assert json.loads(entry.read_text())["trainable_percent"] == first["trainable_percent"]


def test_a_link_in_the_preflight_cache_is_named_as_a_link_not_as_a_missing_model(
    repo_root, tiny, tmp_path, monkeypatch, capsys
):
    """Before: a link at LORA_CACHE_DIR/preflight/preflight.log read "the config of MODEL is neither a local
    folder nor in the Hugging Face cache ... hf download MODEL"."""
    monkeypatch.chdir(repo_root)
    monkeypatch.setenv("LORA_CACHE_DIR", str(tmp_path / "cache"))
    folder = configs(tmp_path, {"one": {}})
    log = tmp_path / "cache" / "preflight" / "preflight.log"
    log.parent.mkdir(parents=True)
    (tmp_path / "elsewhere.log").write_text("someone's file\n")
    log.symlink_to(tmp_path / "elsewhere.log")
    assert launch.main(["--all", "--config-dir", str(folder), "--preflight"]) == 2
    err = capsys.readouterr().err
    assert f"{log}: is a symbolic link" in err and "LORA_CACHE_DIR" in err
    assert "model.name_or_path" not in err and "hf download" not in err
    assert (tmp_path / "elsewhere.log").read_text() == "someone's file\n"


def shipped_with_cluster_yaml(repo_root: Path, tmp: Path, text: str) -> Path:
    """configs/experiments (and the base it inherits) with a cluster.yaml of the test's own."""
    shutil.copytree(repo_root / "configs", tmp / "configs")
    (tmp / "configs" / "experiments" / "cluster.yaml").write_text(text)
    return tmp / "configs" / "experiments"


@pytest.mark.slow
def test_the_shipped_experiments_preflight_offline_from_fixture_configs(repo_root, tmp_path):
    """With hub_downloads: nodes, what this machine lacks is a warning: the nodes will download it."""
    env = os.environ | {
        "HF_HUB_CACHE": str(hub_cache(tmp_path / "hub")),
        "LORA_CACHE_DIR": str(tmp_path / "c"),
    }
    folder = shipped_with_cluster_yaml(repo_root, tmp_path, "hub_downloads: nodes\n")
    argv = ["--all", "--config-dir", str(folder), "--preflight", "--json", "data.max_length=512"]
    command = [sys.executable, "launch.py", *argv]
    started = time.monotonic()
    done = subprocess.run(command, cwd=repo_root, env=env, capture_output=True, text=True, check=False)
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    results = {r["job"]: r for r in json.loads(done.stdout)}
    # Qwen2.5-0.5B, r16 on all 7 projections of 24 layers: (2·16·(896+896) + 16·(896+128)·2
    # + 3·16·(896+4864)) · 24 = 8,798,208 of 494,032,768 + 8,798,208 parameters.
    assert results["qwen-random/train"]["trainable_params"] == 8_798_208
    assert results["qwen-random/train"]["trainable_percent"] == round(100 * 8_798_208 / 502_830_976, 4)
    # flan-t5-small, r16 on q,k,v,o (384 wide inside, 512 outside) and wi_0, wi_1, wo (1024 wide).
    per_attention = 4 * 16 * (512 + 384)
    per_ffn = 3 * 16 * (512 + 1024)
    flan = 8 * (per_attention + per_ffn) + 8 * (2 * per_attention + per_ffn)
    assert results["flan-t5-small-qg/train"]["trainable_params"] == flan
    # Its public size is 76,961,152; transformers 5 ties T5's lm_head to the shared embedding whatever the
    # config says (configuration_t5.py), so the job, and preflight with it, count one 32128×512 less.
    assert results["flan-t5-small-qg/train"]["total_params"] == 76_961_152 - 32128 * 512 + flan
    # Qwen3-VL-4B, r16 on every Linear of the language model's 36 layers and none of its vision tower:
    # q (2560→4096), k and v (2560→1024), o (4096→2560), gate and up (2560→9728), down (9728→2560).
    per_layer = 16 * ((2560 + 4096) + 2 * (2560 + 1024) + (4096 + 2560) + 3 * (2560 + 9728))
    assert results["qwen3-vl-random/train"]["trainable_params"] == 36 * per_layer == 33_030_144
    assert results["qwen3-vl-curriculum/hard"]["trainable_by_module"] == {"lora": 33_030_144}
    for result in results.values():  # no tokenizer in the cache: lengths are skipped, saying why
        assert result["max_length"] is None and "not available here" in result["tokens_skipped"]
        assert result["memory_gb"] > 0
    # Neither weights, tokenizer nor data are here: each job names the commands that fetch them, once.
    assert results["qwen-random/train"]["fetch"] == [
        "hf download Qwen/Qwen2.5-0.5B",
        "hf download b-mc2/sql-create-context --repo-type dataset",
    ]
    assert done.stderr.count("  hf download rajpurkar/squad --repo-type dataset\n") == 1
    print(f"preflight of {len(results)} jobs took {took:.0f}s")  # a figure, not a bound: bench/ holds speed
    # Skipped for want of tokenizer files, which would change the key: kept, so a relaunch is torch-free.
    code = (
        f"import sys, launch; rc = launch.main({argv!r}); sys.exit(10 + rc if 'torch' in sys.modules else rc)"
    )
    again = subprocess.run(
        [sys.executable, "-c", code], cwd=repo_root, env=env, capture_output=True, text=True
    )
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout) == list(results.values())


@pytest.mark.slow
def test_jobs_that_run_offline_refuse_what_this_machine_could_not_fetch(repo_root, tmp_path):
    """hub_downloads: login (the default): preflight fetches what the jobs need, and SLURM jobs run offline,
    so what it could not fetch (this machine is offline too: HF_HUB_OFFLINE, conftest) refuses the launch,
    each job naming the commands, before anything is queued."""
    env = os.environ | {"HF_HUB_CACHE": str(hub_cache(tmp_path / "hub")), "LORA_CACHE_DIR": str(tmp_path)}
    command = [sys.executable, "launch.py", "data.max_length=512", "--backend", "local"]
    command += ["--exp", "qwen-random", "flan-t5-small-qg"]
    done = subprocess.run(command, cwd=repo_root, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "3 problem(s); nothing was submitted." in done.stderr
    offline = "(this machine is offline: HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set)"
    assert (
        "qwen-random.yaml: model.name_or_path: qwen-random/train runs offline (cluster.yaml hub_downloads: "
        f"login) and this machine could not fetch what it needs: hf download Qwen/Qwen2.5-0.5B {offline}; "
        f"hf download b-mc2/sql-create-context --repo-type dataset {offline}; run that where there is network"
    ) in " ".join(done.stderr.split())
    assert f"hf download google/flan-t5-small {offline}" in done.stderr
    # Its eval job scores BERTScore with a hub model, which the offline eval job must find here too.
    assert (
        "flan-t5-small-qg.yaml: eval.bertscore_model: flan-t5-small-qg/eval runs offline (cluster.yaml "
        f"hub_downloads: login) and this machine could not fetch what it needs: hf download roberta-large {offline}"
    ) in " ".join(done.stderr.split())


@pytest.mark.slow
def test_a_hub_that_does_not_answer_is_tried_once_not_retried_for_minutes(repo_root, tmp_path):
    """Network allowed (no HF_HUB_OFFLINE) but the hub refuses connections (a closed local port): before,
    huggingface_hub retried every request five times with backoff, ~40 s per repo (142 s of `Retrying in
    8s` lines for the shipped configs); now one request for the whole launch, then each repo's error."""
    env = {k: v for k, v in os.environ.items() if not k.endswith("_OFFLINE")}
    env |= {
        "HF_HUB_CACHE": str(hub_cache(tmp_path / "hub")),
        "LORA_CACHE_DIR": str(tmp_path),
        "HF_ENDPOINT": "http://127.0.0.1:9",  # the discard port: nothing listens there
    }
    command = [sys.executable, "launch.py", "data.max_length=512", "--exp", "qwen-random", "--preflight"]
    done = subprocess.run(command, cwd=repo_root, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 2, done.stderr
    said = " ".join(done.stderr.split())
    assert "hf download Qwen/Qwen2.5-0.5B (cannot reach http://127.0.0.1:9:" in said
    assert (
        "hf download b-mc2/sql-create-context --repo-type dataset (cannot reach http://127.0.0.1:9:" in said
    )
    library_log = tmp_path / "preflight" / "preflight.log"
    assert "Retrying" not in done.stderr + (library_log.read_text() if library_log.exists() else "")


def test_an_eval_scoring_model_that_could_not_be_fetched_refuses_the_launch(
    repo_root, tiny, tmp_path, monkeypatch, capsys
):
    """Eval jobs run offline too: a hub bertscore_model this machine cannot fetch is named before queueing."""
    monkeypatch.chdir(repo_root)
    folder = configs(tmp_path, {"scored": {}})
    scored = ["eval.metrics=[bertscore]", "eval.bertscore_model=org/tiny-bert", "eval.split=train"]
    assert launch.main(["--all", "--config-dir", str(folder), "--backend", "local", *scored]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "scored.yaml: eval.bertscore_model: scored/eval runs offline" in err
    assert "hf download org/tiny-bert (this machine is offline" in err
    assert not (tmp_path / "runs" / "scored").exists()


@pytest.mark.slow
def test_a_model_config_missing_here_is_refused_with_the_command_that_fetches_it(repo_root, tmp_path):
    env = os.environ | {"HF_HUB_CACHE": str(hub_cache(tmp_path / "hub")), "LORA_CACHE_DIR": str(tmp_path)}
    command = [sys.executable, "launch.py", "--exp", "qwen-random", "--preflight", "model.revision=v2.0"]
    done = subprocess.run(command, cwd=repo_root, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "qwen-random.yaml: model.name_or_path:" in done.stderr
    assert "hf download Qwen/Qwen2.5-0.5B --revision v2.0" in done.stderr


@pytest.mark.parametrize(
    "action, expected_rc",
    [(["--all", "--dry-run"], 0), (["--status"], 0), (["--tail", "sql-t5-lora"], 1)],  # 1: not submitted
)
def test_the_dry_run_and_the_watching_commands_import_no_torch(
    repo_root, tiny, action, expected_rc, tmp_path
):
    # The demo's configs with runs and logs under tmp: after `make demo` the repository's own runs/ holds
    # a submitted sql-t5-lora, and the suite must not read it (before: --tail found it, rc 0, not 1).
    folder = demo_configs(repo_root, tmp_path)
    code = (
        f"import sys, launch; rc = launch.main(['--config-dir', {str(folder)!r}, *{action!r}]); "
        "print('torch imported' if 'torch' in sys.modules else 'torch-free', rc)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True)
    assert done.stdout.splitlines()[-1] == f"torch-free {expected_rc}", done.stdout + done.stderr


def test_gpu_memory_is_looked_up_by_constraint_then_partition_then_default():
    from core.config import Resources
    from slurm.cluster.profile import ClusterProfile

    profile = ClusterProfile(partition="gpu", gpu_mem_gb={"a100_80": 80, "gpu": 40, "default": 24})
    assert profile.gpu_mem_for(Resources(constraint="a100_80")) == 80
    assert profile.gpu_mem_for(Resources()) == 40  # the profile's partition
    assert profile.gpu_mem_for(Resources(partition="small")) == 24
    assert ClusterProfile(gpu_mem_gb={"gpu": 40}).gpu_mem_for(Resources()) is None  # unknown: not judged
    assert ClusterProfile(gpu_mem_gb=40).gpu_mem_for(Resources(partition="any")) == 40


CASES = {
    "added tokens": ("causal", {"model": {"added_tokens": ["<sql>", "</sql>"]}}),
    "full lm_head": ("causal", {"adapter": {"modules_to_save": ["lm_head"], "allow_full_modules": True}}),
    "qlora t5": ("seq2seq", {"adapter": {"method": "qlora"}}),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.slow
def test_preflight_counts_what_the_trainer_counts(case, tiny, tmp_path):
    """Added-token rows, a full modules_to_save layer, a 4-bit base: the trainer's setup counts the same."""
    from tests.train_helpers import make_job, model_spec
    from train.preflight import preflight_job
    from train.recipe import StageRecipe

    kind, extra = CASES[case]
    if "model" in extra:
        extra = extra | {"model": model_spec(tiny, kind, **extra["model"])}
    job = make_job(tiny, tmp_path / "run", kind, **extra)
    job = job.model_copy(update={"adapter": job.adapter.model_copy(update={"max_trainable_percent": 90})})
    predicted = preflight_job(job, None)
    recipe = StageRecipe(job, threading.Event())
    recipe.setup()
    assert (predicted.trainable_params, predicted.total_params) == (
        recipe.params.trainable,
        recipe.params.total,
    )
    assert predicted.trainable_by_module == recipe.params.by_module
    assert predicted.max_length == recipe.lengths.max_length


@pytest.mark.slow
def test_what_the_libraries_print_while_preflight_computes_goes_to_its_log_not_the_screen(
    repo_root, tmp_path
):
    # Before: bitsandbytes' import notice, transformers' FutureWarnings and datasets' progress bars were
    # mixed into the launcher's own lines on every preflight that computed (a fresh process: imports happen).
    folder = demo_configs(repo_root, tmp_path)
    env = os.environ | {"LORA_CACHE_DIR": str(tmp_path / "cache")}
    command = [
        sys.executable,
        "launch.py",
        "--exp",
        "sql-t5-lora",
        "--preflight",
        "--config-dir",
        str(folder),
    ]
    done = subprocess.run(command, cwd=repo_root, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "examples/s" not in done.stderr and "Warning" not in done.stderr, done.stderr
    assert "sql-t5-lora/train" in done.stdout  # preflight's own table is still shown
    assert "examples/s" in (tmp_path / "cache" / "preflight" / "preflight.log").read_text()


def test_an_offline_refusal_of_a_hub_id_names_the_local_folder_it_was_converted_into(tmp_path, monkeypatch):
    """Before: offline, `HuggingFaceTB/SmolLM2-135M-Instruct` was refused naming only its download, while
    the folder the real-model page had just made sat in models/."""
    from slurm.planning import preflight
    from slurm.planning.preflight import local_copy, unfetched

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(preflight, "MODEL_FOLDERS", (Path("models"),))  # not this checkout's own models/
    (tmp_path / "models" / "smollm2-135m-instruct").mkdir(parents=True)
    (tmp_path / "models" / "half-made").mkdir()  # no config.json: not a model folder
    assert local_copy("HuggingFaceTB/SmolLM2-135M-Instruct") is None
    (tmp_path / "models" / "smollm2-135m-instruct" / "config.json").write_text("{}")
    assert local_copy("HuggingFaceTB/SmolLM2-135M-Instruct") == "./models/smollm2-135m-instruct"
    assert local_copy("org/half-made") is None and local_copy("org/not-here") is None
    missing = {"hf download HuggingFaceTB/SmolLM2-135M-Instruct": "offline"}
    [problem] = unfetched(
        "a/train", "a.yaml", "model.name_or_path", missing, "HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    assert problem.message.endswith(
        "a local copy is here: write model.name_or_path: ./models/smollm2-135m-instruct"
    )
    # Only a dataset missing: the model is had, and no folder is suggested for it.
    dataset = {"hf download org/ds --repo-type dataset": "offline"}
    [problem] = unfetched(
        "a/train", "a.yaml", "model.name_or_path", dataset, "HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    assert "local copy" not in problem.message
