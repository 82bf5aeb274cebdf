"""G3 on real files: checksums, corruption, reopening, O_DIRECT, a full disk, kvikio fallback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from services import tiny_tmpfs

from kvledger.events.types import BlockInfo
from kvledger.tiers import BlockShape, Copier, DeviceTier, DiskTier, DiskTierError, HostTier
from kvledger.tiers.disk import G3InUse
from kvledger.tiers.disk.fileio import kvikio_unavailable_reason

SHAPE = BlockShape(num_layers=2, outer_dim=2, page_size=4, inner_dim=128, dtype=torch.bfloat16)
POISON = 0x5A


def random_host(blocks: int, seed: int) -> HostTier:
    host = HostTier(SHAPE, blocks, pin=False)
    raw = host.layout.tensor.view(torch.uint8)
    gen = torch.Generator().manual_seed(seed)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    return host


def raw_bytes(host: HostTier) -> torch.Tensor:
    return host.layout.block_bytes_view()


def test_block_of_a_page_uses_o_direct_and_round_trips(tmp_path: Path) -> None:
    assert SHAPE.block_bytes % 4096 == 0
    g3 = DiskTier(tmp_path, SHAPE, 8)
    assert g3.io.name == "posix+odirect"  # ext4/xfs under tmp_path; tmpfs would say "posix"
    host, back = random_host(8, 1), HostTier(SHAPE, 8, pin=False)
    copier = Copier()
    copier.copy(host, [0, 1, 2, 3], g3, [7, 0, 3, 5]).wait()
    result = copier.copy(g3, [7, 0, 3, 5], back, [4, 5, 6, 7]).wait()
    assert result.failed == []
    assert torch.equal(raw_bytes(back)[4:8], raw_bytes(host)[0:4])
    copier.close()
    g3.close()


def test_corrupt_slot_is_a_miss_never_handed_on(tmp_path: Path) -> None:
    copier = Copier(staging_blocks=2)
    g3 = DiskTier(tmp_path, SHAPE, 8, io_threads=2)
    host = random_host(4, 2)
    g1 = DeviceTier(SHAPE, 8, device="cpu")
    for layer in g1.layout.layers:  # type: ignore[attr-defined]
        layer.view(torch.uint8).fill_(POISON)
    copier.copy(host, [0, 1, 2, 3], g3, [0, 1, 2, 3]).wait()

    with open(g3.path, "r+b") as f:  # one flipped bit in slot 2's bytes
        f.seek(g3.slot_offset(2) + 1000)
        byte = f.read(1)[0]
        f.seek(g3.slot_offset(2) + 1000)
        f.write(bytes([byte ^ 0x10]))

    blocks = [BlockInfo(10 + i, i, None) for i in range(4)]
    result = copier.copy(g3, [0, 1, 2, 3], g1, [4, 5, 6, 7], blocks=blocks).wait()

    assert result.failed == [(2, 6)]
    assert result.dst_slots == [4, 5, 7]
    assert g3.corrupt_reads == 1
    for view in g1.layout.block(6):  # the corrupt bytes never reached G1
        assert bool((view.view(torch.uint8) == POISON).all())
    for src, dst in [(0, 4), (1, 5), (3, 7)]:  # bytes, not values: random bits hold NaNs
        host_block = host.layout.tensor[src].view(torch.uint8)
        for i, v in enumerate(g1.layout.block(dst)):
            assert torch.equal(v.view(torch.uint8), host_block[i])
    assert [b.sequence_hash for b in result.blocks] == [10, 11, 13]  # the names that arrived

    # The slot is no longer trusted: a second read is an empty miss, not another corrupt one.
    again = copier.copy(g3, [2], host, [0]).wait()
    assert again.failed == [(2, 0)] and g3.empty_reads == 1 and g3.corrupt_reads == 1
    copier.close()
    g3.close()


def test_corruption_is_caught_reading_into_host_memory_too(tmp_path: Path) -> None:
    g3 = DiskTier(tmp_path, SHAPE, 4)
    host = random_host(4, 3)
    copier = Copier()
    copier.copy(host, [0, 1], g3, [0, 1]).wait()
    with open(g3.path, "r+b") as f:
        f.seek(g3.slot_offset(1) + SHAPE.block_bytes - 1)
        last = f.read(1)[0]
        f.seek(g3.slot_offset(1) + SHAPE.block_bytes - 1)
        f.write(bytes([last ^ 1]))
    result = copier.copy(g3, [0, 1], host, [2, 3]).wait()
    assert (result.copied, result.failed, g3.corrupt_reads) == ([(0, 2)], [(1, 3)], 1)
    copier.close()


def test_never_written_slot_reads_as_a_miss(tmp_path: Path) -> None:
    g3 = DiskTier(tmp_path, SHAPE, 4)
    copier = Copier()
    result = copier.copy(g3, [3], HostTier(SHAPE, 1, pin=False), [0]).wait()
    assert result.failed == [(3, 0)] and g3.empty_reads == 1 and g3.corrupt_reads == 0
    copier.close()


def test_reopened_file_keeps_slots_and_checksums(tmp_path: Path) -> None:
    host = random_host(3, 4)
    copier = Copier()
    g3 = DiskTier(tmp_path, SHAPE, 6)
    copier.copy(host, [0, 1, 2], g3, [5, 4, 0]).wait()
    g3.close()

    reopened = DiskTier(tmp_path, SHAPE, 6)
    back = HostTier(SHAPE, 4, pin=False)
    result = copier.copy(reopened, [5, 4, 0, 1], back, [0, 1, 2, 3]).wait()
    assert result.failed == [(1, 3)]  # never written before the restart
    assert torch.equal(raw_bytes(back)[:3], raw_bytes(host)[:3])
    copier.close()


def test_file_of_another_layout_or_kind_is_refused(tmp_path: Path) -> None:
    DiskTier(tmp_path, SHAPE, 6).close()
    other = BlockShape(2, 2, 8, 128, torch.bfloat16)
    with pytest.raises(ValueError, match=r"made for another layout: .*page_size=4 \(want 8\)"):
        DiskTier(tmp_path, other, 6)
    with pytest.raises(ValueError, match=r"delete .*g3-slots.bin and g3-slots.bin.idx"):
        DiskTier(tmp_path, other, 6)
    (tmp_path / "junk.bin").write_bytes(b"not a kvledger file")
    with pytest.raises(ValueError, match="is not a kvledger G3 file"):
        DiskTier(tmp_path, SHAPE, 6, file_name="junk.bin")


def test_bad_disk_tier_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="positive number of blocks"):
        DiskTier(tmp_path, SHAPE, 0)
    with pytest.raises(ValueError, match="io_threads must be at least 1"):
        DiskTier(tmp_path, SHAPE, 2, io_threads=0)
    with pytest.raises(ValueError, match="unknown G3 I/O backend 'nvme'"):
        DiskTier(tmp_path, SHAPE, 2, backend="nvme")  # type: ignore[arg-type]


@pytest.mark.skipif(kvikio_unavailable_reason() is None, reason="kvikio is usable here")
def test_without_kvikio_auto_falls_back_and_explicit_kvikio_says_why(tmp_path: Path) -> None:
    assert DiskTier(tmp_path, SHAPE, 2, file_name="a.bin").io.name.startswith("posix")
    with pytest.raises(RuntimeError, match=r"'kvikio' was asked for but .*(libcuda|kvikio)"):
        DiskTier(tmp_path, SHAPE, 2, file_name="b.bin", backend="kvikio")


CHILD_PRELUDE = """
import json, resource, signal, sys, torch
from kvledger.tiers import BlockShape, DiskTier, DiskTierError, HostTier, Copier
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG from write() instead of dying
SHAPE = BlockShape(2, 2, 4, 128, torch.bfloat16)
directory, limit = sys.argv[1], int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
"""


def run_child(body: str, *args: object) -> dict[str, object]:
    code = CHILD_PRELUDE + textwrap.dedent(body)
    proc = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    out: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def test_disk_full_while_creating_is_a_clear_error_and_leaves_no_file(tmp_path: Path) -> None:
    out = run_child(
        """
        try:
            DiskTier(directory, SHAPE, 64)
            print(json.dumps({"error": None}))
        except DiskTierError as exc:
            print(json.dumps({"error": str(exc)}))
        """,
        tmp_path,
        64 * 1024,
    )
    error = str(out["error"])
    assert str(tmp_path / "g3-slots.bin") in error
    assert "cannot reserve" in error and "file size limit" in error
    assert not (tmp_path / "g3-slots.bin").exists()


def test_disk_full_while_offloading_fails_the_transfer_and_reports_nothing(
    tmp_path: Path,
) -> None:
    g3 = DiskTier(tmp_path, SHAPE, 8)
    limit = g3.slot_offset(2)  # slots 0 and 1 fit under the limit, slot 5 does not
    g3.close()
    out = run_child(
        """
        copier = Copier()
        g3 = DiskTier(directory, SHAPE, 8, io_threads=1)
        host = HostTier(SHAPE, 2, pin=False)
        host.layout.tensor.view(torch.uint8).fill_(7)
        blocks = [(1, 1, None), (2, 2, 1)]
        handle = copier.copy(host, [0, 1], g3, [0, 5], blocks=blocks)
        try:
            handle.wait()
            error = None
        except DiskTierError as exc:
            error = str(exc)
        copier.close()
        print(json.dumps({"error": error, "slot5": g3.is_valid(5)}))
        """,
        tmp_path,
        limit,
    )
    error = str(out["error"])
    assert str(g3.path) in error and "writing slot 5" in error and "file size limit" in error
    assert out["slot5"] is False


def test_disk_full_on_a_real_tiny_file_system(tmp_path: Path) -> None:
    with tiny_tmpfs(tmp_path / "tiny", "256k") as mount:
        DiskTier(mount, SHAPE, 8, file_name="fits.bin").close()
        with pytest.raises(DiskTierError, match="file system is out of space") as caught:
            DiskTier(mount, SHAPE, 64)
        assert str(mount / "g3-slots.bin") in str(caught.value)
        assert not (mount / "g3-slots.bin").exists()


# -- the slot index, recovery and the lock ---------------------------------------------------


def named(i: int) -> BlockInfo:
    return BlockInfo(1000 + i, 2000 + i, 999 + i if i else None)


def write_named(g3: DiskTier, host: HostTier, slots: list[int], blocks: list[BlockInfo]) -> None:
    rows = raw_bytes(host).numpy()
    g3.write_slots(slots, [rows[i] for i in range(len(slots))], blocks)


def known_of(blocks: list[BlockInfo]) -> dict[int, tuple[int, int | None]]:
    return {b.sequence_hash: (b.local_hash, b.parent_hash) for b in blocks}


def test_reopening_keeps_only_slots_naming_known_blocks_intact(tmp_path: Path) -> None:
    host = random_host(5, 7)
    blocks = [named(i) for i in range(5)]
    g3 = DiskTier(tmp_path, SHAPE, 8)
    write_named(g3, host, [0, 1, 2, 3, 4], blocks)
    g3.close()
    with open(g3.path, "r+b") as f:  # slot 1's bytes, one bit
        f.seek(g3.slot_offset(1) + 100)
        byte = f.read(1)[0]
        f.seek(g3.slot_offset(1) + 100)
        f.write(bytes([byte ^ 1]))
    with open(g3.index_path, "r+b") as f:  # slot 2's entry, one bit of its sequence hash
        f.seek(2 * 64 + 16)
        f.write(b"\x01")

    known = known_of(blocks[:4])
    known[blocks[3].sequence_hash] = (blocks[3].local_hash, 12345)  # another parent: not it
    again = DiskTier(tmp_path, SHAPE, 8, known=known)
    r = again.recovery
    assert (r.kept, r.corrupt, r.damaged, r.ignored) == (1, [blocks[1]], 1, 2)
    assert again.recovered_blocks() == [(0, blocks[0])]
    assert [again.is_valid(s) for s in range(5)] == [True, False, False, False, False]
    back = HostTier(SHAPE, 1, pin=False)
    assert again.read_slots([0], [raw_bytes(back).numpy()[0]]) == [True]
    assert torch.equal(raw_bytes(back)[0], raw_bytes(host)[0])
    again.close()
    third = DiskTier(tmp_path, SHAPE, 8, known=known)  # what was freed stays freed
    assert third.recovered_blocks() == [(0, blocks[0])] and third.recovery.ignored == 0
    third.close()


def test_newest_copy_of_a_block_wins(tmp_path: Path) -> None:
    host = random_host(2, 8)
    g3 = DiskTier(tmp_path, SHAPE, 4)
    write_named(g3, host, [3], [named(0)])
    write_named(g3, host, [1], [named(0)])
    g3.close()
    again = DiskTier(tmp_path, SHAPE, 4, known=known_of([named(0)]))
    assert again.recovered_blocks() == [(1, named(0))] and again.recovery.duplicates == 1
    again.close()


def test_shrinking_keeps_the_newest_slots_and_moves_them_down(tmp_path: Path) -> None:
    host = random_host(8, 9)
    blocks = [named(i) for i in range(8)]
    g3 = DiskTier(tmp_path, SHAPE, 8)
    rows = raw_bytes(host).numpy()
    for i in range(8):  # one write each: slot 7 is the newest
        g3.write_slots([i], [rows[i]], [blocks[i]])
    g3.close()
    small = DiskTier(tmp_path, SHAPE, 3, known=known_of(blocks))
    assert small.recovery.kept == 3 and small.recovery.no_room == blocks[4::-1]
    assert os.path.getsize(small.path) == small.file_bytes
    assert os.path.getsize(small.index_path) == 3 * 64
    kept = small.recovered_blocks()
    assert [b for _, b in kept] == blocks[5:]
    back = HostTier(SHAPE, 3, pin=False)
    ok = small.read_slots([s for s, _ in kept], list(raw_bytes(back).numpy()))
    assert ok == [True] * 3
    assert torch.equal(raw_bytes(back), raw_bytes(host)[5:])
    small.close()
    grown = DiskTier(tmp_path, SHAPE, 16, known=known_of(blocks))
    assert [b for _, b in grown.recovered_blocks()] == blocks[5:]
    assert os.path.getsize(grown.path) == grown.file_bytes
    grown.close()


def test_a_format_1_file_is_replaced_by_an_empty_cache(tmp_path: Path) -> None:
    fields = {
        "magic": "kvledger-g3",
        "version": 1,
        "num_slots": 4,
        "slot_bytes": 4096,
        "block_bytes": SHAPE.block_bytes,
        "num_layers": 2,
        "outer_dim": 2,
        "page_size": 4,
        "inner_dim": 128,
        "dtype": "torch.bfloat16",
    }
    (tmp_path / "g3-slots.bin").write_bytes(json.dumps(fields).encode().ljust(3 * 4096, b"\n"))
    g3 = DiskTier(tmp_path, SHAPE, 4, known={1: (2, None)})
    assert g3.recovered_blocks() == [] and not any(g3.is_valid(s) for s in range(4))
    assert os.path.getsize(g3.path) == g3.file_bytes
    g3.close()


def test_one_tier_per_file_and_the_lock_goes_with_close(tmp_path: Path) -> None:
    g3 = DiskTier(tmp_path, SHAPE, 4)
    holder = rf"{tmp_path / 'g3-slots.bin'} is in use .*pid {os.getpid()}"
    with pytest.raises(G3InUse, match=holder):
        DiskTier(tmp_path, SHAPE, 4)
    other = DiskTier(tmp_path, SHAPE, 4, file_name="other.bin")  # another file is fine
    other.close()
    g3.close()
    DiskTier(tmp_path, SHAPE, 4).close()
