"""A cluster in one process: N mock engines behind a router, on one simulated clock.

Each worker is a ``MockEngine`` over its own ``SimulatedCache`` (its own tiers, its own event
emitter, so its own event ids and log). Requests arrive in trace order; each is routed when it
arrives, with what the router knows at that instant, and joins the chosen worker's queue.

Workers only meet at the router, so between two arrivals each worker runs on its own: before
routing a request that arrives at time t, every worker runs the steps that *start* before t.
A step's cache transitions (its admissions, the blocks it names, its evictions) happen when
it starts, so their events are out by t; what it produces (first tokens, finished requests)
exists when it ends, so the router hears of those only once t reaches the step's end. A
request arriving at t joins its worker's next step, as in a single engine.

The router learns cached prefixes from the workers' events through a feed
(``kvledger.mocker.feeds``): in memory (at once, or after a simulated delay), or through the
real ZMQ publishers or the shared registry in Redis. It learns load (prompt work routed and not
yet prefilled, blocks of active requests) from its own bookkeeping and the engines' replies.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from kvledger.events.types import Tier
from kvledger.mocker.cache import SimulatedCache
from kvledger.mocker.engine import EngineConfig, MockEngine, SimClock, _Sequence
from kvledger.mocker.router import Router
from kvledger.mocker.stats import TIERS, CountingEmitter, SimStats
from kvledger.mocker.steady import SteadyDecoders
from kvledger.mocker.traces import TraceRequest, iter_arrivals

CLUSTER_TIERS = (*TIERS, Tier.G4)


class ClusterEngine(MockEngine):
    """A mock engine that a cluster feeds request by request and runs up to a given time.

    ``MockEngine.run`` takes a whole trace; a worker of a cluster learns its requests one at a
    time, when the router picks it, so this engine keeps its queues between calls: ``submit``
    queues a request and ``advance`` runs the steps that start before a given time.
    """

    def __init__(
        self,
        cache: SimulatedCache,
        config: EngineConfig,
        *,
        clock: SimClock,
        on_finished: Callable[[_Sequence], None] | None = None,
    ) -> None:
        super().__init__(cache, config, clock=clock)
        self.waiting: deque[_Sequence] = deque()
        self.running: list[_Sequence] = []
        self.stats = SimStats()
        self.finished = 0
        self.on_finished = on_finished
        #: called with the simulated time each step (or run of quiet steps) ends
        self.on_step_end: Callable[[float], None] | None = None
        self._steady = (
            SteadyDecoders(config.block_size, naming=not config.cache_partial_blocks)
            if self.decode_ahead
            else None
        )

    def begin(self, now_ms: float) -> None:
        """The run starts at simulated ``now_ms`` (the first arrival)."""
        self.clock.now_ms = now_ms
        self._sim_start_ms = now_ms
        self._wall_start = time.monotonic()

    def submit(self, s: _Sequence) -> None:
        """``s`` arrived and was routed here; an idle engine wakes up at its arrival."""
        if not self.waiting and not self.running and self.clock.now_ms < s.req.arrival_ms:
            self.clock.now_ms = s.req.arrival_ms
        self.waiting.append(s)

    def advance(self, until_ms: float | None) -> int:
        """Run the steps that start before ``until_ms`` (None: until nothing is left);
        returns how many requests finished."""
        waiting, running, stats, steady = self.waiting, self.running, self.stats, self._steady
        clock = self.clock
        bs = self.config.block_size
        before = self.finished
        while waiting or running:
            if until_ms is not None and clock.now_ms >= until_ms:
                break
            if (
                steady is not None
                and not waiting
                and not steady.active
                and self._decode_ahead(steady, until_ms)
            ):
                continue
            self.finished += len(self._step(waiting, running, stats, bs))
            if self.on_step_end is not None:
                self.on_step_end(clock.now_ms)
        return self.finished - before

    def run_alone(
        self, requests: Sequence[tuple[int, TraceRequest]], finished: Callable[[int], None]
    ) -> None:
        """Run ``requests`` (this worker's, as (index, request) in arrival order) to the end,
        as ``MockEngine.run`` runs a trace: for a worker whose requests do not depend on what
        the others do. ``finished`` hears how many requests ended, step by step."""

        def count(done: int) -> None:
            self.finished += done
            finished(done)

        self._run_to_end(
            deque(requests), self.waiting, self.running, self.stats, self._steady, count
        )

    def _finish(self, done: list[_Sequence], running: list[_Sequence]) -> None:
        super()._finish(done, running)
        if self.on_finished is not None:
            for s in done:
                self.on_finished(s)

    def summary(self) -> dict[str, Any]:
        """This engine's own figures (``MockEngine``'s run summary)."""
        return self._summary()


@dataclass
class ClusterWorker:
    """One worker of a cluster: its id, cache, event emitter (counts, sinks) and engine."""

    worker_id: int
    cache: SimulatedCache
    emitter: CountingEmitter
    engine: ClusterEngine


class Feed(Protocol):
    """How the router's index learns the workers' events (``kvledger.mocker.feeds``)."""

    def step_ended(self, worker_id: int, now_ms: float) -> None:
        """A step of ``worker_id`` ended at ``now_ms``: what it emitted is out."""

    def catch_up(self, now_ms: float) -> None:
        """Bring the router's index up to what the feed has delivered by ``now_ms``."""

    def settle(self, last_ids: dict[int, int]) -> None:
        """The run is over: wait until the index holds every event up to ``last_ids`` (per
        worker), so that it is the fold of everything the workers emitted."""

    def close(self) -> None: ...


