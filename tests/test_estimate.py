"""Estimates (slurm/planning/estimate.py), the speed book (core/speeds.py) and `resources.time: auto`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.config import DataSpec, EvalJob, ModelSpec, TrainJob
from core.problems import ConfigError
from core.speeds import EvalSpeedRecord, SpeedRecord, book_of, read_book
from slurm.cluster.profile import load_profile
from slurm.planning import guesses
from slurm.planning.estimate import Estimator, auto_time_limit_s
from slurm.planning.experiments import load_experiments
from slurm.planning.plan import estimated_again
from slurm.planning.preflight_books import DataTokens, read_exact_tokens, record_exact_tokens
from tests.helpers import plan_for, sized, write_experiments

MODEL = {"name_or_path": "org/some-model-0.5B", "kind": "causal"}


def train_job(**train) -> TrainJob:
    return TrainJob(
        experiment="e",
        stage="s",
        model=MODEL,
        adapter={},
        data={"train": "train.jsonl", "eval": "eval.jsonl"},
        train=train,
        run_dir="runs/e/s",
    )


def record(**changes) -> SpeedRecord:
    values = dict(
        model=MODEL["name_or_path"],
        method="lora",
        precision="bf16",
        device_name="NVIDIA A100",
        world_size=1,
        batch_size=10,
        grad_accum=1,
        max_length=256,
        tokens_per_s=1000.0,
        startup_s=20.0,
        eval_s=4.0,
        eval_examples=50,
        save_s=2.0,
        data="train.jsonl",
        examples=100,
        tokens_per_example=100.0,
        time=1.0,
    )
    return SpeedRecord(**(values | changes))


def hundred_examples(source, spec) -> DataTokens:
    """The pluggable token count: 100 examples of 100 tokens, whatever the file."""
    return DataTokens(examples=100, tokens=10_000)


def test_preflights_exact_count_beats_the_characters_until_the_data_file_changes(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "how many rows", "sql": "SELECT count(*) FROM t"}\n' * 100)
    spec = DataSpec(train=str(data), input_field="question", target_field="sql")
    job = train_job(epochs=2, batch_size=10, eval_every_epochs=None).model_copy(update={"data": spec})
    record_exact_tokens(tmp_path, [(job, 100, 3_000)])  # as a launch's preflight leaves it
    exact = Estimator([record()], exact=read_exact_tokens(tmp_path))(job, gpus=1)
    assert exact.tokens == "preflight" and exact.seconds == pytest.approx(
        20 + 6_000 / 1000
    )  # start-up + 6,000 tokens at 1,000/s
    assert exact.basis.startswith("6,000 tokens (counted by preflight) in 20 steps")
    characters = Estimator([record()])(job, gpus=1)
    assert characters.tokens == "characters" and characters.to_json()["tokens"] == "characters"
    assert characters.seconds != exact.seconds
    data.write_text(data.read_text() + data.read_text())  # 200 examples now: the count is stale
    assert Estimator([record()], exact=read_exact_tokens(tmp_path))(job, gpus=1).tokens == "characters"


def test_a_training_estimate_worked_out_by_hand():
    job = train_job(epochs=2, batch_size=10, eval_every_epochs=1, save_every_steps=5)
    estimate = Estimator([record()], hundred_examples)(job, gpus=1)
    # 10 steps an epoch, 20 in all: 20,000 tokens at 1,000/s = 20 s; start-up 20 s; an eval after each
    # epoch, 100 examples at 4 s / 50 = 8 s each = 16 s; saves at steps 5, 10, 15, 20 and at the 2 evals,
    # 6 x 2 s = 12 s.
    assert estimate.source == "measured"
    assert estimate.seconds == pytest.approx(20 + 20 + 16 + 12)


def test_max_steps_count_the_examples_they_take_on_every_gpu():
    job = train_job(max_steps=7, batch_size=10, grad_accum=2, eval_every_epochs=None, save_every_steps=100)
    estimate = Estimator([record(world_size=2, tokens_per_s=2000.0)], hundred_examples)(job, gpus=2)
    # 7 steps x 10 x 2 accumulated x 2 GPUs = 280 examples x 100 tokens = 28,000 tokens; the book's
    # 2,000 tokens/s on 2 GPUs is 1,000 per GPU, 2,000 for this 2-GPU job: 14 s + 20 s start-up.
    assert estimate.seconds == pytest.approx(14 + 20)


def test_the_speed_book_beats_the_guess_only_for_the_same_model_method_and_precision():
    job = train_job(precision="bf16")
    guessed = Estimator([], hundred_examples)(job, gpus=1)
    assert guessed.source == "guess" and "0.5B" not in guessed.basis and "5e+08 parameters" in guessed.basis
    for other in (record(model="org/other"), record(method="qlora"), record(precision="fp32")):
        assert Estimator([other], hundred_examples)(job, gpus=1).source == "guess"
    measured = Estimator([record()], hundred_examples)(job, gpus=1)
    assert measured.source == "measured" and measured.seconds != guessed.seconds


def test_the_nearest_batch_wins_then_the_median_speed_of_the_rows_as_near():
    job = train_job(batch_size=16, eval_every_epochs=None, save_every_steps=10_000)
    near, far = (
        record(batch_size=16, tokens_per_s=500.0),
        record(batch_size=64, tokens_per_s=4000.0, time=9.0),
    )
    newer = record(batch_size=16, tokens_per_s=250.0, time=5.0)
    assert Estimator([far, near], hundred_examples)(job, 1).seconds == pytest.approx(20 + 30_000 / 500)
    # Two as near: the slower (a time limit errs long); a third, newest and fast (noisy, or another
    # machine's day), does not swing it: before, the newest row alone decided.
    assert Estimator([far, near, newer], hundred_examples)(job, 1).seconds == pytest.approx(20 + 30_000 / 250)
    noisy = record(batch_size=16, tokens_per_s=2000.0, time=7.0)
    assert Estimator([far, near, newer, noisy], hundred_examples)(job, 1).seconds == pytest.approx(
        20 + 30_000 / 500
    )


def test_an_eval_job_scores_only_eval_limit_examples():
    def spec(limit):
        return EvalJob(
            experiment="e",
            stage="s",
            model=MODEL,
            adapter={},
            data={"train": "t.jsonl", "eval": "e.jsonl"},
            eval={"limit": limit, "batch_size": 16, "max_new_tokens": 50},
            adapter_dir="a",
            out_dir="o",
        )

    estimate = Estimator([], lambda source, data_spec: DataTokens(1000, 1e5))
    limited, whole = estimate(spec(32), 1), estimate(spec(None), 1)
    assert limited.source == whole.source == "guess"
    # The guess: loading the model, then one decoding step per new token of each batch of 16.
    parameters = 0.5e9  # from the name, org/some-model-0.5B
    startup_s, step_s = guesses.startup_s(parameters), guesses.decode_step_s(parameters, 1, 1)
    assert limited.seconds == pytest.approx(startup_s + 2 * 50 * step_s)  # 32 examples: 2 batches
    assert whole.seconds == pytest.approx(startup_s + 63 * 50 * step_s)  # all 1000: 63 batches
    assert "32 examples in 2 batches" in limited.basis
    assert "1000 examples in 63 batches" in whole.basis


def test_an_eval_job_of_a_model_the_book_has_seen_is_estimated_from_its_eval_row():
    def spec(batch_size=16, beams=1):
        return EvalJob(
            experiment="e",
            stage="s",
            model=MODEL,
            adapter={},
            data={"train": "t.jsonl", "eval": "e.jsonl"},
            eval={"limit": 64, "batch_size": batch_size, "max_new_tokens": 50, "num_beams": beams},
            adapter_dir="a",
            out_dir="o",
        )

    row = EvalSpeedRecord(
        model=MODEL["name_or_path"],
        device_name="NVIDIA A100",
        num_beams=1,
        batch_size=8,
        max_new_tokens=100,
        batches=4,
        startup_s=30.0,
        decode_step_s=0.02,
        scoring_s=5.0,
        time=1.0,
    )
    estimate = Estimator([], lambda source, data_spec: DataTokens(1000, 1e5), eval_book=[row])
    # 64 examples in 4 batches of 16 x 50 steps, each step twice the row's (batch 16 against 8); scoring
    # per example: the row scored 4 x 8 = 32 examples in 5 s.
    assert estimate(spec(), 1).seconds == pytest.approx(30 + 4 * 50 * 0.04 + 5 * 64 / 32)
    assert estimate(spec(), 1).source == "measured"
    assert estimate(spec(beams=4), 1).source == "guess"  # beam search is another cost: not this row


def three_turn_chats(path: Path, conversations: int) -> Path:
    """`conversations` chats of three exchanges each: three assistant turns apiece."""
    turns = [{"role": role, "content": f"{role} {n}"} for n in range(3) for role in ("user", "assistant")]
    path.write_text("".join(json.dumps({"messages": turns}) + "\n" for _ in range(conversations)))
    return path


def test_eval_turns_all_over_three_turn_chats_is_estimated_at_three_times_the_answers_of_last(tmp_path):
    """Issue 38's leftover: under `eval.turns: all` the eval generates one answer per assistant turn, and
    the estimate counted conversations: a 3-turn eval set was estimated at a third of its work, and its
    `time: auto` limit was that short. eval.limit counts conversations, as the eval applies it (the first
    N rows, each with all its turns: train/data.py prompts_and_targets)."""
    chats = three_turn_chats(tmp_path / "chats.jsonl", 10)

    def spec(turns, limit=None):
        return EvalJob(
            experiment="e",
            stage="s",
            model=MODEL,
            adapter={},
            data={"train": str(chats), "eval": str(chats), "format": "messages"},
            eval={"turns": turns, "limit": limit, "batch_size": 4, "max_new_tokens": 50},
            adapter_dir="a",
            out_dir="o",
        )

    # The book's row: batches of answers (eval/job.py counts the batches of its prompts, one per answer);
    # scoring 10 s for 5 x 4 = 20 answers, 0.5 s an answer.
    row = EvalSpeedRecord(
        model=MODEL["name_or_path"],
        device_name="NVIDIA A100",
        num_beams=1,
        batch_size=4,
        max_new_tokens=100,
        batches=5,
        startup_s=30.0,
        decode_step_s=0.02,
        scoring_s=10.0,
        time=1.0,
    )
    measured = Estimator([], eval_book=[row])  # the real count: validation's read of the file
    last, every = measured(spec("last", limit=4), 1), measured(spec("all", limit=4), 1)
    assert last.source == every.source == "measured"
    # last: 4 answers, 1 batch of 4 x 50 steps at 0.02 s, scoring 4 x 0.5 s
    assert last.seconds == pytest.approx(30 + 1 * 50 * 0.02 + 4 * 0.5)  # 33 s
    # all: 4 conversations x 3 turns = 12 answers (not 4: the limit counts conversations), 3 batches
    assert every.seconds == pytest.approx(30 + 3 * 50 * 0.02 + 12 * 0.5)  # 39 s
    assert every.seconds - 30 == pytest.approx(3 * (last.seconds - 30))  # the work beyond start-up, 3x
    assert "4 examples in 1 batches" in last.basis
    assert "12 answers (every assistant turn of 4 conversations) in 3 batches" in every.basis
    # The whole file: 10 answers against 30, and the guess counts answers too.
    assert "10 examples in 3 batches" in measured(spec("last"), 1).basis
    assert (
        "30 answers (every assistant turn of 10 conversations) in 8 batches" in measured(spec("all"), 1).basis
    )
    guessed = Estimator([])
    step_s = guesses.decode_step_s(0.5e9, 1, 1)
    guess_last, guess_all = guessed(spec("last", limit=4), 1), guessed(spec("all", limit=4), 1)
    assert guess_last.source == guess_all.source == "guess"
    assert guess_all.seconds - guess_last.seconds == pytest.approx((3 - 1) * 50 * step_s)
    # Turns unknown (a count without them, as the speed book's size of an `hf:` set): one per conversation.
    unknown = Estimator([], lambda source, data_spec: DataTokens(10, 1e3), eval_book=[row])(spec("all", 4), 1)
    assert "4 conversations (assistant turns unknown: one answer each) in 1 batches" in unknown.basis


def test_auto_limit_is_the_estimate_with_its_margin_rounded_up_and_capped():
    assert auto_time_limit_s(2000, 120, 86400) == 3300  # 2000 x 1.3 + 120 + 300 = 3020 → 3300
    assert auto_time_limit_s(2000, 120, 1200) == 1200
    assert auto_time_limit_s(None, 120, 7200) == 7200  # nothing to estimate from: the longest allowed


def auto_folder(tmp_path: Path, cluster: str = "") -> Path:
    return write_experiments(
        tmp_path,
        cluster=cluster,
        auto=sized(
            "auto",
            "{gpus: 1, time: auto, signal_delay_s: 120}",
            "{metrics: [exact_match], resources: {time: auto}}",
        ),
    )


def sbatch_time(folder: Path, job_id: str) -> int:
    from slurm.queueing.backends import SlurmBackend
    from slurm.queueing.snapshot import CodeSnapshot

    profile, _ = load_profile(folder)
    backend = SlurmBackend(profile, folder, CodeSnapshot(folder, None, None))
    return backend.sbatch_parameters(plan_for(folder=folder).job(job_id), [])["time"]


def test_time_auto_resolves_in_the_plan_and_reaches_sbatch(tmp_path):
    folder = auto_folder(tmp_path)
    job = plan_for(folder=folder).job("auto/train")
    wanted = auto_time_limit_s(job.estimate.seconds, 120, 2 * 86400, guessed=True)
    assert job.estimate.source == "guess" and job.estimate.seconds > 0
    # A guessed speed takes the wide margin (a guess was 7x off for a real model), not the measured one's.
    assert job.resources.time_s == wanted and wanted % 300 == 0 and wanted >= job.estimate.seconds * 4 + 420
    assert wanted > auto_time_limit_s(job.estimate.seconds, 120, 2 * 86400)
    assert sbatch_time(folder, "auto/train") == wanted // 60
    assert plan_for(folder=folder).job("auto/eval").resources.time != "auto"
    assert plan_for(folder=folder).job("other/train").resources.time == "04:00:00"  # written times stay


def test_a_guessed_eval_limit_leaves_room_for_a_slow_machine():
    """Before: a newcomer's evals, guessed at ~49 s, got 15 minutes and were killed on a busy machine."""
    from slurm.planning.estimate import GUESSED_EVAL_FLOOR_S

    assert auto_time_limit_s(49, 120, 86400, guessed=True) == 900  # the guess alone: what killed them
    assert auto_time_limit_s(49, 120, 86400, guessed=True, floor_s=GUESSED_EVAL_FLOOR_S) == 3600
    assert (
        auto_time_limit_s(49, 120, 1800, guessed=True, floor_s=GUESSED_EVAL_FLOOR_S) == 1800
    )  # max_time wins
    assert auto_time_limit_s(2000, 120, 86400, guessed=True, floor_s=GUESSED_EVAL_FLOOR_S) == 8700


