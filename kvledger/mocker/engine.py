"""The mock engine: a continuous-batching scheduler over a ``SimulatedCache``, on a simulated clock.

It behaves like an inference engine's scheduler without running a model, so that cache
policies and capacities can be judged by what an engine would feel (time to first token,
preemptions), not only by hit rates:

- requests join a waiting queue when the clock reaches their arrival time;
- every step has a token budget (``max_num_batched_tokens``) and a seat limit
  (``max_num_seqs``); running sequences are served first, oldest first, then waiting ones
  are admitted first come, first served while budget, seats and the G1 watermark allow;
- a prompt is prefilled in chunks that fit the budget; its cached prefix (G1 hits, G2/G3
  onboards) costs no compute, only the copy time of the bandwidth model;
- a decoding sequence computes one token per step, and takes a new G1 block each time one
  fills (decode blocks get hashes derived from the request, so they never collide with
  another request's);
- when G1 cannot supply a block, the newest running sequence is preempted: its blocks are
  released (they stay cached, so its resumption hits them) and it goes back to the front of
  the waiting queue, to recompute prompt + generated tokens (vLLM's recompute preemption).

The cost of a step is ``StepCosts`` plus the copy time of the onboards it did. Time is
simulated: a step advances the clock by its cost; with a speed-up factor the run also
sleeps so that simulated time runs ``speedup`` times faster than the wall clock.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

from kvledger.config import Settings
from kvledger.events.types import Tier
from kvledger.mocker.cache import Admission, SimulatedCache
from kvledger.mocker.stats import SimStats, occupancy
from kvledger.mocker.steady import SteadyDecoders
from kvledger.mocker.timing import DynamoTiming
from kvledger.mocker.traces import TraceRequest, iter_arrivals, request_hashes
from kvledger.registry.hashing import pair_hash, sequence_hash


@dataclass(frozen=True, slots=True)
class StepCosts:
    """What one engine step costs in simulated milliseconds.

    The defaults are round figures for an 8B-parameter model on one H100-class GPU: prefill
    runs at roughly 25k tokens/s, a forward pass has a fixed floor of a few milliseconds
    (kernel launches, sampling, scheduling), and each sequence in a batch adds its KV reads.
    They only need to be plausible: the simulator compares policies and capacities, and
    every one of them is charged by the same model.
    """

    #: compute for each prompt token that is not cached
    prefill_ms_per_token: float = 0.02
    #: fixed cost of any forward pass
    step_ms: float = 5.0
    #: added per sequence in the step's batch (decode attention over its KV)
    per_seq_ms: float = 0.02


@dataclass(frozen=True, slots=True)
class Bandwidth:
    """Copy times between tiers: ``bytes_per_block`` over a GB/s figure per tier pair."""

    bytes_per_block: int
    gbps: dict[frozenset[Tier], float]

    @classmethod
    def from_settings(cls, settings: Settings) -> Bandwidth:
        return cls(
            settings.bytes_per_block,
            {
                frozenset((Tier.G1, Tier.G2)): settings.g1_g2_gbps,
                frozenset((Tier.G2, Tier.G3)): settings.g2_g3_gbps,
                frozenset((Tier.G1, Tier.G3)): settings.g1_g3_gbps,
            },
        )

    def copy_ms(self, src: Tier, dst: Tier, blocks: int) -> float:
        gbps = self.gbps[frozenset((src, dst))]
        return blocks * self.bytes_per_block / (gbps * 1e9) * 1e3


ADMISSION_RULES = ("watermark", "whole_prompt")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    watermark: float
    bandwidth: Bandwidth
    costs: StepCosts = StepCosts()
    #: 0: as fast as possible; otherwise simulated seconds per wall-clock second
    speedup: float = 0.0
    #: Dynamo's polynomial pass cost instead of ``costs`` (None: the linear ``costs``)
    timing: DynamoTiming | None = None
    #: "watermark": admit while G1 keeps ``watermark`` free; "whole_prompt": admit only when
    #: the whole uncached prompt fits in free or evictable G1 blocks (Dynamo's rule)
    admission: str = "watermark"
    #: name (cache) a prompt's partial last block; False: only full blocks are cached (Dynamo)
    cache_partial_blocks: bool = True

    def __post_init__(self) -> None:
        if self.speedup < 0:
            raise ValueError(f"speedup must be >= 0 (0 = as fast as possible), got {self.speedup}")
        if self.admission not in ADMISSION_RULES:
            raise ValueError(
                f"admission must be one of {', '.join(ADMISSION_RULES)}, got {self.admission!r}"
            )

    @classmethod
    def from_settings(
        cls, settings: Settings, *, speedup: float = 0.0, costs: StepCosts | None = None
    ) -> EngineConfig:
        return cls(
            block_size=settings.block_size,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_num_seqs=settings.max_num_seqs,
            watermark=settings.watermark,
            bandwidth=Bandwidth.from_settings(settings),
            costs=costs if costs is not None else StepCosts(),
            speedup=speedup,
            timing=(
                DynamoTiming(speedup_ratio=settings.speedup_ratio)
                if settings.timing_model == "dynamo"
                else None
            ),
            admission=settings.admission_rule,
            cache_partial_blocks=settings.cache_partial_blocks,
        )


class StepRecord(NamedTuple):
    """What one step did: when it ended, its cost, sequences and tokens it computed."""

    end_ms: float
    step_ms: float
    seqs: int
    tokens: int
    prefill_tokens: int


def _output_tokens(req: TraceRequest) -> int:
    """Tokens a request generates: at least one, the first, which its last prefill step
    samples (a trace row with output length 0 still gets it)."""
    n = req.output_length
    return n if n > 1 else 1


@dataclass(slots=True, eq=False)
class _Sequence:
    """One request's progress through the engine."""

    index: int
    req: TraceRequest
    seq: list[int]  # sequence hashes: prompt blocks, then decode blocks as they are needed
    local: list[int]
    output_length: int
    generated: int = 0
    computed: int = 0  # tokens whose KV is on G1
    admission: Admission | None = None
    recorded: bool = False  # its prefix hits were counted (first admission only)
    first_token_ms: float | None = None
    tokens: int = 0  # tokens that exist: the prompt and what was generated so far
    order: int = 0  # position in the running queue (set when it joins)
    parked_at: int = -1  # step it was parked at among the steady decoders, -1: not parked

    def __post_init__(self) -> None:
        self.tokens = self.req.input_length + self.generated


