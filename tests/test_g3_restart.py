"""G3 across restarts, end to end: real SQLite log, real G3 files, real processes.

A restarted manager must serve the disk cache its log lists (byte for byte), drop with a
``Removed`` what fails verification or no longer fits, keep the log a true fold (replay equals
the live registry), and refuse to share its G3 file with a second live manager.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import cast

import pytest
import torch
from services import manager_settings

from kvledger import BlockManager
from kvledger.config import Settings
from kvledger.events.log.replay import replay
from kvledger.events.types import Removed, Tier
from kvledger.registry.state import RegistryState
from kvledger.tiers.disk import G3InUse

BLOCK = 4
GEOMETRY = dict(block_size=BLOCK, num_layers=2, outer_dim=2, inner_dim=8, dtype="float32")


def settings(tmp_path: Path, **kw: object) -> Settings:
    base: dict[str, object] = dict(
        g1_blocks=8, g2_blocks=0, g3_blocks=32, eviction_policy="lru", offload_filter="always"
    )  # no G2: G1 -> G3 directly
    return manager_settings(tmp_path, **(base | kw))


def prompt(i: int, blocks: int = 2) -> list[int]:
    return [1000 * (i + 1) + t for t in range(blocks * BLOCK)]


def compute(m: BlockManager, tokens: list[int], seed: int) -> list[torch.Tensor]:
    """Reuse the cached prefix, fill the rest with seeded random KV, register, release.
    Returns every block's bytes (cached ones read back from G1)."""
    seq = m.sequence(tokens)
    held = m.onboard(seq)
    fresh = m.allocate(len(seq) - len(held))
    gen = torch.Generator().manual_seed(seed)
    layout = m.g1.layout
    for slot in fresh:
        for view in layout.block(slot):
            view.copy_(torch.rand(view.shape, generator=gen))
    held += m.register(fresh, seq, start=len(held))
    data = [torch.cat([v.flatten() for v in layout.block(s)]).clone() for s in held]
    m.release(held)
    assert m.wait_idle(10)
    return data


def onboarded(m: BlockManager, tokens: list[int]) -> list[torch.Tensor]:
    held = m.onboard(m.sequence(tokens))
    layout = m.g1.layout
    data = [torch.cat([v.flatten() for v in layout.block(s)]).clone() for s in held]
    m.release(held)
    return data


def on_g3(m: BlockManager, i: int) -> int:
    hashes = m.sequence(prompt(i)).sequence_hashes
    n = 0
    while n < len(hashes) and m.slot_of(Tier.G3, hashes[n]) is not None:
        n += 1
    return n


def live_state(m: BlockManager) -> RegistryState:
    return m.state()


def assert_log_is_a_fold(m: BlockManager) -> None:
    assert m.event_log is not None
    m.event_log.flush()
    replayed = replay(m.event_log)
    assert replayed == live_state(m), replayed.diff(live_state(m))


def test_restart_serves_the_disk_cache_the_log_lists(tmp_path: Path) -> None:
    s = settings(tmp_path)
    with BlockManager(s) as m:
        original = [compute(m, prompt(i), seed=i) for i in range(3)]
        assert [on_g3(m, i) for i in range(3)] == [2, 2, 2]
    with BlockManager(s) as m2:
        assert m2.recovery is not None
        assert (m2.recovery.listed, m2.recovery.recovered) == (6, 6)
        for i in range(3):
            assert m2.match(m2.sequence(prompt(i))) == (0, 0, 2)
            got = onboarded(m2, prompt(i))
            assert len(got) == 2
            assert all(torch.equal(a, b) for a, b in zip(got, original[i], strict=True))
        assert_log_is_a_fold(m2)


