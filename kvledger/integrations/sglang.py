"""SGLang's HiCache L3: a ``HiCacheStorage`` backend that keeps pages in kvledger's G3.

SGLang loads it with one flag (``--hicache-storage-backend dynamic`` and an extra config naming
this module and ``KvledgerHiCacheStorage``), one instance per TP rank. Each instance owns a G3
file of fixed-size page slots (``DiskTier``) and a G3 ``BlockPool`` whose events go to kvledger's
durable log, so ``kvledger replay`` shows what SGLang's L3 held at any moment, and a restarted
rank serves again every page the log and the file both vouch for.

SGLang names a page by the SHA-256 hex digest of its tokens chained on the previous page's
digest. kvledger names blocks by 64-bit hashes: the sequence hash is the digest's first 8 bytes
and the local hash its next 8, so a page's name survives a restart in the log and in the G3
index alike, and two keys sharing a sequence hash but not a local hash are a collision that is
refused, never a page handed out under the wrong name. A key that is not a hex digest (a
sidecar pool's ``<digest>.<pool>``) is first hashed with SHA-256 itself.

Settings, all optional, in the extra config: ``data_dir`` (default ``$KVLEDGER_DATA_DIR`` or
``kvledger-hicache``), ``capacity_pages`` (G3 slots, default 4096), ``page_bytes`` (default:
the host pool's page, known once SGLang registers it), ``log_url`` (default one SQLite file per
rank in ``data_dir``; a PostgreSQL URL puts every rank in one log), ``worker_id`` (default
``tp_rank + tp_size * pp_rank``), ``redis_url`` and ``redis_namespace`` (the shared registry
other ranks' pages are found in), ``g4`` (how they are read: ``nixl``, ``shared_fs`` or
``off``), ``g4_interface``, ``g4_timeout_s``, ``g4_staging_pages`` (docs/sglang.md). Every
key is checked by
``kvledger.integrations.extra_config.SglangExtraConfig``: a bad value or a key kvledger does not
read stops start-up with a message naming it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvledger.builder import Worker, open_worker
from kvledger.config import Settings
from kvledger.events.files import private_folder
from kvledger.events.log import EventLog
from kvledger.events.log.schema import database_url
from kvledger.events.shared import RedisPublisher
from kvledger.events.types import BlockInfo, LogRecord, Lookup, Released, RunInfo, Tier
from kvledger.integrations.extra_config import SglangExtraConfig
from kvledger.integrations.sglang_g4 import NixlPages
from kvledger.recovery import open_g3
from kvledger.registry.pool import BlockPool
from kvledger.tiers.disk import DiskTier
from kvledger.tiers.disk.peer import PeerG3
from kvledger.tiers.layout import BlockShape

__all__ = ["KvledgerHiCacheStorage", "page_hashes"]

log = logging.getLogger(__name__)


def g3_file_name(worker_id: int) -> str:
    """A rank's G3 file in its ``data_dir`` (other ranks on a shared folder read it there)."""
    return f"hicache-g3-w{worker_id}.bin"


#: seconds before a rank whose G3 file could not be opened is tried again
UNREADABLE_RETRY_S = 30.0
G3_BIT = 1 << (Tier.G3 - 1)  # the shared registry's tier mask: G1=1, G2=2, G3=4, G4=8
_HEX = frozenset("0123456789abcdefABCDEF")


def page_hashes(key: str) -> tuple[int, int]:
    """``(sequence_hash, local_hash)`` of an SGLang page key: its digest's first 8 and next 8
    bytes (a key that is not a hex digest is hashed with SHA-256 first)."""
    if not isinstance(key, str):
        raise TypeError(f"SGLang page keys are str, got {type(key).__name__}: {key!r}")
    if len(key) >= 32 and _HEX.issuperset(key):
        digest = bytes.fromhex(key[:32])
    else:
        digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "big"), int.from_bytes(digest[8:16], "big")


