"""Lookup records and ``kvledger whatif``: a recorded run re-run under its own settings gives
back every recorded hit; other settings answer "what if"; replay ignores the records."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger import BlockManager
from kvledger.config import Settings
from kvledger.events.chunk_decode import decode_chunk
from kvledger.events.codec import CodecError, decode, encode
from kvledger.events.log import EventLog
from kvledger.events.log.check import check_log
from kvledger.events.log.replay import replay
from kvledger.events.log.rows import to_row
from kvledger.events.types import AnyEvent, Lookup, LookupRecord, Released, RunInfo, Tier
from kvledger.mocker.cache import SimulatedCache
from kvledger.mocker.rerun import CacheSettings, RecordedRun, load_run, recorded, rerun
from kvledger.registry.columns import ops_from_events
from kvledger.registry.emitter import EventEmitter
from kvledger.registry.lookups import LookupRecorder
from kvledger.registry.state import RegistryState

BLOCK = 4


def _manager_settings(tmp_path: Path, **kw: object) -> Settings:
    base: dict[str, object] = dict(
        block_size=BLOCK,
        num_layers=1,
        outer_dim=1,
        inner_dim=4,
        dtype="float32",
        g1_blocks=10,
        g2_blocks=12,
        g3_blocks=40,
        eviction_policy="lru",
        offload_filter="always",
        data_dir=tmp_path / "data",
        event_log_url=f"sqlite:///{tmp_path / 'events.db'}",
    )
    base.update(kw)
    return Settings.load(**base)


def _prompts(seed: int, count: int) -> list[list[int]]:
    """Prompts over a few shared prefixes, whole blocks long."""
    rng = random.Random(seed)
    stems = [[rng.randrange(50_000) for _ in range(BLOCK * rng.randint(1, 3))] for _ in range(4)]
    out = []
    for _ in range(count):
        tail = [rng.randrange(50_000) for _ in range(BLOCK * rng.randint(0, 2))]
        out.append(rng.choice(stems) + tail)
    return out


def test_blockmanager_run_rerun_with_its_settings_reproduces_every_hit(
    tmp_path: Path, clean_env: None
) -> None:
    """The acceptance test of the method: a BlockManager run on G1+G2+G3 (real tiers, real
    log), requests overlapping (two held at a time), re-run from its log."""
    s = _manager_settings(tmp_path)
    held: list[tuple[int, list[int]]] = []
    delivered: list[object] = []  # what a publisher or router encoder would get
    with BlockManager(s, device="cpu", sinks=[delivered.append]) as manager:
        for i, tokens in enumerate(_prompts(1, 60)):
            seq = manager.sequence(tokens)
            slots = manager.onboard(seq, request_id=f"req-{i}")
            fresh = manager.allocate(len(seq) - len(slots))
            slots += manager.register(fresh, seq, start=len(slots))
            manager.wait_idle()  # the write-through copies land before the next lookup
            held.append((i, slots))
            if len(held) > 2:
                j, done = held.pop(0)
                manager.release(done, request_id=f"req-{j}")
        for j, done in held:
            manager.release(done, request_id=f"req-{j}")
        live = manager.state()
    assert replay(s.log_url) == live  # the lookup records change nothing replay rebuilds
    assert delivered and not [e for e in delivered if isinstance(e, Lookup | Released | RunInfo)]
    with EventLog(s.log_url, read_only=True) as log:  # a worker's transitions: ids 0, 1, 2, ...
        ids = [e.event_id for e in log.read(worker_id=0)]
        assert ids == list(range(len(ids))) and len(ids) == len(delivered)

    with EventLog(s.log_url, read_only=True) as log:
        run = load_run(log)
        assert not check_log(log).damaged
    lookups = [r for _, r in run.records if isinstance(r, Lookup)]
    assert len(lookups) == 60
    assert sum(1 for _, r in run.records if isinstance(r, Released)) == 60
    had = recorded(run)
    assert had.hits[0] and had.hits[1] and had.hits[2], "the run should hit on G1, G2 and G3"
    assert run.settings == CacheSettings(10, 12, 40, "lru", "always")

    again = rerun(run, run.settings, compare=True)
    assert again.compared == 60
    assert again.mismatches == []
    assert again.tally.hits == had.hits and again.tally.blocks == had.blocks


def test_manager_finds_requests_without_ids(tmp_path: Path, clean_env: None) -> None:
    """With no request id, register finds the request by its sequence and release by its
    slots, so growth and ends are still recorded under the manager's own numbers."""
    s = _manager_settings(tmp_path)
    with BlockManager(s, device="cpu") as manager:
        seq = manager.sequence(list(range(2 * BLOCK)))
        slots = manager.onboard(seq)
        slots += manager.register(manager.allocate(2), seq, start=0)
        seq.extend(list(range(100, 100 + BLOCK)))  # decoded one block more
        slots += manager.register(manager.allocate(1), seq, start=2)
        manager.release(slots)
    with EventLog(s.log_url, read_only=True) as log:
        records = [r for _, r in load_run(log).records]
    assert [type(r) for r in records] == [RunInfo, Lookup, Lookup, Released]
    first, grown, end = records[1], records[2], records[3]
    assert isinstance(first, Lookup) and isinstance(grown, Lookup) and isinstance(end, Released)
    assert (first.start, len(first.sequence_hashes), first.num_tokens) == (0, 2, 2 * BLOCK)
    assert (grown.start, len(grown.sequence_hashes)) == (2, 1)
    assert first.request_id == grown.request_id == end.request_id