def test_time_auto_is_capped_by_cluster_max_time(tmp_path):
    folder = auto_folder(tmp_path, cluster="max_time: '00:07:00'\n")
    assert plan_for(folder=folder).job("auto/train").resources.time == "00:07:00"
    assert sbatch_time(folder, "auto/train") == 7


def test_time_auto_on_a_dataset_fetched_on_the_node_is_an_error_with_its_line(tmp_path):
    folder = write_experiments(tmp_path)
    (folder / "remote.yaml").write_text(
        "name: remote\nmodel: {name_or_path: org/m, kind: causal}\n"
        "data: {train: 'hf:org/data:train', eval: 'hf:org/data:dev'}\nresources:\n  time: auto\n"
    )
    profile, _ = load_profile(folder)
    with pytest.raises(ConfigError) as caught:
        load_experiments(folder, profile)
    assert [(p.key, p.line) for p in caught.value.problems] == [("resources.time", 5)]
    assert "hf:org/data:train" in caught.value.problems[0].message


def test_dry_run_json_has_estimates_limits_makespan_and_gpu_hours(tmp_path, capsys, monkeypatch):
    import launch

    folder = auto_folder(tmp_path)
    monkeypatch.chdir(folder)
    assert launch.main(["--all", "--dry-run", "--json", "--config-dir", "."]) == 0
    plan = json.loads(capsys.readouterr().out)
    jobs = {job["id"]: job for job in plan["jobs"]}
    assert set(jobs["auto/train"]["estimate"]) >= {"seconds", "source"}
    assert jobs["auto/train"]["estimate"]["source"] == "guess"
    assert jobs["other/train"]["time_limit_min"] == 240
    # chain/one → chain/two → chain/eval is the longest chain; every job asks for one GPU.
    chain = sum(jobs[j]["estimate"]["seconds"] for j in ("chain/one", "chain/two", "chain/eval"))
    assert plan["makespan_s"] == pytest.approx(chain, abs=2)
    assert plan["gpu_hours"] == pytest.approx(
        sum(j["estimate"]["seconds"] for j in jobs.values()) / 3600, abs=1e-2
    )
    # Each experiment's own chain, apart from what it waits for in others.
    assert plan["experiments"]["chain"]["critical_path"] == ["chain/one", "chain/two", "chain/eval"]
    assert plan["experiments"]["chain"]["critical_path_s"] == pytest.approx(chain, abs=2)
    assert plan["experiments"]["other"]["critical_path_s"] == pytest.approx(
        sum(j["estimate"]["seconds"] for j in jobs.values() if j["experiment"] == "other"), abs=2
    )


