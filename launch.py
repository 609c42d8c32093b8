"""Validate experiment YAMLs, plan them onto stages and jobs, and run them on SLURM (or locally).

python launch.py --all                       # every experiment in configs/experiments
python launch.py --all --config-dir configs/demo --wait
python launch.py --exp NAME --dry-run train.learning_rate=1e-4
python launch.py --all --pack 4 --budget 6:00:00 # one 4-GPU allocation, if the estimates fit
python launch.py --exp NAME --calibrate       # time a few dozen steps on the real GPUs for the estimates
python launch.py --all --preflight [--json]  # trainable %, token lengths, GPU memory; run before every submit
python launch.py --status | --tail EXP[/STAGE] [--rank K] | --cancel [--exp NAME ...] | --report | --sync
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from slurm import cli


def parse_args(argv: list[str]) -> argparse.Namespace:
    args = argument_parser().parse_args(argv)
    # `--exp a b key=value`: argparse hands the override to --exp, which takes every word after it. No
    # experiment name holds '=' (core/config.py SAFE_NAME), so such a word is an override, in its place.
    if args.exp and (overrides := [word for word in args.exp if "=" in word]):
        args.exp = [word for word in args.exp if "=" not in word] or None
        args.overrides = [*overrides, *args.overrides]
    return args


def argument_parser() -> argparse.ArgumentParser:
    """Every option of the command line, with its help: what --help prints and docs/reference/ lists."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--all", action="store_true", help="every experiment in --config-dir")
    which.add_argument("--exp", nargs="+", metavar="NAME", help="only these experiments")
    add_verbs(parser.add_mutually_exclusive_group())
    add_options(parser)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. train.learning_rate=1e-4")
    return parser


def add_verbs(action) -> None:
    """The flags that name what to do, one at most (none: a launch); slurm/planning/request.py names each verb."""
    action.add_argument("--dry-run", action="store_true", help="validate and print the plan; submit nothing")
    action.add_argument(
        "--preflight",
        action="store_true",
        help="trainable %%, token lengths and GPU memory per training job, from configs (no weights, no GPU)",
    )
    action.add_argument(
        "--calibrate",
        action="store_true",
        help="run a few dozen steps of each selected experiment's first stage to fill the speed book",
    )
    action.add_argument("--status", action="store_true", help="one table: state, reason, step, loss, ETA")
    action.add_argument("--tail", metavar="EXP[/STAGE]", help="follow the log of that job")
    action.add_argument(
        "--cancel", action="store_true", help="cancel the live jobs of the selected experiments"
    )
    action.add_argument("--report", action="store_true", help="write runs/report.md, .csv and loss plots")
    action.add_argument("--sync", action="store_true", help="upload offline W&B runs (from a login node)")
    action.add_argument(
        "--export",
        nargs="*",
        metavar="EXP[/STAGE]",
        help="merge the adapter into its base as a model to serve (runs/EXP/export/); with --all, every one",
    )
    action.add_argument(
        "--retry-failed",
        action="store_true",
        help="resubmit only failed jobs and the jobs that depend on them",
    )


def add_options(parser: argparse.ArgumentParser) -> None:
    """How a verb does it (slurm/planning/request.py refuses an option given to a verb it does not apply to)."""
    parser.add_argument(
        "--rank", type=int, metavar="K", help="with --tail: the log of task K of a multi-GPU job"
    )
    parser.add_argument("--calibrate-steps", type=int, metavar="N", help="with --calibrate: steps to time")
    parser.add_argument(
        "--config-dir",
        type=Path,
        help="the folder of experiment YAMLs (default configs/experiments); with --status, --tail, --cancel "
        "and --report, it narrows them to that folder's experiments (default: all the run root holds)",
    )
    parser.add_argument(
        "--backend", choices=["auto", "slurm", "local"], help="default: auto (sbatch on PATH)"
    )
    parser.add_argument("--json", action="store_true", help="with --dry-run or --preflight: as JSON")
    parser.add_argument("--no-preflight", action="store_true", help="submit without the preflight checks")
    parser.add_argument("--wait", action="store_true", help="block with a live table until every job ended")
    parser.add_argument(
        "--pack",
        type=int,
        metavar="G",
        help="run the jobs as units of one allocation with G GPUs (one lane each); see --budget",
    )
    parser.add_argument(
        "--budget",
        metavar="HH:MM:SS",
        help="with --pack: the allocation's time limit; a plan whose estimates do not fit is refused",
    )
    parser.add_argument(
        "--budget-basis",
        choices=["worst", "expected"],
        help="with --pack --budget: count a pruned sweep's runs whole (worst, the default) or at the epochs "
        "pruning is expected to leave them (expected)",
    )
    parser.add_argument("--force", action="store_true", help="rerun finished stages whose config changed")
    parser.add_argument(
        "--export-format",
        choices=["safetensors", "gguf"],
        help="with --export: gguf also runs llama.cpp's converter (or says the command to run)",
    )
    parser.add_argument(
        "--removed",
        action="store_true",
        help="with --cancel: the live jobs of experiments (sweep points) no config folder has any more",
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return cli.run(args)


if __name__ == "__main__":
    sys.exit(main())
