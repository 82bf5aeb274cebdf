"""Re-run a recorded run's lookups through a simulated cache: ``kvledger whatif``.

The log's lookup records (``events/types.py``: ``Lookup``, ``Released``, ``RunInfo``) say what
each request asked for, how it grew and when it ended, in order. Feeding them, in that order,
to a ``SimulatedCache`` (the same ``TieredPools`` a live worker runs) answers "what would
this traffic have hit with other capacities, another policy, another offload filter". Run with
the recorded settings, it must give back every recorded hit count: that is the check that the
method holds, and the reason to trust the alternatives.

The model of a request is the simulator's: at its lookup its cached prefix is taken (G1 hits,
G2/G3 onboarded) and the rest of what it asked for is registered as computed; a growth
registers the new blocks; its release lets go of everything. That is exactly what a
``kvledger simulate`` run did, and what a ``BlockManager`` run did whenever each request
registered its prompt before the next lookup and its copies landed before the next lookup;
otherwise the baseline says which lookups differ.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from kvledger.events.codec import decode
from kvledger.events.log import EventLog
from kvledger.events.log.schema import database_url
from kvledger.events.types import Lookup, LookupRecord, Released, RunInfo, Tier
from kvledger.mocker.cache import Admission, SimulatedCache
from kvledger.mocker.stats import TIERS, EventCounter
from kvledger.mocker.traces import TraceRequest
from kvledger.registry.emitter import EventEmitter
from kvledger.registry.tiered import TieredPools

PROGRESS_EVERY = 1024
"""Records between two ``on_progress`` calls of ``rerun``."""


class NoLookupsError(ValueError):
    """The log (or the part asked for) holds no lookup records to re-run."""


@dataclass(frozen=True)
class CacheSettings:
    """What a re-run may change."""

    g1_blocks: int
    g2_blocks: int
    g3_blocks: int
    policy: str
    offload_filter: str

    @classmethod
    def of(cls, run: RunInfo) -> CacheSettings:
        return cls(run.g1_blocks, run.g2_blocks, run.g3_blocks, run.policy, run.offload_filter)

    def label(self) -> str:
        tiers = f"G1 {self.g1_blocks}"
        if self.g2_blocks:
            tiers += f" G2 {self.g2_blocks}"
        if self.g3_blocks:
            tiers += f" G3 {self.g3_blocks} {self.offload_filter}"
        return f"{tiers}, {self.policy}"


@dataclass
class RecordedRun:
    """One worker's lookup records, and the window of them that counts."""

    worker: int
    records: list[tuple[int, LookupRecord]]  # (position, record), in log order
    settings: CacheSettings
    block_size: int
    count_from: int = 0  # the first position whose lookups count (earlier ones warm the cache)

    @property
    def counted_lookups(self) -> int:
        return sum(1 for p, r in self.records if p >= self.count_from and isinstance(r, Lookup))


@dataclass
class Tally:
    """Hits of the prompt lookups (``start == 0``) in the counted window."""

    lookups: int = 0
    blocks: int = 0
    hits: list[int] = field(default_factory=lambda: [0, 0, 0])
    tokens: int = 0
    tokens_hit: int = 0

    def add(self, lookup_blocks: int, hits: tuple[int, int, int], tokens: int, bs: int) -> None:
        self.lookups += 1
        self.blocks += lookup_blocks
        for i, n in enumerate(hits):
            self.hits[i] += n
        if tokens:
            self.tokens += tokens
            self.tokens_hit += min(sum(hits) * bs, tokens)

    def summary(self) -> dict[str, Any]:
        hit = sum(self.hits)
        return {
            "lookups": self.lookups,
            "blocks_requested": self.blocks,
            "blocks_hit": hit,
            "hit_rate": round(hit / self.blocks, 6) if self.blocks else 0.0,
            "hits_by_tier": {t.name: n for t, n in zip(TIERS, self.hits, strict=True)},
            "hit_rate_by_tier": {
                t.name: round(n / self.blocks, 6) if self.blocks else 0.0
                for t, n in zip(TIERS, self.hits, strict=True)
            },
            "token_hit_rate": round(self.tokens_hit / self.tokens, 6) if self.tokens else None,
        }


