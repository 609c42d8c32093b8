"""YAML reading on the login node: one parse per file per command, line numbers kept, no shared state."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from core import yamlfile
from core.problems import ConfigError
from core.yamlfile import YamlProblem, load_chain, read_yaml
from slurm.planning.experiments import parse_overrides

ROOT = Path(__file__).resolve().parent.parent


def test_a_shared_fragment_is_parsed_once_and_each_reader_gets_its_own_copy(tmp_path, monkeypatch):
    fragment = tmp_path / "_shared.yaml"
    fragment.write_text("train:\n  epochs: 2\n  batch_size: 8\n")
    parses = []
    real_parse = yamlfile._parse
    monkeypatch.setattr(yamlfile, "_parse", lambda path: parses.append(path) or real_parse(path))
    first, second = read_yaml(fragment), read_yaml(fragment)
    assert len(parses) == 1
    first.data["train"]["epochs"] = 99  # what merging an experiment into it could do
    assert second.data["train"]["epochs"] == 2 and read_yaml(fragment).data["train"]["epochs"] == 2
    assert first.lines[("train", "batch_size")] == 3


def test_an_edited_file_is_read_again(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("a: 1\n")
    assert read_yaml(path).data == {"a": 1}
    path.write_text("a: 22\n")
    os.utime(path, ns=(1, 1))  # even if the clock did not move, size or mtime differ
    assert read_yaml(path).data == {"a": 22}


def test_inherits_chain_does_not_consume_the_cached_inherits_key(tmp_path):
    (tmp_path / "base.yaml").write_text("train: {epochs: 3}\n")
    (tmp_path / "_mid.yaml").write_text("inherits: base.yaml\ntrain: {batch_size: 4}\n")
    for name in ("one", "two"):  # the second experiment must still see _mid.yaml's parent
        (tmp_path / f"{name}.yaml").write_text(f"name: {name}\ninherits: _mid.yaml\n")
        merged, chain = load_chain(tmp_path / f"{name}.yaml", stop=tmp_path)
        assert merged["train"] == {"epochs": 3, "batch_size": 4}
        assert [f.path.name for f in chain] == [f"{name}.yaml", "_mid.yaml", "base.yaml"]


def test_bad_yaml_points_at_the_line_where_the_mapping_started(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\ntrain: {epochs: 2\nbatch_size: 4\n")
    with pytest.raises(YamlProblem) as caught:
        read_yaml(path)
    assert caught.value.problem.line == 2 and "not valid YAML" in caught.value.problem.message


# A billion laughs: nine lines whose aliases stand for 10^9 strings. Parsed, it is 100 nodes; every reader
# after the parser (line numbers, merging, validation, the error message quoting it) expands it.
BOMB = "name: bomb\nlol0: &lol0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"lol{i}: &lol{i} [{', '.join([f'*lol{i - 1}'] * 10)}]\n" for i in range(1, 10)
)
# A bomb is loaded in a child process capped at 2 GB, with a timeout as a safety net only: the bounds make
# it answer in milliseconds, and a regression must fail the test, not take the machine's memory.
CHILD = """
import sys
from pathlib import Path
from core.yamlfile import YamlProblem, read_yaml
try:
    read_yaml(Path(sys.argv[1]))
    print("loaded")
except YamlProblem as exc:
    print(exc.problem)
