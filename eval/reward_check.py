"""A GRPO stage's rewards checked before anything is queued, on the login node, in a bounded child.

A reward that cannot work wastes a whole job: a gold query that fails (its completions all score None), a
score whose reference does not earn 1.0 (the data and the score disagree: a "right" completion would not be
rewarded as right), a user's function that raises, returns no finite number, or scores the reference no
higher than an empty completion. Each is found here, with the very code the job runs (eval/rewards.py):

- every SQL reward runs every training gold query once, on its database, under its own timeout;
- every reward scores a sample of the training references as completions: a score reward must give each
  1.0, a function a finite number each, and more on average than it gives empty completions.

The rewards run in a child process (this module run as a script: the login node stays torch-free) whose
address space is capped and which is killed past TIME_S: a user's function is a program too.

    reward_problems(request) -> [(reward index, what is wrong), ...]
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

TIME_S = 120.0  # the whole check: a few hundred gold queries and a sample of rewards take seconds
MEMORY_BYTES = 2 << 30  # the child's address space: Python, rouge_score and a user's function
SAMPLE = 16  # references scored as completions
FAILED_SHOWN = 3


def reward_problems(request: dict) -> list[tuple[int, str]]:
    """What is wrong with each reward of `request` ({train, data, rewards, functions_from}: the training file,
    its DataSpec and the rewards as dicts, the folder user functions are imported from); -1: all of them."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "eval.reward_check"],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            timeout=TIME_S,
            preexec_fn=cap_memory,
            cwd=Path(__file__).resolve().parent.parent,
        )
    except subprocess.TimeoutExpired:
        return [(-1, f"checking the rewards on the training references ran past {TIME_S:g} s")]
    try:
        answer = json.loads(done.stdout)
    except ValueError:  # killed by the kernel, or crashed: say what the child said
        tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return [(-1, f"checking the rewards on the training references failed: {tail}")]
    return [(index, message) for index, message in answer["problems"]]


def cap_memory() -> None:  # runs in the child, before it executes Python
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))


# ---- the child ------------------------------------------------------------------------------------------
def references_of(train: str, data: dict) -> tuple[list[str], list[str]]:
    """(prompt text, reference) of each training example, read as the job reads them: a `fields` or alpaca
    example's prompt and target, a conversation's last user turn and last assistant turn."""
    from core.config import DataSpec
    from core.conversations import conversation, last_answer, prompt_of, target_of
    from core.examples import numbered_csv, numbered_jsonl

    spec = DataSpec.model_validate(data)
    path = Path(train)
    rows = numbered_csv(path) if path.suffix.lower() == ".csv" else numbered_jsonl(path)
    prompts, references = [], []
    for _, row in rows:
        if spec.format in ("fields", "alpaca"):
            prompts.append(prompt_of(row, spec))
            references.append(target_of(row, spec))
            continue
        turns = conversation(row, spec)
        answer = last_answer(turns)
        asked = [t["content"] for t in turns[:answer] if t["role"] == "user"]
        prompts.append(asked[-1] if asked else "")
        references.append(turns[answer]["content"])
    return prompts, references


def problems_of(request: dict) -> list[tuple[int, str]]:
    from core.config import RewardSpec
    from core.names import SQL_REWARD_SCORES
    from eval.rewards import ScoreReward, user_function

    prompts, references = references_of(request["train"], request["data"])
    found: list[tuple[int, str]] = []
    for index, raw in enumerate(request["rewards"]):
        spec = RewardSpec.model_validate(raw)
        if spec.score:
            scorer = ScoreReward(spec, spec.db)
            usable = list(range(len(references)))
            if spec.score in SQL_REWARD_SCORES:
                failed = {q: scorer.gold_error(q) for q in dict.fromkeys(references)}
                failed = {q: error for q, error in failed.items() if error is not None}
                if failed:
                    shown = "; ".join(f"{q!r}: {error}" for q, error in list(failed.items())[:FAILED_SHOWN])
                    found.append(
                        (
                            index,
                            f"{len(failed)} of the training data's gold queries fail on {spec.db} ({shown}): "
                            "their completions could earn no reward; fix those rows or the database",
                        )
                    )
                usable = [i for i in usable if references[i] not in failed]
            sample = [references[i] for i in usable[:SAMPLE]]
            values = scorer.each(sample, sample)
            wrong = [(text, value) for text, value in zip(sample, values, strict=True) if value != 1.0]
            if wrong:
                text, value = wrong[0]
                found.append(
                    (
                        index,
                        f"the training references themselves earn less than 1.0 on {spec.score} ({len(wrong)} of "
                        f"{len(sample)} checked; {text!r}: {value}): a right completion would not be rewarded as right",
                    )
                )
            continue
        try:
            function = user_function(spec, request.get("functions_from") or ".")
            sample = references[:SAMPLE]
            asked = prompts[:SAMPLE]
            right = called(function, asked, sample, sample)
            empty = called(function, asked, [""] * len(sample), sample)
        except Exception as exc:  # a user's function: whatever it raises is its problem, named
            found.append(
                (index, f"{spec.function} failed on the training references: {type(exc).__name__}: {exc}")
            )
            continue
        if sum(right) <= sum(empty):
            found.append(
                (
                    index,
                    f"{spec.function} gives the training references {mean(right):.3g} on average, no more than "
                    f"empty completions ({mean(empty):.3g}): it would not reward a right answer",
                )
            )
    return found


def called(function, prompts: list[str], completions: list[str], references: list[str]) -> list[float]:
    """The function called as the GRPO stage calls it; each value a finite number."""
    values = list(
        function(
            prompts=prompts,
            completions=completions,
            completion_ids=[[]] * len(completions),
            reference=references,
        )
    )
    if len(values) != len(completions):
        raise ValueError(f"returned {len(values)} values for {len(completions)} completions")
    numbers = [float(v) for v in values]
    if not all(math.isfinite(v) for v in numbers):
        raise ValueError(f"returned a value that is not a finite number: {values[:4]}")
    return numbers


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def main() -> None:
    request = json.loads(sys.stdin.read())
    try:
        found = problems_of(request)
    except (
        Exception
    ) as exc:  # unreadable data: said by the data checks; this says why the rewards were not checked
        found = [(-1, f"the rewards could not be checked: {type(exc).__name__}: {exc}")]
    sys.stdout.write(json.dumps({"problems": found}))


if __name__ == "__main__":
    main()
