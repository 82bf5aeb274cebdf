"""kvledger's HiCache storage backend against SGLang's own ``HiCacheStorage`` and factory.

Runs in the SGLang test venv (SGLang 0.5.23 ``--no-deps`` with what its storage module imports,
layered over the project's venv), which ``make test`` builds and from which
``tests/integrations/test_sglang_hicache.py`` runs this file. By hand::

    make sglang-venv
    .sglang-test-venv/bin/python -m pytest tests/integrations/sglang
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

NOT_HERE = (
    "SGLang is not installed in this interpreter: run `make sglang-venv`, then "
    "`.sglang-test-venv/bin/python -m pytest tests/integrations/sglang`"
)
hicache = pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage",
    reason=NOT_HERE,
)
factory = pytest.importorskip(
    "sglang.srt.mem_cache.storage.backend_factory",
    reason=NOT_HERE,
)

from kvledger.config import SettingsError  # noqa: E402
from kvledger.events.log import EventLog  # noqa: E402
from kvledger.events.log.replay import replay  # noqa: E402
from kvledger.events.types import Removed, Stored, Tier  # noqa: E402
from kvledger.integrations.sglang import KvledgerHiCacheStorage, page_hashes  # noqa: E402
from kvledger.tiers.disk import G3InUse  # noqa: E402

PAGE_TOKENS = 4
PAGE_BYTES = 512  # per page: PAGE_TOKENS tokens of 128 bytes


def chain(n: int, seed: str = "") -> list[str]:
    """SGLang's page keys: SHA-256 hex of each page chained on the previous page's key."""
    keys: list[str] = []
    prev = seed
    for i in range(n):
        prev = hashlib.sha256(f"{prev}|page{i}".encode()).hexdigest()
        keys.append(prev)
    return keys


def pages(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (PAGE_BYTES,), dtype=torch.uint8, generator=g) for _ in range(n)]


class HostPool:
    """What the v1 path asks of SGLang's host pool: flat pages read and written by index."""

    def __init__(self, tokens: int) -> None:
        self.page_size = PAGE_TOKENS
        self.data = torch.zeros(tokens, PAGE_BYTES // PAGE_TOKENS, dtype=torch.uint8)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(PAGE_BYTES, dtype=torch.uint8)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return self.data[index : index + PAGE_TOKENS].flatten()

    def set_from_flat_data_page(self, index: int, page: torch.Tensor) -> None:
        self.data[index : index + PAGE_TOKENS] = page.view(PAGE_TOKENS, -1)


def storage_config(tmp_path: Path, **extra: Any) -> Any:
    return hicache.HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="test-model",
        extra_config={
            "backend_name": "kvledger",
            "module_path": "kvledger.integrations.sglang",
            "class_name": "KvledgerHiCacheStorage",
            "interface_v1": 1,
            "data_dir": str(tmp_path),
            "capacity_pages": 8,
            **extra,
        },
    )


def open_backend(tmp_path: Path, **extra: Any) -> KvledgerHiCacheStorage:
    """Through SGLang's own factory, as ``--hicache-storage-backend dynamic`` does."""
    backend = factory.StorageBackendFactory.create_backend(
        "dynamic", storage_config(tmp_path, **extra), None
    )
    assert isinstance(backend, KvledgerHiCacheStorage)
    return backend


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[KvledgerHiCacheStorage]:
    b = open_backend(tmp_path, page_bytes=PAGE_BYTES)
    yield b
    b.close()


def live_g3(b: KvledgerHiCacheStorage, keys: list[str]) -> set[int]:
    return {page_hashes(k)[0] for k in keys if b.exists(k)}


def replayed_g3(tmp_path: Path, worker: int = 0) -> set[int]:
    state = replay(str(tmp_path / f"hicache-log-w{worker}.sqlite"))
    return {b.sequence_hash for b in state.infos(worker, Tier.G3)}


def test_is_sglangs_hicache_storage() -> None:
    assert issubclass(KvledgerHiCacheStorage, hicache.HiCacheStorage)
    assert not KvledgerHiCacheStorage.__abstractmethods__