def test_log_lookups_off_writes_none(tmp_path: Path, clean_env: None) -> None:
    s = _manager_settings(tmp_path, log_lookups=False)
    with BlockManager(s, device="cpu") as manager:
        seq = manager.sequence(list(range(BLOCK)))
        manager.release(manager.register(manager.allocate(1), seq, start=len(manager.onboard(seq))))
    with EventLog(s.log_url, read_only=True) as log:
        assert not [row for chunk in log.read_chunks(lookups_only=True) for row in chunk]
        with pytest.raises(ValueError, match="no lookup records"):
            load_run(log)


def _recorded_stream(seed: int, requests: int, g1: int) -> RecordedRun:
    """Lookup records of a G1-only LRU run, recorded by the recorder a live cache uses."""
    records: list[LookupRecord] = []
    recorder = LookupRecorder(records.append)
    recorder.run(
        g1_blocks=g1, g2_blocks=0, g3_blocks=0, block_size=1, policy="lru", offload_filter="never"
    )
    cache = SimulatedCache.build(g1, policy="lru", offload_filter="never")
    cache.lookups = recorder
    rng = random.Random(seed)
    stems = [[rng.randrange(2**63) for _ in range(rng.randint(1, 6))] for _ in range(5)]
    for _ in range(requests):
        hashes = [*rng.choice(stems)[: rng.randint(1, 6)], rng.randrange(2**63)]
        chained = list(_chain(hashes))
        cache.finish(cache.admit(chained, chained))
    numbered = list(enumerate(records, 1))
    return RecordedRun(0, numbered, CacheSettings(g1, 0, 0, "lru", "never"), block_size=1)


def _chain(locals_: list[int]) -> list[int]:
    from kvledger.registry.hashing import chain_sequence_hashes

    return chain_sequence_hashes(locals_)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    small=st.integers(8, 40),
    extra=st.integers(1, 60),
)
def test_larger_g1_never_lowers_the_lru_hit_rate(seed: int, small: int, extra: int) -> None:
    """LRU is a stack policy: on the same recorded stream, a bigger G1 holds a superset of
    what a smaller one holds at every moment, so it can only hit more."""
    run = _recorded_stream(seed, 120, small)
    base = CacheSettings(small, 0, 0, "lru", "never")
    bigger = CacheSettings(small + extra, 0, 0, "lru", "never")
    assert rerun(run, base, compare=True).mismatches == []
    assert sum(rerun(run, bigger).tally.hits) >= sum(rerun(run, base).tally.hits)


