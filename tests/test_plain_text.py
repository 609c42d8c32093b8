"""Issue 48, item 3 (M1, N1): text is printed as text, never markup. A `[/INST]` in a problem, gloo's
`[/__w/pytorch/…]` in a failed job's log tail, a path with brackets: rich read each as a closing tag and
raised MarkupError (a traceback, exit 1) instead of printing the message, and a sibling file's warning
broke every `--exp` of its folder. The consoles read no markup (slurm/watching/render.py console), colour
comes from `labelled`; a test of the source holds every console and print to that."""

from __future__ import annotations

import ast
import json
import pickle
import re
import shutil
import subprocess
from pathlib import Path

import launch
from core.job_records import record_job
from tests.helpers import ROOT, bounded_child, dry_run, experiment_folder

GLOO = (
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
    "Connection closed by peer [10.0.0.2]:41234"
)
MARKUP_TAG = re.compile(r"\[/?(bold|dim|italic|red|green|yellow|blue|cyan|magenta|white)\b[^\]]*\]|\[/\]")


def sources() -> list[Path]:
    return [
        ROOT / "launch.py",
        *sorted((ROOT / "slurm").rglob("*.py")),
        *sorted((ROOT / "eval").rglob("*.py")),
    ]


def test_no_console_reads_markup_and_no_print_asks_for_it():
    """A markup print would parse whatever it interpolates; a tag in our own text would now be printed
    as it is written."""
    found = []
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", getattr(node.func, "attr", ""))
                markup = [k.value for k in node.keywords if k.arg == "markup"]
                if name == "Console" and not any(
                    isinstance(v, ast.Constant) and v.value is False for v in markup
                ):
                    found.append(f"{where}: a Console without markup=False")
                if any(not (isinstance(v, ast.Constant) and v.value is False) for v in markup):
                    found.append(f"{where}: markup asked for")
                if name in ("from_markup", "render_markup"):
                    found.append(f"{where}: text parsed as markup ({name})")
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and MARKUP_TAG.search(node.value)
            ):
                found.append(f"{where}: a rich markup tag in text: {node.value!r}")
    assert not found, "\n".join(found)


def test_status_prints_a_failed_multinode_jobs_gloo_tail_as_text(tmp_path, capsys):
    """A killed rank's gloo message in the log and the reason: before, MarkupError, twice."""
    configs = experiment_folder(tmp_path)
    dead = subprocess.Popen(["true"])  # a controller that has ended: its pid is the local job's id
    dead.wait()
    run_dir, logs = tmp_path / "runs" / "a" / "train", tmp_path / "logs" / "a" / "train"
    run_dir.mkdir(parents=True)
    logs.mkdir(parents=True)
    record_job(run_dir, str(dead.pid), "local")
    (logs / f"{dead.pid}_0_log.out").write_text(f"step 10\nTraceback (most recent call last):\n{GLOO}\n")
    with (logs / f"{dead.pid}_0_result.pkl").open("wb") as fh:
        pickle.dump(("error", f"Traceback (most recent call last):\n{GLOO}"), fh)
    code = launch.main(["--status", "--config-dir", str(configs)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "MarkupError" not in captured.err and "Traceback (most recent call last)" not in captured.err
    assert "  | RuntimeError: [/__w/pytorch/pytorch/third_party/gloo" in captured.out + captured.err
    assert "a/train: FAILED" in captured.out + captured.err


def test_a_problem_quoting_a_closing_tag_is_printed_and_a_sibling_files_warning_too(tmp_path, capsys):
    """A pair whose role is `[/INST]`: refused with its file and line, not a traceback; the same file
    beside another experiment is a warning that does not stop `--exp` of the other."""
    configs = experiment_folder(tmp_path)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": [{"role": "[/INST]", "content": "q"}], "chosen": "a", "rejected": "b"}\n')
    (configs / "p.yaml").write_text(
        (configs / "a.yaml").read_text().replace("name: a", "name: p")
        + f"stages:\n  - name: dpo\n    data: {{format: preference, train: {pairs}, eval: {pairs}}}\n"
        "    train: {method: dpo}\n"
    )
    code, err = dry_run(configs, capsys)
    assert code == 2 and "Traceback" not in err and "MarkupError" not in err, err
    assert "[/INST]" in err and "pairs.jsonl:1" in err
    code = launch.main(["--exp", "a", "--config-dir", str(configs), "--dry-run"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "MarkupError" not in captured.err


MISTRAL = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST]' + m['content'] + '[/INST]' }}"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}"
)
CHAT = ROOT / "data" / "demo" / "sql" / "chat-train.jsonl"


def chat_folder(tmp_path: Path, model: Path, template: str | None) -> Path:
    configs = experiment_folder(tmp_path, model=str(model))
    text = (configs / "a.yaml").read_text()
    data = f"data: {{train: {CHAT}, eval: {CHAT}, format: messages"
    data += f", chat_template: {json.dumps(template)}}}" if template else "}"
    start = text.index("data: {")
    (configs / "a.yaml").write_text(text[:start] + data + text[text.index("\n", start) :])
    return configs


def test_a_mistral_template_is_accepted_inline_and_its_folder_dry_runs(tiny, tmp_path, capsys):
    """N1: refused (no generation prompt, by design) with a message quoting `[/INST]`, whose printing
    crashed every command on the folder. `[/INST]` ends the prompt and the answer follows: it labels right."""
    code, err = dry_run(chat_folder(tmp_path, tiny["tiny-llama"], MISTRAL), capsys)
    assert code == 0, err


def test_a_model_folders_own_template_that_would_learn_its_header_is_refused_before_queueing(
    tiny, tmp_path, capsys
):
    """The rule an inline template keeps, for a model folder's own (before: accepted, the header learnt)."""
    model = tmp_path / "model"
    shutil.copytree(tiny["tiny-llama"], model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = (  # ChatML without its generation prompt: `<|im_start|>assistant` learnt
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
        "'<|im_end|>' + '\\n' }}{% endfor %}"
    )
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    code, err = dry_run(chat_folder(tmp_path, model, None), capsys)
    assert code == 2
    assert "data.format: is rendered with" in err and "own chat template, which cannot be trained on" in err
    assert "no add_generation_prompt branch" in err


def test_tokenizer_files_linked_to_dev_zero_are_read_bounded_by_the_dry_run(tiny, tmp_path):
    """M4: tokenizer.json or tokenizer_config.json linked to /dev/zero drove --dry-run (no torch) to 2.7 GB
    and MemoryError. Run in a child under RLIMIT_AS 1 GiB: before, it died there."""
    model = tmp_path / "model"
    shutil.copytree(tiny["tiny-llama"], model)
    configs = chat_folder(tmp_path, model, "chatml")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
        (model / name).symlink_to("/dev/zero")
    done = bounded_child(["launch.py", "--all", "--config-dir", str(configs), "--dry-run"])
    assert "MemoryError" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.returncode in (0, 2), done.stderr[-2000:]
