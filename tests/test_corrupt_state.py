"""A corrupt state file never crashes the commands that watch or relaunch a run (issue 23, defect 8).

One real finished run (a training stage and its eval, local backend, tiny model), then for each (file,
corruption) of a table, what a crash, a full disk or a hand edit can leave: bytes that are not UTF-8, torn
JSON, JSON of another shape, a string where a number belongs, a folder where the file belongs, a count of
zero. `--status`, `--report`, `--dry-run` and a relaunch (`--all`, local backend) each run on it, in this
process: none may show a traceback, each that reads the file names it, and a relaunch never runs a stage
again behind the user's back (a DONE it cannot trust is refused, saying why, not taken for a changed config).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import launch
from core.rundir import RunDir
from tests.conftest import write_cluster_yaml
from tests.helpers import tiny_sql_base

pytestmark = pytest.mark.slow  # trains or launches for seconds: make test-fast leaves it out

EXPERIMENT = """\
name: one
inherits: _tiny-sql.yaml
data: {{eval: {root}/data/demo/sql/dev.jsonl}}
train: {{epochs: 1, batch_size: 8, eval_every_epochs: 1}}
eval: {{metrics: [exact_match], limit: 4, max_new_tokens: 8}}
"""
NOT_UTF8 = b'{"step": 1, "loss": \xff\xfe 2.0}\n'
COMMANDS = {
    "status": ["--status"],
    "report": ["--report"],
    "dry-run": ["--all", "--dry-run"],
    "relaunch": ["--all", "--backend", "local"],
}
EVERY = tuple(COMMANDS)
WATCH = ("status", "report", "relaunch")  # the commands that read a stage's scheduler record and progress
REPORT = ("report", "relaunch")  # a relaunch that finds everything done writes the report


def put(content: bytes | str | None) -> Callable[[Path], None]:
    """Replace the file with `content`; None: a folder where the file belongs."""

    def corrupt(path: Path) -> None:
        if path.is_dir():
            shutil.rmtree(path)
        path.unlink(missing_ok=True)
        if content is None:
            (path / "left-by-hand").mkdir(parents=True)
        else:
            path.write_bytes(content if isinstance(content, bytes) else content.encode())

    return corrupt


def edit_json(change: Callable[[dict], object], lines: bool = False) -> Callable[[Path], None]:
    """The file's own JSON (each line of a .jsonl), as `change` returns it."""

    def corrupt(path: Path) -> None:
        if lines:
            rows = [json.loads(line) for line in path.read_text().splitlines()]
            path.write_text("".join(json.dumps(change(row)) + "\n" for row in rows))
        else:
            path.write_text(json.dumps(change(json.loads(path.read_text()))))

    return corrupt


def all_strings(row: dict) -> dict:
    return {
        k: "fast" if isinstance(v, int | float) and not isinstance(v, bool) else v for k, v in row.items()
    }


