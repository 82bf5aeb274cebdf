"""G4 over NIXL between SGLang ranks: two processes, real Redis, real NIXL agents (UCX over
loopback), real bytes, and no shared file system between them.

The owner (rank 0) is a separate process (this file run as a script) with its own data
folder: kvledger's HiCache backend with ``g4: nixl``, whose G3 file is mapped and registered
with its NIXL agent and whose pages are published, with their checksums, in the remote
directory. The reader (rank 1) is a backend in the test process with another data folder, as
on another host: a page it lacks is found in the shared registry and READ over NIXL straight
from the owner's file, checked, and kept in its own G3. A page the owner evicted (its slot
reused) or whose bytes changed after the lookup is a miss, never other bytes.

Run as ``python test_sglang_g4_nixl.py owner DIR REDIS_URL NAMESPACE G4`` it is the owner: one
JSON answer per command on stdin (``store SEED N``, ``evict``, ``corrupt SEED I``,
``restart``, ``quit``).
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

NOT_HERE = "SGLang is not installed in this interpreter: run `make sglang-venv`"
pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason=NOT_HERE)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_sglang_backend import (  # noqa: E402
    PAGE_BYTES,
    PAGE_TOKENS,
    HostPool,
    chain,
    open_backend,
    pages,
    replayed_g3,
)

from kvledger.config import SettingsError  # noqa: E402
from kvledger.integrations.sglang import KvledgerHiCacheStorage, page_hashes  # noqa: E402
from kvledger.tiers.remote import nixl_unavailable_reason  # noqa: E402

OWNER, READER = 0, 1
ANSWER = "@answer "  # NIXL logs to stdout too: the owner's answers carry this prefix

pytestmark = [
    pytest.mark.skipif(
        nixl_unavailable_reason() is not None, reason=str(nixl_unavailable_reason())
    ),
    pytest.mark.timeout(120),
]


# -- the owner process ---------------------------------------------------------------------


def owner_main(folder: Path, redis_url: str, namespace: str, g4: str) -> int:
    def open_owner() -> KvledgerHiCacheStorage:
        return open_backend(
            folder,
            page_bytes=PAGE_BYTES,
            redis_url=redis_url,
            redis_namespace=namespace,
            worker_id=OWNER,
            g4=g4,
        )

    b = open_owner()

    def settle() -> None:
        assert b.publisher is not None and b.publisher.wait_applied(30)
        if b.nixl is not None:
            assert b.nixl.flush(30)

    def answer(**fields: Any) -> None:
        print(ANSWER + json.dumps(fields), flush=True)

    settle()
    answer(ready=True, pid=os.getpid())
    for line in sys.stdin:
        cmd, *rest = line.split()
        if cmd == "store":
            seed, n = rest[0], int(rest[1])
            ok = b.batch_set(chain(n, seed=seed), pages(n, seed=len(seed)))
            settle()
            answer(ok=ok)
        elif cmd == "evict":  # the page capacity's worth of new pages: every old one evicted
            ok = b.batch_set(chain(b.capacity_pages, seed="evict"), pages(b.capacity_pages, 99))
            settle()
            answer(ok=ok)
        elif cmd == "corrupt":  # other bytes in a page's slot, its directory entry unchanged
            key = chain(int(rest[1]) + 1, seed=rest[0])[-1]
            disk = b.disk_tier
            slot = b._slot(key)
            assert disk is not None and slot is not None
            fd = os.open(disk.path, os.O_WRONLY)
            try:
                os.pwrite(fd, b"\xa5" * PAGE_BYTES, disk.slot_offset(slot))
            finally:
                os.close(fd)
            answer(ok=True, slot=slot)
        elif cmd == "restart":  # a new backend on the same files: G3 recovered, served again
            b.close()
            b = open_owner()
            settle()
            answer(ok=True)
        elif cmd == "quit":
            break
    b.close()
    return 0


# -- the test side -------------------------------------------------------------------------


class Owner:
    """The owner process and a line-by-line JSON conversation with it."""

    def __init__(self, folder: Path, redis_url: str, namespace: str, g4: str = "nixl") -> None:
        folder.mkdir(mode=0o700, exist_ok=True)
        self.stderr = open(folder.parent / f"owner-{folder.name}.stderr", "w+")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "owner", str(folder), redis_url, namespace, g4],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            env={**os.environ, "NIXL_LOG_LEVEL": "WARN"},
        )
        self.hello = self._read(90)

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while True:
            if not sel.select(max(0.0, deadline - time.monotonic())):
                self.stderr.seek(0)
                raise TimeoutError(f"owner said nothing in {timeout} s:\n{self.stderr.read()}")
            line = self.proc.stdout.readline()
            if not line:
                self.stderr.seek(0)
                raise RuntimeError(f"owner exited ({self.proc.poll()}):\n{self.stderr.read()}")
            if line.startswith(ANSWER):
                return dict(json.loads(line[len(ANSWER) :]))

    def ask(self, command: str, timeout: float = 60) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()


@pytest.fixture
def redis_url(redis_client: redis.Redis) -> str:
    url = redis_client.connection_pool.connection_kwargs
    return f"redis://{url['host']}:{url['port']}/{url.get('db', 0)}"


@pytest.fixture
def namespace(redis_client: redis.Redis) -> Iterator[str]:
    name = f"test-sglang-g4-{uuid.uuid4().hex[:8]}"
    yield name
    for key in redis_client.scan_iter(match=f"kvl:{{{name}*", count=1000):
        redis_client.delete(key)


@pytest.fixture
def owner(tmp_path: Path, redis_url: str, namespace: str) -> Iterator[Owner]:
    o = Owner(tmp_path / "owner-host", redis_url, namespace)
    yield o
    o.close()


def open_reader(folder: Path, redis_url: str, namespace: str, **extra: Any) -> Any:
    """Rank 1 in this process, in a folder of its own (no file of the owner's in reach)."""
    folder.mkdir(mode=0o700, exist_ok=True)
    return open_backend(
        folder,
        page_bytes=PAGE_BYTES,
        redis_url=redis_url,
        redis_namespace=namespace,
        **{"worker_id": READER, "g4": "nixl", **extra},
    )


def same(got: torch.Tensor | None, want: torch.Tensor) -> bool:
    return got is not None and bytes(got.numpy()) == bytes(want.numpy())


def test_a_rank_reads_another_processes_pages_over_nixl_byte_identical(
    owner: Owner, tmp_path: Path, redis_url: str, namespace: str
) -> None:
    keys, values = chain(4, seed="g4"), pages(4, seed=len("g4"))
    v1_keys, v1_values = chain(3, seed="v1"), pages(3, seed=len("v1"))
    assert owner.ask("store g4 4")["ok"] and owner.ask("store v1 3")["ok"]
    reader_dir = tmp_path / "reader-host"
    with open_reader(reader_dir, redis_url, namespace) as reader:
        assert reader.nixl is not None
        unknown = chain(1, seed="nowhere")
        assert reader.batch_exists(keys + unknown) == 4
        got = reader.batch_get(keys + unknown)
        assert got[4] is None
        assert all(same(g, v) for g, v in zip(got[:4], values, strict=True))
        # the zero-copy path: straight into SGLang's host pool
        reader.register_mem_pool_host(HostPool(PAGE_TOKENS * 4))
        at = torch.arange(PAGE_TOKENS, PAGE_TOKENS * 4, dtype=torch.int64)
        assert reader.batch_get_v1(v1_keys, at) == [True, True, True]
        pool = reader.mem_pool_host
        for i, value in enumerate(v1_values):
            assert same(pool.get_data_page(PAGE_TOKENS * (i + 1)), value)
        stats = reader.nixl.fetcher.stats
        assert stats.blocks == 7 and not stats.failures, stats
        assert not list(reader_dir.glob("hicache-g3-w0*"))  # nothing of the owner's here
        assert reader.publisher is not None and reader.publisher.wait_applied(30)
        held = all(reader.exists(k) for k in keys + v1_keys)
    assert held  # kept in rank 1's own G3 now, and its log says so
    assert replayed_g3(reader_dir, worker=READER) == {page_hashes(k)[0] for k in keys + v1_keys}


def test_a_page_evicted_or_overwritten_after_the_lookup_is_a_miss(
    owner: Owner, tmp_path: Path, redis_url: str, namespace: str
) -> None:
    keys, values = chain(4, seed="gone"), pages(4, seed=len("gone"))
    assert owner.ask("store gone 4")["ok"]
    with open_reader(tmp_path / "reader-host", redis_url, namespace) as reader:
        assert reader.nixl is not None
        fetcher = reader.nixl.fetcher
        hashes = [page_hashes(k)[0] for k in keys]
        plan = fetcher.plan(hashes)
        assert plan is not None and len(plan) == 4 and plan.worker_id == OWNER
        # the owner evicts every page and reuses their slots after the reader looked them up
        assert owner.ask("evict")["ok"]
        result = fetcher.execute(plan, [0, 1, 2, 3])
        assert result.count == 0 and result.reason in ("checksum", "vanished"), result
        # the backend's own reads: gone from the registry and the directory, a miss
        assert reader.batch_exists(keys) == 0
        assert reader.batch_get(keys) == [None] * 4
        assert reader.get_stats() == {"pages": 0, "capacity_pages": 8}  # nothing kept

        # a page whose bytes change in its slot (the entry unchanged) reads as a miss too
        assert owner.ask("store gone 4")["ok"]
        assert owner.ask("corrupt gone 1")["ok"]
        got = reader.batch_get(keys)
        assert got[1] is None
        assert same(got[0], values[0]) and same(got[2], values[2]) and same(got[3], values[3])
        assert fetcher.stats.failures["checksum"] >= 1
        assert reader.get_stats() == {"pages": 3, "capacity_pages": 8}  # all but the bad one
        assert reader._slot(keys[1]) is None and reader._slot(keys[0]) is not None


def test_a_restarted_rank_serves_its_recovered_pages_over_nixl(
    owner: Owner, tmp_path: Path, redis_url: str, namespace: str
) -> None:
    keys, values = chain(4, seed="again"), pages(4, seed=len("again"))
    assert owner.ask("store again 4")["ok"]
    assert owner.ask("restart")["ok"]  # a new NIXL agent; the pages come from G3 recovery
    with open_reader(tmp_path / "reader-host", redis_url, namespace) as reader:
        got = reader.batch_get(keys)
        assert all(same(g, v) for g, v in zip(got, values, strict=True))
        assert reader.nixl is not None and reader.nixl.fetcher.stats.blocks == 4


def test_a_rank_without_nixl_is_read_from_the_shared_file_system(
    tmp_path: Path, redis_url: str, namespace: str
) -> None:
    """The fallback: the owner exports nothing over NIXL (``g4: shared_fs``), the folder is
    shared, so the reader takes the page from the owner's G3 file; with ``g4: off`` a rank
    reads no other rank's pages at all."""
    shared = tmp_path / "shared"
    o = Owner(shared, redis_url, namespace, g4="shared_fs")
    try:
        keys, values = chain(2, seed="fs"), pages(2, seed=len("fs"))
        assert o.ask("store fs 2")["ok"]
        with open_reader(shared, redis_url, namespace) as reader:
            got = reader.batch_get(keys)
            assert all(same(g, v) for g, v in zip(got, values, strict=True))
            assert reader.nixl is not None and reader.nixl.fetcher.stats.blocks == 0
            assert reader.nixl.fetcher.stats.failures["no_agent"] >= 1
        with open_reader(shared, redis_url, namespace, g4="off", worker_id=2) as alone:
            assert alone.nixl is None
            assert alone.batch_exists(keys) == 0
            assert alone.batch_get(keys) == [None, None]
        apart = tmp_path / "another-host"
        with open_reader(apart, redis_url, namespace, g4="shared_fs", worker_id=3) as far:
            # the owner's file is not in this rank's folder: its pages are not counted as
            # there (a read could only miss), and reading them is a miss
            assert far.batch_exists(keys) == 0
            assert far.batch_get(keys) == [None, None]
    finally:
        o.close()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"g4": "nixl"}, "g4 'nixl' needs redis_url"),
        ({"g4": "wire", "redis_url": "redis://127.0.0.1:6379/0"}, "g4: Input should be"),
        ({"g4_interface": "lo eth0"}, "g4_interface: must name network devices"),
        ({"g4_timeout_s": 0}, "g4_timeout_s: Input should be greater than 0"),
        ({"g4_staging_pages": 0}, "g4_staging_pages: Input should be greater than 0"),
    ],
)
def test_g4_settings_are_checked_by_name(
    tmp_path: Path, extra: dict[str, Any], message: str
) -> None:
    with pytest.raises(SettingsError, match=message) as err:
        open_backend(tmp_path, page_bytes=PAGE_BYTES, **extra)
    assert "\n" not in str(err.value)


if __name__ == "__main__" and sys.argv[1:2] == ["owner"]:
    folder, url, name, mode = sys.argv[2:6]
    sys.exit(owner_main(Path(folder), url, name, mode))