@pytest.mark.slow
def test_a_finished_stage_appends_a_speed_book_row_the_next_plan_uses(tiny, tmp_path):
    from tests.train_helpers import make_job, sql_data
    from train.recipe import run_stage

    run_dir = tmp_path / "runs" / "t" / "s"  # RUN_ROOT/EXP/STAGE, as the plan lays it out
    # easy.jsonl: 85 examples, 11 steps an epoch; an eval every 3 steps; saves at 2, 3 and 4.
    data = sql_data("easy", "dev")
    job = make_job(tiny, run_dir, data=data, max_steps=4, eval_every_epochs=0.25, save_every_steps=2)
    assert run_stage(job) == "completed"
    (row,) = read_book(tmp_path / "runs" / "speeds.jsonl")
    assert (row.model, row.method, row.precision, row.device_name) == (
        str(tiny["tiny-llama"]),
        "lora",
        "fp32",
        "cpu",
    )
    assert (row.world_size, row.batch_size, row.grad_accum, row.examples, row.eval_examples) == (
        1,
        8,
        1,
        85,
        48,
    )
    assert row.data == data["train"] and 10 < row.tokens_per_example <= row.max_length
    assert row.tokens_per_s > 0 and row.startup_s > 0 and row.eval_s > 0 and row.save_s > 0
    assert row.gradient_checkpointing is False  # recorded: a checkpointing row is another speed
    assert Estimator([row])(job, gpus=0).source == "measured"
    assert Estimator([row])(job, gpus=1).source == "guess"  # a CPU row says nothing of a GPU's speed