_Reply = tuple[float, bool, int]
"""Something a worker tells the router when a step ends: (at_ms, first token or finish,
request). A plain tuple: a NamedTuple's constructor is Python code, run twice a request."""


@dataclass
class ClusterRun:
    """What a cluster run measured: per worker, and the requests' routing."""

    workers: list[ClusterWorker]
    router: Router
    #: worker index of each request, in arrival order
    placement: list[int]
    wall_s: float
    #: per routing decision, events the workers had emitted that the router's index lacked
    behind: list[int] = field(default_factory=list)


class Cluster:
    """N workers, a router and the feed that tells the router what the workers hold.

    ``sim_speedup``: pace the simulated clock at that many times the wall clock (0: as fast
    as possible); with a real feed (ZMQ, Redis) that is what turns its wall-clock lag into
    simulated staleness.
    """

    def __init__(
        self,
        workers: Sequence[ClusterWorker],
        router: Router,
        *,
        feed: Feed | None = None,
        sim_speedup: float = 0.0,
        progress: Callable[[int], None] | None = None,
        index_last_ids: Callable[[], dict[int, int]] | None = None,
    ) -> None:
        if len(workers) != router.workers:
            raise ValueError(f"{len(workers)} workers but a router for {router.workers}")
        if sim_speedup < 0:
            raise ValueError(f"sim_speedup must be >= 0, got {sim_speedup}")
        self.workers = list(workers)
        self.router = router
        self.feed = feed
        self.sim_speedup = sim_speedup
        self.progress = progress
        self._index_last_ids = index_last_ids
        self._replies: list[deque[_Reply]] = [deque() for _ in self.workers]
        for i, worker in enumerate(self.workers):
            engine = worker.engine
            engine.on_first_token = self._replier(i, first=True)
            engine.on_finished = self._replier(i, first=False)
            if feed is not None:  # (a partial: no Python frame of its own, every step)
                engine.on_step_end = partial(feed.step_ended, worker.worker_id)

    def _replier(self, worker: int, *, first: bool) -> Callable[[_Sequence], None]:
        replies = self._replies[worker]
        clock = self.workers[worker].engine.clock

        def reply(s: _Sequence) -> None:
            replies.append((clock.now_ms, first, s.index))

        return reply

    def run(self, requests: Sequence[TraceRequest]) -> ClusterRun:
        """Route and run every request; returns once every worker has finished."""
        workers = self.workers
        engines = [w.engine for w in workers]
        first = engines[0]
        arrivals = list(iter_arrivals(list(requests)))
        first._check_fits(arrivals)
        bs = first.config.block_size
        placement: list[int] = []
        behind: list[int] = []
        started = time.perf_counter()
        if arrivals:
            t0 = arrivals[0].arrival_ms
            epoch = time.time() - t0 / 1e3
            for engine in engines:
                engine.begin(t0)
                engine.clock.epoch = epoch  # one time line for every worker's events
            if self.feed is not None:  # what the workers said before the run (a restart)
                for w in workers:
                    self.feed.step_ended(w.worker_id, t0)
        router, feed, progress = self.router, self.feed, self.progress
        if router.stateless and feed is None and not self.sim_speedup:
            # nothing a worker does changes where requests go: route them all, then run each
            # worker alone (what each one does is the same as interleaved, only cheaper)
            mine: list[list[tuple[int, TraceRequest]]] = [[] for _ in engines]
            for index, req in enumerate(arrivals):
                worker = router.route(index, [], req.input_length)
                placement.append(worker)
                mine[worker].append((index, req))
            finished = [0]

            def tick(n: int) -> None:
                finished[0] += n
                if progress is not None:
                    progress(finished[0])

            for engine, queue in zip(engines, mine, strict=True):
                engine.on_first_token = engine.on_finished = None
                engine.run_alone(queue, tick)
            return ClusterRun(workers, router, placement, time.perf_counter() - started)
        wall0 = time.monotonic()
        track = self._index_last_ids is not None
        done = reported = 0
        # per worker: its index, engine, clock and the replies the router has not yet heard
        lanes = [
            (worker, engine, engine.clock, replies)
            for worker, (engine, replies) in enumerate(zip(engines, self._replies, strict=True))
        ]
        hand_over = self._hand_over
        for index, req in enumerate(arrivals):
            now = req.arrival_ms
            for worker, engine, clock, replies in lanes:
                # a worker whose step runs past this arrival has no step to start before it
                if clock.now_ms < now and (engine.waiting or engine.running):
                    done += engine.advance(now)
                # what happened by now reaches the router, worker by worker in the same pass
                # (workers only meet at the router, so hearing of one before the next one runs
                # changes nothing); the test in line, as this runs for every worker at every
                # arrival and most find nothing due
                if replies and replies[0][0] <= now:
                    hand_over(worker, replies, now)
            if progress is not None and done != reported:
                progress(done)
                reported = done
            if self.sim_speedup:
                self._pace(wall0, now - arrivals[0].arrival_ms)
            if feed is not None:
                feed.catch_up(now)
            if track:
                behind.append(self._behind())
            s = first._sequence(index, req)  # its blocks hashed as it arrives
            full = req.input_length // bs
            worker = router.route(index, s.seq[:full], req.input_length)
            placement.append(worker)
            engines[worker].submit(s)
        for engine in engines:
            done += engine.advance(None)
        if progress is not None:
            progress(done)
        for worker, replies in enumerate(self._replies):
            self._hand_over(worker, replies, math.inf)
        if feed is not None:
            feed.settle({w.worker_id: w.emitter.next_event_id - 1 for w in workers})
        return ClusterRun(workers, router, placement, time.perf_counter() - started, behind=behind)

    def _hand_over(self, worker: int, replies: deque[_Reply], until_ms: float) -> None:
        """Tell the router of ``worker``'s first tokens and finishes that happened by
        ``until_ms``."""
        router = self.router
        while replies and replies[0][0] <= until_ms:
            _at, first, request = replies.popleft()
            if first:
                router.prefill_done(worker, request)
            else:
                router.finished(worker, request)

    def _behind(self) -> int:
        assert self._index_last_ids is not None
        applied = self._index_last_ids()
        return sum(
            max(0, w.emitter.next_event_id - 1 - applied.get(w.worker_id, -1)) for w in self.workers
        )

    def _pace(self, wall0: float, sim_elapsed_ms: float) -> None:
        delay = wall0 + sim_elapsed_ms / 1e3 / self.sim_speedup - time.monotonic()
        if delay > 0:
            time.sleep(delay)


