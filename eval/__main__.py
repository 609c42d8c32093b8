"""`python -m eval SUBCOMMAND ...`: each subcommand's module registers its own parser and `run`.

A subcommand module must not import torch at import time: `score` runs on the login node.
"""

from __future__ import annotations

import argparse
import sys

from eval import job, score, shared


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval", description="Evaluation tools.")
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    score.add_parser(subcommands)
    job.add_parser(subcommands)
    shared.add_parser(subcommands)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