def test_a_stage_run_outside_the_plans_layout_writes_no_speed_book(tmp_path):
    assert book_of(train_job()) == Path("runs/speeds.jsonl")
    assert book_of(train_job().model_copy(update={"run_dir": str(tmp_path)})) is None


@pytest.mark.slow
def test_calibrate_times_a_few_steps_and_the_estimates_then_say_calibrated(repo_root, tmp_path, tiny, capsys):
    import launch
    from bench.packing import scenario

    folder = scenario(repo_root, tmp_path, {"x": "stages: [{{name: one}}, {{name: two}}]\n"})
    # CPU jobs: this machine calibrates on its CPU, and a CPU row never estimates a GPU job.
    dry_run = ["--all", "--config-dir", str(folder), "--dry-run", "--json", "resources.gpus=0"]
    assert launch.main(dry_run) == 0
    before = {j["id"]: j["estimate"]["source"] for j in json.loads(capsys.readouterr().out)["jobs"]}
    assert before == {"x/one": "guess", "x/two": "guess"}

    calibrate = [*dry_run[:3], "--calibrate", "--calibrate-steps", "6", "resources.gpus=0"]
    assert launch.main([*calibrate, "--backend", "local", "--no-preflight"]) == 0
    run_dir = tmp_path / "runs" / "x" / "one-calibrate"  # the first stage only, beside the real ones
    assert json.loads((run_dir / "summary.json").read_text())["global_step"] == 6
    assert not (tmp_path / "runs" / "x" / "one").exists() and not (run_dir / "tb").exists()
    (row,) = read_book(tmp_path / "runs" / "speeds.jsonl")
    assert row.calibration and row.model.endswith("tiny-llama") and row.tokens_per_s > 0

    capsys.readouterr()
    assert launch.main(dry_run) == 0
    after = {j["id"]: j["estimate"] for j in json.loads(capsys.readouterr().out)["jobs"]}
    assert {e["source"] for e in after.values()} == {"calibrated"}
    assert "from the speed book" in after["x/one"]["basis"]


