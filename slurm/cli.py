"""The door of launch.py: its parsed flags become one typed request (slurm/planning/request.py, checked before
anything loads), and the request's verb runs its command (slurm/commands/, one module a verb). User
mistakes end here as messages and exit code 2; a launch stopped midway as exit 1 (130 for Ctrl-C)."""

from __future__ import annotations

import errno
from pathlib import Path

from core.files import NotARegularFile, forget_warnings, links_below
from core.problems import ConfigError, LaunchError, Problem
from slurm.cluster.profile import load_profile
from slurm.commands import cancel, export, launch, report, sync, watch
from slurm.planning.request import LaunchRequest, action_of, nothing_done, request_from
from slurm.watching.render import err, error, warning

# What a read-only, full or hand-altered run folder raises where a command writes (the report, the launch
# lock, a job's record): a sentence naming the file, exit 1, never a traceback.
WRITE_REFUSALS = {
    errno.EACCES,
    errno.EPERM,
    errno.EROFS,
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EFBIG,
    errno.EISDIR,
    errno.ENOTDIR,
}

# Each verb (slurm/planning/request.py names them, launch.py's flags choose one) → its command.
VERBS = {
    "launch": launch.launch,
    "retry_failed": launch.launch,  # a launch of the failed jobs and what follows them (slurm/queueing/submit.py)
    "dry_run": launch.dry_run,
    "preflight": launch.preflight,
    "calibrate": launch.calibrate,
    "status": watch.status,
    "tail": watch.tail,
    "cancel": cancel.cancel,
    "report": report.report,
    "export": export.export,
    "sync": sync.sync,
}


def run(args) -> int:
    """launch.py's parsed flags → what they ask for (checked at the door) → its verb's command."""
    forget_warnings()  # each command names every unreadable file it meets, even in one process
    try:
        return dispatch(request_from(args))
    except OSError as exc:
        if exc.errno not in WRITE_REFUSALS and not isinstance(exc, NotARegularFile):
            raise
        err.print(
            error(
                f"cannot write {exc.filename or 'a file'} ({exc.strerror}): its folder is read-only or full, "
                "or a folder (a FIFO, a device) stands where this file belongs; fix that and run the command again"
            ),
            highlight=False,
            soft_wrap=True,
        )
        return 1
    except ConfigError as exc:
        for problem in exc.warnings:
            err.print(warning(problem), highlight=False, soft_wrap=True)
        for problem in exc.problems:
            err.print(error(problem), highlight=False, soft_wrap=True)
        undone = nothing_done(action_of(args))
        err.print(f"{len(exc.problems)} problem(s)" + (f"; {undone}." if undone else "."), highlight=False)
        return 2
    except LaunchError as exc:  # Interrupted (Ctrl-C) too: what was left queued or stopped, exit 130
        err.print(error(exc), highlight=False, soft_wrap=True)
        return exc.exit_code
    except KeyboardInterrupt:
        err.print("interrupted (Ctrl-C)", highlight=False)
        return 130


# The verbs that write under the run and log roots, or start jobs that do (--status too: it cancels jobs
# that can never start and notes it in their job.json; --sync marks the W&B runs it uploaded).
WRITING = {"launch", "retry_failed", "calibrate", "preflight", "report", "export", "cancel", "status", "sync"}


def dispatch(request: LaunchRequest) -> int:
    if not request.config_dir.is_dir():
        raise ConfigError(
            [Problem(str(request.config_dir), "--config-dir", "is not a folder of experiment YAMLs")]
        )
    profile, _ = load_profile(request.config_dir)
    if request.action in WRITING:
        refuse_links(Path(profile.run_dir), Path(profile.log_dir))
    return VERBS[request.action](request, profile)


def refuse_links(*roots: Path) -> None:
    """Anyone who can write a shared runs/ can plant a link there (`speeds.jsonl` -> another user's file,
    a stage folder -> theirs) and make this launch, its jobs or the report write through it: every link
    below the run and log roots is refused before anything is written. A root that is itself a link is
    the user's choice and stays allowed."""
    found = sorted({link for root in roots for link in links_below(root)})  # a log root inside the run root
    if found:
        message = (
            "is a symbolic link below the run or log root: a launch, its jobs or the report would write "
            "into what it points to; remove it (a run root that is itself a link is fine)"
        )
        raise ConfigError([Problem(str(link), "", message) for link in found])
