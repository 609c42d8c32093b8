"""The few collective steps the recipe needs when it runs as N data-parallel processes (DDP).

    join(placement)        # init the process group from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (env://)
    is_main()              # rank 0 writes the run directory; the others only train
    barrier(at)            # wait until every rank got here (e.g. a checkpoint is committed)
    doing(what)            # what this rank does now (tokenizing X): a rank left waiting past the
                           # preparation timeout names it (PreparationTimeout), not torch's bare timeout
    any_rank(flag)         # True on every rank when it is True on any: a stop is collective
    gather(value, at)      # every rank's value, in rank order (on every rank)
    post(topic, text)      # hand rank 0 a text without waiting on anyone (another node's GPU samples);
    collect(topic, ranks)  # rank 0: what those ranks posted since its last collect
    leave()                # all ranks meet at the end of the stage

With one process (WORLD_SIZE unset or 1) each of these is the trivial local answer, so the recipe reads
the same either way. The process group is made here, before the Trainer: the recipe needs a barrier while
it prepares the run directory; accelerate (the Trainer's) then reuses the group instead of making one.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from train.device import Placement

log = logging.getLogger(__name__)


# Two stated waits (env, seconds). JOIN: every rank reaches rank 0's address and the group forms, before any
# weight is loaded; a rank that cannot (a wrong address, a firewall, a node that never started) fails the
# job within it, naming itself and the address:port it tried. PREPARE: what any later collective may wait,
# e.g. the others at a barrier while rank 0 tokenizes for minutes (torch's own default, 30 minutes).
def seconds_from_env(name: str, default: int) -> int:
    """A stated wait from the environment, in whole seconds; anything else is refused naming the variable
    (before: a bare `invalid literal for int()` at the import of this module, in every training job)."""
    raw = os.environ.get(name, str(default))
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(
            f"{name}={raw!r}: a whole number of seconds above 0 is expected (the default is {default})"
        )
    return value


JOIN_TIMEOUT_S = seconds_from_env("LORA_JOIN_TIMEOUT_S", 120)
PREPARE_TIMEOUT_S = seconds_from_env("LORA_PREPARE_TIMEOUT_S", 1800)
# What the other ranks wait for rank 0's writes (a checkpoint's commit and rotation, the final adapter and
# summary): not a preparation, so never less than this, whatever LORA_PREPARE_TIMEOUT_S says (before: a
# 3 s preparation timeout failed a run that had finished training, at its final save; L6).
SAVE_WAIT_S = max(PREPARE_TIMEOUT_S, 600)


class JoinError(RuntimeError):
    """The ranks did not form their group within JOIN_TIMEOUT_S: the message names who and where."""


class PreparationTimeout(RuntimeError):
    """A rank waited at a collective past PREPARE_TIMEOUT_S: the message names the ranks that had not come,
    their nodes, and what each was still doing (`doing`), instead of gloo's or NCCL's bare timeout."""


# The rendezvous store, where each rank says what it is doing (`doing`); None with one process.
_store: dist.Store | None = None


def join(placement: Placement) -> None:
    """Join the process group of this run when there is more than one process (idempotent)."""
    if placement.world_size <= 1 or dist.is_initialized():
        return
    if placement.cuda:
        torch.cuda.set_device(placement.device)  # nccl binds each rank to its own GPU
    if placement.backend == "gloo" and os.environ.get("MASTER_ADDR") == "127.0.0.1":
        # All ranks on this machine: gloo's own connections stay on loopback too, instead of the address
        # the host name resolves to (on a closed network a dropped connect hangs, it does not fail).
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # Said before, not after: a rank that cannot reach rank 0 waits here until the join timeout.
    log.info(
        "joining %d ranks at %s:%s (%s%s), join timeout %d s",
        placement.world_size,
        os.environ.get("MASTER_ADDR"),
        os.environ.get("MASTER_PORT"),
        placement.backend,
        f" on {os.environ['GLOO_SOCKET_IFNAME']}" if "GLOO_SOCKET_IFNAME" in os.environ else "",
        JOIN_TIMEOUT_S,
    )
    global _store
    _store = joined_store(placement.world_size)
    dist.init_process_group(
        backend=placement.backend,
        store=_store,
        rank=int(os.environ["RANK"]),
        world_size=placement.world_size,
        timeout=timedelta(seconds=PREPARE_TIMEOUT_S),
        device_id=torch.device(placement.device) if placement.cuda else None,
    )


def joined_store(world_size: int, join_s: int | None = None) -> dist.TCPStore:
    """The rendezvous store once every rank has reached it (rank 0 hosts it and waits for the others; the
    others connect), within the join timeout; its later waits get the preparation timeout."""
    join_s = JOIN_TIMEOUT_S if join_s is None else join_s
    address, port, rank = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["RANK"])
    try:
        store = dist.TCPStore(
            address, port, world_size, is_master=rank == 0, timeout=timedelta(seconds=join_s)
        )
    except (RuntimeError, OSError) as exc:
        said = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise JoinError(
            join_failure(rank, world_size, socket.gethostname(), address, port, join_s, str(exc), said)
        ) from None
    store.set_timeout(timedelta(seconds=PREPARE_TIMEOUT_S))
    return store


def join_failure(
    rank: int, world_size: int, host: str, address: str, port: int, join_s: int, text: str, said: str
) -> str:
    """Why the group did not form, from torch's `text` of the failure. Rank 0 finding its port taken fails at
    once: it did not wait for anyone, and the other ranks may have reached whatever holds that port (L3:
    before, it read as a 120 s join wait)."""
    if rank == 0 and re.search(r"address already in use|EADDRINUSE|errno:? ?98\b", text, re.IGNORECASE):
        return (
            f"rank 0 on {host} could not listen on {address}:{port}: another process on that node holds the "
            f"port, so the group never formed and no weights were loaded; the port is drawn from the job id "
            f"(slurm/cluster/rendezvous.py): free it, or relaunch (a new job draws another). torch said: {said}"
        )
    whom = (
        f"rank 0 on {host} waited for the other {world_size - 1} rank(s) at {address}:{port}"
        if rank == 0
        else f"rank {rank} on {host} could not reach rank 0 at {address}:{port}"
    )
    return (
        f"{whom} for the join timeout ({join_s} s, LORA_JOIN_TIMEOUT_S); the group never formed, so no "
        f"weights were loaded. Each rank's log names its node; torch said: {said}"
    )


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def is_main() -> bool:
    return rank() == 0


def doing(what: str) -> None:
    """Say what this rank is doing now (loading the model, tokenizing a file): a rank left waiting for it
    past PREPARE_TIMEOUT_S names it (`waited_for`). One store write; not for every training step."""
    if active() and _store is not None:
        _store.set(f"doing/{rank()}", f"{socket.gethostname()}\t{time.time():.0f}\t{what}")


def waited_for(at: str, world_size: int, now: float | None = None) -> str:
    """Who a rank waiting at `at` waited for: each rank not at `at`, its node and what it said it was doing."""
    now = time.time() if now is None else now
    _store.set_timeout(timedelta(seconds=5))  # rank 0 hosts the store; a rank that is gone answers nothing
    late = []
    for other in range(world_size):
        key = f"doing/{other}"
        try:
            said = _store.get(key).decode() if _store.check([key]) else ""
        except (RuntimeError, OSError):
            said = ""
        host, since, what = (said.split("\t", 2) + ["?", "?", "?"])[:3] if said else ("?", "?", "?")
        if what != f"waiting at {at}":
            spent = f" (for {now - float(since):.0f} s)" if since.isdigit() else ""
            late.append(f"rank {other} on {host} was still {what if said else 'starting'}{spent}")
    return "; ".join(late) or "every rank had come (a rank may have ended)"


@contextmanager
def collective(at: str, wait_s: int | None = None):
    """A collective of the preparation, `at` what. The ranks first meet in the rendezvous store (each sets
    its arrival key, then waits for everyone's), so past PREPARE_TIMEOUT_S it fails naming the late ranks
    and what they were doing, whatever the backend: gloo says only that a receive timed out, and NCCL's
    watchdog tears the process down. The collective itself then runs with every rank there. `wait_s`: the
    bound of that wait, PREPARE_TIMEOUT_S when None. Once through, the rank says so (`doing`): a rank later
    late elsewhere is named by what it does after, not as still waiting here (L6)."""
    wait_s = PREPARE_TIMEOUT_S if wait_s is None else wait_s
    if active() and _store is not None:
        doing(f"waiting at {at}")
        _arrivals[at] = _arrivals.get(at, 0) + 1  # every rank calls the same collectives in the same order
        keys = [f"arrived/{at}/{_arrivals[at]}/{other}" for other in range(dist.get_world_size())]
        _store.set(keys[rank()], "1")
        try:
            _store.wait(keys, timedelta(seconds=wait_s))
        except RuntimeError:  # the store's own timeout (DistStoreError)
            raise PreparationTimeout(
                f"rank {rank()} on {socket.gethostname()} waited {wait_s} s (LORA_PREPARE_TIMEOUT_S) "
                f"at {at}: {waited_for(at, dist.get_world_size())}. Raise LORA_PREPARE_TIMEOUT_S above the "
                "longest preparation (a first tokenization of a large file), or tokenize once before (the cache "
                "is shared)"
            ) from None
    yield
    doing(f"past {at}")


# How many times this rank reached each collective: the generation in its arrival keys.
_arrivals: dict[str, int] = {}


def barrier(at: str = "a barrier", wait_s: int | None = None) -> None:
    if active():
        with collective(at, wait_s):
            dist.barrier()


def any_rank(flag: bool) -> bool:
    """All-reduce (MAX) of a local flag: every rank gets the same answer at the same call."""
    if not active():
        return flag
    device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def gather(value, at: str = "a gather") -> list:
    """Every rank's (picklable) value, in rank order."""
    if not active():
        return [value]
    values = [None] * dist.get_world_size()
    with collective(at):
        dist.all_gather_object(values, value)
    return values


def post(topic: str, text: str) -> None:
    """Append `text` to this rank's list under `topic` in the rendezvous store, for rank 0 to `collect`: a
    one-way channel that waits on nobody, unlike a collective, so a thread may post while the ranks train.
    Each rank is the only writer of its list: the text first, then the count that makes it visible."""
    if _store is None:
        return
    key = f"{topic}/{rank()}"
    _posted[key] = _posted.get(key, 0) + 1
    _store.set(f"{key}/{_posted[key]}", text)
    _store.add(f"{key}/count", 1)


def collect(topic: str, ranks: list[int]) -> dict[int, list[str]]:
    """Rank 0: what each of `ranks` posted under `topic` since the last collect, oldest first; the texts
    read are deleted from the store (a job of days posts thousands)."""
    if _store is None:
        return {}
    texts: dict[int, list[str]] = {}
    for other in ranks:
        key = f"{topic}/{other}"
        count = _store.add(f"{key}/count", 0)
        unread = range(_collected.get(key, 0) + 1, count + 1)
        texts[other] = [_store.get(f"{key}/{n}").decode() for n in unread]
        for n in unread:
            _store.delete_key(f"{key}/{n}")
        _collected[key] = count
    return texts


# How many texts this rank posted under each key, and how many rank 0 collected.
_posted: dict[str, int] = {}
_collected: dict[str, int] = {}


def leave() -> None:
    """All ranks meet at the end, so rank 0 (host of the rendezvous store) does not exit under the others.
    The group is not destroyed: torch frees it at exit. Destroying it while the Trainer's DDP model still
    holds it hung a rank at exit about one run in three (tests/test_train_ddp.py)."""
    barrier()