def test_a_cpu_row_is_never_used_for_a_gpu_job_even_with_precision_auto():
    # precision: auto took whatever ran, so a row from a CPU run (fp32) estimated a GPU job: too long, or,
    # with a CPU faster than the guess assumes for a tiny model, too short a `time: auto`.
    job = train_job(precision="auto", epochs=1, eval_every_epochs=None, save_every_steps=10_000)
    cpu = record(device_name="cpu", precision="fp32", tokens_per_s=50.0)
    assert Estimator([cpu], hundred_examples)(job, gpus=1).source == "guess"
    assert Estimator([cpu], hundred_examples)(job, gpus=0).seconds == pytest.approx(20 + 10_000 / 50)
    gpu = record(precision="bf16", tokens_per_s=1000.0)  # what `auto` runs on an A100
    assert Estimator([cpu, gpu], hundred_examples)(job, gpus=1).seconds == pytest.approx(20 + 10_000 / 1000)
    assert Estimator([gpu], hundred_examples)(job, gpus=0).source == "guess"  # nor a GPU row for a CPU job


def test_an_h100_row_is_scaled_to_an_a100_job_by_peak_and_marked():
    job = train_job(epochs=1, eval_every_epochs=None, save_every_steps=10_000)
    h100 = record(device_name="NVIDIA H100 80GB HBM3", tokens_per_s=3000.0)
    estimate = Estimator([h100], hundred_examples)(job, gpus=1, gpu="A100")
    # 3,000 tokens/s on an H100 (989 TFLOP/s bf16) is 3,000 x 312 / 989 = 946 on an A100 (312).
    assert estimate.source == "measured (scaled from H100)"
    assert estimate.seconds == pytest.approx(20 + 10_000 / (3000 * 312 / 989))
    assert "scaled from H100 to A100" in estimate.basis
    a100 = record(device_name="NVIDIA A100-SXM4-80GB", tokens_per_s=800.0, time=0.5)  # older, same GPU
    assert Estimator([h100, a100], hundred_examples)(job, gpus=1, gpu="A100").source == "measured"
    # The GPU model unknown (no constraint names one): the slowest model the book saw, unscaled.
    unknown = Estimator([h100, a100], hundred_examples)(job, gpus=1)
    assert unknown.source == "measured" and unknown.seconds == pytest.approx(20 + 10_000 / 800)
    assert Estimator([h100], hundred_examples)(job, gpus=1).source == "measured"  # the cluster's own GPU


