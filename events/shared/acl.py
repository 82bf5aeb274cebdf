"""Redis ACL rules for the roles that share a namespace: what each may run, on which keys.

A shared registry trusts whoever may write its keys, so a deployment gives each role a Redis
user of its own (docs/security.md says how):

- a **worker** runs the registry's scripts, refreshes its lease and publishes its G4 directory:
  the commands below, on the namespace's keys only (no other namespace, no FLUSHALL, no CONFIG);
- a **router** reads: ``who_has`` (a read-only script call, ``EVALSHA_RO``), the applied ids,
  and the event stream through a consumer group, whose bookkeeping (``XREADGROUP``, ``XACK``)
  Redis counts as writes to the stream key; so a router may write the stream keys, with those
  group commands only, and may only read every other key. It cannot add to the stream, touch
  the index, or create a namespace.

Which worker id a worker may act as is not an ACL matter (every worker writes the shared index):
that is the claim a worker holds on its id.

``setuser_args`` gives the arguments of ``ACL SETUSER`` for a role and namespace; the lines in
docs/security.md are its output for the namespace ``prod``, and a test checks both.
"""

from __future__ import annotations

from typing import Literal

from kvledger.events.shared.keys import KeySpace

Role = Literal["worker", "router"]
ROLES: tuple[Role, ...] = ("worker", "router")

# every connection: the cluster probe, a database number, loading the scripts
_CONNECTION = ("+ping", "+info", "+select", "+script|load")

WORKER_COMMANDS = (
    *_CONNECTION,
    # the registry's scripts and what they call (Redis checks a script's calls too)
    "+evalsha",
    "+evalsha_ro",
    "+get",
    "+set",
    "+del",
    "+exists",
    "+pexpire",
    "+hget",
    "+hmget",
    "+hset",
    "+hdel",
    "+hexists",
    "+hincrby",
    "+hgetall",
    "+hscan",
    "+sadd",
    "+srem",
    "+sismember",
    "+smembers",
    "+xadd",
    "+xtrim",
    "+multi",
    "+exec",
)
"""What a worker runs: registry scripts, leases, the G4 directory."""

ROUTER_COMMANDS = (
    *_CONNECTION,
    "+evalsha_ro",
    "+get",
    "+exists",
    "+hget",
    "+hmget",
    "+hgetall",
    "+hscan",
    "+smembers",
    "+xgroup|create",
    "+xreadgroup",
    "+xack",
    "+xautoclaim",
)
"""What a router runs: ``who_has``, applied ids and counts, the stream with a consumer group."""


def key_patterns(namespace: str) -> tuple[str, str]:
    """The namespace's keys: shard 0's (``kvl:{ns}:...``) and the other shards'
    (``kvl:{ns:<i>:<salt>}:...``; a namespace cannot contain ':')."""
    prefix = KeySpace(namespace).prefix  # checks the name
    return f"{prefix}*", f"kvl:{{{namespace}:*"


def setuser_args(namespace: str, role: Role) -> list[str]:
    """``ACL SETUSER <user> on >password`` followed by these gives ``role`` what it needs in
    ``namespace`` and nothing else (``resetkeys`` and ``-@all`` first: a user being redefined
    keeps nothing it had)."""
    shard0, others = key_patterns(namespace)
    base = ["resetkeys", "resetchannels", "-@all"]
    if role == "worker":
        return [*base, *WORKER_COMMANDS, f"~{shard0}", f"~{others}"]
    if role == "router":
        streams = f"{KeySpace(namespace).stream}", f"kvl:{{{namespace}:*}}:events"
        return [
            *base,
            *ROUTER_COMMANDS,
            f"%R~{shard0}",
            f"%R~{others}",
            *(f"%RW~{stream}" for stream in streams),
        ]
    raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")


def setuser_line(user: str, namespace: str, role: Role, password: str = "PASSWORD") -> str:
    """The ``ACL SETUSER`` line (for ``redis-cli`` or an ACL file, as ``user ...``) of
    ``role`` in ``namespace``."""
    return " ".join(["ACL SETUSER", user, "on", f">{password}", *setuser_args(namespace, role)])
