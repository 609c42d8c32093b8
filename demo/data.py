"""The demo's text-to-SQL data: a small shop database and template questions over it, deterministic.

    python -m demo.data [OUT_DIR]      # default OUT_DIR: data/demo

writes `shop.db` and `sql/{train,dev,easy,medium,hard}.jsonl` (rows: id, question, schema, sql, difficulty),
and the same train and dev rows as conversations, `sql/chat-{train,dev}.jsonl` (data.format: messages: a
system turn holding the schema, then question → SQL; in train, every pair of the first CHAT_PAIRED rows is
one two-exchange conversation, a follow-up question in the same chat), and as preference pairs,
`sql/pairs-{train,dev}.jsonl` (data.format: preference: the fields prompt, the gold query chosen, a plausible
wrong one rejected: a wrong column, table, order, aggregate or condition, whose result differs from the gold
one's on shop.db), byte-identical on every run. easy + medium + hard is the train split cut by difficulty (a curriculum);
dev shares no question with train. Every gold query runs on shop.db. The SQL is short and in one canonical
style (upper-case keywords, single quotes, aliases o/c/p in joins) so a tiny model learns it in a few epochs.

Standard library only: the launcher and the tests import it without torch.
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import sys
from pathlib import Path

SEED = 7
DEV_EVERY = 6  # one row in six goes to dev: 288 rows -> 240 train, 48 dev
CITIES = ["Paris", "Lyon", "Nice", "Lille", "Brest", "Metz"]
CATEGORIES = ["book", "game", "tool", "food"]
NAMES = [
    "Ada", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Hana",
    "Ivo", "Jill", "Kai", "Lea", "Max", "Nora", "Omar", "Pia",
]  # fmt: skip
PRODUCTS = [
    "lamp", "chess", "saw", "tea", "novel", "atlas", "drill", "cake", "puzzle", "jam", "hammer", "cards",
]  # fmt: skip
YEARS = [2020, 2021, 2022, 2023, 2024]
AGES = list(range(20, 70, 5))
PRICES = [10, 20, 30, 40, 50]
N_ORDERS = 90
SCHEMA = (
    "customers(id, name, city, age) | products(id, name, category, price) | "
    "orders(id, customer_id, product_id, quantity, year)"
)
# The two join paths every hard query is built from, in the one canonical spelling. One join per query:
# a second join takes the SQL past 40 BPE tokens, which a tiny model learns poorly in a few epochs.
JOIN_C = "FROM orders o JOIN customers c ON o.customer_id = c.id"
JOIN_P = "FROM orders o JOIN products p ON o.product_id = p.id"

Pair = tuple[str, str]
CHAT_PAIRED = 80  # train rows joined two by two into multi-turn conversations
CHAT_SYSTEM = "Write one SQLite query for each question. Tables: {schema}"


def table_rows(rng: random.Random) -> dict[str, list[tuple]]:
    customers = [(i + 1, n, rng.choice(CITIES), rng.randint(18, 70)) for i, n in enumerate(NAMES)]
    products = [
        (i + 1, n, CATEGORIES[i % len(CATEGORIES)], rng.randint(2, 60)) for i, n in enumerate(PRODUCTS)
    ]
    orders = []
    for i in range(N_ORDERS):
        # The first orders cycle through every customer and product so that no per-name question has an
        # empty answer (execution accuracy on an empty result says little).
        customer = i % len(NAMES) + 1 if i < 2 * len(NAMES) else rng.randint(1, len(NAMES))
        product = i % len(PRODUCTS) + 1 if i < 2 * len(PRODUCTS) else rng.randint(1, len(PRODUCTS))
        orders.append((i + 1, customer, product, rng.randint(1, 5), rng.choice(YEARS)))
    return {"customers": customers, "products": products, "orders": orders}


def build_database(path: Path, rows: dict[str, list[tuple]]) -> None:
    """Built in memory, then VACUUM INTO a temp file and renamed: never half-written, same bytes every run."""
    db = sqlite3.connect(":memory:")
    db.executescript(
        "CREATE TABLE customers(id INTEGER PRIMARY KEY, name TEXT, city TEXT, age INTEGER);"
        "CREATE TABLE products(id INTEGER PRIMARY KEY, name TEXT, category TEXT, price INTEGER);"
        "CREATE TABLE orders(id INTEGER PRIMARY KEY, customer_id INTEGER, product_id INTEGER,"
        " quantity INTEGER, year INTEGER);"
    )
    for table, values in rows.items():
        marks = ",".join("?" * len(values[0]))
        db.executemany(f"INSERT INTO {table} VALUES ({marks})", values)
    db.commit()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    db.execute("VACUUM INTO ?", (str(tmp),))
    db.close()
    os.replace(tmp, path)


def easy_pairs() -> list[list[Pair]]:
    """Single-table SELECT ... WHERE, no aggregate; one inner list per template."""
    return [
        [(f"names of customers in {c}", f"SELECT name FROM customers WHERE city = '{c}'") for c in CITIES],
        [(f"names of customers older than {a}", f"SELECT name FROM customers WHERE age > {a}") for a in AGES],
        [
            (f"names of customers younger than {a}", f"SELECT name FROM customers WHERE age < {a}")
            for a in AGES
        ],
        [(f"names of {k} products", f"SELECT name FROM products WHERE category = '{k}'") for k in CATEGORIES],
        [(f"products cheaper than {p}", f"SELECT name FROM products WHERE price < {p}") for p in PRICES],
        [
            (f"products that cost more than {p}", f"SELECT name FROM products WHERE price > {p}")
            for p in PRICES
        ],
        [(f"price of the {n}", f"SELECT price FROM products WHERE name = '{n}'") for n in PRODUCTS],
        [(f"category of the {n}", f"SELECT category FROM products WHERE name = '{n}'") for n in PRODUCTS],
        [(f"city of {n}", f"SELECT city FROM customers WHERE name = '{n}'") for n in NAMES],
        [(f"age of {n}", f"SELECT age FROM customers WHERE name = '{n}'") for n in NAMES],
        [(f"ids of orders placed in {y}", f"SELECT id FROM orders WHERE year = {y}") for y in YEARS],
    ]


def medium_pairs() -> list[list[Pair]]:
    """One table with an aggregate, or ORDER BY ... LIMIT."""
    return [
        [
            (f"how many customers live in {c}", f"SELECT COUNT(*) FROM customers WHERE city = '{c}'")
            for c in CITIES
        ],
        [
            (f"how many customers are older than {a}", f"SELECT COUNT(*) FROM customers WHERE age > {a}")
            for a in AGES
        ],
        [
            (f"how many {k} products", f"SELECT COUNT(*) FROM products WHERE category = '{k}'")
            for k in CATEGORIES
        ],
        [
            (f"average price of {k} products", f"SELECT AVG(price) FROM products WHERE category = '{k}'")
            for k in CATEGORIES
        ],
        [
            (
                f"most expensive {k} product",
                f"SELECT name FROM products WHERE category = '{k}' ORDER BY price DESC LIMIT 1",
            )
            for k in CATEGORIES
        ],
        [
            (
                f"cheapest {k} product",
                f"SELECT name FROM products WHERE category = '{k}' ORDER BY price LIMIT 1",
            )
            for k in CATEGORIES
        ],
        [
            (
                f"oldest customer in {c}",
                f"SELECT name FROM customers WHERE city = '{c}' ORDER BY age DESC LIMIT 1",
            )
            for c in CITIES
        ],
        [
            (
                f"youngest customer in {c}",
                f"SELECT name FROM customers WHERE city = '{c}' ORDER BY age LIMIT 1",
            )
            for c in CITIES
        ],
        [
            (f"average age of customers in {c}", f"SELECT AVG(age) FROM customers WHERE city = '{c}'")
            for c in CITIES
        ],
        [(f"how many orders in {y}", f"SELECT COUNT(*) FROM orders WHERE year = {y}") for y in YEARS],
        [
            (f"total quantity ordered in {y}", f"SELECT SUM(quantity) FROM orders WHERE year = {y}")
            for y in YEARS
        ],
        [
            (f"average quantity of orders in {y}", f"SELECT AVG(quantity) FROM orders WHERE year = {y}")
            for y in YEARS
        ],
        [
            (
                f"how many orders have a quantity above {q}",
                f"SELECT COUNT(*) FROM orders WHERE quantity > {q}",
            )
            for q in (1, 2, 3, 4)
        ],
        [
            (f"the {n} most expensive products", f"SELECT name FROM products ORDER BY price DESC LIMIT {n}")
            for n in (2, 3, 4, 5)
        ],
        [
            (f"the {n} cheapest products", f"SELECT name FROM products ORDER BY price LIMIT {n}")
            for n in (2, 3, 4, 5)
        ],
        [
            (f"the {n} oldest customers", f"SELECT name FROM customers ORDER BY age DESC LIMIT {n}")
            for n in (2, 3, 4, 5)
        ],
        [
            (f"the {n} youngest customers", f"SELECT name FROM customers ORDER BY age LIMIT {n}")
            for n in (2, 3, 4, 5)
        ],
        [
            ("the oldest customer", "SELECT name FROM customers ORDER BY age DESC LIMIT 1"),
            ("the youngest customer", "SELECT name FROM customers ORDER BY age LIMIT 1"),
            ("the most expensive product", "SELECT name FROM products ORDER BY price DESC LIMIT 1"),
            ("the cheapest product", "SELECT name FROM products ORDER BY price LIMIT 1"),
            ("how many customers are there", "SELECT COUNT(*) FROM customers"),
            ("how many products are there", "SELECT COUNT(*) FROM products"),
            ("how many orders are there", "SELECT COUNT(*) FROM orders"),
        ],
    ]


def hard_pairs() -> list[list[Pair]]:
    """Joins through orders, and GROUP BY."""
    return [
        [
            (f"total quantity ordered by {n}", f"SELECT SUM(o.quantity) {JOIN_C} WHERE c.name = '{n}'")
            for n in NAMES
        ],
        [(f"how many orders did {n} place", f"SELECT COUNT(*) {JOIN_C} WHERE c.name = '{n}'") for n in NAMES],
        [
            (f"how many times was the {n} ordered", f"SELECT COUNT(*) {JOIN_P} WHERE p.name = '{n}'")
            for n in PRODUCTS
        ],
        [
            (f"total quantity of {n} ordered", f"SELECT SUM(o.quantity) {JOIN_P} WHERE p.name = '{n}'")
            for n in PRODUCTS
        ],
        [(f"number of orders from {c}", f"SELECT COUNT(*) {JOIN_C} WHERE c.city = '{c}'") for c in CITIES],
        [
            (f"number of orders for {k} products", f"SELECT COUNT(*) {JOIN_P} WHERE p.category = '{k}'")
            for k in CATEGORIES
        ],
        [
            (
                f"total quantity of {k} products ordered",
                f"SELECT SUM(o.quantity) {JOIN_P} WHERE p.category = '{k}'",
            )
            for k in CATEGORIES
        ],
        [(f"products ordered in {y}", f"SELECT DISTINCT p.name {JOIN_P} WHERE o.year = {y}") for y in YEARS],
        [
            (f"customers who ordered in {y}", f"SELECT DISTINCT c.name {JOIN_C} WHERE o.year = {y}")
            for y in YEARS
        ],
        [
            (
                f"number of orders per customer in {y}",
                f"SELECT c.name, COUNT(*) {JOIN_C} WHERE o.year = {y} GROUP BY c.name",
            )
            for y in YEARS
        ],
        [
            ("number of customers per city", "SELECT city, COUNT(*) FROM customers GROUP BY city"),
            ("average age per city", "SELECT city, AVG(age) FROM customers GROUP BY city"),
            ("number of products per category", "SELECT category, COUNT(*) FROM products GROUP BY category"),
            ("average price per category", "SELECT category, AVG(price) FROM products GROUP BY category"),
            ("highest price per category", "SELECT category, MAX(price) FROM products GROUP BY category"),
            ("number of orders per year", "SELECT year, COUNT(*) FROM orders GROUP BY year"),
            ("total quantity per year", "SELECT year, SUM(quantity) FROM orders GROUP BY year"),
            ("number of orders per customer", f"SELECT c.name, COUNT(*) {JOIN_C} GROUP BY c.name"),
            ("total quantity per product", f"SELECT p.name, SUM(o.quantity) {JOIN_P} GROUP BY p.name"),
            ("number of orders per city", f"SELECT c.city, COUNT(*) {JOIN_C} GROUP BY c.city"),
        ],
    ]


def all_examples(rng: random.Random) -> list[dict]:
    """Every row, template by template with each template's values shuffled (dev is cut from this order)."""
    examples = []
    for difficulty, templates in (("easy", easy_pairs()), ("medium", medium_pairs()), ("hard", hard_pairs())):
        for pairs in templates:
            pairs = list(pairs)
            rng.shuffle(pairs)
            examples += [
                {"question": q, "schema": SCHEMA, "sql": s, "difficulty": difficulty} for q, s in pairs
            ]
    questions = [e["question"] for e in examples]
    if len(set(questions)) != len(questions):
        raise ValueError("two templates produced the same question; dev would overlap train")
    return examples