def test_a_gpu_model_comes_from_a_device_name_or_a_constraint_and_a_guess_uses_its_peak():
    from slurm.planning.guesses import gpu_model

    assert gpu_model("NVIDIA H100 80GB HBM3") == "H100" and gpu_model("NVIDIA H100 PCIe") == "H100 PCIE"
    assert gpu_model("NVIDIA A100-SXM4-80GB") == gpu_model("a100_80g") == "A100"
    assert gpu_model("NVIDIA L4") == "L4" and gpu_model("NVIDIA L40S") == "L40S"
    assert gpu_model("a100|h100") == "A100"  # either may be given: the slower
    assert gpu_model("ib&bigmem") is None and gpu_model("cpu") is None and gpu_model(None) is None
    job = train_job().model_copy(update={"model": ModelSpec(name_or_path="org/big-7B", kind="causal")})
    a100, h100 = (Estimator([], hundred_examples)(job, 1, gpu) for gpu in ("A100", "H100"))
    assert "on 1 x H100" in h100.basis and a100.seconds > h100.seconds


def test_a_checkpointing_row_is_not_used_for_a_job_without_checkpointing():
    # Gradient checkpointing runs one more forward per step: its speed is not the job's.
    plain = train_job(gradient_checkpointing=False)
    checkpointed = train_job(gradient_checkpointing=True)
    row = record(gradient_checkpointing=True)
    assert Estimator([row], hundred_examples)(plain, gpus=1).source == "guess"
    assert Estimator([row], hundred_examples)(checkpointed, gpus=1).source == "measured"
    # A row written before the book kept the flag was a run without it (the default).
    legacy = record()
    assert legacy.gradient_checkpointing is None
    assert Estimator([legacy], hundred_examples)(plain, gpus=1).source == "measured"
    assert Estimator([legacy], hundred_examples)(checkpointed, gpus=1).source == "guess"


def test_an_eval_row_from_a_cpu_never_estimates_a_gpu_eval_and_another_gpus_is_scaled():
    spec = EvalJob(
        experiment="e",
        stage="s",
        model=MODEL,
        adapter={},
        data={"train": "t.jsonl", "eval": "e.jsonl"},
        eval={"limit": 64, "batch_size": 8, "max_new_tokens": 50},
        adapter_dir="a",
        out_dir="o",
    )

    def row(device_name: str) -> EvalSpeedRecord:
        return EvalSpeedRecord(MODEL["name_or_path"], device_name, 1, 8, 100, 4, 30.0, 0.1, 0.0, 1.0)

    def estimator(*rows):
        return Estimator([], lambda source, data_spec: DataTokens(1000, 1e5), eval_book=list(rows))

    assert estimator(row("cpu"))(spec, 1).source == "guess"
    assert estimator(row("cpu"))(spec, 0).source == "measured"
    # Decoding reads the weights each step: an H100's step (3.35 TB/s) is 1.675 x an A100's (2.0).
    scaled = estimator(row("NVIDIA H100 80GB HBM3"))(spec, 1, "A100")
    assert scaled.source == "measured (scaled from H100)"
    assert scaled.seconds == pytest.approx(30 + 8 * 50 * 0.1 * 3.35 / 2.0)


def test_the_gpu_model_a_job_gets_is_read_from_its_constraint_then_its_partition():
    from core.config import Resources
    from slurm.planning.guesses import job_gpu

    assert job_gpu(Resources(gpus=1, constraint="h100&ib", partition="gpu-a100")) == "H100"
    assert job_gpu(Resources(gpus=1, constraint="ib", partition="gpu-a100")) == "A100"
    assert job_gpu(Resources(gpus=1), partition="l40s") == "L40S"  # cluster.yaml's partition
    assert job_gpu(Resources(gpus=1, partition="gpu")) is None  # unknown: the book's slowest, or A100
    assert job_gpu(Resources(gpus=0, constraint="a100")) is None  # a CPU job gets no GPU