def test_restart_after_sigkill_recovers_what_the_log_committed(tmp_path: Path) -> None:
    """The worker dies without closing anything: the kernel drops its lock, and every block
    the committed log lists on G3 is served again."""
    code = textwrap.dedent(
        f"""
        import sys, time, torch
        from pathlib import Path
        from kvledger import BlockManager, Settings
        tmp = Path(sys.argv[1])
        m = BlockManager(Settings.load(**{GEOMETRY!r}, g1_blocks=8, g2_blocks=0, g3_blocks=32,
            offload_filter="always", data_dir=tmp / "data",
            event_log_url=f"sqlite:///{{tmp / 'events.db'}}"))
        for i in range(3):
            seq = m.sequence([1000 * (i + 1) + t for t in range(2 * {BLOCK})])
            slots = m.allocate(2)
            for slot in slots:
                for view in m.g1.layout.block(slot):
                    view.fill_(i + 0.5)
            m.release(m.register(slots, seq, start=0))
        assert m.wait_idle(10)
        m.event_log.flush()
        print("ready", flush=True)
        time.sleep(60)
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        with pytest.raises(G3InUse, match=f"pid {child.pid}"):
            BlockManager(settings(tmp_path))
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    with BlockManager(settings(tmp_path)) as m:
        assert m.recovery is not None and m.recovery.recovered == 6
        for i in range(3):
            got = onboarded(m, prompt(i))
            assert [float(t[0]) for t in got] == [i + 0.5, i + 0.5]
        assert_log_is_a_fold(m)


def test_a_corrupt_or_unnamed_slot_is_dropped_with_a_removed_event(tmp_path: Path) -> None:
    s = settings(tmp_path)
    with BlockManager(s) as m:
        original = [compute(m, prompt(i), seed=i) for i in range(2)]
        corrupt_hash = m.sequence(prompt(0)).sequence_hashes[1]
        lost_hash = m.sequence(prompt(1)).sequence_hashes[0]
        # both blocks are on G3: the slots are ints
        corrupt_slot = cast(int, m.slot_of(Tier.G3, corrupt_hash))
        lost_slot = cast(int, m.slot_of(Tier.G3, lost_hash))
        tier = m.tier(Tier.G3)
        path, index_path = tier.path, tier.index_path  # type: ignore[attr-defined]
        offset = tier.slot_offset(corrupt_slot)  # type: ignore[attr-defined]
    with open(path, "r+b") as f:  # one flipped bit in a slot's bytes
        f.seek(offset + 3)
        byte = f.read(1)[0]
        f.seek(offset + 3)
        f.write(bytes([byte ^ 0x10]))
    with open(index_path, "r+b") as f:  # an index entry lost (as if overwritten at a crash)
        f.seek(lost_slot * 64)
        f.write(bytes(64))

    with BlockManager(s) as m2:
        r = m2.recovery
        assert r is not None
        assert (r.listed, r.recovered, r.corrupt, r.missing, r.no_room) == (4, 2, 1, 1, 0)
        assert m2.match(m2.sequence(prompt(0))) == (0, 0, 1)  # the prefix ends at the bad one
        assert m2.match(m2.sequence(prompt(1))) == (0, 0, 0)
        assert torch.equal(onboarded(m2, prompt(0))[0], original[0][0])
        assert m2.event_log is not None
        m2.event_log.flush()
        removed = [e for e in m2.event_log.read() if isinstance(e, Removed) and e.tier is Tier.G3]
        assert {h for e in removed for h in e.sequence_hashes} == {corrupt_hash, lost_hash}
        assert_log_is_a_fold(m2)


def test_deleted_g3_files_mean_an_empty_g3_and_the_log_says_so(tmp_path: Path) -> None:
    s = settings(tmp_path)
    with BlockManager(s) as m:
        compute(m, prompt(0), seed=0)
    for name in ("g3-slots.bin", "g3-slots.bin.idx"):
        (tmp_path / "data" / name).unlink()
    with BlockManager(s) as m2:
        assert m2.recovery is not None and m2.recovery.recovered == 0
        assert on_g3(m2, 0) == 0
        assert_log_is_a_fold(m2)


def test_slots_the_log_does_not_list_are_freed(tmp_path: Path) -> None:
    """A block evicted from G3 (Removed in the log) still has intact bytes in its slot: it
    must not come back."""
    s = settings(tmp_path, g3_blocks=4)
    with BlockManager(s) as m:
        for i in range(3):  # 6 blocks through a 4-block G3: the first prompt is evicted
            compute(m, prompt(i), seed=i)
        assert on_g3(m, 0) == 0
    with BlockManager(s) as m2:
        r = m2.recovery
        assert r is not None and (r.listed, r.recovered, r.missing) == (4, 4, 0)
        assert m2.match(m2.sequence(prompt(0))).total == 0
        assert m2.match(m2.sequence(prompt(2))) == (0, 0, 2)
        assert_log_is_a_fold(m2)


def test_g3_blocks_can_grow_and_shrink_keeping_the_newest(tmp_path: Path) -> None:
    with BlockManager(settings(tmp_path, g3_blocks=12)) as m:
        original = [compute(m, prompt(i), seed=i) for i in range(6)]
    with BlockManager(settings(tmp_path, g3_blocks=40)) as m:
        assert m.recovery is not None and m.recovery.recovered == 12
        assert_log_is_a_fold(m)
    with BlockManager(settings(tmp_path, g3_blocks=5)) as m:
        r = m.recovery
        assert r is not None and (r.recovered, r.no_room, r.missing) == (5, 7, 0)
        # the newest writes stay: prompts 5 and 4, and a block of prompt 3
        assert [on_g3(m, i) for i in (4, 5)] == [2, 2]
        assert m.counts()[Tier.G3] == 5
        for i in (4, 5):
            got = onboarded(m, prompt(i))
            assert all(torch.equal(a, b) for a, b in zip(got, original[i], strict=True))
        assert_log_is_a_fold(m)
    data = tmp_path / "data" / "g3-slots.bin"
    slot_bytes = 4096  # a 256-byte block rounds up to a page
    assert os.path.getsize(data) == 4096 + 5 * slot_bytes


def test_two_managers_on_one_folder_are_refused_in_one_process_too(tmp_path: Path) -> None:
    s = settings(tmp_path)
    with BlockManager(s):
        with pytest.raises(G3InUse, match=str(tmp_path / "data")) as caught:
            BlockManager(s)
        assert f"pid {os.getpid()}" in str(caught.value)
    BlockManager(s).close()  # free again once the first one closed


def test_a_second_process_gets_a_clear_error_naming_the_holder(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys
                from pathlib import Path
                from kvledger import BlockManager, Settings
                tmp = Path(sys.argv[1])
                m = BlockManager(Settings.load(**{GEOMETRY!r}, g1_blocks=8, g3_blocks=32,
                    data_dir=tmp / "data", event_log_url=f"sqlite:///{{tmp / 'a.db'}}"))
                print("ready", flush=True)
                sys.stdin.readline()
                m.close()
                """
            ),
            str(tmp_path),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert holder.stdout.readline().strip() == "ready"
        probe = subprocess.run(
            [
                sys.executable,
                "-c",
                textwrap.dedent(
                    f"""
                    import json, sys
                    from pathlib import Path
                    from kvledger import BlockManager, Settings
                    tmp = Path(sys.argv[1])
                    s = Settings.load(**{GEOMETRY!r}, g1_blocks=8, g3_blocks=32,
                        data_dir=tmp / "data", event_log_url=f"sqlite:///{{tmp / 'b.db'}}")
                    try:
                        BlockManager(s).close()
                        print(json.dumps(None))
                    except Exception as exc:
                        print(json.dumps([type(exc).__name__, str(exc)]))
                    """
                ),
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert probe.returncode == 0, probe.stderr
        kind, message = json.loads(probe.stdout.strip().splitlines()[-1])
        assert kind == "G3InUse"
        assert str(tmp_path / "data" / "g3-slots.bin") in message
        assert f"pid {holder.pid}" in message and "data_dir" in message
    finally:
        holder.stdin.write("\n")
        holder.stdin.flush()
        holder.wait(30)
    assert holder.returncode == 0
