"""The owner's side of G4: keep this worker's block table in the remote directory current.

``BlockExporter`` is an event sink. Events reach it synchronously from the block manager while
the manager holds its lock, right after a pool change: a block that just arrived on the exported
tier (Stored, Offloaded or Onboarded there) has its bytes in place, so its checksum is taken at
once, before anything can evict it and reuse the slot. Redis is written from a background
thread, in event order, so the engine never waits on the network.

A reader may still see an entry a moment after the block was evicted (the withdrawal is in the
queue). That is why readers check the checksum of what they read and look the entry up again
afterwards: a slot that was reused reads as a mismatch, never as another block's bytes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Protocol

import xxhash

from kvledger.events.types import AnyEvent, Cleared, Offloaded, Onboarded, Removed, Stored, Tier
from kvledger.tiers.base import MemoryTier
from kvledger.tiers.layout import FullyContiguous
from kvledger.tiers.remote.directory import AgentCard, BlockEntry, RemoteDirectory

log = logging.getLogger(__name__)

SlotOf = Callable[[int], "int | None"]


def block_checksum(layout: FullyContiguous, slot: int) -> int:
    """xxh3-64 of one block's bytes (the same checksum the G3 file keeps per slot).

    A block in device memory (G1 on CUDA) is copied to the host first: xxh3 runs on the CPU.
    """
    row = layout.block_bytes_view()[slot]
    if row.device.type != "cpu":
        row = row.cpu()
    return xxhash.xxh3_64_intdigest(row.numpy().data)


class ExportedSlots(Protocol):
    """Slots other workers read in place: a host tier, or a G3 file mapped into memory
    (``MappedG3``), with the checksum of what a slot holds now."""

    @property
    def tier(self) -> Tier: ...

    def checksum(self, slot: int) -> int:
        """xxh3-64 of the block in ``slot``, as a reader must find it."""
        ...


class HostSlots:
    """A host tier's slots: checksums are taken from the bytes, when the block arrives."""

    def __init__(self, tier: MemoryTier) -> None:
        layout = tier.layout
        if not isinstance(layout, FullyContiguous) or layout.device.type != "cpu":
            raise ValueError(
                f"only a host tier with one run of memory can be exported, not "
                f"{tier.tier.name} on {layout.device}"
            )
        self.tier = tier.tier
        self.layout = layout

    def checksum(self, slot: int) -> int:
        return block_checksum(self.layout, slot)


class BlockExporter:
    """Publishes the blocks of one tier of ``card.worker_id`` for remote reads: a host tier
    (G2), or any ``ExportedSlots`` (the SGLang backend's G3 file, mapped).

    ``bind(slot_of)`` must be called before blocks arrive: ``slot_of(sequence_hash)`` is the
    tier pool's lookup (``BlockPool.lookup``). Events of other tiers are ignored.
    """

    def __init__(
        self,
        directory: RemoteDirectory,
        card: AgentCard,
        tier: MemoryTier | ExportedSlots,
        *,
        heartbeat_s: float | None = None,
    ) -> None:
        slots = HostSlots(tier) if isinstance(tier, MemoryTier) else tier
        if card.region(slots.tier) is None:
            raise ValueError(f"the agent card of worker {card.worker_id} has no {slots.tier.name}")
        self.directory = directory
        self.card = card
        self.slots: ExportedSlots = slots
        self.tier = slots.tier
        self.worker_id = card.worker_id
        self.heartbeat_s = directory.ttl_ms / 3000 if heartbeat_s is None else heartbeat_s
        self._slot_of: SlotOf | None = None
        self._ops: list[tuple[str, int, BlockEntry | None]] = []
        self._cond = threading.Condition()
        self._busy = False
        self._stop = False
        self.published = 0
        self.withdrawn = 0
        self.redis_errors = 0
        self._thread = threading.Thread(
            target=self._run, name=f"kvledger-export-{self.worker_id}", daemon=True
        )

    def bind(self, slot_of: SlotOf) -> BlockExporter:
        self._slot_of = slot_of
        return self

    def start(self) -> BlockExporter:
        """Publish the card and start the writer thread."""
        self.directory.publish_card(self.card)
        self.directory.update_blocks(self.worker_id, clear=True)
        self._thread.start()
        return self

    # -- the event sink ----------------------------------------------------------------------

    def __call__(self, event: AnyEvent) -> None:
        if event.tier != self.tier:
            return
        if isinstance(event, Stored | Offloaded | Onboarded):
            self.export(event.sequence_hashes)
        elif isinstance(event, Removed):
            self._queue([("del", seq, None) for seq in event.sequence_hashes])
        elif isinstance(event, Cleared):
            self._queue([("clear", 0, None)])

    def export(self, sequence_hashes: Iterable[int]) -> None:
        """Publish blocks that are on the tier now: what each event of their arrival does,
        and what a restarted worker does for the blocks it recovered (no event names them)."""
        if self._slot_of is None:
            raise RuntimeError("BlockExporter got blocks before bind(slot_of) was called")
        ops: list[tuple[str, int, BlockEntry | None]] = []
        for seq in sequence_hashes:
            slot = self._slot_of(seq)
            if slot is not None:
                ops.append(("put", seq, BlockEntry(self.tier, slot, self.slots.checksum(slot))))
        self._queue(ops)

    def _queue(self, ops: list[tuple[str, int, BlockEntry | None]]) -> None:
        if ops:
            with self._cond:
                self._ops.extend(ops)
                self._cond.notify()

    # -- the writer thread -------------------------------------------------------------------

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued change is in Redis; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._ops or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _run(self) -> None:
        next_beat = time.monotonic() + self.heartbeat_s
        while True:
            with self._cond:
                while not self._ops and not self._stop and time.monotonic() < next_beat:
                    self._cond.wait(max(0.0, next_beat - time.monotonic()))
                ops, self._ops = self._ops, []
                stopping = self._stop
                self._busy = True
            try:
                if ops:
                    self._write(ops)
                if time.monotonic() >= next_beat:
                    self.directory.publish_card(self.card)  # also brings it back after a flush
                    self.directory.heartbeat(self.worker_id)
                    next_beat = time.monotonic() + self.heartbeat_s
            except Exception as exc:  # Redis down: readers miss; they never read wrong bytes
                self.redis_errors += 1
                log.warning("remote directory update of worker %d failed: %s", self.worker_id, exc)
                time.sleep(min(1.0, self.heartbeat_s))
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
            if stopping:
                return

    def _write(self, ops: list[tuple[str, int, BlockEntry | None]]) -> None:
        """Fold the batch into its final state per block, then write it in one transaction."""
        clear = False
        final: dict[int, BlockEntry | None] = {}
        for op, seq, entry in ops:
            if op == "clear":
                clear, final = True, {}
            else:
                final[seq] = entry
        puts = [(s, e) for s, e in final.items() if e is not None]
        dels = [s for s, e in final.items() if e is None]
        self.directory.update_blocks(self.worker_id, puts, dels, clear=clear)
        self.published += len(puts)
        self.withdrawn += len(dels)

    def close(self, *, withdraw: bool = True) -> None:
        """Write what is queued, stop the thread and (by default) remove the card and table."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        if withdraw:
            try:
                self.directory.withdraw(self.worker_id)
            except Exception as exc:
                log.warning(
                    "withdrawing worker %d from the remote directory: %s", self.worker_id, exc
                )
