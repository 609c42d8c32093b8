"""What preflight finds, shown before anything is queued (--preflight, and the check a launch or an export
runs first): the table of each training job's lengths, memory and micro-batch, the notes, and the refusal.
slurm/planning/preflight.py computes it (torch only on a cache miss)."""

from __future__ import annotations

import json

from rich.text import Text

from core.preflight import trained_share
from core.problems import ConfigError
from core.split import label as split_label
from slurm.planning.plan import Plan
from slurm.planning.preflight_books import record_exact_tokens, record_splits
from slurm.watching.render import err, fit, out, warning


def run_preflight(plan: Plan, files: dict[str, str], profile, show: bool, as_json: bool) -> int:
    """Refuse (exit 2) what the jobs would refuse or could not fit, before anything is queued; torch is
    imported only on a preflight cache miss, never by the dry run or the status commands."""
    from slurm.planning.preflight import preflight_plan

    fetching = profile.hub_downloads == "login"
    results, problems = preflight_plan(plan, files, profile.gpu_mem_for, fetch=fetching)
    specs = {j.id: j.spec for j in plan.jobs if j.kind == "train"}
    record_exact_tokens(
        plan.run_root,
        [(specs[r.job], r.examples, r.tokens_per_epoch) for r in results if r.tokens_per_epoch],
    )
    chosen = [(specs[r.job], r.gpu_mem_gb, r.split) for r in results if r.split and r.split["how"] == "auto"]
    record_splits(plan.run_root, chosen)
    if as_json:
        print(json.dumps([r.as_json() for r in results], indent=1))
    elif show and results:  # no empty box when nothing could be computed (the errors below say why)
        out.print(fit(preflight_table(results), out.width, PREFLIGHT_PRIORITY))
    if not as_json:
        for note in marker_text_notes(results):
            err.print(note, highlight=False, soft_wrap=True)
    if not fetching and (fetch := list(dict.fromkeys(c for r in results for c in r.fetch))):
        err.print(fetch_note(fetch), highlight=False, soft_wrap=True)  # fetching: they are problems
    if problems:
        raise ConfigError(problems)
    return 0


def marker_text_notes(results) -> list[Text]:
    """A warning per job whose training conversations hold special-token text in their content (the job's
    log and preflight.log say which tokens): trained as those control tokens, as TRL and axolotl do."""
    return [
        warning(
            f"{r.job}: {r.marker_text_conversations} training conversation(s) hold special-token text in their "
            "content (e.g. `<|im_end|>` typed into a turn): it is encoded as those control tokens, in the "
            "labels and the eval's prompts; escape or remove it if it is not meant so"
        )
        for r in results
        if r.marker_text_conversations
    ]


def fetch_note(commands: list[str]) -> Text:
    """hub_downloads: nodes: not a refusal, the nodes download at the job's start; if they cannot after
    all, the note says how to fetch on this machine into the cache the nodes share."""
    lines = "\n".join(f"  {c}" for c in commands)
    return warning(
        "not in this machine's Hugging Face cache, so jobs on nodes without network would fail at their "
        f"start; fetch into the shared cache (HF_HOME) first:\n{lines}"
    )


# preflight_table's columns, most important first (slurm/watching/render.py fit).
PREFLIGHT_PRIORITY = (
    "job",
    "fits",
    "memory/GPU",
    "micro-batch",
    "trainable",
    "max_length",
    "cut at max_length",
    "tokens/epoch",
    "lengths p50/p90/p99/max",
)


def preflight_table(results):
    from rich.table import Table

    table = Table(
        "job",
        "trainable",
        "lengths p50/p90/p99/max",
        "max_length",
        "tokens/epoch",
        "cut at max_length",
        "memory/GPU",
        "fits",
        "micro-batch",
    )
    for r in results:
        memory = (
            f"{r.memory_gb:.1f} GB" + (f" of {r.gpu_mem_gb:g}" if r.gpu_mem_gb else "")
            if r.memory_gb
            else "-"
        )
        table.add_row(
            r.job,
            f"{r.trainable_percent:.2f}% ({r.trainable_params:,})",
            "\n".join(
                ("targets " if part == "targets" else "") + "/".join(map(str, values))
                for part, values in r.length_percentiles.items()
            )
            or "-",
            length_cell(r),
            trained_cell(r),
            cut_cell(r),
            memory,
            {True: "yes", False: f"no (batch {r.largest_batch} fits)", None: "-"}[r.fits],
            split_label(r.split) or "-",
        )
    return table


def cut_cell(r) -> str:
    """How many examples max_length cuts, and how many it leaves out whole (a pair whose answer alone does not
    fit): `11, 13 dropped`."""
    if r.truncated_inputs is None:
        return "-"
    return f"{r.truncated_inputs}" + (f", {r.dropped_examples} dropped" if r.dropped_examples else "")


def length_cell(r) -> str:
    if r.max_length:
        return str(r.max_length)
    return f"refused: {r.data_refused}" if r.data_refused else f"skipped: {r.tokens_skipped}"


def trained_cell(r) -> str:
    """Tokens per epoch, and how many of them the loss sees."""
    if not r.tokens_per_epoch:
        return "-"
    if r.labelled_tokens is None:
        return f"{r.tokens_per_epoch:,}"
    return trained_share(r.labelled_tokens, r.tokens_per_epoch)
