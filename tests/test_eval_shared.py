"""One eval process for several adapters of one base (eval/shared.py, issue 50): each adapter's eval folder
as its own eval job writes it, the base loaded once; a stopped process starts again at the first adapter not
scored."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.config import EvalJob
from core.rundir import RunDir
from eval.job import run_eval
from eval.shared import SCORED, not_shareable, run_shared_eval
from tests.train_helpers import StopAfter, make_job, model_spec, sql_data
from train.recipe import run_stage

pytestmark = pytest.mark.slow  # trains three tiny adapters and evaluates them twice
RUN_BOUND = ("generation_s", "predictions_kept")  # what differs between any two runs of one eval


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory) -> list[Path]:
    """Three adapters of one base that differ: other seeds and learning rates."""
    found = []
    for seed, rate in ((1, 1e-3), (2, 3e-3), (3, 5e-3)):
        run_dir = tmp_path_factory.mktemp(f"trained{seed}")
        assert run_stage(make_job(tiny, run_dir, max_steps=2, seed=seed, learning_rate=rate)) == "completed"
        found.append(run_dir / "adapter")
    return found


def eval_job(tiny, adapter: Path | None, out_dir: Path, method: str = "lora", **evaluation) -> EvalJob:
    return EvalJob(
        experiment="t",
        stage="s",
        model=model_spec(tiny),
        adapter={"rank": 8, "alpha": 16, "dropout": 0.0, "method": method},
        data=sql_data("easy", eval_split="dev"),
        eval={"metrics": ["exact_match", "rouge"], "limit": 8, "batch_size": 2, "max_new_tokens": 6}
        | evaluation,
        adapter_dir=None if adapter is None else str(adapter),
        out_dir=str(out_dir),
    )


def written(out_dir: Path) -> tuple[list[dict], dict]:
    """(predictions.jsonl rows, results.json without what differs between any two runs)."""
    folder = RunDir.of(out_dir)
    rows = [json.loads(line) for line in folder.predictions.read_text().splitlines() if line.strip()]
    results = json.loads(folder.results.read_text())
    return rows, {k: v for k, v in results.items() if k not in RUN_BOUND}


def test_one_process_scoring_three_adapters_and_the_base_writes_what_four_eval_jobs_write(
    tiny, adapters, tmp_path
):
    """Before, a sweep's points were each scored by a job of its own, each loading the same base; the shared
    process writes the same predictions (token for token, greedy) and scores into each one's folder."""
    names = ["base", "a", "b", "c"]
    alone = [eval_job(tiny, a, tmp_path / "alone" / n) for n, a in zip(names, [None, *adapters], strict=True)]
    shared = [
        eval_job(tiny, a, tmp_path / "shared" / n) for n, a in zip(names, [None, *adapters], strict=True)
    ]
    for job in alone:
        run_eval(job)
    results = run_shared_eval(shared, tmp_path / "shared-job")
    assert all(r is not None for r in results)
    for one, many in zip(alone, shared, strict=True):
        assert written(Path(many.out_dir)) == written(Path(one.out_dir)), many.out_dir
    predictions = [[r["prediction"] for r in written(Path(j.out_dir))[0]] for j in shared]
    assert len({tuple(p) for p in predictions}) > 1  # the adapters were really switched
    assert all(results[k]["adapter_changes_output"] is not None for k in (1, 2, 3))


def test_a_qlora_adapter_scored_on_the_shared_4bit_base_writes_what_its_own_job_writes(tiny, tmp_path):
    """QLoRA: the base held in 4 bits once, the adapter put on it and taken off again (peft's unload leaves
    the 4-bit layers as they were): the same predictions as its own job, and the base row's too."""
    run_dir = tmp_path / "trained"
    job = make_job(tiny, run_dir, max_steps=2, adapter={"method": "qlora"})
    assert run_stage(job) == "completed"
    adapter = run_dir / "adapter"
    jobs = (("base", None), ("q", adapter))
    alone = [eval_job(tiny, a, tmp_path / "alone" / n, "qlora", limit=4) for n, a in jobs]
    shared = [eval_job(tiny, a, tmp_path / "shared" / n, "qlora", limit=4) for n, a in jobs]
    for one in alone:
        run_eval(one)
    run_shared_eval(shared, tmp_path / "shared-job")
    for one, many in zip(alone, shared, strict=True):
        assert written(Path(many.out_dir)) == written(Path(one.out_dir)), many.out_dir