class SimClock:
    """Simulated time, which the mock engine advances step by step.

    Calling it gives Unix seconds, so it serves as an ``EventEmitter``'s clock: build the
    cache's emitter with the clock the engine is given and events carry simulated time.
    """

    __slots__ = ("epoch", "now_ms")

    def __init__(self) -> None:
        self.now_ms = 0.0
        self.epoch = time.time()  # Unix seconds at now_ms == 0

    def __call__(self) -> float:
        return self.epoch + self.now_ms / 1e3

    def start(self, now_ms: float) -> None:
        """Make this wall-clock instant simulated ``now_ms`` (a run starts when it begins)."""
        self.now_ms = now_ms
        self.epoch = time.time() - now_ms / 1e3


class MockEngine:
    """Drives a ``SimulatedCache`` with a scheduler; ``run`` returns the run's ``SimStats``.

    Events emitted while the engine runs are stamped with simulated time when the cache's
    emitter was built with the engine's ``clock``, so a log can be replayed up to a simulated
    instant.
    """

    def __init__(self, cache: SimulatedCache, config: EngineConfig, *, clock: SimClock) -> None:
        self.cache = cache
        self.config = config
        self.clock = clock
        self.steps = 0
        self.preemptions = 0
        self.onboard_ms = 0.0
        self.latency_ms: list[float] = []
        #: per request with 2+ tokens: (last token - first token) / (tokens - 1)
        self.tpot_ms: list[float] = []
        #: called after every step with what it did (tests, traces)
        self.on_step: Callable[[StepRecord], None] | None = None
        #: called with a sequence when its first token is out (a cluster's router hears it)
        self.on_first_token: Callable[[_Sequence], None] | None = None
        #: where blocks a peer worker holds come from (G4): given a prompt's sequence hashes
        #: and how many leading ones are cached here, how many of the next ones a peer can
        #: send, and what copying them costs in ms (None: no peers)
        self.peers: Callable[[list[int], int], tuple[int, float]] | None = None
        #: advance quietly decoding sequences in aggregate and take runs of pure-decode steps
        #: at once (False: the step-by-step reference, touching every sequence every step)
        self.decode_ahead = True
        self._steady: SteadyDecoders[_Sequence] | None = None
        self._refused: tuple[int, int, int | None] | None = None  # see _admit
        self._joined = 0
        self._wall_start = time.monotonic()
        self._sim_start_ms = 0.0
        self._g1 = cache.tiered.g1  # the registry's tiers are fixed when it is built
        self._capacity_tokens = self._g1.capacity * config.block_size
        #: prompt tokens at every admission (re-admissions after preemption too), and the
        #: cached part of them: Dynamo's ``prefix_cache_reused_ratio``
        self.admitted_tokens = 0
        self.reused_tokens = 0

    # -- the run --------------------------------------------------------------------------

    def run(
        self,
        requests: Iterable[TraceRequest],
        *,
        progress: Callable[[int], None] | None = None,
        sample_every: int = 0,
    ) -> SimStats:
        arrivals = list(iter_arrivals(list(requests)))
        bs = self.config.block_size
        self._check_fits(arrivals)
        stats = SimStats()
        if arrivals:
            self._sim_start_ms = arrivals[0].arrival_ms
            self.clock.start(self._sim_start_ms)
        self._wall_start = time.monotonic()
        steady = self._steady = (
            SteadyDecoders(bs, naming=not self.config.cache_partial_blocks)
            if self.decode_ahead
            else None
        )
        finished = 0

        def count(done: int) -> None:
            nonlocal finished
            for _ in range(done):
                finished += 1
                if progress is not None:
                    progress(finished)
                if sample_every and finished % sample_every == 0:
                    stats.timeline.append((finished, stats.hit_rate, occupancy(self.cache)))

        self._run_to_end(deque(enumerate(arrivals)), deque(), [], stats, steady, count)
        stats.extra.update(self._summary())
        return stats

    def _run_to_end(
        self,
        pending: deque[tuple[int, TraceRequest]],
        waiting: deque[_Sequence],
        running: list[_Sequence],
        stats: SimStats,
        steady: SteadyDecoders[_Sequence] | None,
        finished: Callable[[int], None],
    ) -> None:
        """Queue ``pending`` requests (index, request; in arrival order) as the clock reaches
        each, and step until every one is done; ``finished`` hears how many ended at each step
        that ended any. ``run`` and a cluster's worker whose requests are all known
        (``ClusterEngine``) share it.

        A request's blocks are hashed when it arrives, not before the run: a long trace starts
        stepping at once and holds the hashes of what has arrived, not of the whole trace
        (100,000 built-in requests spent about 5 s hashing before the first step; at 20,000,
        peak memory went from 285 to 216 MB)."""
        clock = self.clock
        bs = self.config.block_size
        sequence = self._sequence
        while pending or waiting or running:
            while pending and pending[0][1].arrival_ms <= clock.now_ms:
                waiting.append(sequence(*pending.popleft()))
            if not waiting and not running:
                clock.now_ms = pending[0][1].arrival_ms
                self._pace()
                continue
            if (
                steady is not None
                and not waiting
                and not steady.active
                and self._decode_ahead(steady, pending[0][1].arrival_ms if pending else None)
            ):
                continue
            done = self._step(waiting, running, stats, bs)
            if done:
                finished(len(done))

    def _sequence(self, index: int, req: TraceRequest) -> _Sequence:
        bs = self.config.block_size
        seq, local = request_hashes(req, bs)
        if not self.config.cache_partial_blocks and req.input_length % bs:
            # The partial last block fills up with generated tokens, so once full it is this
            # request's alone: name it like a decode block (it is registered only when full).
            del seq[-1], local[-1]
            s = _Sequence(index, req, seq, local, _output_tokens(req))
            self._grow_hashes(s, len(seq) + 1)
            return s
        return _Sequence(index, req, seq, local, _output_tokens(req))

    def _check_fits(self, requests: Iterable[TraceRequest]) -> None:
        """A request whose whole KV exceeds G1 could never finish: refuse it up front (the
        requests in arrival order, as ``iter_arrivals`` gives them, so that the index named is
        the sequence's)."""
        g1 = self.cache.tiered.g1.capacity
        bs = self.config.block_size
        for index, req in enumerate(requests):
            output = _output_tokens(req)
            need = -(-(req.input_length + output) // bs)
            if need > g1:
                raise ValueError(
                    f"request {index} needs {need} G1 blocks of {bs} tokens "
                    f"(input {req.input_length} + output {output} tokens) but G1 "
                    f"holds {g1}; raise --g1-blocks or use a smaller trace"
                )

    # -- one step -------------------------------------------------------------------------

    def _step(
        self,
        waiting: deque[_Sequence],
        running: list[_Sequence],
        stats: SimStats,
        bs: int,
    ) -> list[_Sequence]:
        """Schedule, charge and apply one step; returns the sequences that finished."""
        budget = self.config.max_num_batched_tokens
        batch: list[tuple[_Sequence, int]] = []
        i = 0
        preempted = self.preemptions
        prefill_tokens = 0
        naming = not self.config.cache_partial_blocks  # blocks are named as they fill
        steady = self._steady
        scan: list[_Sequence] = running
        parked = 0
        if steady is not None:
            if steady.count + len(steady.active) > budget:
                steady.wake_all(self.steps)  # not every sequence gets its token: one by one
            scan = steady.due(self.steps)
            parked = steady.count  # each decodes one token, before any prefill (queue order)
            budget -= parked
        while i < len(scan) and budget > 0:
            if steady is not None and steady.count != parked:  # a parked one was preempted
                budget += parked - steady.count
                parked = steady.count
            s = scan[i]
            if s.admission is None:  # preempted earlier in this step
                i += 1
                continue
            n = s.tokens - s.computed
            if n > budget:
                n = budget
            upto = s.computed + n
            admission = s.admission
            assert admission is not None  # every running sequence holds its blocks
            if (
                upto > len(admission.slots) * bs or (naming and upto // bs > admission.registered)
            ) and not self._reserve(s, upto, running, waiting):
                continue  # s itself was preempted (and removed from running)
            batch.append((s, n))
            if n > 1 or upto < s.tokens:  # more than the last token to feed: prefill
                prefill_tokens += n
            budget -= n
            i += 1
        if steady is not None:
            parked = steady.count
        onboard_ms = 0.0
        # After a preemption G1 is short: admit nobody new this step (as vLLM does).
        admitting = self.preemptions == preempted
        while admitting and waiting and budget > 0 and len(running) < self.config.max_num_seqs:
            admitted = self._admit(waiting[0], budget, bool(running), stats)
            if admitted is None:
                break
            s, n, copy_ms = admitted
            waiting.popleft()
            running.append(s)
            self._joined += 1
            s.order = self._joined
            if steady is not None:
                steady.add(s)
            batch.append((s, n))
            if n > 1 or s.computed + n < s.tokens:
                prefill_tokens += n
            budget -= n
            onboard_ms += copy_ms
        if not batch and not parked:
            # Only possible when nothing runs and the head of the queue cannot be admitted,
            # which _check_fits rules out; fail loudly rather than spin.
            raise RuntimeError("mock engine made no progress: nothing runs and nothing fits")

        if self.config.timing is None:
            costs = self.config.costs
            step_ms = (
                costs.step_ms
                + costs.per_seq_ms * (len(batch) + parked)
                + costs.prefill_ms_per_token * prefill_tokens
                + onboard_ms
            )
        else:
            context = steady.context(self.steps) if steady is not None else 0
            step_ms = self._dynamo_step_ms(batch, context) + onboard_ms
        now = self.clock.now_ms = self.clock.now_ms + step_ms
        self.onboard_ms += onboard_ms
        step = self.steps = self.steps + 1
        if self.on_step is not None:
            tokens = sum(n for _, n in batch) + parked
            self.on_step(StepRecord(now, step_ms, len(batch) + parked, tokens, prefill_tokens))
        done: list[_Sequence] = []
        for s, n in batch:
            computed = s.computed = s.computed + n
            if computed < s.tokens:
                continue  # prefill goes on next step
            s.generated += 1  # the step that feeds the last token samples the next one
            s.tokens += 1
            if s.first_token_ms is None:
                s.first_token_ms = now
                stats.ttft_ms.append(now - s.req.arrival_ms)
                if self.on_first_token is not None:
                    self.on_first_token(s)
            if s.generated >= s.output_length:
                done.append(s)
        if done:
            self._finish(done, running)
        self._pace()
        if steady is not None:
            park = steady.park
            for s, _ in batch:
                if s.admission is not None and s.parked_at < 0:
                    park(s, step)
        return done

    def _dynamo_step_ms(self, batch: list[tuple[_Sequence, int]], context: int = 0) -> float:
        """Dynamo's pass cost: prefill on the uncached prompt tokens computed, plus decode over
        the context of the sequences that decode in this pass (``context``: that of the
        parked ones, which are not in ``batch``). A sequence whose prompt ends in this pass
        samples its first token but counts as prefill, not decode, as in Dynamo's mocker."""
        timing = self.config.timing
        assert timing is not None
        prefilling = ends = starts = 0
        for s, n in batch:
            before = s.computed
            prompt = s.req.input_length
            if before < prompt:
                prefilling += 1
                starts += before
                end = before + n
                ends += end if end < prompt else prompt
            elif before + n >= s.tokens:
                context += s.tokens
        if prefilling > 1:
            # Dynamo charges a batch of prompt chunks as that many chunks from the mean start
            # to the mean end, each mean in whole tokens
            prompt_tokens = prefilling * (ends // prefilling - starts // prefilling)
        else:
            prompt_tokens = ends - starts
        step_ms = timing.prefill_ms(prompt_tokens)
        if context:
            step_ms += timing.decode_ms(context, self._capacity_tokens)
        return step_ms

    def _decode_ahead(
        self, steady: SteadyDecoders[_Sequence], next_arrival_ms: float | None
    ) -> bool:
        """Take the pure-decode steps before the next event at once; False if there are none.

        While nobody waits and every running sequence is parked, steps change nothing but
        the clock and the parked counters until a parked sequence's event step or an
        arrival. Taking them in one go gives exactly what that many calls of ``_step`` would
        (the step hook still sees each one).
        """
        n = steady.count
        event = steady.next_event()
        if event is None or n > self.config.max_num_batched_tokens:
            return False
        quiet = event - self.steps
        timing = self.config.timing
        costs = self.config.costs
        capacity = self._capacity_tokens
        on_step = self.on_step
        now = self.clock.now_ms
        until = math.inf if next_arrival_ms is None else next_arrival_ms
        decode_ms = timing.decode_ms if timing is not None else None
        context = steady.context(self.steps)  # grows by n, a token each, every quiet step
        j = 0
        while j < quiet and now < until:
            if decode_ms is None:
                step_ms = costs.step_ms + costs.per_seq_ms * n
            else:
                step_ms = decode_ms(context, capacity)
                context += n
            now += step_ms
            j += 1
            if on_step is not None:
                on_step(StepRecord(now, step_ms, n, n, 0))
        if not j:
            return False
        self.clock.now_ms = now
        self.steps += j
        self._pace()
        return True

    def _finish(self, done: list[_Sequence], running: list[_Sequence]) -> None:
        for s in done:
            running.remove(s)
            if self._steady is not None:
                self._steady.leave(s, self.steps)
            assert s.admission is not None
            self.cache.finish(s.admission)
            s.admission = None
            self.latency_ms.append(self.clock.now_ms - s.req.arrival_ms)
            if s.generated > 1 and s.first_token_ms is not None:
                self.tpot_ms.append((self.clock.now_ms - s.first_token_ms) / (s.generated - 1))

    def _admit(
        self, s: _Sequence, budget: int, others_run: bool, stats: SimStats
    ) -> tuple[_Sequence, int, float] | None:
        """Place a waiting sequence's cached prefix and first chunk on G1, or None to wait."""
        bs = self.config.block_size
        cache = self.cache
        g1 = self._g1
        whole_prompt = self.config.admission == "whole_prompt"
        if whole_prompt and self._refused is not None:
            # Refused before, and nothing that could change the answer happened since: no
            # block was freed or became evictable (room did not grow), and the block after
            # its cached prefix is still not cached (hits did not grow). An eviction of one of
            # its hits takes as much room as it gives.
            index, room, after = self._refused
            if (
                index == s.index
                and g1.num_free + g1.num_inactive <= room
                and (after is None or after not in g1)
            ):
                return None
        prompt_blocks = -(-s.tokens // bs)
        if len(s.seq) < prompt_blocks:
            self._grow_hashes(s, prompt_blocks)
        hashes, local = s.seq[:prompt_blocks], s.local[:prompt_blocks]
        probe = cache.tiered.match(hashes)
        hits, total = probe.g1, probe.total
        if whole_prompt:
            # Dynamo: the whole uncached prompt must fit in free or evictable blocks now;
            # cached blocks nobody holds are not evictable for it (it is about to use them).
            # Those idle hits are between none and all of the hits, so they need counting
            # only when the whole prompt is more than the room (under load, rarely).
            room = g1.num_free + g1.num_inactive
            if prompt_blocks > room and prompt_blocks - hits > room - g1.count_inactive(
                hashes[:hits]
            ):
                after = hashes[hits] if hits < prompt_blocks else None
                self._refused = (s.index, room, after)
                return None
        tokens = s.tokens
        remote, remote_ms = 0, 0.0
        if self.peers is not None and total < prompt_blocks:
            remote, remote_ms = self.peers(hashes, total)
        # (comparisons rather than min() and max(), here and below: once per admission,
        # the builtins cost more than the arithmetic; the values are the same)
        cached = (total + remote) * bs
        if cached > tokens - 1:
            cached = tokens - 1
        upto = cached + (budget if budget < tokens - cached else tokens - cached)
        need = -(-upto // bs)
        limit = need if need > total else total
        if others_run and not whole_prompt:
            # keep a fraction of G1 free for the running sequences' next blocks
            spare = g1.num_free + g1.num_inactive - (limit - hits)
            if spare < self.config.watermark * g1.capacity:
                return None
        full = None if self.config.cache_partial_blocks else upto // bs
        admission = cache.admit(
            hashes, local, limit=limit, full=full, match=probe, num_tokens=tokens
        )
        copy_ms = 0.0
        for src, n in admission.onboarded.items():
            copy_ms += self.config.bandwidth.copy_ms(src, Tier.G1, n)
        hit_blocks = admission.hit_blocks
        if remote:
            # a peer's blocks, registered here as they land: copied, not computed
            remote = max(0, min(remote, admission.placed - hit_blocks))
            copy_ms += remote_ms
        computed = (hit_blocks + remote) * bs
        if computed > tokens - 1:
            computed = tokens - 1
        s.computed = computed
        n = budget if budget < tokens - computed else tokens - computed
        if admission.placed < -(-(computed + n) // bs):
            cache.finish(admission)  # G1 is full of running sequences' blocks: wait
            s.computed = 0
            return None
        s.admission = admission
        prompt = s.req.input_length
        self.admitted_tokens += prompt
        self.reused_tokens += computed if computed < prompt else prompt
        if not s.recorded:
            s.recorded = True
            stats.record(s.req, admission, bs, prompt_blocks, remote=remote)
            # the engine places the rest of the prompt chunk by chunk, never leaves it out
            stats.blocks_unplaced -= prompt_blocks - admission.placed
        return s, n, copy_ms

    def _reserve(
        self, s: _Sequence, upto: int, running: list[_Sequence], waiting: deque[_Sequence]
    ) -> bool:
        """Hold G1 blocks for ``s``'s first ``upto`` tokens, preempting the newest running
        sequence until they fit. False when ``s`` itself had to go."""
        bs = self.config.block_size
        need = -(-upto // bs)
        admission = s.admission
        assert admission is not None
        full = None if self.config.cache_partial_blocks else upto // bs
        if len(admission.slots) >= need and (full is None or admission.registered >= full):
            return True
        if len(s.seq) < need:
            self._grow_hashes(s, need)
        while True:
            self.cache.extend(admission, s.seq, s.local, full=full, blocks=need)
            if len(admission.slots) >= need:
                return True
            victim = running[-1]
            self._preempt(victim, running, waiting)
            if victim is s:
                return False

    def _preempt(self, s: _Sequence, running: list[_Sequence], waiting: deque[_Sequence]) -> None:
        running.remove(s)
        if self._steady is not None:
            self._steady.leave(s, self.steps)
        assert s.admission is not None
        self.cache.finish(s.admission)
        s.admission = None
        s.computed = 0
        waiting.appendleft(s)
        self.preemptions += 1

    def _grow_hashes(self, s: _Sequence, blocks: int) -> None:
        """Name the decode blocks up to ``blocks``: local hash from (request, block number),
        chained onto the request's last block like any other block."""
        while len(s.seq) < blocks:
            local = pair_hash(s.index, len(s.seq), 0)
            s.seq.append(sequence_hash(s.seq[-1], local) if s.seq else local)
            s.local.append(local)

    # -- time -----------------------------------------------------------------------------

    def _pace(self) -> None:
        """With a speed-up factor, sleep until the wall clock catches up with simulated time."""
        speedup = self.config.speedup
        if not speedup:
            return
        due = self._wall_start + (self.clock.now_ms - self._sim_start_ms) / 1e3 / speedup
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)

    def _summary(self) -> dict[str, float | int]:
        out: dict[str, float | int] = {
            "simulated_s": round((self.clock.now_ms - self._sim_start_ms) / 1e3, 3),
            "steps": self.steps,
            "preemptions": self.preemptions,
            "onboard_ms": round(self.onboard_ms, 3),
        }
        if self.admitted_tokens:
            out["token_hit_rate_all_admissions"] = round(
                self.reused_tokens / self.admitted_tokens, 6
            )
        if self.tpot_ms:
            out["tpot_ms_mean"] = round(sum(self.tpot_ms) / len(self.tpot_ms), 3)
        if self.latency_ms:
            ordered = sorted(self.latency_ms)
            out["latency_ms_p50"] = round(ordered[len(ordered) // 2], 3)
            out["latency_ms_p99"] = round(
                ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 3
            )
        return out