def split_examples(examples: list[dict], rng: random.Random) -> dict[str, list[dict]]:
    # Every DEV_EVERY-th row of the template-ordered list: dev gets each difficulty and most templates in
    # proportion, with values the model never saw in train.
    dev = [e for i, e in enumerate(examples) if i % DEV_EVERY == DEV_EVERY - 1]
    train = [e for i, e in enumerate(examples) if i % DEV_EVERY != DEV_EVERY - 1]
    rng.shuffle(train)  # file order is training order for `order: file` curricula: no template runs
    rng.shuffle(dev)
    splits = {}
    for split, rows in (("train", train), ("dev", dev)):
        splits[split] = [{"id": f"{split}-{i}", **row} for i, row in enumerate(rows)]
    for difficulty in ("easy", "medium", "hard"):
        splits[difficulty] = [r for r in splits["train"] if r["difficulty"] == difficulty]
    return splits


def check_sql(db_path: Path, rows: list[dict]) -> None:
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        for row in rows:
            db.execute(
                row["sql"]
            ).fetchall()  # raises on a broken gold query: better here than in an eval job
    finally:
        db.close()


def write_jsonl(path: Path, rows: list[dict]) -> None:
    text = "".join(json.dumps(row) + "\n" for row in rows)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def build_demo_data(out_dir: Path) -> dict[str, Path]:
    """Write shop.db and the splits under out_dir; the same bytes on every run. Returns the paths by name."""
    out_dir = Path(out_dir)
    (out_dir / "sql").mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)
    paths = {"db": out_dir / "shop.db"}
    build_database(paths["db"], table_rows(rng))
    splits = split_examples(all_examples(rng), rng)
    check_sql(paths["db"], splits["train"] + splits["dev"])
    for split, rows in splits.items():
        paths[split] = out_dir / "sql" / f"{split}.jsonl"
        write_jsonl(paths[split], rows)
    for split in ("train", "dev"):
        paths[f"chat-{split}"] = out_dir / "sql" / f"chat-{split}.jsonl"
        write_jsonl(
            paths[f"chat-{split}"], conversations(splits[split], CHAT_PAIRED if split == "train" else 0)
        )
        paths[f"pairs-{split}"] = out_dir / "sql" / f"pairs-{split}.jsonl"
        write_jsonl(paths[f"pairs-{split}"], preference_pairs(paths["db"], splits[split]))
    return paths