def test_pages_round_trip_byte_identical(backend: KvledgerHiCacheStorage) -> None:
    keys, values = chain(3), pages(3)
    assert backend.batch_set(keys, values)
    got = backend.batch_get(keys)
    assert all(g is not None and torch.equal(g, v) for g, v in zip(got, values, strict=True))
    target = torch.empty(PAGE_TOKENS, PAGE_BYTES // PAGE_TOKENS, dtype=torch.uint8)
    assert backend.get(keys[1], target) is target
    assert torch.equal(target.flatten(), values[1])


def test_exists_and_batch_exists_count_the_stored_prefix(
    backend: KvledgerHiCacheStorage,
) -> None:
    keys = chain(4)
    assert not backend.exists(keys[0]) and backend.batch_exists(keys) == 0
    assert backend.batch_set(keys[:2], pages(2))
    assert backend.set(keys[3], pages(1, seed=3)[0])
    assert backend.exists(keys[3]) and not backend.exists(keys[2])
    assert backend.batch_exists(keys) == 2
    assert backend.get(keys[2]) is None


def test_pages_survive_close_and_reopen(tmp_path: Path) -> None:
    keys, values = chain(5), pages(5)
    with open_backend(tmp_path, page_bytes=PAGE_BYTES) as b:
        assert b.batch_set(keys, values)
    with open_backend(tmp_path, page_bytes=PAGE_BYTES) as b:
        assert b.batch_exists(keys) == 5
        got = b.batch_get(keys)
        assert all(g is not None and torch.equal(g, v) for g, v in zip(got, values, strict=True))
        more = chain(2, seed="other")
        assert b.batch_set(more, pages(2, seed=9))
        live = live_g3(b, keys + more)
    assert replayed_g3(tmp_path) == live


def test_eviction_is_logged_and_the_log_replays_to_the_live_state(
    backend: KvledgerHiCacheStorage, tmp_path: Path
) -> None:
    keys = chain(12)  # capacity is 8: the least recently used pages go
    assert backend.batch_set(keys[:6], pages(6))
    backend.get(keys[0])  # recent again: survives
    assert backend.batch_set(keys[6:], pages(6, seed=1))
    assert backend.exists(keys[0]) and not backend.exists(keys[1])
    assert backend.batch_exists(keys[6:]) == 6
    live = live_g3(backend, keys)
    assert len(live) == 8
    log = backend.event_log
    assert log is not None
    log.flush()
    events = list(log.read(worker_id=0))
    assert any(isinstance(e, Removed) for e in events)
    stored = [b for e in events if isinstance(e, Stored) for b in e.blocks]
    assert {seq for seq, _ in stored} == {page_hashes(k)[0] for k in keys}
    assert replayed_g3(tmp_path) == live


def test_pages_are_chained_on_the_previous_key(
    backend: KvledgerHiCacheStorage, tmp_path: Path
) -> None:
    keys = chain(3)
    host = HostPool(tokens=64)
    backend.register_mem_pool_host(host)
    host.data.copy_(torch.randint(0, 256, host.data.shape, dtype=torch.uint8))
    indices = torch.arange(3 * PAGE_TOKENS)
    prefix = hicache.HiCacheStorageExtraInfo(prefix_keys=keys[:1])
    assert backend.batch_set_v1(keys[1:], indices[: 2 * PAGE_TOKENS], prefix) == [True, True]
    assert backend.event_log is not None
    backend.event_log.flush()
    parents = {b.sequence_hash: b.parent_hash for b in replay(backend.event_log).infos(0, Tier.G3)}
    assert parents[page_hashes(keys[1])[0]] == page_hashes(keys[0])[0]
    assert parents[page_hashes(keys[2])[0]] == page_hashes(keys[1])[0]


def test_v1_path_copies_by_host_index(backend: KvledgerHiCacheStorage) -> None:
    host = HostPool(tokens=64)
    backend.register_mem_pool_host(host)
    host.data.copy_(torch.randint(0, 256, host.data.shape, dtype=torch.uint8))
    keys = chain(3)
    src = torch.arange(8, 8 + 3 * PAGE_TOKENS)
    assert backend.batch_set_v1(keys, src) == [True, True, True]
    want = host.data[8 : 8 + 3 * PAGE_TOKENS].clone()
    dst = torch.arange(32, 32 + 4 * PAGE_TOKENS)
    assert backend.batch_exists(keys + chain(1, seed="x"), None) == 3
    assert backend.batch_get_v1(keys + chain(1, seed="x"), dst) == [True, True, True, False]
    assert torch.equal(host.data[32 : 32 + 3 * PAGE_TOKENS], want)
    with pytest.raises(ValueError, match="host indices"):
        backend.batch_get_v1(keys, dst[:5])


def test_colliding_key_is_refused_and_the_first_page_kept(
    backend: KvledgerHiCacheStorage,
) -> None:
    key = chain(1)[0]
    twin = key[:16] + ("0" if key[16] != "0" else "1") + key[17:]  # same first 8 bytes
    assert page_hashes(twin)[0] == page_hashes(key)[0]
    first, second = pages(2)
    assert backend.set(key, first)
    assert not backend.set(twin, second)
    assert not backend.exists(twin) and backend.get(twin) is None
    got = backend.get(key)
    assert got is not None and torch.equal(got, first)


def test_bad_input_is_refused_with_what_is_wrong(backend: KvledgerHiCacheStorage) -> None:
    key = chain(1)[0]
    with pytest.raises(ValueError, match="a page of 7 bytes, but pages are 512"):
        backend.set(key, torch.zeros(7, dtype=torch.uint8))
    with pytest.raises(TypeError, match="page keys are str"):
        backend.exists(b"abc")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="2 keys but values"):
        backend.batch_set(chain(2), pages(1))
    assert not backend.exists(key)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"worker_id": "abc"}, "worker_id: must be a whole number (a JSON integer), got 'abc'"),
        ({"worker_id": -3}, "worker_id: Input should be greater than or equal to 0, got -3"),
        ({"worker_id": 1.7}, "worker_id: must be a whole number (a JSON integer), got 1.7"),
        ({"capacity_pages": 0}, "capacity_pages: Input should be greater than 0, got 0"),
        ({"capacity_pages": "8"}, "capacity_pages: must be a whole number"),
        ({"page_bytes": 1.5}, "page_bytes: must be a whole number (a JSON integer), got 1.5"),
        ({"page_bytes": True}, "page_bytes: must be a whole number (a JSON integer), got True"),
        ({"capcity_pages": 8}, "'capcity_pages' is not a key kvledger reads; did you mean"),
        ({"log_url": "mysql://u:pw@127.0.0.1/x"}, "log_url: mysql://u:***@127.0.0.1/x: the mysql"),
        ({"redis_namespace": "a b"}, "redis_namespace: namespace 'a b' must be"),
    ],
)
def test_a_bad_extra_config_key_is_one_line_naming_it(
    tmp_path: Path, extra: dict[str, object], named: str
) -> None:
    """Refused, never coerced (1.7 is not worker 1) or ignored (a misspelt key), before
    anything is created."""
    folder = tmp_path / "data"
    folder.mkdir()
    with pytest.raises(SettingsError) as caught:
        open_backend(folder, **extra)
    message = str(caught.value)
    assert len(message.splitlines()) == 1, message
    assert message.startswith("hicache storage backend extra config"), message
    assert named in message, message
    assert "pw" not in message
    assert list(folder.iterdir()) == []


