"""A recorded run over time: what ``kvledger report`` prints and plots.

The log is cut into windows of equal time; each window counts the lookups that arrived in it
(their hits per tier), the transitions by kind, the blocks evicted, offloaded and onboarded,
and how many requests were holding blocks at its end. Every count is a count of rows, each in
exactly one window, so the windows add up to the totals of the whole range.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvledger.events.codec import KIND_CODES, KIND_NAMES, decode
from kvledger.events.log import EventLog
from kvledger.events.types import (
    Lookup,
    Offloaded,
    Onboarded,
    Released,
    Removed,
    RunInfo,
    Tier,
)

TIERS = (Tier.G1, Tier.G2, Tier.G3)
RUN_KIND = KIND_CODES[RunInfo]


@dataclass
class Window:
    """Counts of the rows stamped in ``[start, end)`` (the last window includes its end)."""

    start: float
    end: float
    first_position: int | None = None
    last_position: int | None = None
    lookups: int = 0
    blocks_requested: int = 0
    hits: Counter[str] = field(default_factory=Counter)
    tokens: int = 0
    tokens_hit: int = 0
    rows_by_kind: Counter[str] = field(default_factory=Counter)
    evicted: Counter[str] = field(default_factory=Counter)
    offloaded: Counter[str] = field(default_factory=Counter)
    onboarded: Counter[str] = field(default_factory=Counter)
    in_flight: int = 0  # requests holding blocks at the window's end

    def add_position(self, position: int) -> None:
        if self.first_position is None:
            self.first_position = position
        self.last_position = position

    def summary(self) -> dict[str, Any]:
        blocks = self.blocks_requested
        hit = sum(self.hits.values())
        return {
            "start_ts": self.start,
            "end_ts": self.end,
            "first_position": self.first_position,
            "last_position": self.last_position,
            "lookups": self.lookups,
            "blocks_requested": blocks,
            "blocks_hit": hit,
            "hits_by_tier": {t.name: self.hits[t.name] for t in TIERS},
            "hit_rate": round(hit / blocks, 6) if blocks else None,
            "hit_rate_by_tier": {
                t.name: round(self.hits[t.name] / blocks, 6) if blocks else None for t in TIERS
            },
            "tokens_requested": self.tokens,
            "tokens_hit": self.tokens_hit,
            "rows_by_kind": dict(sorted(self.rows_by_kind.items())),
            "evicted_blocks": {t.name: self.evicted[t.name] for t in TIERS},
            "offloaded_blocks": {t.name: self.offloaded[t.name] for t in TIERS},
            "onboarded_blocks": {t.name: self.onboarded[t.name] for t in TIERS},
            "requests_in_flight": self.in_flight,
        }


def _time_range(log: EventLog, after: int, until: int | None) -> tuple[float, float] | None:
    lo = hi = None
    for chunk in log.read_chunks(
        after_position=after, until_position=until, columns=("ts",), chunk_size=100_000
    ):
        ts = [row[0] for row in chunk]
        lo = min(ts) if lo is None else min(lo, *ts)
        hi = max(ts) if hi is None else max(hi, *ts)
    return None if lo is None or hi is None else (lo, hi)


def _block_size_before(log: EventLog, position: int) -> int:
    """The block size of the run going on at ``position`` (0 when none was recorded)."""
    block_size = 0
    if position:
        for chunk in log.read_chunks(lookups_only=True, until_position=position):
            for row_position, _ts, payload in chunk:
                if payload[2] == RUN_KIND:
                    run = decode(payload, row_position)
                    assert isinstance(run, RunInfo)
                    block_size = run.block_size
    return block_size


def build_report(
    log: EventLog,
    *,
    since_position: int = 1,
    until_position: int | None = None,
    since_ts: float | None = None,
    until_ts: float | None = None,
    windows: int = 20,
    worker: int | None = None,
    top: int = 10,
    on_progress: Callable[[int], object] | None = None,
) -> dict[str, Any]:
    """The report of the rows in the range, as ``kvledger report --json`` prints it;
    ``on_progress`` is called with the position reached after each chunk of rows."""
    if windows < 1:
        raise ValueError(f"windows must be 1 or more, got {windows}")
    after = max(since_position - 1, 0)
    found = _time_range(log, after, until_position)
    if found is None:
        raise ValueError(f"{log.url}: no events in the range asked for")
    t0 = found[0] if since_ts is None else max(found[0], since_ts)
    t1 = found[1] if until_ts is None else min(found[1], until_ts)
    if t1 < t0:
        raise ValueError(f"{log.url}: no events in the range asked for")
    width = (t1 - t0) / windows if t1 > t0 else 1.0
    cuts = [Window(t0 + i * width, t0 + (i + 1) * width) for i in range(windows)]
    cuts[-1].end = t1
    total = Window(t0, t1)
    runs: list[dict[str, Any]] = []
    live: set[tuple[int, int]] = set()
    asked: Counter[int] = Counter()
    hit_counts: Counter[int] = Counter()
    depth: dict[int, int] = {}
    parent: dict[int, int] = {}
    current = 0
    block_size = _block_size_before(log, after)
    for chunk in log.read_chunks(after_position=after, until_position=until_position):
        for position, ts, payload in chunk:
            if ts < t0 or ts > t1:
                continue
            record = decode(payload, position)
            if worker is not None and record.worker_id != worker:
                continue
            index = min(int((ts - t0) / width), windows - 1) if t1 > t0 else 0
            while current < index:  # windows end in order: carry the requests in flight on
                cuts[current].in_flight = len(live)
                current += 1
            window = cuts[index]
            kind = KIND_NAMES[type(record)]
            for w in (window, total):
                w.add_position(position)
                w.rows_by_kind[kind] += 1
            if isinstance(record, Lookup):
                key = (record.worker_id, record.request_id)
                live.add(key)
                if record.start:
                    continue
                hashes = record.sequence_hashes
                n_hit = sum(record.hits)
                for w in (window, total):
                    w.lookups += 1
                    w.blocks_requested += len(hashes)
                    for tier, n in zip(TIERS, record.hits, strict=True):
                        w.hits[tier.name] += n
                    if record.num_tokens:
                        w.tokens += record.num_tokens
                        w.tokens_hit += min(n_hit * block_size, record.num_tokens)
                for i, h in enumerate(hashes):
                    asked[h] += 1
                    depth[h] = i
                    if i:
                        parent[h] = hashes[i - 1]
                    if i < n_hit:
                        hit_counts[h] += 1
            elif isinstance(record, Released):
                live.discard((record.worker_id, record.request_id))
            elif isinstance(record, RunInfo):
                block_size = record.block_size
                live = {k for k in live if k[0] != record.worker_id}  # a restart
                runs.append(
                    {
                        "position": position,
                        "ts": ts,
                        "worker": record.worker_id,
                        "g1_blocks": record.g1_blocks,
                        "g2_blocks": record.g2_blocks,
                        "g3_blocks": record.g3_blocks,
                        "block_size": record.block_size,
                        "policy": record.policy,
                        "offload_filter": record.offload_filter,
                    }
                )
            elif isinstance(record, Removed):
                for w in (window, total):
                    w.evicted[record.tier.name] += len(record.sequence_hashes)
            elif isinstance(record, Offloaded):
                for w in (window, total):
                    w.offloaded[record.tier.name] += len(record.blocks)
            elif isinstance(record, Onboarded):
                for w in (window, total):
                    w.onboarded[record.src_tier.name] += len(record.blocks)
        if on_progress is not None:
            on_progress(chunk[-1][0])
    while current < windows:
        cuts[current].in_flight = len(live)
        current += 1
    total.in_flight = len(live)
    hottest = _hottest(asked, depth, parent, top)
    return {
        "log": log.url,
        "worker": worker,
        "since_ts": t0,
        "until_ts": t1,
        "window_s": width if t1 > t0 else 0.0,
        "runs": runs,
        "windows": [w.summary() for w in cuts],
        "totals": total.summary(),
        "hottest_prefixes": [
            {
                "sequence_hash": f"{h:016x}",
                "block": depth[h],
                "asked": n,
                "hit": hit_counts[h],
            }
            for h, n in hottest
        ],
    }


def _hottest(
    asked: Counter[int], depth: dict[int, int], parent: dict[int, int], top: int
) -> list[tuple[int, int]]:
    """The most asked prefixes, each named by its longest block asked as often: the blocks of
    one hot prefix would otherwise fill the list."""
    out: list[tuple[int, int]] = []
    covered: set[int] = set()
    for h, n in sorted(asked.items(), key=lambda kv: (-kv[1], -depth[kv[0]])):
        if h in covered:
            continue
        out.append((h, n))
        if len(out) == top:
            break
        p = parent.get(h)
        while p is not None and asked[p] == n and p not in covered:
            covered.add(p)
            p = parent.get(p)
    return out


def percent(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{100 * value:.1f}%"
