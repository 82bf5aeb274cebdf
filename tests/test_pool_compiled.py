"""The block pool's compiled loops (registry/_pool.c) against its Python loops (pool.py).

Two pools, one on each path, take the same random operations: the cached prefix of a path
(asked for as a list, a tuple or an iterator), allocations that may run dry, registrations
with and without token ids and keys, of new blocks and of blocks held already, at times with
a slot that must be refused or with blocks that are not plain tuples; releases in any order,
at times of a slot released more often than taken; explicit removals, shared references,
clears, under every policy and with ``fresh_first`` or without. Every call must give both the
same answer (or the same exception and message), both must emit the same events, and after
every step both must hold the same state: the resident blocks, the inactive slots in eviction
order, the counts, every slot's refcount, token ids and key.

The Python loops are the reference: the compiled ones leave them every case but the plain one,
so an agreement here says that the plain case is done as the Python loops do it.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from unittest import mock

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from switches import python_with

from kvledger.events.types import AnyEvent, HashKey, Tier
from kvledger.registry import pool as pool_module
from kvledger.registry.emitter import EventEmitter
from kvledger.registry.policies import POLICY_NAMES
from kvledger.registry.pool import BlockPool, PoolExhausted

pytest.importorskip(
    "kvledger.registry._pool",
    reason="registry/_pool.c was not built (no C compiler at install): only the Python loops run",
)

PATHS = st.lists(st.integers(0, 2), min_size=0, max_size=6).map(tuple)
KEYS = st.sampled_from([None, ("lora-a", None), (None, "salt"), ("lora-b", "s")])
FORMS = st.sampled_from(["list", "tuple", "iterator"])


def seq_hash(path: tuple[int, ...]) -> int:
    """A stable, distinct 64-bit name per path (some above 2**63, as real hashes are)."""
    h = 1469598103934665603
    for step in path:
        h = ((h ^ (step + 1)) * 1099511628211) % (1 << 64)
    return h


def shaped(items: list[int], form: str) -> Iterable[int]:
    if form == "tuple":
        return tuple(items)
    if form == "iterator":
        return iter(items)
    return list(items)


def make_pool(
    compiled: bool, capacity: int, policy: str, fresh_first: bool
) -> tuple[BlockPool, list[AnyEvent]]:
    """A pool on one path, and the list its events go to (stamped at ts 0, so that the two
    paths' events compare equal)."""
    events: list[AnyEvent] = []
    with mock.patch.object(pool_module, "COMPILED", compiled):
        pool = BlockPool(
            capacity,
            tier=Tier.G2,
            policy=policy,
            emitter=EventEmitter(events.append, clock=lambda: 0.0),
            fresh_first=fresh_first,
        )
    assert pool._compiled is compiled
    return pool, events


def outcome(call: Callable[[BlockPool], Any], pool: BlockPool) -> tuple[str, Any]:
    """What a call gave: its result, or its exception's class and message."""
    try:
        return "ok", call(pool)
    except (ValueError, LookupError, TypeError, AssertionError, RuntimeError) as exc:
        return type(exc).__name__, str(exc)


def state(pool: BlockPool) -> dict[str, Any]:
    slots = list(range(pool.capacity))
    return {
        "resident": pool.resident_blocks(),
        "inactive": pool.inactive_slots(),
        "counts": (pool.num_free, pool.num_inactive, pool.num_active, pool.num_registered),
        "refcounts": [pool.refcount(slot) for slot in slots],
        "tokens": pool.tokens_of(slots),
        "keys": pool.keys_of(slots),
        "free": list(pool._free),
        "next_event_id": pool.emitter.next_event_id,
    }


class CompiledAgainstPython(RuleBasedStateMachine):
    @initialize(
        capacity=st.integers(1, 10),
        policy=st.sampled_from(POLICY_NAMES),
        fresh_first=st.booleans(),
    )
    def setup(self, capacity: int, policy: str, fresh_first: bool) -> None:
        self.compiled, self.compiled_events = make_pool(True, capacity, policy, fresh_first)
        self.python, self.python_events = make_pool(False, capacity, policy, fresh_first)
        self.capacity = capacity
        self.held: list[int] = []  # one entry per reference taken on a registered slot
        self.mutable: list[int] = []  # allocated, not registered yet
        #: paths of one block or more, registered once: walked again, blocks held already
        self.paths: list[tuple[int, ...]] = []

    def both(self, call: Callable[[BlockPool], Any]) -> tuple[str, Any]:
        ours = outcome(call, self.compiled)
        theirs = outcome(call, self.python)
        assert ours == theirs
        return ours

    @rule(path=PATHS, form=FORMS)
    def match(self, path: tuple[int, ...], form: str) -> None:
        hashes = [seq_hash(path[: i + 1]) for i in range(len(path))]
        # a fresh iterable for each pool: an iterator is used up by the first
        kind, slots = self.both(lambda pool: pool.match(shaped(hashes, form)))
        if kind == "ok":
            self.held += slots

    @rule(count=st.integers(0, 6) | st.integers(0, 12), upto=st.booleans())
    def allocate(self, count: int, upto: bool) -> None:
        kind, slots = self.both(
            lambda pool: pool.allocate_upto(count) if upto else pool.allocate(count)
        )
        event(f"allocate: {kind}")
        if kind == "ok":
            self.mutable += slots

    @precondition(lambda self: self.mutable)
    @rule(
        data=st.data(),
        start=PATHS,
        tokens=st.booleans(),
        key=KEYS,
        odd_blocks=st.booleans(),
    )
    def register(
        self,
        data: st.DataObject,
        start: tuple[int, ...],
        tokens: bool,
        key: HashKey | None,
        odd_blocks: bool,
    ) -> None:
        """New blocks, blocks held already (a path walked again), a slot to refuse (one in
        use, registered, or free) and blocks as lists rather than tuples."""
        use = data.draw(st.integers(1, len(self.mutable)))
        slots = data.draw(st.permutations(self.mutable))[:use]
        bad = data.draw(st.sampled_from(["none"] * 4 + ["registered", "free", "twice"]))
        if bad == "registered" and self.held:
            slots.insert(
                data.draw(st.integers(0, len(slots))), data.draw(st.sampled_from(self.held))
            )
        elif bad == "free":
            slot = data.draw(st.integers(0, self.capacity - 1))
            if not self.compiled.refcount(slot):
                slots.insert(data.draw(st.integers(0, len(slots))), slot)
        elif bad == "twice" and slots:
            slots.append(slots[0])
        steps = data.draw(st.lists(st.integers(0, 2), min_size=len(slots), max_size=len(slots)))
        walk_again = bool(self.paths) and data.draw(st.booleans())
        if walk_again:  # along a path registered before
            known = data.draw(st.sampled_from(self.paths))
            split = data.draw(st.integers(0, len(known)))
            start, again = known[:split], list(known[split : split + len(slots)])
            steps[: len(again)] = again
        path = start + tuple(steps)
        hashes = [seq_hash(path[: i + 1]) for i in range(len(path))][len(start) :]
        blocks: list[Any] = [
            [seq, seq & 0xFFFF] if odd_blocks and i % 2 else (seq, seq & 0xFFFF)
            for i, seq in enumerate(hashes)
        ]
        parent = seq_hash(start) if start else None
        token_ids = [[i, seq % 1000] for i, seq in enumerate(hashes)] if tokens else None
        kind, out = self.both(lambda pool: pool.register(slots, blocks, parent, token_ids, key))
        event(
            f"register: {kind}" + (", blocks held already" if kind == "ok" and out != slots else "")
        )
        if kind == "ok":
            self.paths.append(path)
            for slot in slots:
                if slot in self.mutable:
                    self.mutable.remove(slot)
            self.held += out

    @rule(data=st.data(), form=FORMS, extra=st.sampled_from(["none", "again", "free"]))
    def release(self, data: st.DataObject, form: str, extra: str) -> None:
        """Any of the references held, in any order; at times one released too often."""
        order = data.draw(st.permutations(self.held + self.mutable))
        order = order[: data.draw(st.integers(0, len(order)))]
        if extra == "again" and order:
            # one more release than references taken on that slot
            slot = order[data.draw(st.integers(0, len(order) - 1))]
            taken = self.compiled.refcount(slot) - order.count(slot)
            order[data.draw(st.integers(0, len(order))) : 0] = [slot] * (taken + 1)
        elif extra == "free":  # any slot: often one that nobody holds
            slot = data.draw(st.integers(0, self.capacity - 1))
            order.insert(data.draw(st.integers(0, len(order))), slot)
        kind, _ = self.both(lambda pool: pool.release(shaped(order, form)))
        event(f"release: {kind}")
        if kind == "ok":
            for slot in order:
                self.forget(slot)

    @precondition(lambda self: self.held or self.mutable)
    @rule(data=st.data(), form=FORMS)
    def release_all(self, data: st.DataObject, form: str) -> None:
        """Every reference held, in any order: what fills the inactive queue, so that later
        allocations evict (and the policy's order shows)."""
        order = data.draw(st.permutations(self.held + self.mutable))
        kind, _ = self.both(lambda pool: pool.release(shaped(order, form)))
        if kind == "ok":
            self.held, self.mutable = [], []

    @rule(path=PATHS, tokens=st.booleans(), keep=st.booleans())
    def request(self, path: tuple[int, ...], tokens: bool, keep: bool) -> None:
        """What an engine does per request (and bench/registry_bench.py times): take the
        cached prefix, allocate and register the rest, release it all tail first, or keep it
        for a while."""
        hashes = [seq_hash(path[: i + 1]) for i in range(len(path))]
        blocks = [(seq, seq & 0xFFFF) for seq in hashes]
        token_ids = [[seq % 1000] for seq in hashes] if tokens else None

        def run(pool: BlockPool) -> list[int]:
            hit = pool.match(hashes)
            n = len(hit)
            try:
                new = pool.allocate(len(hashes) - n)
            except PoolExhausted:
                pool.release(hit[::-1])
                raise
            rest = None if token_ids is None else token_ids[n:]
            slots = hit + pool.register(new, blocks[n:], hashes[n - 1] if n else None, rest)
            if not keep:
                pool.release(slots[::-1])
            return slots

        kind, slots = self.both(run)
        event(f"request: {kind}")
        if kind == "ok":
            self.paths += [path] if path else []
            if keep:
                self.held += slots

    def forget(self, slot: int) -> None:
        """One reference released. The bookkeeping here only steers the draws toward slots in
        use (the two pools are checked against each other, not against it), so a slot it lost
        track of (misuse the pool lets through, such as one slot twice in a ``register``) is
        let go."""
        for refs in (self.held, self.mutable):
            if slot in refs:
                refs.remove(slot)
                return

    @precondition(lambda self: self.held)
    @rule(data=st.data(), use=st.booleans(), bad=st.booleans())
    def acquire(self, data: st.DataObject, use: bool, bad: bool) -> None:
        slots = data.draw(st.lists(st.sampled_from(self.held), max_size=4))
        if bad:
            slots.append(data.draw(st.integers(0, self.capacity - 1)))
        kind, _ = self.both(lambda pool: pool.acquire(slots, use=use))
        if kind == "ok":
            self.held += slots

    @rule(paths=st.lists(PATHS, max_size=3))
    def remove(self, paths: list[tuple[int, ...]]) -> None:
        self.both(lambda pool: pool.remove([seq_hash(p) for p in paths if p]))

    @rule(paths=st.lists(PATHS, max_size=3))
    def missed(self, paths: list[tuple[int, ...]]) -> None:
        self.both(lambda pool: pool.missed([seq_hash(p) for p in paths]))

    @rule()
    def clear(self) -> None:
        self.both(lambda pool: pool.clear())

    @invariant()
    def same_state_and_events(self) -> None:
        assert state(self.compiled) == state(self.python)
        ours, theirs = self.compiled_events, self.python_events
        assert ours == theirs
        assert repr(ours) == repr(theirs)  # with the fields equality leaves out (lora, salt)


CompiledAgainstPython.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None
)
TestCompiledAgainstPython = CompiledAgainstPython.TestCase


