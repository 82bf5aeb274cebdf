"""The SGLang backend's G4 over NIXL: this rank's G3 file served to other ranks, theirs read.

Ranks on different hosts share no file system, so the copy of a page another rank can read is
the one in the owner's G3 file, read over the network. Each rank (``g4: nixl``):

- maps its G3 file and registers the mapping with its NIXL agent as one region
  (``MappedG3``), and publishes the agent card and, per page, its slot and the checksum the G3
  index recorded (``BlockExporter``, fed by the same events as the log, so the exported map
  follows the log: a page evicted is withdrawn, a page recovered at start is published again);
- reads a page it lacks from the rank the shared registry names (``fetch_blocks``: one NIXL
  READ per run of pages into registered staging pages, each page checked against its
  published checksum, the entries looked up again): a page its owner evicted or overwrote
  meanwhile reads as a miss, never as another page's bytes.

Nothing here imports SGLang: it is the mechanism BlockManager's G4 and the vLLM peer tier use,
wired to a G3 file.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import numpy as np

from kvledger.events.shared.registry import SharedRegistry
from kvledger.events.types import AnyEvent, Tier
from kvledger.tiers.disk import DiskTier
from kvledger.tiers.host import HostTier
from kvledger.tiers.remote import (
    BlockExporter,
    MappedG3,
    RemoteAgent,
    RemoteDirectory,
    RemoteFetcher,
    fetch_blocks,
    nixl_unavailable_reason,
)
from kvledger.tiers.remote.export import SlotOf

__all__ = ["NixlPages"]


class NixlPages:
    """One rank's G4 over NIXL: ``disk`` exported, other ranks' G3 pages read into
    ``staging_pages`` host pages.

    Raises RuntimeError naming the cause when NIXL cannot be loaded: ``g4: nixl`` was asked
    for, so the backend does not start without it.
    """

    def __init__(
        self,
        worker_id: int,
        shared: SharedRegistry,
        disk: DiskTier,
        *,
        staging_pages: int = 16,
        timeout_s: float = 5.0,
        devices: str | None = None,
    ) -> None:
        reason = nixl_unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"kvledger HiCache: g4 'nixl' needs NIXL, which fails: {reason}")
        self.worker_id = worker_id
        self.timeout_s = timeout_s
        self.agent = RemoteAgent(worker_id, devices=devices)
        self.mapped: MappedG3 | None = None
        try:
            self.mapped = MappedG3(disk)
            self.agent.register_region(self.mapped.region)
            self.staging = HostTier(disk.shape, staging_pages, pin=False)
            self.agent.register(self.staging)
            directory = RemoteDirectory(
                shared.client, shared.namespace, ttl_s=shared.lease_ttl_ms / 1000
            )
            self.exporter = BlockExporter(directory, self.agent.card(disk.shape), self.mapped)
            self.fetcher = RemoteFetcher(
                self.agent,
                directory,
                shared,
                self.staging,
                worker_id=worker_id,
                source_tier=Tier.G3,
                timeout_s=timeout_s,
            )
        except BaseException:
            self._release()
            raise
        self._rows = self.staging.layout.block_bytes_view().numpy()
        # staging pages free to land in; those an abandoned read may still write into stay
        # with the fetcher until ``reclaim`` names them
        self._free = list(range(staging_pages))
        self._cond = threading.Condition()
        self._started = False

    # -- this rank's pages -------------------------------------------------------------------

    def observe(self, event: AnyEvent) -> None:
        """See one event before the log does (the emitter's sink calls this first): a page
        that arrived on G3 is published with its index checksum, one evicted is withdrawn."""
        self.exporter(event)

    def start(self, slot_of: SlotOf, recovered: Iterable[int] = ()) -> None:
        """Publish the card and the pages G3 recovery kept (``recovered`` sequence hashes:
        adopted without events); ``slot_of`` is the G3 pool's lookup."""
        self.exporter.bind(slot_of).start()
        self._started = True
        self.exporter.export(recovered)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until the directory holds every change so far (tests, benchmarks)."""
        return self.exporter.flush(timeout)

    # -- other ranks' pages ------------------------------------------------------------------

    def read(
        self, hashes: Sequence[int], into: Sequence[np.ndarray | None] | None = None
    ) -> list[np.ndarray | None]:
        """Each of ``hashes`` that another rank holds in G3, read over NIXL and checked: its
        bytes (in ``into[i]`` when given, else a new array), or None for a miss."""
        out: list[np.ndarray | None] = [None] * len(hashes)
        at = 0
        while at < len(hashes):
            slots = self._take(len(hashes) - at)
            if not slots:  # every staging page is in use past the deadline: misses
                break
            chunk = hashes[at : at + len(slots)]
            fetched = fetch_blocks(self.fetcher, chunk, slots)
            for i, slot in fetched.landed:
                target = into[at + i] if into is not None else None
                if target is None:
                    out[at + i] = self._rows[slot].copy()
                else:
                    target[:] = self._rows[slot]
                    out[at + i] = target
            self._give(slots, fetched.held_back)
            at += len(chunk)
        return out

    def _take(self, wanted: int) -> list[int]:
        """Up to ``wanted`` staging pages, waiting (at most a read's deadline) while all are
        busy with other threads' reads."""
        with self._cond:
            if self.fetcher.holding:
                self._free += self.fetcher.reclaim()
            self._cond.wait_for(lambda: bool(self._free), timeout=self.timeout_s)
            taken, self._free = self._free[:wanted], self._free[wanted:]
            return taken

    def _give(self, slots: list[int], held_back: Sequence[int]) -> None:
        held = set(held_back)  # the fetcher gives them back (``reclaim``) when their reads end
        with self._cond:
            self._free += [s for s in slots if s not in held]
            self._cond.notify_all()

    # -- closing -----------------------------------------------------------------------------

    def close(self) -> None:
        """Withdraw this rank's card and pages, let go of the memory, unmap the file."""
        if self._started:
            self.exporter.close()
            self._started = False
        self._release()

    def _release(self) -> None:
        self.agent.close()
        if self.mapped is not None:
            self.mapped.close()
            self.mapped = None
