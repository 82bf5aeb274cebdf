"""The one G3 recovery: open a worker's slot file and keep what its log vouches for.

A restarted worker serves again every G3 block that its log lists on its G3 and whose slot still
names it with an intact checksum; the log's other G3 blocks are gone (overwritten, damaged, or
beyond a smaller file) and are announced as ``Removed``, so the log replays to what the tier
holds. A new file, or a log that cannot be folded, starts G3 empty (the restart's ``Cleared``
says so). ``BlockManager``, the vLLM disk tier and the SGLang backend all recover this way,
each adopting the kept slots into its own pool.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from kvledger.builder import KnownBlocks, Worker
from kvledger.events.types import BlockInfo, Tier
from kvledger.registry.emitter import EventEmitter
from kvledger.tiers.disk.tier import DiskTier
from kvledger.tiers.layout import BlockShape

__all__ = ["G3Recovery", "OpenedG3", "open_g3"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class G3Recovery:
    """What a restarted worker kept of its disk cache (``BlockManager.recovery``).

    ``listed`` blocks were on G3 according to the event log; each was either ``recovered``
    (its slot names it and passes its checksum: it is served again) or dropped, with a
    ``Removed`` event, as ``corrupt`` (its bytes fail their checksum), ``no_room`` (G3 shrank
    below it) or ``missing`` (no intact slot holds it: written or overwritten when the worker
    stopped). ``freed`` slots held blocks the log does not list (evicted, or written in the
    last moments before a crash) and are free again.
    """

    listed: int = 0
    recovered: int = 0
    corrupt: int = 0
    no_room: int = 0
    missing: int = 0
    freed: int = 0
    seconds: float = 0.0


@dataclass
class OpenedG3:
    """A worker's G3 file, opened: what to adopt, and what to announce."""

    disk: DiskTier
    kept: list[tuple[int, BlockInfo]]
    """(slot, block) of every block served again: the caller adopts them into its pool."""
    dropped: list[int]
    """Blocks the log listed on G3 that did not survive."""
    vouched: bool
    """Whether the log vouched for the file (an existing file and a log that folds): G3 is
    then kept through the restart, else it starts empty."""
    report: G3Recovery

    @property
    def recovered(self) -> tuple[Tier, ...]:
        """What to pass ``Worker.resume`` as recovered: G3 when the log vouched for it."""
        return (Tier.G3,) if self.vouched else ()

    def announce(self, worker: Worker, emitter: EventEmitter) -> None:
        """After an earlier run, the dropped blocks' ``Removed`` when the log vouched for the
        file (``resume`` then left G3 out; otherwise its ``Cleared`` said G3 starts empty)."""
        if not worker.restarted:
            return
        if self.vouched:
            emitter.removed(Tier.G3, self.dropped)


def open_g3(
    worker: Worker,
    shape: BlockShape,
    num_blocks: int,
    directory: str | os.PathLike[str],
    *,
    file_name: str = "g3-slots.bin",
    io_threads: int = 4,
) -> OpenedG3:
    """Open (or create) ``directory/file_name`` for ``num_blocks`` blocks of ``shape`` and
    recover it against ``worker``'s log (the tier folds the log once it holds the file's lock).
    """
    folded: list[KnownBlocks | None] = [None]

    def listed() -> KnownBlocks:
        folded[0] = worker.logged(Tier.G3)
        return folded[0] or {}

    disk = DiskTier(directory, shape, num_blocks, file_name=file_name, known=listed,
                    io_threads=io_threads)  # fmt: skip
    try:
        known = folded[0]
        vouched = known is not None  # a new file never asks; a log that cannot fold says None
        kept = disk.recovered_blocks() if vouched else []
        held = {block.sequence_hash for _, block in kept}
        dropped = [seq for seq in (known or {}) if seq not in held]
        report = _report(disk, known or {}, len(kept), dropped)
    except BaseException:
        disk.close()
        raise
    return OpenedG3(disk, kept, dropped, vouched, report)


def _report(disk: DiskTier, known: KnownBlocks, kept: int, dropped: list[int]) -> G3Recovery:
    found = disk.recovery
    gone = set(dropped)
    corrupt = {b.sequence_hash for b in found.corrupt if b is not None} & gone
    no_room = {b.sequence_hash for b in found.no_room if b is not None} & gone - corrupt
    report = G3Recovery(
        listed=len(known),
        recovered=kept,
        corrupt=len(corrupt),
        no_room=len(no_room),
        missing=len(gone - corrupt - no_room),
        freed=found.ignored + found.duplicates + found.damaged,
        seconds=found.seconds,
    )
    if known or report.freed:
        log.info(
            "G3 %s: recovered %d of %d blocks the log lists in %.2f s; dropped %d corrupt, "
            "%d missing, %d that no longer fit; freed %d slots the log does not list",
            disk.path,
            report.recovered,
            report.listed,
            report.seconds,
            report.corrupt,
            report.missing,
            report.no_room,
            report.freed,
        )
    return report
