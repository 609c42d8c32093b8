"""Where the ranks of a SLURM job meet (torch's env:// rendezvous): pure functions of what SLURM says.

    MASTER_ADDR  the first node of the allocation as SLURM addresses it: its NodeAddr in `scontrol show
                 node` (never localhost, never the login node's SLURM_LAUNCH_NODE_IPADDR); one node: loopback
    MASTER_PORT  drawn from the job id alone, so every node and every requeue of the job picks the same one

Torch-free and scheduler-free (the job entry, slurm/queueing/jobs.py, runs the two scontrol commands and hands their
text here), so each rule is tested on recorded output: the dev cluster's nodes all have the address
127.0.0.1, and a wrong choice would pass every test run on it.
"""

from __future__ import annotations

import hashlib
import re
import socket
from collections.abc import Callable

# Below Linux's default ephemeral range (32768-60999), where any outgoing connection on a node may hold a
# port (rank 0 then fails with EADDRINUSE: seen on the dev cluster), and above the well-known services.
# Fixed, not read from the node: nodes whose ranges differ would pick different ports and never meet.
PORT_RANGE = (10000, 32767)


class RendezvousError(RuntimeError):
    """The ranks could not be told where to meet: the message names the node and what SLURM said."""


def rendezvous_port(job_id: str) -> int:
    """Rank 0's port: the same on every node, for every task and every requeue of `job_id`."""
    first, last = PORT_RANGE
    return first + int(hashlib.sha256(job_id.encode()).hexdigest(), 16) % (last - first + 1)


def first_node(hostnames: str) -> str:
    """The allocation's first node in `scontrol show hostnames $SLURM_JOB_NODELIST` (one name a line, in
    SLURM's node order: the node of task 0)."""
    names = hostnames.split()
    if not names:
        raise RendezvousError("scontrol show hostnames printed no node for this job's SLURM_JOB_NODELIST")
    return names[0]


def node_address(node: str, show_node: str) -> str | None:
    """NodeAddr of `node` in `scontrol show node NODE` (one or several lines); None when it names none."""
    for block in re.split(r"\n(?=NodeName=)", show_node.strip()):
        fields = dict(re.findall(r"(\w+)=(\S*)", block))
        if fields.get("NodeName") == node:
            return fields.get("NodeAddr") or None
    return None


def resolves(name: str) -> bool:
    try:
        socket.getaddrinfo(name, None)
    except (OSError, UnicodeError):
        return False
    return True


def master_address(node: str, show_node: str, can_resolve: Callable[[str], bool] = resolves) -> str:
    """The address every rank dials to reach rank 0 on `node`: its NodeAddr, which SLURM itself uses to
    reach the node. SLURM defaults NodeAddr to the node's name; a name no rank can resolve is refused here
    rather than left to each rank to hang on."""
    address = node_address(node, show_node) or node
    if re.fullmatch(r"[\d.]+|[0-9a-fA-F:]*:[0-9a-fA-F:.]*", address) or can_resolve(address):
        return address
    raise RendezvousError(
        f"rank 0's node {node} has NodeAddr {address!r} (scontrol show node {node}), which does not resolve "
        "on this node: the other ranks could not reach it. Set NodeAddr in slurm.conf to an address, or "
        f"make {address} resolve on every node (DNS, /etc/hosts)"
    )


def tasks_per_node(text: str) -> list[int]:
    """SLURM_TASKS_PER_NODE → each node's count: `4(x2)` → [4, 4], `2(x2),1` → [2, 2, 1], `4` → [4]."""
    counts = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            raise RendezvousError(f"SLURM_TASKS_PER_NODE={text!r} is not SLURM's N(xK),M form")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def gpus_on_node(text: str | None) -> int | None:
    """SLURM_GPUS_ON_NODE (a plain count on every SLURM; SLURM_GPUS_PER_NODE may read `a100:4`)."""
    return int(text) if text and text.strip().isascii() and text.strip().isdigit() else None


def same_on_every_node(tasks: list[int]) -> None:
    """One task per GPU on every node, the same count on each: a job SLURM gave unevenly is refused with
    the numbers (the global batch and each rank's share assume it)."""
    if len(set(tasks)) > 1:
        raise RendezvousError(
            f"SLURM placed {tasks} tasks on the job's {len(tasks)} nodes; every node must run the same "
            "number (one per GPU): ask resources.gpus per node, not a total"
        )