def test_this_install_built_it() -> None:
    """The build is optional (an install without a compiler goes on without it), so a broken
    build would pass unnoticed but for this: the suite's install has a compiler, and new pools
    run compiled unless the environment says otherwise."""
    expected = os.environ.get("KVLEDGER_PYTHON_POOL", "") in ("", "0")
    assert pool_module.COMPILED is expected
    assert BlockPool(4)._compiled is expected


def test_the_environment_turns_it_off() -> None:
    """``KVLEDGER_PYTHON_POOL=1``: the Python loops alone, with the compiled module there."""
    script = (
        "import sys; from kvledger.registry import pool, _pool; "
        "pool._pool = None; "  # any compiled call would now fail
        "p = pool.BlockPool(4); "
        "s = p.register(p.allocate(3), [(1, 2), (3, 4), (5, 6)]); p.release(s); "
        "p.release(p.match([1, 3, 9])); p.allocate(4); "
        "sys.stdout.write(repr((pool.COMPILED, p._compiled, p.num_free)))"
    )
    for value, expected in (("1", "(False, False, 0)"), ("0", None), ("", None)):
        out = python_with("KVLEDGER_PYTHON_POOL", value, script, check=False)
        if expected is None:  # compiled: the call into the module it was robbed of fails
            assert out.returncode != 0 and "AttributeError" in out.stderr
        else:
            assert out.returncode == 0, out.stderr
            assert out.stdout == expected


