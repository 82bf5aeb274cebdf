"""``allocate`` waits for the write-through copies that hold released blocks, and only then
says the pool is exhausted; a really full pool still says so at once."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
from services import manager_settings

from kvledger import BlockManager, Settings
from kvledger.events.types import Tier
from kvledger.registry.errors import PoolExhausted


def test_readme_loop_with_a_small_g1_runs_as_written(tmp_path: Path) -> None:
    """The README example in a loop, with the README's geometry and g1_blocks=64,
    g2_blocks=128: every request needs 62 of the 64 G1 blocks while the previous request's
    blocks are still being written through to G2."""
    manager = BlockManager(Settings.load(g1_blocks=64, g2_blocks=128, data_dir=tmp_path))
    rng = random.Random(0)
    try:
        for _ in range(4):
            prompt_token_ids = [rng.randrange(32000) for _ in range(1000)]
            seq = manager.sequence(prompt_token_ids)
            held = manager.onboard(seq)
            fresh = manager.allocate(len(seq) - len(held))
            held += manager.register(fresh, seq, start=len(held))
            manager.release(held)
    finally:
        manager.close()


def small(tmp_path: Path, **kw: object) -> BlockManager:
    base: dict[str, object] = dict(g1_blocks=8, g2_blocks=16)
    return BlockManager(manager_settings(tmp_path, **(base | kw)))


def test_a_really_full_pool_raises_at_once_saying_who_holds_it(tmp_path: Path) -> None:
    with small(tmp_path, allocate_wait_s=600) as m:
        held = m.allocate(8)
        started = time.monotonic()
        with pytest.raises(PoolExhausted, match="8 are held by requests, 0 by copies in flight"):
            m.allocate(1)
        assert time.monotonic() - started < 60, "a full pool must not wait for the timeout"
        m.release(held)


def stall_copies(m: BlockManager) -> threading.Event:
    """Keep the copier's one worker thread busy until the returned event is set, so
    every copy queued meanwhile stays in flight."""
    go = threading.Event()
    m._transfers._worker.submit(go.wait)  # no public way to stall the copy thread
    return go


def test_allocate_waits_for_copies_in_flight_then_succeeds(tmp_path: Path) -> None:
    with small(tmp_path) as m:
        go = stall_copies(m)
        seq = m.sequence(list(range(32)))
        slots = m.allocate(8)
        m.release(m.register(slots, seq, start=0))  # released, but G1 -> G2 copies hold them
        got: list[list[int]] = []
        waiter = threading.Thread(target=lambda: got.append(m.allocate(8, timeout=60)))
        try:
            waiter.start()
            waiter.join(0.3)
            assert waiter.is_alive() and not got, "allocate waits while the copies are in flight"
        finally:
            go.set()
        waiter.join(60)
        assert len(got) == 1 and sorted(got[0]) == list(range(8))
        m.release(got[0])


def test_allocate_gives_up_after_its_timeout_naming_the_copies(tmp_path: Path) -> None:
    with small(tmp_path) as m:
        go = stall_copies(m)
        slots = m.allocate(8)
        m.release(m.register(slots, m.sequence(list(range(32))), start=0))
        try:
            with pytest.raises(
                PoolExhausted, match=r"8 more are held by copies in flight .* within 0.2 s"
            ):
                m.allocate(3, timeout=0.2)
            assert m.num_free(Tier.G1) == 0, "nothing handed out"
        finally:
            go.set()
        assert len(m.allocate(3)) == 3