def percentile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile of sorted values, interpolated between the two nearest ranks (rank
    ``q * (n - 1)``): how Dynamo's replay summary (and numpy's default) computes its TTFT
    percentiles, so that the two can be compared to the millisecond."""
    rank = q * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def cluster_summary(run: ClusterRun, block_size: int) -> dict[str, Any]:
    """Per-worker and cluster figures of a run (what ``simulate --workers N --json`` prints
    under ``cluster`` and ``per_worker``)."""
    per_worker: list[dict[str, Any]] = []
    ttft: list[float] = []
    tpot: list[float] = []
    latency: list[float] = []
    asked = hit = tokens = tokens_hit = admitted = reused = preemptions = 0
    by_tier = dict.fromkeys((t.name for t in CLUSTER_TIERS), 0)
    simulated = 0.0
    for i, w in enumerate(run.workers):
        engine, stats = w.engine, w.engine.stats
        mine = stats.summary(w.cache, w.emitter)
        mine.update(engine.summary())
        mine["hits_by_tier"] = {t.name: stats.hits_by_tier.get(t, 0) for t in CLUSTER_TIERS}
        mine["worker_id"] = w.worker_id
        mine["routed"] = run.router.routed[i]
        per_worker.append(mine)
        ttft += stats.ttft_ms
        tpot += engine.tpot_ms
        latency += engine.latency_ms
        asked += stats.blocks_requested
        hit += stats.blocks_hit
        tokens += stats.tokens_requested
        tokens_hit += stats.tokens_hit
        admitted += engine.admitted_tokens
        reused += engine.reused_tokens
        preemptions += engine.preemptions
        for t in CLUSTER_TIERS:
            by_tier[t.name] += stats.hits_by_tier.get(t, 0)
        simulated = max(simulated, mine.get("simulated_s", 0.0))
    routed = run.router.routed
    mean = sum(routed) / len(routed) if routed else 0.0
    cluster: dict[str, Any] = {
        "workers": len(run.workers),
        "router": run.router.name,
        "requests": sum(routed),
        "blocks_requested": asked,
        "blocks_hit": hit,
        "hit_rate": round(hit / asked, 6) if asked else 0.0,
        "token_hit_rate": round(tokens_hit / tokens, 6) if tokens else 0.0,
        "token_hit_rate_all_admissions": round(reused / admitted, 6) if admitted else 0.0,
        "hits_by_tier": by_tier,
        "hit_rate_by_tier": {t: round(n / asked, 6) if asked else 0.0 for t, n in by_tier.items()},
        "preemptions": preemptions,
        "simulated_s": simulated,
        # load balance: the busiest worker's requests over the mean (1.0: even)
        "load_imbalance": round(max(routed) / mean, 4) if mean else 0.0,
        "routed": list(routed),
        "wall_s": round(run.wall_s, 3),
    }
    if ttft:
        ordered = sorted(ttft)
        cluster["ttft_ms_p50"] = round(percentile(ordered, 0.5), 3)
        cluster["ttft_ms_p99"] = round(percentile(ordered, 0.99), 3)
        cluster["ttft_ms_mean"] = round(sum(ttft) / len(ttft), 3)
    if tpot:
        cluster["tpot_ms_mean"] = round(sum(tpot) / len(tpot), 3)
    if latency:
        ordered = sorted(latency)
        cluster["latency_ms_p50"] = round(percentile(ordered, 0.5), 3)
        cluster["latency_ms_p99"] = round(percentile(ordered, 0.99), 3)
    if run.behind:
        ordered_behind = sorted(run.behind)
        cluster["router_events_behind"] = {
            "p50": round(percentile(ordered_behind, 0.5), 1),
            "p99": round(percentile(ordered_behind, 0.99), 1),
            "max": ordered_behind[-1],
            "stale_decisions": round(sum(1 for b in run.behind if b) / len(run.behind), 6),
        }
    router = run.router
    asked_blocks = getattr(router, "asked_blocks", 0)
    if asked_blocks:
        cluster["router_overlap"] = round(getattr(router, "overlap_blocks", 0) / asked_blocks, 6)
    return {"cluster": cluster, "per_worker": per_worker, "block_size": block_size}