def test_a_data_dir_that_is_a_file_is_refused_by_name(tmp_path: Path) -> None:
    taken = tmp_path / "taken"
    taken.write_text("not a folder")
    with pytest.raises(SettingsError, match=f"data_dir: {taken} is a file, not a folder"):
        open_backend(taken, page_bytes=PAGE_BYTES)
    assert taken.read_text() == "not a folder"


def test_pages_sized_by_the_first_page_without_page_bytes(tmp_path: Path) -> None:
    keys, values = chain(2), pages(2)
    with open_backend(tmp_path) as b:
        assert not b.exists(keys[0])
        assert b.batch_set(keys, values)
        assert b.page_bytes == PAGE_BYTES
    with EventLog(str(tmp_path / "hicache-log-w0.sqlite"), read_only=True) as log:
        assert sum(len(e.blocks) for e in log.read() if isinstance(e, Stored)) == 2


# A rank in its own process: stores pages through SGLang's factory, then holds its G3 until told.
RANK_PROCESS = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from test_sglang_backend import chain, open_backend, pages
from pathlib import Path
b = open_backend(Path(sys.argv[1]), page_bytes=512)
assert b.batch_set(chain(6), pages(6, seed=7))
print("stored", flush=True)
sys.stdin.readline()
b.close()
"""


def test_another_process_recovers_a_ranks_pages(tmp_path: Path) -> None:
    here = str(Path(__file__).parent)
    rank = subprocess.Popen(
        [sys.executable, "-c", RANK_PROCESS, str(tmp_path), here],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert rank.stdout is not None and rank.stdout.readline().strip() == "stored"
        with pytest.raises(G3InUse):  # one owner per rank's G3 file
            open_backend(tmp_path, page_bytes=PAGE_BYTES)
        rank.communicate("\n", timeout=60)
    finally:
        if rank.poll() is None:
            rank.kill()
    assert rank.returncode == 0
    keys, values = chain(6), pages(6, seed=7)
    with open_backend(tmp_path, page_bytes=PAGE_BYTES) as b:
        got = b.batch_get(keys)
        assert all(g is not None and torch.equal(g, v) for g, v in zip(got, values, strict=True))
        live = live_g3(b, keys)
    assert replayed_g3(tmp_path) == live == {page_hashes(k)[0] for k in keys}


def test_concurrent_prefetch_and_backup_threads_keep_the_log_true(
    backend: KvledgerHiCacheStorage, tmp_path: Path
) -> None:
    """SGLang reads (prefetch) and writes (backup) from two threads at once."""
    keys = chain(40)
    values = pages(40, seed=5)
    errors: list[BaseException] = []

    def backup() -> None:
        try:
            for i in range(0, 40, 4):
                backend.batch_set(keys[i : i + 4], values[i : i + 4])
        except BaseException as exc:
            errors.append(exc)

    def prefetch() -> None:
        try:
            for _ in range(20):
                for key, page in zip(keys, backend.batch_get(keys), strict=True):
                    if page is not None:
                        assert torch.equal(page, values[keys.index(key)])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=backup), threading.Thread(target=prefetch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert backend.event_log is not None
    backend.event_log.flush()
    live = live_g3(backend, keys)
    assert len(live) == 8
    assert replayed_g3(tmp_path) == live


def test_a_corrupt_page_reads_as_a_miss_and_is_dropped_in_the_log(
    backend: KvledgerHiCacheStorage, tmp_path: Path
) -> None:
    keys, values = chain(2), pages(2)
    assert backend.batch_set(keys, values)
    g3 = backend.disk_tier
    assert g3 is not None
    slot = {block.sequence_hash: at for at, block in g3.recovered_blocks()}[page_hashes(keys[1])[0]]
    with open(g3.path, "r+b") as f:  # flip a byte of the page on disk
        f.seek(g3.slot_offset(slot) + 10)
        byte = f.read(1)
        f.seek(g3.slot_offset(slot) + 10)
        f.write(bytes([byte[0] ^ 0xFF]))
    got = backend.batch_get(keys)
    assert got[0] is not None and torch.equal(got[0], values[0])
    assert got[1] is None and not backend.exists(keys[1])
    assert backend.event_log is not None
    backend.event_log.flush()
    assert replayed_g3(tmp_path) == {page_hashes(keys[0])[0]}


def test_use_after_close_is_refused(tmp_path: Path) -> None:
    b = open_backend(tmp_path, page_bytes=PAGE_BYTES)
    b.close()
    with pytest.raises(RuntimeError, match="closed"):
        b.set(chain(1)[0], pages(1)[0])


def test_host_pool_of_another_page_size_is_refused(tmp_path: Path) -> None:
    with (
        open_backend(tmp_path, page_bytes=PAGE_BYTES * 2) as b,
        pytest.raises(ValueError, match="pages are 1024 bytes, got one of 512"),
    ):
        b.register_mem_pool_host(HostPool(tokens=16))


@pytest.mark.parametrize("page_bytes", [0, 1.5, True])
def test_bad_page_bytes_is_refused(tmp_path: Path, page_bytes: object) -> None:
    with pytest.raises(ValueError, match="page_bytes"):
        open_backend(tmp_path, page_bytes=page_bytes)


# Rank 0 in its own process with the shared registry: stores pages, holds them until told.
G4_OWNER = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from test_sglang_backend import chain, open_backend, pages
from pathlib import Path
b = open_backend(Path(sys.argv[1]), page_bytes=512, redis_url=sys.argv[3],
                 redis_namespace=sys.argv[4], worker_id=0)
assert b.batch_set(chain(4, seed="g4"), pages(4, seed=11))
assert b.publisher is not None and b.publisher.wait_applied(30)
print("stored", flush=True)
sys.stdin.readline()
b.close()
"""