def test_a_constraint_naming_a_gpu_model_scales_the_books_rows_to_it(tmp_path, monkeypatch):
    from dataclasses import asdict

    folder = write_experiments(
        tmp_path,
        h100=sized("h100", "{gpus: 1, constraint: h100}"),
        anywhere=sized("anywhere", "{gpus: 1}"),
    )
    monkeypatch.chdir(folder)
    (folder / "runs").mkdir()
    row = asdict(record(model="org/some-model", device_name="NVIDIA A100-SXM4-80GB"))
    (folder / "runs" / "speeds.jsonl").write_text(json.dumps(row) + "\n")
    plan = plan_for(folder=folder)
    assert plan.job("h100/train").estimate.source == "measured (scaled from A100)"
    assert plan.job("anywhere/train").estimate.source == "measured"


def test_after_preflight_the_plan_is_estimated_again_from_its_tokens_and_keeps_its_jobs(
    tmp_path, monkeypatch
):
    # The launch used to build the whole plan twice (load, hash, estimate); now preflight's count only
    # re-estimates it: the jobs and hashes stay, the estimate and its `time: auto` limit move.
    monkeypatch.chdir(tmp_path)  # cluster.yaml's run_dir is relative
    folder = write_experiments(tmp_path / "configs", big=sized("big", "{gpus: 1, time: auto}"))
    plan = plan_for(folder=folder)
    before = plan.job("big/train")
    assert before.estimate.tokens == "characters"
    record_exact_tokens(plan.run_root, [(before.spec, 1, 500_000_000)])  # as preflight leaves it
    profile, _ = load_profile(folder)
    files = {name: str(folder / f"{name}.yaml") for name in plan.experiments()}
    again = estimated_again(plan, profile, files)
    assert [(j.id, j.config_hash) for j in again.jobs] == [(j.id, j.config_hash) for j in plan.jobs]
    after = again.job("big/train")
    assert after.estimate.tokens == "preflight" and after.estimate.seconds > before.estimate.seconds
    assert after.resources.time_s > before.resources.time_s  # time: auto follows the new estimate


def test_the_dry_run_names_the_jobs_that_would_run_on_a_guessed_speed(tmp_path, capsys, monkeypatch):
    import launch

    monkeypatch.chdir(tmp_path)
    folder = auto_folder(tmp_path)
    (tmp_path / "runs").mkdir(exist_ok=True)
    job = plan_for(folder=folder).job("auto/train")
    measured = record(model=job.spec.model.name_or_path, batch_size=job.spec.train.batch_size)
    # A row for the training jobs (they share model and batch); none for the evals: those are guessed.
    (tmp_path / "runs" / "speeds.jsonl").write_text(json.dumps(measured.__dict__) + "\n")
    # On SLURM, where a GPU job gets its GPU (a local machine without one estimates it as a CPU job).
    assert launch.main(["--all", "--dry-run", "--config-dir", str(folder), "--backend", "slurm"]) == 0
    lines = capsys.readouterr().out.splitlines()
    guessed = next(line for line in lines if line.startswith("On a guessed speed"))
    assert "/train" not in guessed and "auto/eval" in guessed and "4x" in guessed


def decoding_row(**changes) -> EvalSpeedRecord:
    values = dict(
        model=MODEL["name_or_path"],
        device_name="NVIDIA A100",
        num_beams=1,
        batch_size=8,
        max_new_tokens=64,
        batches=4,
        startup_s=10.0,
        decode_step_s=0.05,
        scoring_s=1.0,
        time=1.0,
    )
    return EvalSpeedRecord(**(values | changes))


def test_a_grpo_estimate_counts_its_completions_and_its_generation_by_hand():
    """Issue 49: a GRPO step trains num_generations completions of each prompt and first samples them; before,
    the estimate (and `time: auto`) counted an SFT step of the prompts and no generation at all."""
    grpo = {"num_generations": 4, "max_completion_length": 48, "rewards": [{"score": "exact_match"}]}
    job = train_job(
        method="grpo", grpo=grpo, max_steps=6, batch_size=2, eval_every_epochs=None, save_every_steps=100
    )
    sft = train_job(max_steps=6, batch_size=2, eval_every_epochs=None, save_every_steps=100)
    estimator = Estimator([record(), record(objective="grpo")], hundred_examples, eval_book=[decoding_row()])
    estimate, plain = estimator(job, gpus=1), estimator(sft, gpus=1)
    # Training: 6 steps x 2 prompts = 12 examples x 100 tokens x 4 completions = 4,800 tokens at 1,000/s =
    # 4.8 s; generation: 6 x 48 decoding steps of 8 completions at the book's 0.05 s (batch 8) = 14.4 s.
    assert plain.seconds == pytest.approx(20 + 1.2)
    assert estimate.seconds == pytest.approx(20 + 4.8 + 14.4)
    assert (
        "generation 6 x 48 decoding steps of 8 completions at 0.050 s (an eval's row in the speed book"
        in estimate.basis
    )
    assert estimate.source == "measured"
    # A GRPO stage's own row of the speed book wins over the eval's: 0.02 s a step of its 16 completions,
    # so 0.01 s for this job's 8: 6 x 48 x 0.01 = 2.88 s of generation.
    own = record(objective="grpo", decode_step_s=0.02, decode_batch=16)
    sampled = Estimator([own], hundred_examples, eval_book=[decoding_row()])(job, gpus=1)
    assert sampled.seconds == pytest.approx(20 + 4.8 + 2.88)
    assert "at 0.010 s (a GRPO stage's row in the speed book (NVIDIA A100, batch 16))" in sampled.basis
    # Without a decoding row the generation is a guess, and the estimate says so (time: auto takes 4x).
    guessed = Estimator([record(objective="grpo")], hundred_examples)(job, gpus=1)
    assert guessed.source == "guess" and "guessed from the model's size" in guessed.basis


