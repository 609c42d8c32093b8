"""The demo's text-to-SQL data: a small shop database and template questions over it, deterministic.

    python -m train.demo_data data/demo

writes `shop.db` and `sql/{train,dev,easy,medium,hard}.jsonl` (rows: id, question, schema, sql, difficulty).
Every gold query runs on shop.db. The SQL is short and in one canonical style so a tiny model learns it in
a few epochs on a CPU.
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import sys
from pathlib import Path

SEED = 7
CITIES = ["Paris", "Lyon", "Nice", "Lille", "Brest", "Metz"]
CATEGORIES = ["book", "game", "tool", "food"]
NAMES = ["Ada", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivo", "Jill", "Kai", "Lea"]
PRODUCTS = ["lamp", "chess", "saw", "tea", "novel", "atlas", "drill", "cake", "puzzle", "jam"]
SCHEMA = (
    "customers(id, name, city, age) | products(id, name, category, price) | "
    "orders(id, customer_id, product_id, quantity, year)"
)


def build_database(path: Path, rng: random.Random) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    db = sqlite3.connect(tmp)
    db.executescript(
        "CREATE TABLE customers(id INTEGER PRIMARY KEY, name TEXT, city TEXT, age INTEGER);"
        "CREATE TABLE products(id INTEGER PRIMARY KEY, name TEXT, category TEXT, price INTEGER);"
        "CREATE TABLE orders(id INTEGER PRIMARY KEY, customer_id INTEGER, product_id INTEGER,"
        " quantity INTEGER, year INTEGER);"
    )
    customers = [(i + 1, n, rng.choice(CITIES), rng.randint(18, 70)) for i, n in enumerate(NAMES)]
    products = [(i + 1, n, CATEGORIES[i % 4], rng.randint(2, 60)) for i, n in enumerate(PRODUCTS)]
    orders = [
        (
            i + 1,
            rng.randint(1, len(NAMES)),
            rng.randint(1, len(PRODUCTS)),
            rng.randint(1, 5),
            rng.randint(2020, 2024),
        )
        for i in range(60)
    ]
    db.executemany("INSERT INTO customers VALUES (?,?,?,?)", customers)
    db.executemany("INSERT INTO products VALUES (?,?,?,?)", products)
    db.executemany("INSERT INTO orders VALUES (?,?,?,?,?)", orders)
    db.commit()
    db.close()
    os.replace(tmp, path)


def easy_pairs() -> list[tuple[str, str]]:
    pairs = []
    for city in CITIES:
        pairs.append((f"names of customers in {city}", f"SELECT name FROM customers WHERE city = '{city}'"))
        pairs.append(
            (f"how many customers live in {city}", f"SELECT COUNT(*) FROM customers WHERE city = '{city}'")
        )
    for age in (20, 30, 40, 50, 60):
        pairs.append(
            (f"names of customers older than {age}", f"SELECT name FROM customers WHERE age > {age}")
        )
        pairs.append(
            (f"names of customers younger than {age}", f"SELECT name FROM customers WHERE age < {age}")
        )
    for category in CATEGORIES:
        pairs.append(
            (f"names of {category} products", f"SELECT name FROM products WHERE category = '{category}'")
        )
    for price in (10, 20, 30, 40):
        pairs.append((f"products cheaper than {price}", f"SELECT name FROM products WHERE price < {price}"))
        pairs.append(
            (f"products that cost more than {price}", f"SELECT name FROM products WHERE price > {price}")
        )
    for name in PRODUCTS:
        pairs.append((f"price of the {name}", f"SELECT price FROM products WHERE name = '{name}'"))
    for name in NAMES:
        pairs.append((f"city of {name}", f"SELECT city FROM customers WHERE name = '{name}'"))
        pairs.append((f"age of {name}", f"SELECT age FROM customers WHERE name = '{name}'"))
    return pairs


def medium_pairs() -> list[tuple[str, str]]:
    pairs = []
    for category in CATEGORIES:
        pairs.append(
            (
                f"average price of {category} products",
                f"SELECT AVG(price) FROM products WHERE category = '{category}'",
            )
        )
        pairs.append(
            (
                f"most expensive {category} product",
                f"SELECT name FROM products WHERE category = '{category}' ORDER BY price DESC LIMIT 1",
            )
        )
        pairs.append(
            (
                f"cheapest {category} product",
                f"SELECT name FROM products WHERE category = '{category}' ORDER BY price LIMIT 1",
            )
        )
    for city in CITIES:
        pairs.append(
            (
                f"oldest customer in {city}",
                f"SELECT name FROM customers WHERE city = '{city}' ORDER BY age DESC LIMIT 1",
            )
        )
        pairs.append(
            (f"average age of customers in {city}", f"SELECT AVG(age) FROM customers WHERE city = '{city}'")
        )
    for year in range(2020, 2025):
        pairs.append((f"how many orders in {year}", f"SELECT COUNT(*) FROM orders WHERE year = {year}"))
        pairs.append(
            (f"total quantity ordered in {year}", f"SELECT SUM(quantity) FROM orders WHERE year = {year}")
        )
    for n in (2, 3, 4):
        pairs.append(
            (f"the {n} most expensive products", f"SELECT name FROM products ORDER BY price DESC LIMIT {n}")
        )
        pairs.append((f"the {n} youngest customers", f"SELECT name FROM customers ORDER BY age LIMIT {n}"))
    return pairs


def hard_pairs() -> list[tuple[str, str]]:
    pairs = []
    for name in NAMES:
        pairs.append(
            (
                f"products ordered by {name}",
                "SELECT DISTINCT p.name FROM orders o JOIN products p ON o.product_id = p.id "
                f"JOIN customers c ON o.customer_id = c.id WHERE c.name = '{name}'",
            )
        )
        pairs.append(
            (
                f"how many orders did {name} place",
                f"SELECT COUNT(*) FROM orders o JOIN customers c ON o.customer_id = c.id WHERE c.name = '{name}'",
            )
        )
    for name in PRODUCTS:
        pairs.append(
            (
                f"customers who ordered the {name}",
                "SELECT DISTINCT c.name FROM orders o JOIN customers c ON o.customer_id = c.id "
                f"JOIN products p ON o.product_id = p.id WHERE p.name = '{name}'",
            )
        )
    for city in CITIES:
        pairs.append(
            (
                f"number of orders from {city}",
                f"SELECT COUNT(*) FROM orders o JOIN customers c ON o.customer_id = c.id WHERE c.city = '{city}'",
            )
        )
    pairs.append(("number of customers per city", "SELECT city, COUNT(*) FROM customers GROUP BY city"))
    pairs.append(
        ("number of products per category", "SELECT category, COUNT(*) FROM products GROUP BY category")
    )
    pairs.append(("number of orders per year", "SELECT year, COUNT(*) FROM orders GROUP BY year"))
    pairs.append(("total quantity per year", "SELECT year, SUM(quantity) FROM orders GROUP BY year"))
    return pairs


def rows_for(pairs: list[tuple[str, str]], difficulty: str) -> list[dict]:
    return [{"question": q, "schema": SCHEMA, "sql": s, "difficulty": difficulty} for q, s in pairs]


def build_demo_data(out_dir: Path) -> dict[str, Path]:
    """Write the database and the splits; the same files, byte for byte, on every run."""
    rng = random.Random(SEED)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sql").mkdir(exist_ok=True)
    build_database(out_dir / "shop.db", rng)
    examples = (
        rows_for(easy_pairs(), "easy") + rows_for(medium_pairs(), "medium") + rows_for(hard_pairs(), "hard")
    )
    rng.shuffle(examples)
    cut = len(examples) * 5 // 6
    splits = {"train": examples[:cut], "dev": examples[cut:]}
    for split, rows in splits.items():
        for index, row in enumerate(rows):
            row["id"] = f"{split}-{index}"
    for name in ("easy", "medium", "hard"):
        splits[name] = [r for r in splits["train"] if r["difficulty"] == name]
    paths = {"db": out_dir / "shop.db"}
    for split, rows in splits.items():
        paths[split] = out_dir / "sql" / f"{split}.jsonl"
        lines = [json.dumps({"id": r["id"], **{k: v for k, v in r.items() if k != "id"}}) for r in rows]
        paths[split].write_text("\n".join(lines) + "\n", encoding="utf-8")
    return paths


if __name__ == "__main__":
    written = build_demo_data(Path(sys.argv[1] if len(sys.argv) > 1 else "data/demo"))
    for name, path in written.items():
        print(f"{name}: {path}")