def test_pages_found_on_another_rank_through_the_shared_registry(
    tmp_path: Path, redis_client: redis.Redis
) -> None:
    """G4: rank 1 finds rank 0's pages in the shared registry and reads them, checked, from
    rank 0's G3 file while rank 0 runs in another process; then holds them itself."""
    url = redis_client.connection_pool.connection_kwargs
    redis_url = f"redis://{url['host']}:{url['port']}/{url.get('db', 0)}"
    namespace = f"test-sglang-{uuid.uuid4().hex[:8]}"
    owner = subprocess.Popen(
        [
            *(sys.executable, "-c", G4_OWNER, str(tmp_path), str(Path(__file__).parent)),
            *(redis_url, namespace),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    keys, values = chain(4, seed="g4"), pages(4, seed=11)
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == "stored"
        with open_backend(
            tmp_path,
            page_bytes=PAGE_BYTES,
            redis_url=redis_url,
            redis_namespace=namespace,
            worker_id=1,
        ) as reader:
            unknown = chain(1, seed="nowhere")
            assert reader.batch_exists(keys + unknown) == 4
            got = reader.batch_get(keys + unknown)
            assert got[4] is None
            assert all(
                g is not None and torch.equal(g, v) for g, v in zip(got[:4], values, strict=True)
            )
            assert reader.publisher is not None and reader.publisher.wait_applied(30)
            held = {page_hashes(k)[0]: reader.exists(k) for k in keys}
        owner.communicate("\n", timeout=60)
    finally:
        if owner.poll() is None:
            owner.kill()
        for key in redis_client.scan_iter(match=f"kvl:{{{namespace}*", count=1000):
            redis_client.delete(key)
    assert owner.returncode == 0 and all(held.values())
    # rank 1 now holds them in its own G3, and its log says so
    assert replayed_g3(tmp_path, worker=1) == set(held)


def test_a_peer_reads_only_what_the_owners_g3_holds_now(tmp_path: Path) -> None:
    """Another rank's view of a G3 file: a page evicted and its slot reused is a miss."""
    from kvledger.tiers.disk.peer import PeerG3

    keys, values = chain(12), pages(12)
    with open_backend(tmp_path, page_bytes=PAGE_BYTES) as owner:
        assert owner.set(keys[0], values[0])
        peer = PeerG3(tmp_path / "hicache-g3-w0.bin")
        try:
            got = peer.read(*page_hashes(keys[0]))
            assert got is not None and bytes(got) == bytes(values[0].numpy())
            assert peer.read(*page_hashes(keys[1])) is None
            assert owner.batch_set(keys[1:9], values[1:9])  # capacity 8: keys[0] evicted
            assert not owner.exists(keys[0])
            assert peer.read(*page_hashes(keys[0])) is None
            got = peer.read(*page_hashes(keys[8]))
            assert got is not None and bytes(got) == bytes(values[8].numpy())
        finally:
            peer.close()


def test_a_peers_batched_read_fills_the_given_buffers_and_misses_the_rest(
    tmp_path: Path,
) -> None:
    """``read_many``: one batch of held, never-held and evicted pages, read into buffers."""
    import numpy as np

    from kvledger.tiers.disk.peer import PeerG3

    keys, values = chain(12), pages(12)
    with open_backend(tmp_path, page_bytes=PAGE_BYTES) as owner:
        assert owner.batch_set(keys[:8], values[:8])
        assert owner.batch_set(keys[8:10], values[8:10])  # capacity 8: keys[0:2] evicted
        peer = PeerG3(tmp_path / "hicache-g3-w0.bin")
        try:
            wanted = [keys[9], keys[0], keys[11], keys[4], keys[9]]
            buffers = [np.zeros(PAGE_BYTES, dtype=np.uint8) for _ in wanted]
            got = peer.read_many([page_hashes(k) for k in wanted], [None, *buffers[1:]])
            expected = [values[9], None, None, values[4], values[9]]
            for page, value in zip(got, expected, strict=True):
                assert (page is None) == (value is None)
                if page is not None and value is not None:
                    assert bytes(page) == bytes(value.numpy())
            assert got[3] is buffers[3] and got[4] is buffers[4]  # read in place
            with pytest.raises(ValueError, match="a buffer of 8 bytes"):
                peer.read_many([page_hashes(keys[9])], [np.zeros(8, dtype=np.uint8)])
        finally:
            peer.close()


def test_the_backends_log_takes_the_event_log_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVLEDGER_EVENT_LOG_MAX_DELAY_S", "0.2")
    monkeypatch.setenv("KVLEDGER_EVENT_LOG_QUEUE_SIZE", "20000")
    with open_backend(tmp_path, page_bytes=PAGE_BYTES) as b:
        log = b.event_log
        assert log is not None and (log.max_delay, log.queue_size) == (0.2, 20_000)
    monkeypatch.setenv("KVLEDGER_EVENT_LOG_DURABILITY", "sometimes")
    with pytest.raises(SettingsError, match="KVLEDGER_EVENT_LOG_DURABILITY"):
        open_backend(tmp_path / "bad", page_bytes=PAGE_BYTES)


def test_its_folder_log_and_g3_file_are_the_owners_alone_under_umask_022(tmp_path: Path) -> None:
    data = tmp_path / "made" / "hicache"  # neither folder exists yet
    old = os.umask(0o022)
    try:
        with open_backend(data, page_bytes=PAGE_BYTES) as b:
            assert b.batch_set(chain(2), pages(2))
            assert b.event_log is not None
            b.event_log.flush()
            made = {p.name: stat.S_IMODE(p.stat().st_mode) for p in data.iterdir()}
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "made").stat().st_mode) == 0o700
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    assert {"hicache-log-w0.sqlite", "hicache-g3-w0.bin"} <= set(made)
    assert all(mode == 0o600 for mode in made.values()), made