def test_odd_inputs_are_left_to_the_python_loops() -> None:
    """What is not the plain case (bools and negative slots, blocks as lists, a generator of
    slots) gives the compiled path the Python path's answers and errors."""

    def odd(pool: BlockPool) -> Any:
        return pool  # to be called with what its signatures do not allow

    steps: list[Callable[[BlockPool], Any]] = [
        lambda pool: pool.allocate(3),  # slots 2, 1, 0
        lambda pool: odd(pool).register([True, 0], [[11, 1], (12, 2)]),  # True is slot 1
        lambda pool: pool.register([2], [(13, 3)], 12),
        lambda pool: pool.register([-3], [(14, 4)]),  # slot 1, registered already
        lambda pool: pool.release(x for x in (2, True, 0)),
        lambda pool: pool.release([0]),  # released more often than taken
        lambda pool: pool.match(iter([11, 12, 13, 99, 11])),
        lambda pool: pool.release([-1]),  # slot 3, never taken
        lambda pool: pool.match((11, 12)),
        lambda pool: odd(pool).register([0], [(1, 2, 3)]),  # not a pair
        lambda pool: odd(pool).match([[1]]),  # unhashable
        lambda pool: pool.release([pool.capacity]),  # out of range
        lambda pool: pool.allocate(4),
    ]

    def run(pool: BlockPool) -> list[Any]:
        return [outcome(step, pool) for step in steps] + [state(pool)]

    (ours, our_events), (theirs, their_events) = (
        make_pool(True, 4, "lru", False),
        make_pool(False, 4, "lru", False),
    )
    assert run(ours) == run(theirs)
    assert our_events == their_events


