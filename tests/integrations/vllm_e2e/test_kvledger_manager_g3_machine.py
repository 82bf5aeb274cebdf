"""kvledger's vLLM offloading manager with a G3, as a state machine (runs in the vLLM test venv,
from vLLM's test tree; needs hypothesis there, which the venv script installs).

Random stores (completing or failing), loads, request ends and cache resets go through vLLM's
``OffloadingManager`` interface, and a model worker carries out every job's spec at once, in the
order the manager planned them (the order vLLM's worker submits them, which kvledger's transfer
engine keeps): G2 and G3 are dicts of slot -> the key whose bytes the slot holds, and a failed
store's writes are undone. After every step: each block the manager holds on G2 or G3 sits in
its slot, each load read the right bytes, and the blocks vLLM's event stream announced on CPU
and STORAGE are exactly those on G2 and G3. At the end the event log replays to the manager.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="the vLLM test venv predates hypothesis")

from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)
from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    make_offload_key,
)

from kvledger import replay  # noqa: E402
from kvledger.integrations.vllm.manager import KvledgerOffloadingManager, key_hash  # noqa: E402
from kvledger.integrations.vllm.specs import KvledgerLoadSpec, KvledgerStoreSpec  # noqa: E402

KEYS = [make_offload_key(i.to_bytes(8, "big"), 0) for i in range(8)]
BY_HASH = {key_hash(k): k for k in KEYS}
picks = st.lists(st.sampled_from(KEYS), min_size=1, max_size=2, unique=True)


@dataclass
class Job:
    ctx: ReqContext
    keys: list[OffloadKey]
    writes: list[tuple[str, int]]


class ManagerWithG3(RuleBasedStateMachine):
    offload_filter = "always"

    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory()
        self.log_url = f"sqlite:///{Path(self.tmp.name) / 'machine.db'}"
        self.m = KvledgerOffloadingManager(
            3,
            enable_events=True,
            log_url=self.log_url,
            g3_blocks=4,
            offload_filter=self.offload_filter,
            tokens_per_chunk={0: 16},
        )
        self.tiers: dict[str, dict[int, OffloadKey | None]] = {"g2": {}, "g3": {}}
        self.stores: list[Job] = []
        self.loads: list[Job] = []
        self.announced: dict[Medium, set[OffloadKey]] = {Medium.CPU: set(), Medium.STORAGE: set()}
        self.requests = 0

    def _request(self, keys: list[OffloadKey]) -> ReqContext:
        self.requests += 1
        ctx = ReqContext(req_id=f"r{self.requests}")
        for k in keys:
            ctx.set_offload_key_position(k, (KEYS.index(k) + 1) * 16)
        self.m.on_new_request(ctx)
        return ctx

    def _move(self, src: str, dst: str, pairs: list[tuple[int, int]], job: Job) -> None:
        for a, b in pairs:
            self.tiers[dst][b] = self.tiers[src].get(a)
            job.writes.append((dst, b))

    @rule(keys=picks, at_once=st.booleans())
    def store(self, keys: list[OffloadKey], at_once: bool) -> None:
        ctx = self._request(keys)
        out = self.m.prepare_store(keys, ctx)
        if out is None or not out.keys_to_store:
            self.m.on_request_finished(ctx)
            return
        job = Job(ctx, out.keys_to_store, [])
        spec = out.store_spec
        if isinstance(spec, KvledgerStoreSpec):
            self._move("g2", "g3", spec.moves.demotions, job)
        for key, slot in zip(out.keys_to_store, spec.block_ids.tolist(), strict=True):
            self.tiers["g2"][slot] = key
            job.writes.append(("g2", slot))
        if at_once:  # most stores complete before the next step asks anything
            self.m.complete_store(job.keys, ctx)
            self.m.on_request_finished(ctx)
        else:
            self.stores.append(job)

    @precondition(lambda self: self.stores)
    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data: st.DataObject, success: bool) -> None:
        job = self.stores.pop(data.draw(st.integers(0, len(self.stores) - 1)))
        self.m.complete_store(job.keys, job.ctx, success=success)
        if not success:
            for tier, slot in job.writes:
                self.tiers[tier][slot] = None  # the bytes never arrived
        self.m.on_request_finished(job.ctx)

    @rule(data=st.data(), at_once=st.booleans())
    def load(self, data: st.DataObject, at_once: bool) -> None:
        ctx = self._request(KEYS)
        hits = [k for k in KEYS if self.m.lookup(k, ctx) is LookupResult.HIT]
        if not hits:
            self.m.on_request_finished(ctx)
            return
        keys = data.draw(st.lists(st.sampled_from(hits), min_size=1, max_size=3, unique=True))
        spec = self.m.prepare_load(keys, ctx)
        job = Job(ctx, keys, [])
        g3_slots = [-1] * len(keys)
        if isinstance(spec, KvledgerLoadSpec):
            self._move("g2", "g3", spec.moves.demotions, job)
            self._move("g3", "g2", spec.moves.promotions, job)
            g3_slots = spec.g3_slots.tolist()
        for key, g2, g3 in zip(keys, spec.block_ids.tolist(), g3_slots, strict=True):
            got = self.tiers["g2"].get(g2) if g2 >= 0 else self.tiers["g3"].get(g3)
            assert got == key, f"a load of {key!r} read the bytes of {got!r}"
        if at_once:
            self.m.complete_load(keys, ctx)
            self.m.on_request_finished(ctx)
        else:
            self.loads.append(job)

    @precondition(lambda self: self.loads)
    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        job = self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1)))
        self.m.complete_load(job.keys, job.ctx)
        self.m.on_request_finished(job.ctx)

    @rule()
    def reset(self) -> None:
        self.m.reset_cache()  # vLLM reports no job in flight at a reset afterwards
        self.stores.clear()
        self.loads.clear()
        for held in self.announced.values():
            held.clear()  # vLLM's event tracker resets with the cache

    @invariant()
    def blocks_sit_in_their_slots_and_events_agree(self) -> None:
        for event in self.m.take_events():
            if event.metadata_only:
                continue
            held = self.announced[event.medium]
            if event.removed:
                held.difference_update(event.keys)
            else:
                held.update(event.keys)
        g3 = self.m.g3
        assert g3 is not None
        for name, pool, medium in (("g2", self.m.pool, Medium.CPU), ("g3", g3, Medium.STORAGE)):
            keys = {BY_HASH[h] for h in pool.resident_blocks()}
            assert keys == self.announced[medium], f"{name}: vLLM was told otherwise"
            for key in keys:
                slot = pool.lookup(key_hash(key))
                assert slot is not None
                assert self.tiers[name].get(slot) == key, f"{name} slot {slot} lost {key!r}"

    def teardown(self) -> None:
        self.m.flush_log()
        try:
            assert replay(self.log_url) == self.m.state()
        finally:
            self.m.shutdown()
            self.tmp.cleanup()


class ManagerWithG3SeenTwice(ManagerWithG3):
    offload_filter = "seen_twice"


ManagerWithG3.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
ManagerWithG3SeenTwice.TestCase.settings = settings(
    max_examples=30, stateful_step_count=40, deadline=None
)
TestManagerWithG3 = ManagerWithG3.TestCase
TestManagerWithG3SeenTwice = ManagerWithG3SeenTwice.TestCase