@dataclass
class Rerun:
    settings: CacheSettings
    tally: Tally
    evictions: dict[str, int]
    mismatches: list[dict[str, Any]]  # lookups whose hits differ from the recorded ones
    compared: int  # lookups compared with the recorded ones
    seconds: float

    def summary(self) -> dict[str, Any]:
        out = {"settings": asdict(self.settings), **self.tally.summary()}
        out["evictions"] = self.evictions
        out["lookups_differing"] = len(self.mismatches)
        out["first_differences"] = self.mismatches[:5]
        out["wall_s"] = round(self.seconds, 3)
        return out


def load_run(
    log: EventLog,
    *,
    worker: int | None = None,
    since_position: int = 1,
    since_ts: float | None = None,
    until_position: int | None = None,
    until_ts: float | None = None,
    on_progress: Callable[[int], object] | None = None,
) -> RecordedRun:
    """A worker's lookup records up to the bound; those from ``since`` on are the ones that
    count (the earlier ones are re-run too, so the cache is as warm as it was).
    ``on_progress`` is called with the position reached after each chunk of rows."""
    records: list[tuple[int, LookupRecord]] = []
    workers: set[int] = set()
    count_from: int | None = None
    for chunk in log.read_chunks(lookups_only=True, until_position=until_position):
        if on_progress is not None and chunk:
            on_progress(chunk[-1][0])
        for position, ts, payload in chunk:
            if until_ts is not None and ts > until_ts:
                break
            record = decode(payload, position)
            assert isinstance(record, Lookup | Released | RunInfo)  # lookups_only
            workers.add(record.worker_id)
            if worker is not None and record.worker_id != worker:
                continue
            started = position >= since_position and (since_ts is None or ts >= since_ts)
            if count_from is None and started:
                count_from = position
            records.append((position, record))
    if worker is None and len(workers) > 1:
        raise ValueError(
            f"the log holds lookup records of workers {sorted(workers)}; pick one with --worker"
        )
    runs = [r for _, r in records if isinstance(r, RunInfo)]
    if not runs or not any(isinstance(r, Lookup) for _, r in records):
        who = f" of worker {worker}" if worker is not None else ""
        raise NoLookupsError(
            f"{log.url}: no lookup records{who} in the part asked for; the run was "
            "recorded with log_lookups off (KVLEDGER_LOG_LOOKUPS=0), or by a kvledger that "
            "did not write them"
        )
    first = runs[0]
    return RecordedRun(
        worker=first.worker_id,
        records=records,
        settings=CacheSettings.of(first),
        block_size=first.block_size,
        count_from=count_from if count_from is not None else (records[-1][0] + 1),
    )


def recorded(run: RecordedRun) -> Tally:
    """What the run had, from its own lookup records."""
    tally = Tally()
    for position, record in run.records:
        if position >= run.count_from and isinstance(record, Lookup) and record.start == 0:
            tally.add(len(record.sequence_hashes), record.hits, record.num_tokens, run.block_size)
    return tally


def ceiling(run: RecordedRun) -> Tally:
    """The hits an infinite cache would have had: every block seen before (its whole prefix
    seen) is a hit."""
    seen: set[int] = set()
    tally = Tally()
    for position, record in run.records:
        if not isinstance(record, Lookup):
            continue
        hashes = record.sequence_hashes
        if position >= run.count_from and record.start == 0:
            n = 0
            for h in hashes:
                if h not in seen:
                    break
                n += 1
            tally.add(len(hashes), (n, 0, 0), record.num_tokens, run.block_size)
        seen.update(hashes)
    return tally


