"""The Redis key layout of one shared-registry namespace, in one place.

Every key of a namespace lies under ``kvl:{<namespace>}:``; the braces are a hash tag, so Redis
Cluster keeps a whole namespace on one slot, which the Lua scripts need because they touch keys
they derive from the prefix (``lua/generations.lua`` builds ``idx``, ``gens`` and ``sweep`` from
it). The shared registry, its publishers and subscribers, and the G4 directory
(``kvledger.tiers.remote.directory``) all name their keys through ``KeySpace``.

Kept by the shared registry (``registry.py`` says what each holds):

- ``idx``, ``gens``, ``held``, ``applied``, ``count``, ``workers``, ``events``, ``sweep``
- ``lease:<worker>``            string with a TTL, refreshed by every apply and by heartbeats

Kept by the G4 directory, in keys the registry's scripts never touch:

- ``nixl:<worker>``             string  the worker's NIXL agent card
- ``nixl:<worker>:blocks``      hash    where each of its blocks sits
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_NAMESPACE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclass(frozen=True, slots=True)
class KeySpace:
    """The keys of one namespace: ``KeySpace("prod").lease(3) == "kvl:{prod}:lease:3"``."""

    namespace: str
    prefix: str = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.namespace, str) or not _NAMESPACE.match(self.namespace):
            raise ValueError(
                f"namespace {self.namespace!r} must be 1-64 characters of letters, digits, "
                "'_', '.', '-'"
            )
        object.__setattr__(self, "prefix", f"kvl:{{{self.namespace}}}:")

    # -- the shared registry's -----------------------------------------------------------

    @property
    def index(self) -> str:
        return self.prefix + "idx"

    @property
    def generations(self) -> str:
        return self.prefix + "gens"

    @property
    def held(self) -> str:
        return self.prefix + "held"

    @property
    def applied(self) -> str:
        return self.prefix + "applied"

    @property
    def count(self) -> str:
        return self.prefix + "count"

    @property
    def workers(self) -> str:
        return self.prefix + "workers"

    @property
    def stream(self) -> str:
        return self.prefix + "events"

    @property
    def sweep(self) -> str:
        return self.prefix + "sweep"

    def lease(self, worker_id: int | str) -> str:
        return f"{self.prefix}lease:{worker_id}"

    # -- the G4 directory's --------------------------------------------------------------

    def agent_card(self, worker_id: int) -> str:
        return f"{self.prefix}nixl:{int(worker_id)}"

    def block_table(self, worker_id: int) -> str:
        return f"{self.prefix}nixl:{int(worker_id)}:blocks"

    def all_keys(self) -> str:
        """The SCAN pattern that matches every key of the namespace."""
        return self.prefix + "*"