def test_a_routers_zmq_index_and_the_metrics_follow_its_pages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What every kvledger entry point gets from the one builder: the pages' events on a ZMQ
    stream routers read (fed by the log's commits) and kvledger's metrics, both on loopback."""
    import socket
    import urllib.request

    from kvledger.events.shared.zmq_subscribe import ZmqSubscriber
    from kvledger.registry.index import RouterIndex, holders_from_state

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    endpoint, replay_endpoint = (f"tcp://127.0.0.1:{port}" for port in ports)
    monkeypatch.setenv("KVLEDGER_ZMQ_ENDPOINT", endpoint)
    # batches sent before the subscription reaches the publisher come back through replay
    monkeypatch.setenv("KVLEDGER_ZMQ_REPLAY_ENDPOINT", replay_endpoint)
    monkeypatch.setenv("KVLEDGER_METRICS_PORT", "0")
    b = open_backend(tmp_path, page_bytes=PAGE_BYTES)
    try:
        with ZmqSubscriber(endpoint, replay_endpoint=replay_endpoint) as sub:
            time.sleep(0.3)  # the subscription reaches the publisher before the first batch
            keys, values = chain(12), pages(12)  # 12 pages through 8 slots: evictions
            for i in range(0, 12, 4):
                assert b.batch_set(keys[i : i + 4], values[i : i + 4])
            log = b.event_log
            assert log is not None
            log.flush()
            index = RouterIndex.from_events(sub.events(0, timeout=2.0))
            assert index.holders() == holders_from_state(replay(log))
        worker = b._worker
        assert worker is not None and worker._server is not None
        url = f"http://127.0.0.1:{worker._server.server_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        assert 'kvbm_stored_blocks_total{tier="G3"} 12.0' in text
        assert 'kvbm_evicted_blocks_total{tier="G3"} 4.0' in text
    finally:
        b.close()
