"""One eval process for several adapters of one base model (issue 50): the base is loaded once, and each
adapter is put on it in turn (peft's PeftModel.from_pretrained, then `unload`: the base's own layers back,
nothing merged), then scored by the same steps as its own eval job (eval/job.py `scored`) into its own
eval folder. Adapters are switched between whole passes, so each adapter's batches are those its own job
generates: under greedy decoding the predictions are the same token for token. A base-model eval of the same
base may be one of the jobs (its row, scored once).

Progress is kept in the shared job's own folder (`scored.json`, the eval folders done): a requeued or killed
process starts again at the first adapter not yet scored, and within it from its kept predictions
(eval/predictions.py). Each adapter's results carry `adapter_changes_output` (eval/job.py adapter_check), so
an adapter that changes nothing, the silent fault of tools that score many adapters at once, is warned about
in the report.

    python -m eval generate-shared SHARED_DIR CONFIG.yaml [CONFIG.yaml ...]
"""

from __future__ import annotations

import copy
import json
import logging
import sys
import threading
import time
from pathlib import Path

from core.config import EvalJob
from core.files import read_json, write_json_atomic
from core.rundir import RunDir

log = logging.getLogger("eval.shared")
SCORED = "scored.json"
ADAPTER_CONFIG = "adapter_config.json"  # peft's: a saved adapter has it


def not_shareable(jobs: list[EvalJob]) -> str | None:
    """Why these eval jobs cannot share one process; None when they can."""
    if len({job.sharing_key for job in jobs}) > 1:
        return "their base model, quantization, data or eval settings differ (EvalJob.sharing_key)"
    outs = [job.out_dir for job in jobs]
    if len(set(outs)) < len(outs):
        return "two of them write to one eval folder"
    return None


def run_shared_eval(
    jobs: list[EvalJob], shared_dir: Path, stop: threading.Event | None = None, on_scored=None
) -> list[dict | None]:
    """Each job's results (run_eval's), in order; a job not reached because `stop` was set is None (its
    predictions made so far are kept, and the next run starts there); a job whose adapter folder holds no
    adapter (its training failed) is `{"not_scored": why}`, and the others are scored. Jobs scored by an
    earlier run of this shared job (scored.json) are not scored again: their results are read back.
    `on_scored(job, results)` is called as soon as each is scored (the launcher's job marks it DONE then, so
    a hard kill loses no finished member)."""
    from eval.generate import adapter_on_base, base_for_eval, eval_placement
    from eval.job import scored

    reason = not_shareable(jobs)
    if reason is not None:
        raise ValueError(f"these eval jobs cannot share a process: {reason}")
    shared_dir.mkdir(parents=True, exist_ok=True)
    done = set(read_json(shared_dir / SCORED, expected=list) or [])
    results: list[dict | None] = []
    base, held = None, None  # the base model and the placement it was loaded for
    for job in jobs:
        if job.out_dir in done:
            log.info("%s: scored by an earlier run of this job", job.out_dir)
            results.append(read_json(RunDir.of(job.out_dir).results, expected=dict))
            continue
        if stop is not None and stop.is_set():
            results.append(None)
            continue
        if job.adapter_dir is not None and not (Path(job.adapter_dir) / ADAPTER_CONFIG).is_file():
            # its training failed or was pruned before it saved: the others are still scored
            log.warning("%s: not scored: %s holds no adapter", job.out_dir, job.adapter_dir)
            results.append({"not_scored": f"{job.adapter_dir} holds no adapter (its training did not end)"})
            continue
        started = time.time()
        placement = eval_placement(job.adapter_dir)
        if base is None or placement != held:  # adapters trained in another precision: loaded again
            base, held = base_for_eval(job, placement), placement
            own = copy.deepcopy(base.generation_config)
        # each job's eval finds the model's own generation_config, as its own job would: the eval's decoding
        # replaces it (eval/generate.py explicit_decoding) and records what it overrode
        base.generation_config = copy.deepcopy(own)
        model, tokenizer = adapter_on_base(base, job)
        try:
            result = scored(job, model, tokenizer, placement, started, stop)
        finally:
            base = model.unload() if model is not base else base
        results.append(result)
        if result is not None:
            done.add(job.out_dir)
            write_json_atomic(shared_dir / SCORED, sorted(done), indent=1)
            if on_scored is not None:
                on_scored(job, result)
    return results


def add_parser(subparsers) -> None:
    """Registers `generate-shared`: several eval jobs of one base model in one process."""
    parser = subparsers.add_parser(
        "generate-shared", help="score several adapters of one base model in one process"
    )
    parser.add_argument("shared_dir", type=Path, help="this shared job's folder (its progress: scored.json)")
    parser.add_argument("configs", type=Path, nargs="+", help="each eval job's config.yaml")
    parser.set_defaults(run=run)


def run(args) -> int:
    from eval.job import jobs_of_configs
    from eval.score import UnscoredError

    try:
        jobs = jobs_of_configs(args.configs)
        results = run_shared_eval(jobs, args.shared_dir)
    except (UnscoredError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for job, result in zip(jobs, results, strict=True):
        scores = {k: v for k, v in (result or {}).items() if isinstance(v, float)}
        print(f"{job.out_dir}: {json.dumps(scores)}")
    return 0