@pytest.mark.slow  # two plans, each running its rewards check
def test_a_grpo_step_longer_than_the_signal_delay_is_named_under_the_plan(tmp_path):
    """The time-limit stop lands only between steps: a GRPO step with its generation may outlast the signal
    delay, and then a job at its limit is killed mid-step, its step lost. The plan says so, with the fix."""
    from slurm.watching.render import totals_text

    grpo = (
        "{num_generations: 8, max_completion_length: GEN, from_base: true, rewards: [{score: exact_match}]}"
    )
    text = (
        sized("rl", "{gpus: 1, signal_delay_s: 60}")
        + f"train: {{method: grpo, max_steps: 4, grpo: {grpo}}}\n"
    )
    long_steps = write_experiments(tmp_path / "long", rl=text.replace("GEN", "60000"))
    plan = plan_for(folder=long_steps, names=["rl"])
    (job,) = [j for j in plan.jobs if j.id == "rl/train"]
    assert job.estimate.step_s > 60 and "generation 4 x 60000 decoding steps" in job.estimate.basis
    assert "One step of rl/train takes ~" in totals_text(plan)
    assert "longer than its resources.signal_delay_s 60" in totals_text(plan)
    short_steps = write_experiments(tmp_path / "short", rl=text.replace("GEN", "16"))
    assert "One step of" not in totals_text(plan_for(folder=short_steps, names=["rl"]))


def test_a_gpu_job_the_local_backend_runs_on_a_machine_without_gpus_is_estimated_as_the_cpu_job_it_is(
    tmp_path,
):
    """Before: `gpus: 1` on a machine without GPUs was estimated on an assumed A100 while it trained on the
    CPU (a DPO job ran 13:19 of an automatic 15:00). Now the local backend estimates it on this machine's
    devices: the speed book's CPU row here, a GPU's on SLURM or on a machine with GPUs."""
    from core.devices import estimated_gpus
    from slurm.planning.plan import build_plan, calibration_plan

    assert [estimated_gpus(2, here) for here in (None, 0, 1, 4)] == [2, 0, 2, 2]
    folder = auto_folder(tmp_path)
    profile, _ = load_profile(folder)
    experiments = load_experiments(folder, profile, {}, ["auto"])
    cpu = record(
        model="org/some-model", device_name="cpu", precision="fp32", tokens_per_s=5.0, startup_s=30.0
    )
    estimator = Estimator([cpu], hundred_examples)
    on = {here: build_plan(experiments, profile, estimator, here).job("auto/train") for here in (None, 0, 1)}
    assert on[None].estimate.source == on[1].estimate.source == "guess"
    # 10,000 tokens at the CPU row's 5 tokens/s, its start-up, one in-training eval and no save in between.
    assert on[0].estimate.source == "measured" and on[0].estimate.seconds > 30 + 10_000 / 5
    wanted = auto_time_limit_s(on[0].estimate.seconds, 120, profile.max_time_s)
    assert on[0].resources.time_s == wanted > on[None].resources.time_s
    # --calibrate on that machine measures the CPU job it runs, and says so, as the plan it cuts from.
    calibrating = calibration_plan(build_plan(experiments, profile, estimator, 0), 30, estimator)
    assert calibrating.gpus_here == 0 and calibrating.jobs[0].estimate.source == "measured"


def test_the_dry_run_says_a_gpu_job_runs_and_is_estimated_on_this_machines_cpus(
    tmp_path, capsys, monkeypatch
):
    import launch

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # a machine without GPUs, whatever this one has
    folder = auto_folder(tmp_path)
    assert launch.main(["--exp", "auto", "--config-dir", str(folder), "--dry-run", "--backend", "local"]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "This machine has no GPU: the local backend runs every job on its CPUs" in said
    assert launch.main(["--exp", "auto", "--config-dir", str(folder), "--dry-run", "--backend", "slurm"]) == 0
    assert "This machine has no GPU" not in capsys.readouterr().out