def test_match_reads_nothing_past_the_first_miss() -> None:
    """An iterator of hashes is read up to the first miss, as the Python loop reads it."""
    pool, _ = make_pool(True, 4, "lru", False)
    pool.release(pool.register(pool.allocate(2), [(1, 1), (2, 2)]))

    def hashes() -> Iterator[int]:
        yield from (1, 7)
        raise AssertionError("read past the first miss")

    assert pool.match(hashes()) == [pool.lookup(1)]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    capacity=st.integers(4, 48),
    policy=st.sampled_from(POLICY_NAMES),
    fresh_first=st.booleans(),
)
def test_long_engine_runs_agree(seed: int, capacity: int, policy: str, fresh_first: bool) -> None:
    """Hundreds of requests over shared prefixes in a pool too small for them, as in
    bench/registry_bench.py: every call, event and state alike on both paths, with evictions
    on almost every request (which the state machine's short runs reach less often)."""
    rng = random.Random(seed)
    pools = [make_pool(compiled, capacity, policy, fresh_first) for compiled in (True, False)]
    prefixes = [tuple(rng.randrange(3) for _ in range(rng.randrange(1, 6))) for _ in range(5)]
    held: list[list[list[int]]] = [[], []]
    for _ in range(300):
        path = rng.choice(prefixes) + tuple(rng.randrange(3) for _ in range(rng.randrange(6)))
        hashes = [seq_hash(path[: i + 1]) for i in range(len(path))]
        blocks = [(seq, seq & 0xFFFF) for seq in hashes]
        tokens = [[seq % 1000] for seq in hashes] if rng.random() < 0.3 else None
        keep, finish = rng.random() < 0.3, rng.randrange(4) if rng.random() < 0.5 else None
        answers = []
        for (pool, _), requests in zip(pools, held, strict=True):
            hit = pool.match(hashes)
            n = len(hit)
            fresh = pool.allocate_upto(len(hashes) - n)
            # a shorter allocation registers what it got, as an engine that got less would
            done = pool.register(
                fresh,
                blocks[n : n + len(fresh)],
                hashes[n - 1] if n else None,
                None if tokens is None else tokens[n : n + len(fresh)],
            )
            slots = hit + done
            if keep:
                requests.append(slots)
            else:
                pool.release(slots[::-1])
            if finish is not None and finish < len(requests):
                pool.release(requests.pop(finish))
            answers.append((slots, state(pool)))
        assert answers[0] == answers[1]
    assert pools[0][1] == pools[1][1]
    assert repr(pools[0][1]) == repr(pools[1][1])