# Plausible mistakes, tried in order until one changes the query's result on shop.db (or makes it fail).
WRONG_SQL = (
    (" DESC", ""),
    ("ORDER BY age", "ORDER BY age DESC"),
    ("ORDER BY price", "ORDER BY price DESC"),
    ("SUM(", "COUNT("),
    ("AVG(", "MAX("),
    ("COUNT(*)", "SUM(o.quantity)"),
    (" > ", " < "),
    (" < ", " > "),
    ("c.city", "c.name"),
    ("p.name", "p.category"),
    ("city", "name"),
    ("category", "name"),
    ("age", "id"),
    ("o.year = ", "o.year < "),
    ("= ", "!= "),
    ("FROM customers", "FROM products"),
    ("FROM products", "FROM customers"),
)
PAIR_PROMPT = "{schema} | {question} | SQL: "  # the prompt of the SFT demo (_demo-fields.yaml)


def wrong_query(db: sqlite3.Connection, sql: str) -> str:
    """The first mistake of WRONG_SQL that changes what the gold query returns."""
    gold = db.execute(sql).fetchall()
    for old, new in WRONG_SQL:
        wrong = sql.replace(old, new, 1)
        if wrong == sql:
            continue
        try:
            if db.execute(wrong).fetchall() != gold:
                return wrong
        except sqlite3.Error:
            return wrong  # a query that fails is a plausible wrong answer too
    raise ValueError(f"no plausible wrong query for {sql!r}: add a mistake to WRONG_SQL")


def preference_pairs(db_path: Path, rows: list[dict]) -> list[dict]:
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        return [
            {
                "id": row["id"],
                "prompt": PAIR_PROMPT.format(**row),
                "chosen": row["sql"],
                "rejected": wrong_query(db, row["sql"]),
            }
            for row in rows
        ]
    finally:
        db.close()


def conversations(rows: list[dict], paired: int) -> list[dict]:
    """The rows as `messages` examples: the first `paired` rows two by two, the rest one by one."""
    groups = [rows[i : i + 2] for i in range(0, paired, 2)] + [[row] for row in rows[paired:]]
    chats = []
    for group in groups:
        messages = [{"role": "system", "content": CHAT_SYSTEM.format(schema=group[0]["schema"])}]
        for row in group:
            messages += [
                {"role": "user", "content": row["question"]},
                {"role": "assistant", "content": row["sql"]},
            ]
        chats.append({"id": "+".join(row["id"] for row in group), "messages": messages})
    return chats


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    for name, path in build_demo_data(Path(args[0] if args else "data/demo")).items():
        rows = "" if name == "db" else f" ({len(path.read_text(encoding='utf-8').splitlines())} rows)"
        print(f"{name}: {path}{rows}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