def test_lookup_records_round_trip_and_refuse_bad_values() -> None:
    common: dict[str, Any] = dict(event_id=0, worker_id=2, dp_rank=0, tier=Tier.G1, ts=1.0)
    lookup = Lookup(
        **common, request_id=9, num_tokens=40, start=0, sequence_hashes=(1, 2, 3), hits=(1, 1, 0)
    )
    assert decode(encode(lookup)) == lookup
    run = RunInfo(
        **common,
        g1_blocks=8,
        g2_blocks=0,
        g3_blocks=4,
        block_size=16,
        policy="lru",
        offload_filter="always",
    )
    assert decode(encode(run)) == run
    for bad in (
        Lookup(**common, request_id=-1, num_tokens=0, start=0, sequence_hashes=(), hits=(0, 0, 0)),
        Lookup(**common, request_id=1, num_tokens=0, start=0, sequence_hashes=(1,), hits=(0, 0)),  # type: ignore[arg-type]
        Lookup(**common, request_id=1, num_tokens=-5, start=0, sequence_hashes=(), hits=(0, 0, 0)),
    ):
        with pytest.raises(CodecError, match=r"cannot encode|three counts"):
            encode(bad)
    with pytest.raises(CodecError, match="exceed"):
        decode(
            encode(
                Lookup(
                    **common,
                    request_id=1,
                    num_tokens=0,
                    start=0,
                    sequence_hashes=(5,),
                    hits=(1, 1, 0),
                )
            )
        )


def test_replay_stops_at_a_damaged_lookup_record(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'events.db'}"
    with EventLog(url) as log:
        recorder = LookupRecorder(log.append, worker_id=0)
        recorder.lookup(1, [1, 2], (0, 0, 0))
        recorder.released(1)
    import sqlite3

    db = sqlite3.connect(tmp_path / "events.db")
    (payload,) = db.execute("SELECT payload FROM events WHERE id = 1").fetchone()
    damaged = bytearray(payload)
    damaged[-8] ^= 0x01
    db.execute("UPDATE events SET payload = ? WHERE id = 1", (bytes(damaged),))
    db.commit()
    db.close()
    with pytest.raises(CodecError, match=r"position 1.*damaged"):
        replay(url)
    assert replay(url, until_position=0) == RegistryState()


def test_a_worker_needs_choosing_when_several_recorded(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'events.db'}"
    with EventLog(url) as log:
        for worker in (0, 1):
            recorder = LookupRecorder(log.append, worker_id=worker)
            recorder.run(g1_blocks=4, g2_blocks=0, g3_blocks=0, block_size=16, policy="lru",
                         offload_filter="never")  # fmt: skip
            recorder.lookup(1, [1], (0, 0, 0))
    with EventLog(url, read_only=True) as log:
        with pytest.raises(ValueError, match=r"workers \[0, 1\]; pick one with --worker"):
            load_run(log)
        assert load_run(log, worker=1).worker == 1


def test_replay_folds_a_chunk_with_lookup_records_on_its_array_path() -> None:
    """Lookup records between transitions keep replay on its fast path (the array decoder
    vouches for the chunk) and fold exactly what the transitions alone fold."""
    out: list[LookupRecord | AnyEvent] = []
    cache = SimulatedCache.build(6, 8, policy="lru", emitter=EventEmitter(out.append))
    cache.lookups = LookupRecorder(out.append)
    rng = random.Random(3)
    for _ in range(40):
        hashes = _chain([rng.randrange(12) for _ in range(rng.randint(1, 4))])
        cache.finish(cache.admit(hashes, hashes))
    rows = [to_row(e) for e in out]
    payloads = [row[5] for row in rows]
    ts = [row[4] for row in rows]
    decoded = decode_chunk(payloads, {}, np.array(ts))
    assert decoded is not None
    transitions = [e for e in out if not isinstance(e, Lookup | Released | RunInfo)]
    assert decoded.last_event_id == {0: len(transitions) - 1}
    expected = ops_from_events(transitions)
    assert decoded.ops.keys() == expected.keys()
    for key, ops in expected.items():
        assert (decoded.ops[key].seq == ops.seq).all()