def rerun(
    run: RecordedRun,
    settings: CacheSettings,
    *,
    compare: bool = False,
    on_progress: Callable[[int], object] | None = None,
) -> Rerun:
    """Re-run every lookup record of ``run`` under ``settings``; with ``compare``, note each
    lookup whose hits differ from the recorded ones (meaningful for the recorded settings).
    ``on_progress`` is called with the records re-run so far, every ``PROGRESS_EVERY``."""
    started = time.perf_counter()
    counter = EventCounter()
    cache = _cache(settings, counter)
    live: dict[int, Admission] = {}
    asked: dict[int, list[int]] = {}
    tally = Tally()
    mismatches: list[dict[str, Any]] = []
    compared = 0
    bs, count_from = run.block_size, run.count_from
    runs_seen = 0
    for done, (position, record) in enumerate(run.records):
        if on_progress is not None and not done % PROGRESS_EVERY:
            on_progress(done)
        if isinstance(record, Released):
            admission = live.pop(record.request_id, None)
            if admission is not None:
                cache.finish(admission)
            continue
        if isinstance(record, RunInfo):
            runs_seen += 1
            if runs_seen > 1:  # a restart: the worker's caches started empty again
                cache, live, asked = _cache(settings, counter), {}, {}
            continue
        hashes = record.sequence_hashes
        rid = record.request_id
        if record.start == 0:
            old = live.pop(rid, None)
            if old is not None:
                cache.finish(old)
            admission = cache.admit(hashes, hashes)
            live[rid] = admission
            asked[rid] = list(hashes)
            hits = (
                admission.match.g1,
                admission.onboarded.get(Tier.G2, 0),
                admission.onboarded.get(Tier.G3, 0),
            )
            if position >= count_from:
                tally.add(len(hashes), hits, record.num_tokens, bs)
        else:
            grown = live.get(rid)
            if grown is None:
                continue
            sequence = asked[rid][: record.start] + list(hashes)
            asked[rid] = sequence
            hits = (cache.tiered.g1.probe(sequence[len(grown.slots) :]), 0, 0)
            cache.extend(grown, sequence, sequence)
        if compare and position >= count_from:
            compared += 1
            if hits != record.hits:
                mismatches.append(
                    {
                        "position": position,
                        "request_id": rid,
                        "start": record.start,
                        "recorded": list(record.hits),
                        "rerun": list(hits),
                    }
                )
    if on_progress is not None:
        on_progress(len(run.records))
    evictions = {t.name: counter.removed_blocks.get(t, 0) for t in TIERS}
    return Rerun(settings, tally, evictions, mismatches, compared, time.perf_counter() - started)


def _cache(settings: CacheSettings, counter: EventCounter) -> SimulatedCache:
    tiered = TieredPools(
        settings.g1_blocks,
        settings.g2_blocks,
        settings.g3_blocks,
        policy=settings.policy,
        offload_filter=settings.offload_filter,
        emitter=EventEmitter(counter),
    )
    return SimulatedCache(tiered)


def alternatives(
    base: CacheSettings,
    *,
    g1_blocks: list[int] | None = None,
    g2_blocks: list[int] | None = None,
    g3_blocks: list[int] | None = None,
    policies: list[str] | None = None,
    offload_filters: list[str] | None = None,
) -> Iterator[CacheSettings]:
    """Every combination of the values given (the recorded value where none is)."""
    for g1 in g1_blocks or [base.g1_blocks]:
        for g2 in g2_blocks if g2_blocks is not None else [base.g2_blocks]:
            for g3 in g3_blocks if g3_blocks is not None else [base.g3_blocks]:
                for policy in policies or [base.policy]:
                    for offload in offload_filters or [base.offload_filter]:
                        yield CacheSettings(g1, g2, g3, policy, offload)


def recorded_block_size(location: str) -> int:
    """The block size of a recorded run (its first run record), read without decoding the
    rest of the log: ``simulate --trace LOG`` needs it before it reads the requests."""
    with EventLog(database_url(location), read_only=True) as log:
        for chunk in log.read_chunks(lookups_only=True, chunk_size=64):
            for position, _ts, payload in chunk:
                record = decode(payload, position)
                if isinstance(record, RunInfo):
                    return record.block_size
    return trace_from_log(location)[1]  # no run record: raises what is missing


def trace_from_log(location: str, worker: int | None = None) -> tuple[list[TraceRequest], int]:
    """A recorded run's requests as a trace, and its block size: each prompt lookup is a
    request arriving when it was looked up, its blocks named by the recorded hashes (equal
    prefixes stay equal), its output as long as the blocks it grew by (at least one token).
    A request the engine admitted again after a preemption counts again."""
    with EventLog(database_url(location), read_only=True) as log:
        run = load_run(log, worker=worker)
    bs = run.block_size
    lookups = [r for _, r in run.records if isinstance(r, Lookup)]
    grown: Counter[int] = Counter()
    for r in lookups:
        if r.start:
            grown[r.request_id] += len(r.sequence_hashes)
    prompts = [r for r in lookups if r.start == 0 and r.sequence_hashes]
    t0 = prompts[0].ts if prompts else 0.0
    requests = [
        TraceRequest(
            arrival_ms=(r.ts - t0) * 1000.0,
            input_length=min(r.num_tokens, len(r.sequence_hashes) * bs)
            if r.num_tokens
            else len(r.sequence_hashes) * bs,
            output_length=max(1, grown[r.request_id] * bs),
            block_ids=r.sequence_hashes,
            trace_block_size=bs,
        )
        for r in prompts
    ]
    if not requests:
        raise NoLookupsError(f"{location}: no prompt lookups to make a trace of")
    return requests, bs