FOREIGN_HASH = "0123456789abcdef\n"
RERUNS = "missing or unreadable after its DONE; the eval runs again"
# name: (file under the run root, or "CACHE" for the preflight cache entry; corruption; commands that must
# name the file; the relaunch's exit code; words the relaunch must say)
CASES = {
    "DONE not UTF-8": ("one/train/DONE", put(b"\xff\xfe\x00"), (*WATCH,), 2, "cannot be read"),
    "DONE a folder": ("one/train/DONE", put(None), (*WATCH,), 2, "cannot be read"),
    "DONE a foreign hash": ("one/train/DONE", put(FOREIGN_HASH), ("relaunch",), 2, "never wrote"),
    "DONE no hash at all": ("one/train/DONE", put("done\n"), ("relaunch",), 2, "no config hash"),
    "config.yaml not UTF-8, DONE another config's": (
        "one/train/config.yaml",
        lambda path: put(b"name: \xff")(path) or put(FOREIGN_HASH)(path.with_name("DONE")),
        ("relaunch",),
        2,
        "config.yaml is missing or unreadable",
    ),
    "eval DONE not UTF-8": ("one/eval/DONE", put(b"\x80abc"), (*WATCH,), 2, "cannot be read"),
    "job.json not UTF-8": ("one/train/job.json", put(b'{"jobs": [\xff]}'), WATCH, 0, ""),
    "job.json torn": ("one/train/job.json", put('{"jobs": [{"job_id": "12'), WATCH, 0, ""),
    "job.json a list": ("one/train/job.json", put("[1, 2]"), WATCH, 0, ""),
    "job.json records of another shape": ("one/train/job.json", put('{"jobs": [1, {}]}'), WATCH, 0, ""),
    "job.json jobs a string": ("one/train/job.json", put('{"jobs": "12"}'), WATCH, 0, ""),
    "job.json a folder": ("one/train/job.json", put(None), WATCH, 0, ""),
    "progress.json not UTF-8": ("one/train/progress.json", put(b"\xff"), WATCH, 0, ""),
    "progress.json a list": ("one/train/progress.json", put("[]"), WATCH, 0, ""),
    "progress.json strings": ("one/train/progress.json", edit_json(all_strings), WATCH, 0, ""),
    "summary.json not UTF-8": ("one/train/summary.json", put(b"{\xff}"), REPORT, 0, ""),
    "summary.json torn": ("one/train/summary.json", put('{"train_runtime_s": 1'), REPORT, 0, ""),
    "summary.json a list": ("one/train/summary.json", put("[]"), REPORT, 0, ""),
    "summary.json strings": ("one/train/summary.json", edit_json(all_strings), REPORT, 0, ""),
    "summary.json a folder": ("one/train/summary.json", put(None), REPORT, 0, ""),
    # An eval is done only when its results can be read (issue 31, rule 8): the relaunch runs it again,
    # from the predictions it kept, instead of the report saying "not run yet" for ever.
    "results.json not UTF-8": ("one/eval/results.json", put(b"\xfe"), REPORT, 0, RERUNS),
    "results.json a list": ("one/eval/results.json", put('["exact_match", 0.5]'), REPORT, 0, RERUNS),
    "results.json missing": ("one/eval/results.json", lambda path: path.unlink(), ("relaunch",), 0, RERUNS),
    "results.json strings": ("one/eval/results.json", edit_json(all_strings), REPORT, 0, ""),
    "metrics.jsonl not UTF-8": ("one/train/metrics.jsonl", put(NOT_UTF8), REPORT, 0, ""),
    "metrics.jsonl a list row": (
        "one/train/metrics.jsonl",
        put('[1, 2]\n{"step": 1, "loss": 2.0}\n'),
        REPORT,
        0,
        "",
    ),
    "metrics.jsonl strings": ("one/train/metrics.jsonl", edit_json(all_strings, lines=True), REPORT, 0, ""),
    "metrics.jsonl a folder": ("one/train/metrics.jsonl", put(None), REPORT, 0, ""),
    "speeds.jsonl not UTF-8": ("speeds.jsonl", put(NOT_UTF8), EVERY, 0, ""),
    "speeds.jsonl strings": ("speeds.jsonl", edit_json(all_strings, lines=True), EVERY, 0, ""),
    "speeds.jsonl zero speed": (
        "speeds.jsonl",
        edit_json(lambda r: r | {"tokens_per_s": 0}, True),
        EVERY,
        0,
        "",
    ),
    "speeds.jsonl a folder": ("speeds.jsonl", put(None), EVERY, 0, ""),
    "preflight-tokens.json not UTF-8": ("preflight-tokens.json", put(b"\xff"), EVERY, 0, ""),
    "preflight-tokens.json a list": ("preflight-tokens.json", put("[]"), EVERY, 0, ""),
    "preflight-tokens.json zero and strings": (
        "preflight-tokens.json",
        edit_json(lambda book: {k: {"examples": 0, "tokens": "many"} for k in book}),
        EVERY,
        0,
        "",
    ),
    # What preflight counted is kept there for the next launch's estimates: writing it into a folder fails.
    "preflight-tokens.json a folder": ("preflight-tokens.json", put(None), EVERY, 1, "Is a directory"),
    "preflight cache total_params 0": (
        "CACHE",
        edit_json(lambda e: e | {"total_params": 0}),
        ("relaunch",),
        0,
        "",
    ),
    "preflight cache strings": ("CACHE", edit_json(all_strings), ("relaunch",), 0, ""),
    "preflight cache not UTF-8": ("CACHE", put(b"\xff"), ("relaunch",), 0, ""),
}


@pytest.fixture(scope="module")
def finished(tmp_path_factory, repo_root, tiny) -> Iterator[Path]:
    """A real run, launched and finished once: its configs folder (runs/ beside it, and a pristine copy)."""
    tmp = tmp_path_factory.mktemp("finished")
    folder = tmp / "configs"
    folder.mkdir()
    write_cluster_yaml(folder, tmp)
    tiny_sql_base(folder)
    (folder / "one.yaml").write_text(EXPERIMENT.format(root=repo_root))
    with pytest.MonkeyPatch.context() as patch:
        # A token cache of this module's own: the session's holds other tests' preflight entries, and the
        # cases below corrupt the one entry this run wrote.
        patch.setenv("LORA_CACHE_DIR", str(tmp / "cache"))
        patch.chdir(repo_root)
        assert launch.main(["--all", "--backend", "local", "--config-dir", str(folder)]) == 0
        assert sorted(p.name for p in (tmp / "runs" / "one").glob("*/DONE")) == ["DONE", "DONE"]
        shutil.copytree(tmp / "runs", tmp / "pristine", symlinks=True)
        yield folder


