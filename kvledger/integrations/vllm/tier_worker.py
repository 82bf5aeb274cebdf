"""One kvledger worker under vLLM's tiering layer: what kvledger's secondary tiers share.

vLLM builds each secondary tier on its own (``SecondaryTierFactory``, one class per entry of
``secondary_tiers``), all in the scheduler process and all called under the tiering
manager's lock. kvledger's disk tier (G3) and peer tier (G4, whose exported pool is this
worker's G2) are two tiers of one kvledger worker, so they share one ``TierWorker``: one
event emitter (a worker's event ids are one strictly increasing sequence), one durable log
and one publisher to the shared registry. ``open_tier_worker`` hands every tier of a
process the same one for the same ``(log_url, worker_id)``; each tier gives it back with
``release`` when it shuts down, and the last one closes it.

Events are gathered as the tiers make them and handed over once per scheduler step
(``step``, from each tier's ``on_schedule_end``) to the log through an ``AppendBuffer``
(batched, with a bounded hold, as kvledger's vLLM manager does). The Redis publisher is fed
by the log's writer once they are committed (``EventLog.on_commit``), as every kvledger
publisher is: other processes only ever see what the log holds.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from kvledger.builder import KnownBlocks, Worker, open_worker
from kvledger.config import Settings
from kvledger.events.shared.publish import RedisPublisher
from kvledger.events.shared.registry import SharedRegistry
from kvledger.events.types import AnyEvent, Tier
from kvledger.registry.pool import BlockPool
from kvledger.registry.state import RegistryState

__all__ = ["TierJobs", "TierWorker", "open_tier_worker", "register_runs", "release"]

log = logging.getLogger(__name__)

Observer = Callable[[AnyEvent], None]


class TierWorker:
    """The emitter, log and shared-registry publisher of one kvledger worker under vLLM's
    tiering layer: the builder's ``Worker`` (``kvledger.builder``), which every entry point
    uses, plus what vLLM's tiers share (their pools, their observers, a step's events).

    A worker with a log continues it: event ids go on from this worker's last one
    (``restarted`` tells a tier that it must say how its tier starts: ``Cleared``, or a
    recovered G3's ``Removed``).
    """

    def __init__(self, worker: Worker) -> None:
        self.worker_id = worker.worker_id
        self._worker = worker
        self.event_log = worker.event_log
        self.restarted = worker.restarted
        self.emitter = worker.emitter(self._on_event)
        self._unlogged: list[AnyEvent] = []
        self._observers: list[Observer] = []
        self._pools: dict[Tier, BlockPool] = {}
        self._lock = threading.Lock()

    @property
    def builder_worker(self) -> Worker:
        """The builder's worker under it: its log, publisher, recovery."""
        return self._worker

    @property
    def publisher(self) -> RedisPublisher | None:
        return self._worker.publisher

    @property
    def shared(self) -> SharedRegistry | None:
        return self._worker.shared

    # -- the tiers ---------------------------------------------------------------------------

    def attach(self, pool: BlockPool, observer: Observer | None = None) -> None:
        """A tier's pool (it must use ``emitter``); ``observer`` sees every event of this
        worker as it is made, before any other change (to translate its own tier's events
        for vLLM, or to publish its blocks for remote reads)."""
        if pool.emitter is not self.emitter:
            raise ValueError(f"the {pool.tier.name} pool does not use this worker's emitter")
        if pool.tier in self._pools:
            raise ValueError(f"worker {self.worker_id} already has a {pool.tier.name} tier")
        self._pools[pool.tier] = pool
        if observer is not None:
            self._observers.append(observer)

    def detach(self, pool: BlockPool, observer: Observer | None = None) -> None:
        self._pools.pop(pool.tier, None)
        if observer is not None and observer in self._observers:
            self._observers.remove(observer)

    def logged(self, tier: Tier) -> KnownBlocks | None:
        """This worker's blocks on ``tier`` by the log's fold (``Worker.logged``)."""
        return self._worker.logged(tier)

    def state(self) -> RegistryState:
        """The attached tiers as they stand: what this worker's log replays to."""
        return RegistryState.from_mapping(
            {(self.worker_id, tier): pool.resident_blocks() for tier, pool in self._pools.items()}
        )

    # -- events ------------------------------------------------------------------------------

    def _on_event(self, event: AnyEvent) -> None:
        for observer in self._observers:
            observer(event)
        self._unlogged.append(event)

    def step(self) -> None:
        """Hand the events made since the last step to the log (the publisher follows its
        commits)."""
        with self._lock:
            batch, self._unlogged = self._unlogged, []
        self._worker.extend(batch)

    def flush(self) -> None:
        """Wait until every event so far is durable in the log."""
        self.step()
        self._worker.flush()

    def close(self) -> None:
        """Hand over what waits and stop (the log closes when the worker opened it)."""
        self.step()
        self._worker.close(drain_timeout=5.0)


_open: dict[tuple[str | None, int], tuple[TierWorker, int, tuple[str | None, str]]] = {}
_open_lock = threading.Lock()


def open_tier_worker(
    worker_id: int,
    *,
    log_url: str | None = None,
    redis_url: str | None = None,
    redis_namespace: str = "kvledger",
) -> TierWorker:
    """The ``TierWorker`` of this process for ``(log_url, worker_id)``, built on first use
    by the builder (the log with the ``KVLEDGER_EVENT_LOG_*`` settings, as every kvledger
    log); every call is matched by one ``release``. Two tiers of one worker must name the
    same shared registry."""
    if redis_url is not None and log_url is None:
        raise ValueError(
            "a shared registry (redis_url) needs the event log (log_url): the publisher"
            " catches up from it"
        )
    overrides: dict[str, object] = {"worker_id": worker_id, "redis_namespace": redis_namespace}
    overrides["redis_url"] = redis_url
    if log_url is not None:
        overrides["event_log_url"] = log_url
    if log_url is None:  # nothing durable to share: a worker of its own
        settings = Settings.load(**overrides)
        return TierWorker(open_worker(settings, log_events=False, redis=False, zmq=False))
    key = (log_url, worker_id)
    with _open_lock:
        found = _open.get(key)
        if found is not None:
            worker, users, shared_at = found
            if shared_at != (redis_url, redis_namespace):
                raise ValueError(
                    f"kvledger worker {worker_id} (log {log_url}) is already open with"
                    f" redis_url={shared_at[0]!r}, redis_namespace={shared_at[1]!r}; every"
                    " kvledger tier of a worker must name the same ones"
                )
            _open[key] = (worker, users + 1, shared_at)
            return worker
        worker = TierWorker(open_worker(Settings.load(**overrides), zmq=False))
        _open[key] = (worker, 1, (redis_url, redis_namespace))
        return worker


def release(worker: TierWorker) -> None:
    """Give back a ``TierWorker`` of ``open_tier_worker``; the last user closes it."""
    with _open_lock:
        for key, (found, users, shared_at) in list(_open.items()):
            if found is worker:
                if users > 1:
                    _open[key] = (found, users - 1, shared_at)
                    return
                del _open[key]
                break
    worker.close()


def register_runs(
    pool: BlockPool, slots: Sequence[int], hashes: Sequence[int], parents: Sequence[int | None]
) -> None:
    """Name filled mutable ``slots``: one ``Stored`` per run in which each block's parent is
    the block before it (a request's consecutive chunks are one run)."""
    start = 0
    for i in range(1, len(hashes) + 1):
        if i == len(hashes) or parents[i] != hashes[i - 1]:
            run = hashes[start:i]
            pool.register(slots[start:i], [(h, h) for h in run], parents[start])
            start = i


class Job(Protocol):
    """What ``TierJobs`` reads of a tier's job in flight."""

    job_id: int
    future: Future[Any] | None


class TierParts(Protocol):
    """What ``TierJobs`` reads of the parts a tier runs on (its file or its NIXL side)."""

    owned: bool
    """True where the tier built them, and closes them (and gives the worker back) when done."""


class TierJobs:
    """What kvledger's two tiers under vLLM's tiering layer (``KvledgerDiskTier``,
    ``KvledgerPeerTier``) do alike as vLLM's ``SecondaryTierManager``: their jobs run on the
    tier's I/O threads and are finished when vLLM asks for them, each scheduler step hands the
    worker's events on, and a shutdown finishes every job, stops observing the pool and gives
    the worker back (closing the tier's parts where the tier built them).

    A tier sets ``worker``, ``pool``, ``parts``, ``_io``, ``_jobs`` and ``_observer`` (what it
    attaches to the worker for its pool's events), then calls ``_attach``; it defines
    ``_finish`` (a done job as vLLM's result) and ``_close_parts``.
    """

    worker: TierWorker
    pool: BlockPool
    parts: TierParts
    _io: ThreadPoolExecutor
    _jobs: dict[int, Any]
    _observer: Observer

    def _finish(self, job: Any) -> Any:
        raise NotImplementedError

    def _close_parts(self) -> None:
        raise NotImplementedError

    def _attach(self) -> None:
        """Observe the pool's events; where that fails, nothing the tier opened stays open."""
        try:
            self.worker.attach(self.pool, self._observer)
        except BaseException:
            self._io.shutdown()
            if self.parts.owned:
                self._close_parts()
                release(self.worker)
            raise

    def get_finished_jobs(self) -> list[Any]:
        done: list[Job] = [
            job for job in self._jobs.values() if job.future is None or job.future.done()
        ]
        results = [self._finish(job) for job in done]
        for job in done:
            del self._jobs[job.job_id]
        return results

    def has_pending_work(self) -> bool:
        return bool(self._jobs)

    def drain_jobs(self) -> None:
        for job in list(self._jobs.values()):
            if job.future is not None:
                with contextlib.suppress(Exception):  # reported by get_finished_jobs
                    job.future.result()

    def on_schedule_end(self, context: object) -> None:
        self.worker.step()

    def flush_log(self) -> None:
        """Wait until every event so far is durable in the log."""
        self.worker.flush()

    def shutdown(self) -> None:
        self.drain_jobs()
        for job in list(self._jobs.values()):
            self._finish(job)
        self._jobs.clear()
        self._io.shutdown(wait=True)
        self.worker.detach(self.pool, self._observer)
        self.worker.step()
        if self.parts.owned:
            self._close_parts()
            release(self.worker)