def _page_shape(page_bytes: int) -> BlockShape:
    """G3 stores a page as opaque bytes: SGLang's host pool owns its layout."""
    return BlockShape(
        num_layers=1, outer_dim=1, page_size=1, inner_dim=page_bytes, dtype=torch.uint8
    )


class KvledgerHiCacheStorage(HiCacheStorage):  # type: ignore[misc]  # SGLang ships no types
    """One TP rank's L3: pages in a G3 file, every store, eviction and drop in the event log.

    SGLang calls it from its prefetch and backup threads at once: the pool is guarded by a lock,
    while disk I/O runs outside it on slots that are pinned (being read) or not yet named
    (being written), which eviction never touches.
    """

    def __init__(
        self,
        storage_config: HiCacheStorageConfig | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        extra = storage_config.extra_config if storage_config is not None else None
        # every key checked, by name, before anything is built (a bad value or an unknown key
        # is refused, never coerced or ignored)
        settings = SglangExtraConfig.load(extra)
        rank = storage_config.tp_rank if storage_config is not None else 0
        tp_size = storage_config.tp_size if storage_config is not None else 1
        pp_rank = storage_config.pp_rank if storage_config is not None else 0
        self.worker_id = (
            settings.worker_id if settings.worker_id is not None else rank + tp_size * pp_rank
        )
        self.data_dir = Path(
            settings.data_dir or os.environ.get("KVLEDGER_DATA_DIR") or "kvledger-hicache"
        )
        if self.data_dir.exists() and not self.data_dir.is_dir():  # KVLEDGER_DATA_DIR
            raise ValueError(f"kvledger HiCache: data_dir {self.data_dir} is a file, not a folder")
        self.capacity_pages = settings.capacity_pages
        self.log_url = settings.log_url or str(
            self.data_dir / f"hicache-log-w{self.worker_id}.sqlite"
        )
        self.page_bytes: int | None = None
        self._closed = False
        self.mem_pool_host: Any = None
        self._lock = threading.Lock()
        self._g3: DiskTier | None = None
        self._pool: BlockPool | None = None
        self._log: EventLog | None = None
        self._worker: Worker | None = None
        self.redis_url = settings.redis_url
        self.redis_namespace = settings.redis_namespace
        self.publisher: RedisPublisher | None = None
        self._peers: dict[int, PeerG3] = {}
        # ranks whose G3 file could not be opened -> when to try again (one warning, not one
        # per page; a rank that starts later is found after the wait)
        self._unreadable: dict[int, float] = {}
        self.g4 = settings.g4_mode
        self._g4_settings = settings
        self.nixl: NixlPages | None = None
        if settings.page_bytes is not None:
            self._open(settings.page_bytes)

    # -- opening -----------------------------------------------------------------------------

    def _open(self, page_bytes: Any) -> None:
        """Open the log and the G3 file for pages of ``page_bytes``; recover what both vouch for."""
        if not isinstance(page_bytes, int) or isinstance(page_bytes, bool) or page_bytes < 1:
            raise ValueError(
                f"kvledger HiCache: page_bytes must be a positive integer, got {page_bytes!r}"
            )
        if self._closed:
            raise RuntimeError("kvledger HiCache: the backend is closed")
        if self.page_bytes is not None:
            if page_bytes != self.page_bytes:
                raise ValueError(
                    f"kvledger HiCache: pages are {self.page_bytes} bytes, got one of {page_bytes}"
                )
            return
        private_folder(self.data_dir)  # 0700: its files are prompts' KV bytes
        overrides: dict[str, Any] = {
            "worker_id": self.worker_id,
            "event_log_url": database_url(self.log_url),
            "redis_url": self.redis_url,
            "redis_namespace": self.redis_namespace,
        }
        # the log (with the KVLEDGER_EVENT_LOG_* settings), its buffer, the shared registry's
        # publisher (other ranks see a page once its event is committed), ZMQ and metrics when
        # the settings ask for them: the one builder, as for every entry point
        worker = open_worker(Settings.load(**overrides))
        try:
            opened = open_g3(
                worker,
                _page_shape(page_bytes),
                self.capacity_pages,
                self.data_dir,
                file_name=g3_file_name(self.worker_id),
            )
        except BaseException:
            worker.close(drain_timeout=0)
            raise
        nixl: NixlPages | None = None
        try:
            nixl = self._open_nixl(worker, opened.disk)
            emitter = worker.emitter(worker.sink if nixl is None else _observed(nixl, worker))
            pool = BlockPool(self.capacity_pages, tier=Tier.G3, emitter=emitter)
            pool.adopt([slot for slot, _ in opened.kept], [block for _, block in opened.kept])
            if nixl is not None:  # the recovered pages are served again, before any event
                nixl.start(pool.lookup, [block.sequence_hash for _, block in opened.kept])
        except BaseException:
            if nixl is not None:
                nixl.close()
            opened.disk.close()
            worker.close(drain_timeout=0)
            raise
        # the restart rule, and the pages the log listed that are gone from the file
        worker.resume(emitter, recovered=opened.recovered)
        opened.announce(worker, emitter)
        if opened.kept or opened.dropped:
            log.info(
                "kvledger HiCache worker %d: recovered %d pages from %s, dropped %d",
                self.worker_id,
                len(opened.kept),
                opened.disk.path,
                len(opened.dropped),
            )
        self.publisher = worker.publisher
        self.nixl = nixl
        self._worker = worker
        self._log, self._g3, self._pool = worker.event_log, opened.disk, pool
        self.page_bytes = page_bytes

    def _open_nixl(self, worker: Worker, disk: DiskTier) -> NixlPages | None:
        """With ``g4: nixl``, this rank's G3 served over NIXL and other ranks' read so."""
        if self.g4 != "nixl":
            return None
        shared = worker.shared
        assert shared is not None  # g4 nixl needs redis_url: checked with the extra config
        g4 = self._g4_settings
        return NixlPages(
            self.worker_id,
            shared,
            disk,
            staging_pages=g4.g4_staging_pages,
            timeout_s=g4.g4_timeout_s,
            devices=g4.g4_interface,
        )

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang hands over its host pool: its flat page size is G3's slot size."""
        self.mem_pool_host = mem_pool_host
        page = mem_pool_host.get_dummy_flat_data_page()
        self._open(page.numel() * page.element_size())

    @property
    def event_log(self) -> EventLog | None:
        return self._log

    @property
    def disk_tier(self) -> DiskTier | None:
        return self._g3

    def close(self) -> None:
        """Flush the log and release the G3 file (a later instance recovers from both)."""
        with self._lock:
            for peer in self._peers.values():
                peer.close()
            self._peers.clear()
            if self.nixl is not None:  # withdrawn and unmapped before the file closes
                self.nixl.close()
                self.nixl = None
            if self._g3 is not None:
                self._g3.close()
            if self._worker is not None:
                self._worker.close()  # the log's rest, the publishers, the log
            self._g3 = self._pool = self._log = self._worker = None
            self.publisher = None
            self._closed = True

    def __enter__(self) -> KvledgerHiCacheStorage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- lookups -----------------------------------------------------------------------------

    def _slot(self, key: str) -> int | None:
        """The slot holding ``key``'s page; None when absent or held under another key."""
        seq, local = page_hashes(key)
        pool = self._pool
        if pool is None:
            return None
        slot = pool.lookup(seq)
        if slot is None or pool.block_info(slot).local_hash != local:
            return None
        return slot

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many of ``keys``, from the first, are stored here or, with the shared
        registry, on another rank's G3 (SGLang's prefix semantics)."""
        here = 0
        with self._lock:
            for key in keys:
                if self._slot(key) is None:
                    break
                here += 1
        if here == len(keys):
            return here
        return here + self._count_on_peers(keys[here:])

    # -- G4: other ranks' G3, found through the shared registry -----------------------------

    def _count_on_peers(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, another rank holds in G3."""
        if self.publisher is None or self.g4 == "off" or not keys:
            return 0
        holders = self.publisher.registry.who_has(
            [page_hashes(k)[0] for k in keys], stop_at_miss=True
        )
        n = 0
        for held in holders:
            if not any(
                w != self.worker_id and mask & G3_BIT and self._in_reach(w)
                for w, mask in held.items()
            ):
                break
            n += 1
        return n

    def _in_reach(self, worker: int) -> bool:
        """Whether this rank can read ``worker``'s pages: over NIXL (``g4: nixl``, each read
        still checked), or from its G3 file on a shared ``data_dir``. A page no rank in reach
        holds is not counted as there: SGLang would plan a read that can only miss."""
        return self.nixl is not None or self._peer(worker) is not None

    def _peer(self, worker: int) -> PeerG3 | None:
        peer = self._peers.get(worker)
        if peer is None:
            path = self.data_dir / g3_file_name(worker)
            if self.nixl is not None and not path.exists():
                return None  # the fallback: no shared file system, as between hosts
            if time.monotonic() < self._unreadable.get(worker, 0.0):
                return None
            try:
                peer = PeerG3(path)
            except (OSError, ValueError) as exc:
                log.warning(
                    "kvledger HiCache: rank %d's G3 cannot be read (not on a shared data_dir?"
                    " g4: nixl reads it over the network): %s",
                    worker,
                    exc,
                )
                self._unreadable[worker] = time.monotonic() + UNREADABLE_RETRY_S
                return None
            self._unreadable.pop(worker, None)
            self._peers[worker] = peer
        return peer

    def _peer_pages(
        self,
        keys: Sequence[str],
        pages: list[np.ndarray | None],
        missing: Sequence[int],
        into: Sequence[np.ndarray | None] | None,
    ) -> None:
        """Fill ``pages[i]`` for each ``missing`` key another rank's G3 file holds, checked:
        one registry call for them all, then one batched read a rank, each key tried at its
        holders in turn until one gives it."""
        if self.publisher is None or not missing:
            return
        hashes = {i: page_hashes(keys[i]) for i in missing}
        holders = self.publisher.registry.who_has([hashes[i][0] for i in missing])
        left: dict[int, list[int]] = {}
        for i, held in zip(missing, holders, strict=True):
            workers = [w for w, mask in held.items() if w != self.worker_id and mask & G3_BIT]
            if workers:
                left[i] = workers
        while left:
            by_worker: dict[int, list[int]] = {}
            for i, workers in left.items():
                by_worker.setdefault(workers.pop(0), []).append(i)
            for worker, wanted in by_worker.items():
                peer = self._peer(worker)
                if peer is None or peer.block_bytes != self.page_bytes:
                    continue
                targets = None if into is None else [into[i] for i in wanted]
                got = peer.read_many([hashes[i] for i in wanted], targets)
                for i, page in zip(wanted, got, strict=True):
                    pages[i] = page
            left = {i: workers for i, workers in left.items() if pages[i] is None and workers}

    def _read_anywhere(
        self, keys: Sequence[str], into: Sequence[np.ndarray | None] | None = None
    ) -> list[np.ndarray | None]:
        """``_read``, then pages missing here from other ranks (G4: over NIXL with ``g4:
        nixl``, then from their G3 files on a shared ``data_dir``), kept in this rank's G3
        (``Stored`` in its log) so the next read is local."""
        pages = self._read(keys, into)
        if self.publisher is None or self.g4 == "off":
            return pages
        missing = [i for i, page in enumerate(pages) if page is None]
        fetched = set(missing)
        if self.nixl is not None and missing:
            targets = None if into is None else [into[i] for i in missing]
            got = self.nixl.read([page_hashes(keys[i])[0] for i in missing], targets)
            for i, page in zip(missing, got, strict=True):
                if page is not None and page.nbytes == self.page_bytes:
                    pages[i] = page
            missing = [i for i in missing if pages[i] is None]
        self._peer_pages(keys, pages, missing, into)
        arrived = {i: page for i in sorted(fetched) if (page := pages[i]) is not None}
        for run in _runs(list(arrived)):  # one write per run of keys, each chained on the last
            parent = keys[run[0] - 1] if run[0] else None
            self._write([keys[i] for i in run], [arrived[i] for i in run], parent)
        return pages

    # -- reads -------------------------------------------------------------------------------

    def _read(
        self, keys: Sequence[str], into: Sequence[np.ndarray | None] | None = None
    ) -> list[np.ndarray | None]:
        """Each key's page bytes, or None where it is absent or its slot fails its checksum
        (such a page is dropped, and the log says so). ``into`` gives, per key, a buffer for
        G3 to read straight into (None: a new one)."""
        with self._lock:
            pool = self._pool
            if pool is None:
                return [None] * len(keys)
            slots = [self._slot(key) for key in keys]
            pinned = [s for s in slots if s is not None]
            pool.acquire(pinned)  # an access: LRU recency, and no eviction while read
        g3 = self._g3
        assert g3 is not None and self.page_bytes is not None
        targets = into if into is not None else [None] * len(keys)
        buffers = [
            np.empty(self.page_bytes, dtype=np.uint8) if buf is None else buf
            for slot, buf in zip(slots, targets, strict=True)
            if slot is not None
        ]
        good: list[bool] = []  # stays short when the read fails: nothing is dropped then
        try:
            good = g3.read_slots(pinned, buffers) if pinned else []
        finally:
            with self._lock:
                pool.release(pinned)
                bad = [
                    pool.block_info(s).sequence_hash
                    for s, ok in zip(pinned, good, strict=False)
                    if not ok
                ]
                if bad:
                    pool.remove(bad)
        found = iter(zip(buffers, good, strict=True))
        out: list[np.ndarray | None] = []
        for slot in slots:
            if slot is None:
                out.append(None)
            else:
                buf, ok = next(found)
                out.append(buf if ok else None)
        return out

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Pages as uint8 tensors, or read into ``target_locations`` (returned) when given."""
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        if len(targets) != len(keys):
            raise ValueError(f"kvledger HiCache: {len(keys)} keys but {len(targets)} targets")
        flats = [None if t is None else t.view(-1).view(torch.uint8) for t in targets]
        for flat in flats:
            if flat is not None:
                self._check_size(flat.numel(), "target")
        # host targets are read into directly; others (a device tensor) get a copy
        into = [None if f is None or not f.is_cpu else f.numpy() for f in flats]
        out: list[torch.Tensor | None] = []
        for page, target, flat, direct in zip(
            self._read_anywhere(keys, into), targets, flats, into, strict=True
        ):
            if page is None:
                out.append(None)
            elif target is None:
                out.append(torch.from_numpy(page))
            else:
                if direct is None and flat is not None:
                    flat.copy_(torch.from_numpy(page))
                out.append(target)
        return out

    # -- writes ------------------------------------------------------------------------------

    def _check_size(self, nbytes: int, what: str) -> None:
        if nbytes != self.page_bytes:
            raise ValueError(
                f"kvledger HiCache: a {what} of {nbytes} bytes, but pages are {self.page_bytes}"
            )

    def _write(
        self, keys: Sequence[str], pages: Sequence[np.ndarray], parent: str | None
    ) -> list[bool]:
        """Store each page under its key (chained on the key before it); True where it is now
        stored, including keys stored before. A key colliding with another key's hash, or a
        page that finds no slot (every slot busy), is False."""
        hashes = [page_hashes(key) for key in keys]
        results = [False] * len(keys)
        with self._lock:
            pool = self._pool
            if pool is None:
                raise RuntimeError("kvledger HiCache: the backend is closed")
            todo: list[int] = []
            present: list[int] = []
            for i, (seq, local) in enumerate(hashes):
                slot = pool.lookup(seq)
                if slot is None:
                    if all(hashes[j][0] != seq for j in todo):
                        todo.append(i)
                elif pool.block_info(slot).local_hash == local:
                    results[i] = True
                    present.append(slot)
                else:
                    log.error(
                        "kvledger HiCache: key %s collides with a stored key on sequence hash "
                        "%016x; not stored",
                        keys[i],
                        seq,
                    )
            pool.acquire(present)  # pages of this batch already stored are not evicted by it
            slots = pool.allocate_upto(len(todo))
            pool.release(present)
        todo = todo[: len(slots)]
        before = [parent, *keys[:-1]]  # each page is chained on the key before it
        parents = [None if (k := before[i]) is None else page_hashes(k)[0] for i in todo]
        blocks = [
            BlockInfo(hashes[i][0], hashes[i][1], p) for i, p in zip(todo, parents, strict=True)
        ]
        g3 = self._g3
        assert g3 is not None
        try:
            g3.write_slots(slots, [pages[i] for i in todo], blocks)
        except BaseException:
            with self._lock:
                pool.release(slots)  # never named: freed, nothing announced
            raise
        with self._lock:
            for slot, i, block in zip(slots, todo, blocks, strict=True):
                pool.register([slot], [(block.sequence_hash, block.local_hash)], block.parent_hash)
                results[i] = True
            pool.release(slots)
        return results

    def _as_page(self, value: Any) -> np.ndarray:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"kvledger HiCache: a page must be a torch.Tensor, got {type(value)}")
        flat = value.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy()
        if self.page_bytes is None:
            self._open(flat.nbytes)
        self._check_size(flat.nbytes, "page")
        return flat

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store every page; True when all of them are stored."""
        if values is None or len(values) != len(keys):
            raise ValueError(f"kvledger HiCache: {len(keys)} keys but values {values!r:.60}")
        pages = [self._as_page(v) for v in values]
        return all(self._write(keys, pages, None))

    # -- the zero-copy path (interface_v1): pages move by host-pool index -------------------

    def _page_indices(self, keys: list[str], host_indices: torch.Tensor) -> list[int]:
        pool = self.mem_pool_host
        if pool is None:
            raise RuntimeError("kvledger HiCache: batch_*_v1 before register_mem_pool_host")
        page_size = int(getattr(pool, "page_size", 1) or 1)
        if host_indices.numel() != len(keys) * page_size:
            raise ValueError(
                f"kvledger HiCache: {len(keys)} keys of {page_size} tokens need "
                f"{len(keys) * page_size} host indices, got {host_indices.numel()}"
            )
        return [int(i) for i in host_indices[::page_size].tolist()]

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Load pages into SGLang's host pool at ``host_indices``; False where absent."""
        where = self._page_indices(keys, host_indices)
        out = []
        for page, at in zip(self._read_anywhere(keys), where, strict=True):
            if page is not None:
                self.mem_pool_host.set_from_flat_data_page(at, torch.from_numpy(page))
            out.append(page is not None)
        return out

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store the host pool's pages at ``host_indices``, chained on ``extra_info``'s prefix."""
        where = self._page_indices(keys, host_indices)
        pages = [self._as_page(self.mem_pool_host.get_data_page(at, flat=True)) for at in where]
        prefix = extra_info.prefix_keys if extra_info is not None else None
        return self._write(keys, pages, prefix[-1] if prefix else None)

    # -- the rest of SGLang's interface ------------------------------------------------------

    def clear(self) -> None:
        """Drop every page (the log says ``Removed``); pages being read stay."""
        with self._lock:
            if self._pool is not None:
                self._pool.remove(list(self._pool.resident_blocks()))

    def get_stats(self) -> dict[str, int] | None:
        with self._lock:
            if self._pool is None:
                return None
            return {"pages": self._pool.num_registered, "capacity_pages": self.capacity_pages}


def _observed(nixl: NixlPages, worker: Worker) -> Any:
    """The emitter's sink with G4 over NIXL: the exporter sees each event first (a page that
    arrived is published with its checksum, one evicted withdrawn, so the exported map follows
    the log), then the log takes it."""

    def sink(event: LogRecord) -> None:
        if not isinstance(event, Lookup | Released | RunInfo):
            nixl.observe(event)
        worker.sink(event)

    return sink


def _runs(indices: list[int]) -> list[list[int]]:
    """Ascending ``indices`` cut into runs of consecutive ones."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][-1] + 1 == i:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs
