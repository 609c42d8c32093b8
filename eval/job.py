"""The evaluation job: load a saved adapter, generate on the eval split, score, write the results.

Reads only the adapter folder (which carries its tokenizer) and the data; writes `predictions.jsonl` and
`results.json` into the job's own folder. Predictions are kept as they are made (eval/predictions.py): a
requeued or killed eval goes on from them, and ends with the files an uninterrupted run writes. It never trains and never talks to the scheduler, so it can be
rerun on its own: `python -m eval generate runs/EXP/eval/config.yaml`.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from pathlib import Path

from core.config import EvalJob
from core.files import write_atomic
from core.hashing import content_hash
from core.names import PREFERENCE
from core.rundir import RunDir
from eval.predictions import PartialPredictions, rows, write_final

log = logging.getLogger("eval.job")
SAMPLE_FOR_ADAPTER_CHECK = 4


def run_eval(job: EvalJob, stop: threading.Event | None = None) -> dict | None:
    """Generate, score, write predictions.jsonl and results.json; returns the results. None when `stop`
    was set before every prediction was made: those made are kept, and the next run of this job generates
    only the rest (eval/predictions.py)."""
    from eval.generate import eval_placement, load_for_eval

    started = time.time()
    placement = eval_placement(job.adapter_dir)
    model, tokenizer = load_for_eval(job, placement)  # a chat prompt needs the tokenizer's template
    return scored(job, model, tokenizer, placement, started, stop)


def scored(job: EvalJob, model, tokenizer, placement, started: float, stop=None) -> dict | None:
    """run_eval's work once the job's model is loaded (an adapter on its base, or the base alone), so that
    one process can score several adapters of one base (eval/shared.py) exactly as their own jobs do."""
    from eval.generate import explicit_decoding
    from eval.score import fail_if_unscored
    from train.data import prompts_and_targets

    out = Path(job.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source = job.source  # data.eval, or the training data when eval.split: train says so
    prompts, references = prompts_and_targets(
        source, job.data, tokenizer, job.model.kind, job.eval.limit, job.eval.turns
    )
    images = image_paths(source, job) if job.model.kind == "image-text" else None
    decoding = explicit_decoding(model, job.eval)
    loaded = time.time()
    root = RunDir(out).run_root if out.parent.name == job.experiment else out  # eval_book_of's test
    partial = PartialPredictions(out, fingerprint(job, placement), root)
    made = partial.resume(prompts)
    kept = len(made)
    if kept:
        log.info("%d predictions kept from an earlier run of this job", kept)
    batches = predict(model, tokenizer, job, (prompts, references, images), partial, made, stop)
    if batches is None:
        return None
    generated = time.time()
    changed = adapter_check(model, tokenizer, job, prompts, images) if job.adapter_dir else None
    write_final(out, list(made.values()), root)
    results = score_job(job, [made[i]["prediction"] for i in range(len(prompts))], references)
    if job.data.format == PREFERENCE or job.preference_pairs:  # every row alike (eval/preference.py)
        from eval.preference import preference_scores

        results |= preference_scores(model, tokenizer, job)
    results |= {
        "split": job.eval.split,
        "source": source,
        "adapter_dir": job.adapter_dir,
        "adapter_changes_output": changed,
        "generation_s": round(generated - started, 2),
        "predictions_kept": kept,  # made by an earlier, interrupted run of this job
        **scored_turns_of(job, len(prompts)),
        **decoding,
    }
    write_atomic(
        RunDir(out).results, json.dumps(results, indent=1), root=root
    )  # the report may read it meanwhile
    fail_if_unscored(results)  # before the predictions go: a rerun with the right eval.db only scores
    partial.discard()
    write_speed(job, placement.device_name, batches, loaded, generated)
    log.info("results: %s", {k: v for k, v in results.items() if isinstance(v, float)})
    return results


def scored_turns_of(job: EvalJob, answers: int) -> dict:
    """Which assistant turns of a conversation were scored (eval.turns), for the report; {} for data that
    is no conversation (one answer per example)."""
    if job.data.format not in ("messages", "sharegpt"):
        return {}
    return {"turns": job.eval.turns, "answers_scored": answers}


def generation_options(job: EvalJob) -> dict:
    from core.conversations import templated

    return {
        "kind": job.model.kind,
        "num_beams": job.eval.num_beams,
        "max_new_tokens": job.eval.max_new_tokens,
        "templated": templated(job.data, job.model.kind),
    }


# How often a generating eval says how far it is (before: minutes of silence in its log while it scored).
PROGRESS_EVERY_S = 30.0


class Progress:
    """A line at most every `every_s` seconds while an eval generates, and one at its last batch: answers
    made of all, their rate this run, and the time left at that rate."""

    def __init__(self, total: int, kept: int, every_s: float = PROGRESS_EVERY_S, clock=time.monotonic):
        self.total, self.kept, self.every_s, self.clock = total, kept, every_s, clock
        self.start = self.last = clock()

    def line(self, made: int) -> str | None:
        """What to log now that `made` answers exist (kept ones included); None while it is too soon."""
        now = self.clock()
        if made < self.total and now - self.last < self.every_s:
            return None
        self.last = now
        rate = (made - self.kept) / max(now - self.start, 1e-9)
        left = f", ~{(self.total - made) / rate:.0f} s left" if rate > 0 and made < self.total else ""
        return f"generated {made}/{self.total} answers ({100 * made / self.total:.0f}%), {rate:.2f}/s{left}"


def predict(model, tokenizer, job: EvalJob, examples: tuple, partial, made: dict, stop) -> int | None:
    """Generate the batches not all in `made` (rows by id), each kept on disk before the next starts;
    returns how many were generated, or None when `stop` was set first."""
    from eval.generate import generated_batches, length_batches

    prompts, references, images = examples
    todo = [b for b in length_batches(prompts, job.eval.batch_size) if not made.keys() >= set(b)]
    if todo and stop is not None and stop.is_set():
        return None
    outputs = generated_batches(model, tokenizer, prompts, todo, images=images, **generation_options(job))
    progress = Progress(len(prompts), len(made))
    for done, (batch, texts) in enumerate(outputs, 1):
        new = rows(batch, texts, prompts, references, images)
        partial.append(new)
        made.update((row["id"], row) for row in new)
        if said := progress.line(len(made)):
            log.info("%s", said)
        if done < len(todo) and stop is not None and stop.is_set():
            log.warning("stopped after %d of %d batches; %d predictions kept", done, len(todo), len(made))
            return None
    return len(todo)


def adapter_check(model, tokenizer, job: EvalJob, prompts: list[str], images: list[str] | None) -> bool:
    """Does the adapter change the first few outputs? Warns when it does not."""
    from eval.generate import adapter_changes_output

    sample = slice(SAMPLE_FOR_ADAPTER_CHECK)
    changed = adapter_changes_output(
        model,
        tokenizer,
        prompts[sample],
        images=images and images[sample],
        batch_size=job.eval.batch_size,
        **generation_options(job),
    )
    if not changed:
        log.warning(
            "the adapter does not change the base model's outputs on %d examples", SAMPLE_FOR_ADAPTER_CHECK
        )
    return changed


def score_job(job: EvalJob, predictions: list[str], references: list[str]) -> dict:
    from eval.score import score

    return score(
        predictions,
        references,
        list(job.eval.metrics),
        db=job.eval.db,
        sql_timeout_s=job.eval.sql_timeout_s,
        bertscore_model=job.eval.bertscore_model,
        bertscore_rescale=job.eval.bertscore_rescale,
    )


def fingerprint(job: EvalJob, placement) -> str:
    """What an eval's predictions depend on: a partial file written under another fingerprint is not
    resumed. The adapter by its files (a stage run again writes new ones), the device and precision (a
    requeue onto other hardware could decode differently)."""
    adapter = Path(job.adapter_dir) if job.adapter_dir else None
    files = sorted(adapter.iterdir()) if adapter and adapter.is_dir() else []
    parts = {
        "job": job.model_dump(include={"model", "adapter", "data", "adapter_dir"}),
        "eval": job.eval.model_dump(
            include={"split", "limit", "num_beams", "max_new_tokens", "batch_size", "generation", "turns"}
        ),
        "adapter_files": [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()],
        "device": [placement.device_name, placement.precision],
    }
    return content_hash(parts)


def write_speed(job: EvalJob, device_name: str, batches: int, loaded: float, generated: float) -> None:
    """This job's row in the speed book: the next plans estimate eval jobs on this model from it. `batches`:
    those this run generated (a resumed one generates only the rest)."""
    from core import speeds
    from train.callbacks import process_started_at

    book = speeds.eval_book_of(job.out_dir, job.experiment)
    if book is None or batches == 0:
        return
    record = speeds.EvalSpeedRecord(
        model=job.model.name_or_path,
        device_name=device_name,
        num_beams=job.eval.num_beams,
        batch_size=job.eval.batch_size,
        max_new_tokens=job.eval.max_new_tokens,
        batches=batches,
        startup_s=round(loaded - process_started_at(), 2),
        decode_step_s=round((generated - loaded) / (batches * job.eval.max_new_tokens), 5),
        scoring_s=round(time.time() - generated, 2),
        time=round(time.time(), 3),
    )
    speeds.append(book, record)


def image_paths(source: str, job: EvalJob) -> list[str]:
    """The image file of each scored example (image-text), in the order of the prompts."""
    from core.examples import image_path
    from train.data import read_rows

    rows = read_rows(source, job.data)[: job.eval.limit]
    return [str(image_path(row, job.data, source)) for row in rows]


def add_parser(subparsers) -> None:
    """Registers `generate`: rerun an eval job by hand from its run folder's config.yaml."""
    parser = subparsers.add_parser("generate", help="rerun an eval job: generate with its adapter and score")
    parser.add_argument("config", type=Path, help="runs/EXP/eval/config.yaml (written at submission)")
    parser.set_defaults(run=run)


def jobs_of_configs(paths: list[Path]) -> list[EvalJob]:
    """Each eval job's config.yaml (written at submission), validated (ValueError naming the first that is
    none); then this process is readied as a job is: the optional libraries none of them uses hidden before
    peft is imported (train/libraries.py), and the job's logging."""
    import yaml
    from pydantic import ValidationError

    from train.libraries import hide, unused_libraries

    specs, jobs = [], []
    for path in paths:
        try:
            specs.append(yaml.safe_load(path.read_text(encoding="utf-8")))
            jobs.append(EvalJob.model_validate(specs[-1]))
        except (OSError, yaml.YAMLError, ValidationError) as exc:
            raise ValueError(f"{path}: not an eval job's config.yaml ({exc})") from None
    hide(tuple(set.intersection(*(set(unused_libraries(spec)) for spec in specs))))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return jobs


def run(args) -> int:
    try:
        (job,) = jobs_of_configs([args.config])
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from eval.score import UnscoredError

    try:
        results = run_eval(job)
    except UnscoredError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({k: v for k, v in results.items() if isinstance(v, float)}))
    print(f"wrote {RunDir.of(job.out_dir).results}")
    return 0