"""


def capped(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 * 1024**3, 2 * 1024**3))

    return subprocess.run(
        argv, capture_output=True, text=True, timeout=120, cwd=cwd, preexec_fn=limit_memory, check=False
    )


def load_in_a_child(path) -> str:
    done = capped([sys.executable, "-c", CHILD, str(path)], ROOT)
    return done.stdout.strip() + done.stderr[-2000:]


def test_an_alias_bomb_is_refused_at_its_line_before_it_expands(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    # lol4 is the first list past 100,000 values (111,111 of them).
    assert load_in_a_child(path).startswith(f"{path}:6: lol4: holds more than 100,000 values")


NESTINGS = {
    # libyaml refuses 1000 levels itself; from 600 on, Python's recursion limit broke the readers after it.
    "flow lists": ("name: a\nx: " + "[" * 900 + "]" * 900 + "\n", "deep.yaml:2: x.0.0.0… (64 levels)"),
    "block mappings": (
        "name: a\n" + "".join(" " * i + f"k{i}:\n" for i in range(900)) + " " * 900 + "v: 1\n",
        "deep.yaml:66: k0.k1.k2.k3… (64 levels)",
    ),
    # 25 levels written at most, 75 once the aliases are expanded: small to parse, as deep to read.
    "through aliases": (
        "name: a\nx: &x " + "[" * 25 + "]" * 25 + "\ny: &y " + "[" * 25 + "*x" + "]" * 25 + "\n"
        "z: " + "[" * 25 + "*y" + "]" * 25 + "\n",
        "deep.yaml:4: z.0.0.0… (26 levels)",
    ),
}


@pytest.mark.parametrize("case", sorted(NESTINGS))
def test_nesting_near_the_recursion_limit_is_refused_at_its_line(case, tmp_path):
    text, where = NESTINGS[case]
    path = tmp_path / "deep.yaml"
    path.write_text(text)
    with pytest.raises(YamlProblem) as caught:
        read_yaml(path)
    assert str(caught.value.problem).startswith(f"{tmp_path}/{where}: nests deeper than 64 levels")


def test_an_alias_inside_its_own_anchor_is_refused(tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text("name: a\ntrain:\n  x: &x {y: *x}\n")
    with pytest.raises(YamlProblem) as caught:
        read_yaml(path)
    assert str(caught.value.problem).startswith(f"{path}:3: train.x.y: contains itself through an alias")


def test_a_file_larger_than_a_config_is_refused_unparsed(tmp_path):
    path = tmp_path / "huge.yaml"
    path.write_text("name: a\nnotes: " + "x" * 2_000_000 + "\n")
    with pytest.raises(YamlProblem, match="is larger than 1,000,000 bytes"):
        read_yaml(path)


def test_aliases_and_nesting_a_config_uses_still_load(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text(
        "name: a\nshared: &s {epochs: 2, lr: [1, 2]}\ntrain: *s\ndeep: " + "[" * 60 + "]" * 60 + "\n"
    )
    loaded = read_yaml(path)
    assert loaded.data["train"] == {"epochs": 2, "lr": [1, 2]} and loaded.lines[("train",)] == 3


def test_an_alias_bomb_on_the_command_line_is_refused():
    levels = ["&a [x, x, x, x, x, x, x, x, x, x]"]
    levels += [
        f"&{name} [{', '.join([f'*{below}'] * 10)}]" for below, name in zip("abcd", "bcde", strict=True)
    ]
    bomb = f"[{', '.join(levels)}]"  # e: 111,111 values
    with pytest.raises(ConfigError) as caught:
        parse_overrides([f"model.added_tokens={bomb}"])
    assert str(caught.value.problems[0]).startswith("command line: model.added_tokens: holds more than")


EXPERIMENT = """\
name: a
model: {name_or_path: org/some-model, kind: causal}
data: {train: train.jsonl}
eval: {metrics: []}
"""


@pytest.mark.parametrize("action", ["--status", "--cancel"])
def test_watching_commands_go_on_past_a_hostile_neighbour(action, tmp_path):
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "cluster.yaml").write_text(f"run_dir: {tmp_path / 'runs'}\nlog_dir: {tmp_path / 'logs'}\n")
    (configs / "a.yaml").write_text(EXPERIMENT)
    (configs / "bomb.yaml").write_text(BOMB)
    (configs / "deep.yaml").write_text(NESTINGS["flow lists"][0])
    argv = [
        sys.executable,
        str(ROOT / "launch.py"),
        action,
        "--config-dir",
        str(configs),
        "--backend",
        "local",
    ]
    done = capped(argv, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "bomb.yaml:6: lol4: holds more than 100,000 values" in done.stderr
    assert "deep.yaml:2: x.0.0.0… (64 levels): nests deeper than 64 levels" in done.stderr
    assert "Traceback" not in done.stderr
    if action == "--status":
        assert "a/train" in done.stdout  # the experiment that loads is still watched
