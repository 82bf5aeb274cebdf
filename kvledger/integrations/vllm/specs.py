"""What the manager tells the workers: kvledger's ``LoadStoreSpec``s.

vLLM's scheduler and workers live in different processes, and the only thing that crosses from
the manager to a worker is the spec of each transfer job (``prepare_store``'s ``store_spec``,
``prepare_load``'s spec). With a G3, a job may have to move blocks between kvledger's own tiers
before its G1 copy can run, so the specs carry those moves:

- a store that evicted G2 blocks worth keeping first copies each such G2 slot to the G3 slot
  the manager chose (a demotion), then writes G1 into the G2 slots (``block_ids``);
- a load reads each block from G2 (``block_ids``) or, where ``block_ids`` is -1, straight from
  G3 (``g3_slots``); a block found on G3 only is first copied into a fresh G2 slot (a
  promotion, after the demotions that freeing that slot called for) and read from there.

Both subclass vLLM's ``CPULoadStoreSpec``, so ``block_ids`` keeps its meaning (G2 slots) for
anything that reads it. Plain ``CPULoadStoreSpec``s still come out when no G3 move is needed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from kvledger.events.types import BlockInfo

__all__ = ["DiskMoves", "KvledgerLoadSpec", "KvledgerStoreSpec"]


class DiskMoves:
    """The G2 <-> G3 copies that precede a job's G1 copy, in the order they must run:
    demotions (G2 -> G3, with each block's name for the G3 index), then promotions
    (G3 -> G2)."""

    def __init__(
        self,
        demotions: Sequence[tuple[int, int]] = (),
        names: Sequence[BlockInfo] = (),
        promotions: Sequence[tuple[int, int]] = (),
    ) -> None:
        if len(names) != len(demotions):
            raise ValueError(f"{len(demotions)} demotions but {len(names)} block names")
        self.demotions = [(int(g2), int(g3)) for g2, g3 in demotions]
        self.names = [BlockInfo(*name) for name in names]
        self.promotions = [(int(g3), int(g2)) for g3, g2 in promotions]

    def __bool__(self) -> bool:
        return bool(self.demotions or self.promotions)

    def __repr__(self) -> str:
        return f"DiskMoves(demotions={self.demotions}, promotions={self.promotions})"


class KvledgerStoreSpec(CPULoadStoreSpec):  # type: ignore[misc]  # vLLM is untyped here
    """Write G1 into G2 slots ``block_ids``, after the demotions in ``moves``."""

    def __init__(self, block_ids: list[int], moves: DiskMoves) -> None:
        super().__init__(block_ids)
        self.moves = moves

    def __repr__(self) -> str:
        return f"KvledgerStoreSpec({self.block_ids!r}, {self.moves!r})"


class KvledgerLoadSpec(CPULoadStoreSpec):  # type: ignore[misc]  # vLLM is untyped here
    """Read block ``i`` from G2 slot ``block_ids[i]``, or from G3 slot ``g3_slots[i]`` where
    ``block_ids[i]`` is -1, after the moves in ``moves``."""

    def __init__(self, block_ids: list[int], g3_slots: list[int], moves: DiskMoves) -> None:
        super().__init__(block_ids)
        if len(g3_slots) != len(block_ids):
            raise ValueError(f"{len(block_ids)} G2 slots but {len(g3_slots)} G3 slots")
        self.g3_slots = np.array(g3_slots, dtype=np.int32)
        self.moves = moves

    def __repr__(self) -> str:
        return f"KvledgerLoadSpec({self.block_ids!r}, g3={self.g3_slots!r}, {self.moves!r})"
