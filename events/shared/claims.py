"""One live owner per worker id in a shared-registry namespace.

Two processes publishing as the same worker id would interleave two histories under one
applied id and corrupt the index (and a fleet that forgets to set the id gets exactly that,
since it defaults to 0). So a worker claims its id before it publishes: the claim names the
holder (host, pid, when), lives as long as the worker's lease, and comes with a fencing token,
a number higher than every earlier claim of the id. Every shard keeps the newest token of each
worker (its fence) and refuses writes that carry an older one, so a process that was stopped
past its lease and resumed cannot write over its successor, and learns that it lost the id.

A claim held by a process that is gone (same host, its pid dead or reused) is taken over at
once, so a worker restarted after a crash does not wait for its old lease to lapse.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from datetime import UTC, datetime


class WorkerIdTaken(RuntimeError):
    """Another live process holds this worker id in the namespace."""


class ClaimLost(RuntimeError):
    """A newer claim of this worker id fenced this process off: its writes are refused."""


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (None when unknown or gone):
    with the pid, what tells a live holder from a new process that reused its pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: fields follow the last ')'
    return int(stat[stat.rindex(b")") + 2 :].split()[19])


@dataclass(frozen=True)
class Holder:
    """Who holds a worker id: what a refused claimant is told, and what tells a dead holder."""

    host: str
    pid: int
    since: float
    dp_rank: int = 0
    started: int | None = None

    @classmethod
    def this_process(cls, dp_rank: int = 0) -> Holder:
        pid = os.getpid()
        return cls(socket.gethostname(), pid, time.time(), dp_rank, _start_time(pid))

    def to_json(self) -> str:
        return json.dumps(
            {
                "host": self.host,
                "pid": self.pid,
                "since": self.since,
                "dp_rank": self.dp_rank,
                "started": self.started,
            },
            separators=(",", ":"),
        )

    @classmethod
    def parse(cls, claim: bytes | str) -> tuple[int, Holder | None]:
        """A stored claim (``<token>|<holder JSON>``) as (token, holder); holder None when
        the JSON is not ours (written by something else: treated as alive)."""
        text = claim.decode() if isinstance(claim, bytes) else claim
        token, _, rest = text.partition("|")
        try:
            fields = json.loads(rest)
            holder = cls(
                str(fields["host"]),
                int(fields["pid"]),
                float(fields["since"]),
                int(fields.get("dp_rank", 0)),
                fields.get("started"),
            )
        except (ValueError, KeyError, TypeError):
            holder = None
        return int(token), holder

    def is_gone(self) -> bool:
        """True only when the holder ran on this host and that process no longer runs."""
        if self.host != socket.gethostname():
            return False
        if self.pid == os.getpid():
            return False  # this process: a claim of its own (a second publisher) is live
        started = _start_time(self.pid)
        return started is None or (self.started is not None and started != self.started)

    def describe(self) -> str:
        since = datetime.fromtimestamp(self.since, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        return f"pid {self.pid} on {self.host} (dp rank {self.dp_rank}), since {since}"
