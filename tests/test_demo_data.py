"""The shipped demo data: gold SQL runs on the shipped database, the splits are clean, and regenerating
gives the same files byte for byte."""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from demo.data import SCHEMA, build_demo_data

SPLITS = ("train", "dev", "easy", "medium", "hard")
CHATS = ("chat-train", "chat-dev")  # train and dev as conversations (data.format: messages)
PAIRS = ("pairs-train", "pairs-dev")  # train and dev as preference pairs (data.format: preference)
FIELDS = ["id", "question", "schema", "sql", "difficulty"]


def read_split(folder: Path, split: str) -> list[dict]:
    return [json.loads(line) for line in (folder / "sql" / f"{split}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def shipped(repo_root) -> Path:
    return repo_root / "data" / "demo"


@pytest.fixture(scope="module")
def rows(shipped) -> dict[str, list[dict]]:
    return {split: read_split(shipped, split) for split in SPLITS}


def connect_ro(db: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{db}?mode=ro", uri=True)


def test_every_gold_query_runs_on_the_shipped_db(shipped, rows):
    db = connect_ro(shipped / "shop.db")
    try:
        answers = [db.execute(row["sql"]).fetchall() for row in rows["train"] + rows["dev"]]
    finally:
        db.close()
    # Empty answers make execution accuracy meaningless; the data is built so almost none are empty.
    assert sum(1 for a in answers if a in ([], [(None,)])) <= 2


def test_rows_have_the_documented_fields(rows):
    assert len(rows["train"]) == 240 and len(rows["dev"]) == 48
    for split in ("train", "dev"):
        assert [r["id"] for r in rows[split]] == [f"{split}-{i}" for i in range(len(rows[split]))]
    for split in SPLITS:
        for row in rows[split]:
            assert list(row) == FIELDS, row
            assert row["schema"] == SCHEMA and row["difficulty"] in ("easy", "medium", "hard")


def test_dev_shares_no_question_with_train(rows):
    train = [r["question"] for r in rows["train"]]
    dev = [r["question"] for r in rows["dev"]]
    assert len(set(train)) == len(train) and len(set(dev)) == len(dev)
    assert not set(train) & set(dev)
    assert {r["difficulty"] for r in rows["dev"]} == {"easy", "medium", "hard"}


def test_the_curriculum_is_the_train_split_cut_by_difficulty(rows):
    parts = rows["easy"] + rows["medium"] + rows["hard"]
    assert sorted(r["id"] for r in parts) == sorted(r["id"] for r in rows["train"])
    for difficulty in ("easy", "medium", "hard"):
        assert rows[difficulty] == [r for r in rows["train"] if r["difficulty"] == difficulty]


def test_difficulty_matches_the_sql(rows):
    aggregate = re.compile(r"\b(COUNT|SUM|AVG|MAX|MIN)\(|ORDER BY|LIMIT")
    for row in rows["easy"]:
        assert not aggregate.search(row["sql"]) and " JOIN " not in row["sql"], row
    for row in rows["medium"]:
        assert aggregate.search(row["sql"]) and " JOIN " not in row["sql"] and "GROUP BY" not in row["sql"], (
            row
        )
    for row in rows["hard"]:
        assert " JOIN " in row["sql"] or "GROUP BY" in row["sql"], row


def test_the_schema_string_describes_the_db(shipped):
    db = connect_ro(shipped / "shop.db")
    try:
        tables = [
            t for (t,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY rowid")
        ]
        actual = " | ".join(
            f"{t}({', '.join(c[1] for c in db.execute(f'PRAGMA table_info({t})'))})" for t in tables
        )
    finally:
        db.close()
    assert actual == SCHEMA


def test_regenerating_gives_the_shipped_files(shipped, tmp_path):
    paths = build_demo_data(tmp_path / "demo")
    assert set(paths) == {"db", *SPLITS, *CHATS, *PAIRS}
    for split in SPLITS + CHATS + PAIRS:
        assert paths[split].read_bytes() == (shipped / "sql" / f"{split}.jsonl").read_bytes(), split
    # The db's header records the SQLite library version, so against the shipped file compare contents;
    # two builds with the same library must still be the same bytes.
    assert dump(paths["db"]) == dump(shipped / "shop.db")
    again = build_demo_data(tmp_path / "again")
    assert again["db"].read_bytes() == paths["db"].read_bytes()
    assert not [p.name for p in (tmp_path / "demo").rglob("*") if p.name.endswith(".tmp")]


def test_every_rejected_query_answers_differently_from_the_gold_one(shipped, rows):
    db = connect_ro(shipped / "shop.db")
    try:
        for split in ("train", "dev"):
            pairs = read_split(shipped, f"pairs-{split}")
            assert [p["chosen"] for p in pairs] == [r["sql"] for r in rows[split]]
            for pair in pairs:
                gold = db.execute(pair["chosen"]).fetchall()
                try:
                    wrong = db.execute(pair["rejected"]).fetchall()
                except sqlite3.Error:
                    continue  # a failing query is a wrong answer too
                assert wrong != gold, pair
    finally:
        db.close()


def test_the_chats_hold_the_train_and_dev_rows_as_turns_some_with_a_follow_up(shipped, rows):
    chats = {split: read_split(shipped, f"chat-{split}") for split in ("train", "dev")}
    for split, conversations in chats.items():
        answers = [
            t["content"] for chat in conversations for t in chat["messages"] if t["role"] == "assistant"
        ]
        assert answers == [row["sql"] for row in rows[split]], split  # every row once, in order
    # After the system turn, one exchange or two.
    assert {len(chat["messages"]) for chat in chats["train"]} == {3, 5}
    assert {len(chat["messages"]) for chat in chats["dev"]} == {3}  # each scored as its fields row is


def dump(db_path: Path) -> list[str]:
    db = connect_ro(db_path)
    try:
        return list(db.iterdump())
    finally:
        db.close()


def test_the_generator_does_not_import_torch(repo_root):
    code = "import sys, demo.data; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=repo_root, check=False).returncode == 0
