"""The evaluation job: load a saved adapter, generate on the eval split, score, write the results.

Reads only the adapter folder (which carries its tokenizer) and the data; writes `predictions.jsonl` and
`results.json` into the job's own folder. It never trains and never talks to the scheduler, so it can be
rerun on its own: `python -m eval generate runs/EXP/eval/config.yaml`.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

from train.config import EvalJob
from train.files import write_atomic

log = logging.getLogger("eval.job")
SAMPLE_FOR_ADAPTER_CHECK = 4


def run_eval(job: EvalJob) -> dict:
    from eval.generate import adapter_changes_output, eval_placement, generate, load_for_eval
    from eval.score import score
    from train.data import prompts_and_targets

    out = Path(job.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source = job.source  # data.eval, or the training data when eval.split: train says so
    prompts, references = prompts_and_targets(source, job.data, limit=job.eval.limit)
    images = image_paths(source, job) if job.model.kind == "image-text" else None
    started = time.time()
    placement = eval_placement(job.adapter_dir)
    model, tokenizer = load_for_eval(job, placement)
    loaded = time.time()
    options = {
        "kind": job.model.kind,
        "num_beams": job.eval.num_beams,
        "max_new_tokens": job.eval.max_new_tokens,
        "batch_size": job.eval.batch_size,
    }
    predictions = generate(model, tokenizer, prompts, images=images, **options)
    generated = time.time()
    generation_s = generated - started
    sample = slice(SAMPLE_FOR_ADAPTER_CHECK)
    changed = adapter_changes_output(
        model, tokenizer, prompts[sample], images=images and images[sample], **options
    )
    if not changed:
        log.warning(
            "the adapter does not change the base model's outputs on %d examples", SAMPLE_FOR_ADAPTER_CHECK
        )
    write_predictions(out / "predictions.jsonl", prompts, references, predictions, images)
    results = score(
        predictions,
        references,
        list(job.eval.metrics),
        db=job.eval.db,
        sql_timeout_s=job.eval.sql_timeout_s,
        bertscore_model=job.eval.bertscore_model,
        bertscore_rescale=job.eval.bertscore_rescale,
    )
    results |= {
        "split": job.eval.split,
        "source": source,
        "adapter_dir": job.adapter_dir,
        "adapter_changes_output": changed,
        "generation_s": round(generation_s, 2),
    }
    write_atomic(out / "results.json", json.dumps(results, indent=1))  # the report may read it meanwhile
    write_speed(job, placement.device_name, len(prompts), loaded, generated)
    log.info("results: %s", {k: v for k, v in results.items() if isinstance(v, float)})
    return results


def write_speed(job: EvalJob, device_name: str, examples: int, loaded: float, generated: float) -> None:
    """This job's row in the speed book: the next plans estimate eval jobs on this model from it."""
    from train import speeds
    from train.callbacks import process_started_at

    book = speeds.eval_book_of(job.out_dir, job.experiment)
    if book is None or examples == 0:
        return
    batches = -(-examples // job.eval.batch_size)
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
    from train.data import read_rows
    from train.examples import image_path

    rows = read_rows(source, job.data)[: job.eval.limit]
    return [str(image_path(row, job.data, source)) for row in rows]


def write_predictions(
    path: Path,
    prompts: list[str],
    references: list[str],
    predictions: list[str],
    images: list[str] | None = None,
) -> None:
    rows = []
    for i, (prompt, reference, prediction) in enumerate(zip(prompts, references, predictions, strict=True)):
        row = {"id": i, "input": prompt, "reference": reference, "prediction": prediction}
        if images:
            row["image"] = images[i]
        rows.append(json.dumps(row) + "\n")
    write_atomic(path, "".join(rows))


def add_parser(subparsers) -> None:
    """Registers `generate`: rerun an eval job by hand from its run folder's config.yaml."""
    parser = subparsers.add_parser("generate", help="rerun an eval job: generate with its adapter and score")
    parser.add_argument("config", type=Path, help="runs/EXP/eval/config.yaml (written at submission)")
    parser.set_defaults(run=run)


def run(args) -> int:
    import yaml
    from pydantic import ValidationError

    try:
        job = EvalJob.model_validate(yaml.safe_load(args.config.read_text(encoding="utf-8")))
    except (OSError, yaml.YAMLError, ValidationError) as exc:
        print(f"error: {args.config}: not an eval job's config.yaml ({exc})", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    results = run_eval(job)
    print(json.dumps({k: v for k, v in results.items() if isinstance(v, float)}))
    print(f"wrote {Path(job.out_dir) / 'results.json'}")
    return 0
