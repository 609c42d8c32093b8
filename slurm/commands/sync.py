"""--sync: upload the W&B runs that jobs wrote offline."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from slurm.planning.request import LaunchRequest
from slurm.watching.render import err, error, out


def sync(request: LaunchRequest, profile) -> int:
    return sync_wandb(Path(profile.run_dir))


def sync_wandb(run_root: Path) -> int:
    """--sync: upload the W&B runs that jobs wrote offline (WANDB_MODE=offline on nodes without network),
    skipping those already synced (wandb marks them with a `.synced` file)."""
    runs = [
        run for run in sorted(run_root.glob("*/*/wandb/offline-run-*")) if not any(run.glob("*.wandb.synced"))
    ]
    if not runs:
        out.print(f"No offline W&B runs to sync under {run_root}/.", highlight=False)
        return 0
    out.print(f"Syncing {len(runs)} offline W&B run(s) with `wandb sync`:", highlight=False)
    # In the run root: wandb sync writes its own debug log into ./wandb, not into the user's folder.
    absolute = [str(run.resolve()) for run in runs]
    done = subprocess.run([sys.executable, "-m", "wandb", "sync", *absolute], cwd=run_root, check=False)
    if done.returncode:
        err.print(
            error(
                f"wandb sync failed (exit {done.returncode}), see above: log in on this machine "
                "first (`wandb login`, or WANDB_API_KEY in the environment), with network"
            ),
            highlight=False,
        )
        return 1
    return 0