def cache_entry() -> Path:
    from core.layout import cache_root

    (entry,) = (cache_root() / "preflight").glob("*.json")  # the one training stage's
    return entry


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_corrupt_state_file_is_named_and_never_a_traceback(case, finished, repo_root, monkeypatch, capsys):
    where, corrupt, naming, relaunch_code, relaunch_says = CASES[case]
    runs, pristine = finished.parent / "runs", finished.parent / "pristine"
    shutil.rmtree(runs)
    shutil.copytree(pristine, runs, symlinks=True)
    path = cache_entry() if where == "CACHE" else runs / where
    kept = path.read_bytes()
    corrupt(path)
    monkeypatch.chdir(repo_root)
    try:
        for command, argv in COMMANDS.items():
            capsys.readouterr()
            code = launch.main([*argv, "--config-dir", str(finished)])
            out, err = capsys.readouterr()
            said = out + err
            assert "Traceback" not in said, (command, said)
            expected = relaunch_code if command == "relaunch" else 0
            assert code == expected, (command, said)
            if command in naming:
                assert str(path) in said, (command, said)
            if command == "relaunch":
                assert relaunch_says in said, said
                assert "changed:" not in said, said  # a damaged or foreign DONE is no changed config
                if relaunch_says == RERUNS:  # the eval ran again and wrote its results
                    assert RunDir(runs / "one" / "eval").read_results().get("split") == "eval", said
                else:
                    assert "RUNNING" not in said, said  # nothing ran again
    finally:
        if where == "CACHE":
            if path.is_dir():
                shutil.rmtree(path)
            path.write_bytes(kept)


def mounted(folder: Path, how: str) -> str:
    """Shell lines that make `folder` read-only or full, in a mount namespace of the command's own."""
    if how == "read-only":
        return f"mount --bind {folder} {folder} && mount -o remount,ro,bind {folder}"
    return f"mount -t tmpfs -o size=64k tmpfs {folder} && (cat /dev/zero > {folder}/filler 2>/dev/null; true)"


@pytest.mark.skipif(
    shutil.which("unshare") is None, reason="needs unshare(1) for a real read-only or full mount"
)
@pytest.mark.parametrize(
    ("how", "action", "says"),
    [
        ("read-only", ["--report"], "Read-only file system"),
        ("full", ["--report"], "No space left on device"),
        ("read-only", ["--all", "--backend", "local", "--no-preflight"], "Read-only file system"),
    ],
)
def test_a_read_only_or_full_run_folder_is_a_sentence_not_a_traceback(
    how, action, says, repo_root, tmp_path, tiny
):
    folder = tmp_path / "configs"
    folder.mkdir()
    write_cluster_yaml(folder, tmp_path)
    tiny_sql_base(folder)
    (folder / "one.yaml").write_text(EXPERIMENT.format(root=repo_root))
    runs = tmp_path / "runs"
    (runs / "one").mkdir(parents=True)
    (runs / ".launch.lock").touch()  # left by an earlier launch
    command = " ".join([sys.executable, "launch.py", *action, "--config-dir", str(folder)])
    if os.geteuid() != 0 and subprocess.run(["unshare", "-rm", "true"], check=False).returncode:
        pytest.skip("no user namespaces here to mount in")
    unshare = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
    done = subprocess.run(
        [*unshare, "sh", "-c", f"{mounted(runs, how)} && exec {command}"],
        cwd=repo_root,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert f"{runs}/" in done.stderr and says in done.stderr, done.stderr
    assert "cannot write" in done.stderr and "fix that and run the command again" in done.stderr


@pytest.mark.parametrize(
    "content", [b"\xff\xfe", b"[1, 2]", b'{"precision": 16, "global_step": "ten", "train_runtime_s": "long"}']
)
def test_a_job_that_resumes_or_follows_a_stage_reads_its_corrupt_files_as_absent(
    content, tmp_path, tiny, capsys
):
    """The readers a job runs on its node: the stage before's summary.json (the eval's precision, the next
    stage's step offset), progress.json and the checkpoint's runtime.json of a resumed stage."""
    from eval.generate import trained_precision
    from tests.train_helpers import make_job
    from train.callbacks import RuntimeClock
    from train.tracking import step_offset

    before = tmp_path / "before"
    (before / "adapter").mkdir(parents=True)
    (before / "summary.json").write_bytes(content)
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / RuntimeClock.FILE).write_bytes(content)
    job = make_job(tiny, tmp_path / "run").model_copy(update={"init_adapter": str(before / "adapter")})

    assert trained_precision(str(before / "adapter")) == "auto"
    assert step_offset(job) == 0
    assert RuntimeClock(tmp_path / "checkpoint").before_s == 0.0
    err = capsys.readouterr().err
    assert str(before / "summary.json") in err and str(tmp_path / "checkpoint" / RuntimeClock.FILE) in err
