"""Helpers more than one test module uses (fixtures live in conftest.py)."""

from __future__ import annotations

import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# One small experiment whose checks need no model files (a hub id, never fetched by a dry run): the lines
# the tests name are its own (model.kind on line 2, train on line 5, resources on line 7).
TINY_EXPERIMENT = """\
name: a
model: {{name_or_path: {model}, kind: {kind}}}
adapter: {{rank: 8, alpha: 16}}
data: {{train: {data}, eval: {data}, input_field: question, target_field: sql}}
train: {{epochs: 1, learning_rate: 2.0e-4, eval_every_epochs: 1}}
eval: {{metrics: [exact_match, sql_exec], db: {db}}}
resources: {{gpus: 1, cpus: 1, mem_gb: 1, time: "00:05:00"}}
"""


def experiment_folder(
    tmp_path: Path, model: str = "org/some-model", kind: str = "causal", more: str = ""
) -> Path:
    """configs/ under tmp_path: a cluster.yaml keeping runs there, a one-example data file, and a.yaml, the
    tiny experiment with `more` (a sweep block, say) appended."""
    from tests.conftest import write_cluster_yaml

    configs = tmp_path / "configs"
    configs.mkdir(exist_ok=True)
    write_cluster_yaml(configs, tmp_path)
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "q", "sql": "SELECT 1"}\n')
    db = ROOT / "data" / "demo" / "shop.db"
    (configs / "a.yaml").write_text(TINY_EXPERIMENT.format(model=model, kind=kind, data=data, db=db) + more)
    return configs


def dry_run(configs: Path, capsys, *overrides: str) -> tuple[int, str]:
    """`launch.py --all --dry-run` on `configs`: (exit code, what it wrote to stderr)."""
    import launch

    code = launch.main(["--all", "--config-dir", str(configs), "--dry-run", *overrides])
    return code, capsys.readouterr().err


def wait_until(condition, what: str, timeout_s: float = 240):
    """Polls `condition` until it returns something truthy, and returns that; fails naming `what`. For a
    state another process reaches (a real job, a real launcher), never as a pause."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