def test_a_stopped_shared_eval_starts_again_at_the_first_adapter_not_scored(tiny, adapters, tmp_path):
    jobs = [eval_job(tiny, a, tmp_path / f"e{k}") for k, a in enumerate(adapters)]
    # asked at each adapter's start, before its first batch and after each batch but its last (4 batches):
    # 5 asks for the first adapter, then the second's start, its first batch, its second: stopped there
    first = run_shared_eval(jobs, tmp_path / "shared", StopAfter(8))
    assert first[0] is not None and first[1] is None and first[2] is None
    assert json.loads((tmp_path / "shared" / SCORED).read_text()) == [jobs[0].out_dir]
    scored_at = RunDir.of(jobs[0].out_dir).results.stat().st_mtime_ns
    again = run_shared_eval(jobs, tmp_path / "shared")
    assert RunDir.of(jobs[0].out_dir).results.stat().st_mtime_ns == scored_at  # not scored again
    assert again[1]["predictions_kept"] > 0 and again[2]["predictions_kept"] == 0
    for job in jobs:
        reference = tmp_path / "alone" / Path(job.out_dir).name
        run_eval(job.model_copy(update={"out_dir": str(reference)}))
        assert written(Path(job.out_dir)) == written(reference)


def test_each_adapter_finds_the_models_own_generation_config_as_its_own_job_does(tiny, adapters, tmp_path):
    """A hub model's generation_config (here a repetition_penalty and sampling) is replaced by the eval's
    decoding, and each results.json says what was overridden. Before, the second adapter of a shared process
    found the first one's decoding in its place and recorded nothing overridden."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny["tiny-llama"], model)
    config = json.loads((model / "generation_config.json").read_text())
    config |= {"repetition_penalty": 1.3, "do_sample": True}
    (model / "generation_config.json").write_text(json.dumps(config))
    spec = {"model": {"name_or_path": str(model), "kind": "causal"}}
    jobs = [eval_job(tiny, a, tmp_path / f"s{k}").model_copy(update=spec) for k, a in enumerate(adapters[:2])]
    jobs = [EvalJob.model_validate(job.model_dump()) for job in jobs]
    results = run_shared_eval(jobs, tmp_path / "shared")
    assert [r["generation_overridden"] for r in results] == [
        {"repetition_penalty": 1.3, "do_sample": True}
    ] * 2


def test_a_point_whose_training_left_no_adapter_is_reported_not_scored_and_the_others_are(
    tiny, adapters, tmp_path
):
    failed = tmp_path / "failed-run" / "adapter"  # a training that failed before its first save
    failed.parent.mkdir()
    jobs = [eval_job(tiny, adapters[0], tmp_path / "a"), eval_job(tiny, failed, tmp_path / "failed")]
    results = run_shared_eval(jobs, tmp_path / "shared")
    assert "holds no adapter" in results[1]["not_scored"]
    assert results[0]["exact_match"] is not None and not RunDir.of(tmp_path / "failed").results.exists()


def test_eval_jobs_of_other_generation_settings_do_not_share_a_process(tiny, adapters, tmp_path):
    jobs = [
        eval_job(tiny, adapters[0], tmp_path / "a"),
        eval_job(tiny, adapters[1], tmp_path / "b", num_beams=2),
    ]
    assert "eval settings differ" in not_shareable(jobs)
    with pytest.raises(ValueError, match="cannot share a process"):
        run_shared_eval(jobs, tmp_path / "shared")
