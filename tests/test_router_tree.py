"""The router index's run tree against a per-block model, step by step.

The index keeps its links as a radix tree of runs that split and join as holders change, with
blocks nobody holds kept while blocks below them are held, and runs stored under a parent not
yet seen hung below it once it is. This machine drives it with random Stored, copies, Removed,
Cleared and worker removal across workers, dp ranks and tiers, over a small block space where
chains branch and share prefixes, and after every step compares every answer with a model that
keeps one holder set per block.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvledger.events.types import AnyEvent, BlockInfo, Tier
from kvledger.registry.emitter import EventEmitter
from kvledger.registry.index import Depths, RouterIndex, WorkerKey, tier_bit

WORKERS = 3
TIERS = (Tier.G1, Tier.G2, Tier.G3)
LOCALS = st.integers(0, 2)  # few local hashes: chains branch, and prompts share prefixes


class BlockModel:
    """The router index as a table of holders per block, walked one block at a time.

    A block's sequence hash is a function of its parent's and its own local hash, as every
    engine makes it, so a prompt's local hashes name one chain of blocks; its depth for a
    holder is how many of that chain's leading blocks the holder has.
    """

    def __init__(self) -> None:
        self.held: dict[int, set[tuple[WorkerKey, Tier]]] = {}

    def hold(self, key: WorkerKey, tier: Tier, seqs: list[int]) -> None:
        for seq in seqs:
            self.held.setdefault(seq, set()).add((key, tier))

    def drop(self, where: tuple[WorkerKey, Tier], seqs: list[int] | None = None) -> int:
        """Take ``where`` off ``seqs`` (every block when None); returns how many it had."""
        dropped = 0
        for seq in list(self.held) if seqs is None else set(seqs):
            holders = self.held.get(seq, set())
            if where in holders:
                dropped += 1
                holders.discard(where)
                if not holders:
                    del self.held[seq]
        return dropped

    def depths(self, chain: list[int]) -> Depths:
        out: Depths = {}
        alive = self.held.get(chain[0], set()) if chain else set()
        for depth in range(1, len(chain) + 1):
            after = self.held.get(chain[depth], set()) & alive if depth < len(chain) else set()
            for key, tier in alive - after:
                out.setdefault(key, {})[tier] = depth
            alive = after
        return out

    def holders(self) -> dict[int, dict[int, int]]:
        out: dict[int, dict[int, int]] = {}
        for seq, holders in self.held.items():
            merged: dict[int, int] = {}
            for (worker, _dp), tier in holders:
                merged[worker] = merged.get(worker, 0) | tier_bit(tier)
            out[seq] = merged
        return out


class RouterTreeMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = RouterIndex()
        self.model = BlockModel()
        # the block space: (parent, local) -> sequence hash, and each block's (parent, local)
        self.seq_of: dict[tuple[int | None, int], int] = {}
        self.link_of: dict[int, tuple[int | None, int]] = {}
        self.events: list[AnyEvent] = []
        self.emitters = [self._emitter(w) for w in range(WORKERS)]

    def _emitter(self, worker: int) -> EventEmitter:
        return EventEmitter(self.events.append, worker_id=worker, dp_rank=worker % 2)

    def _seq(self, parent: int | None, local: int) -> int:
        seq = self.seq_of.get((parent, local))
        if seq is None:
            seq = self.seq_of[(parent, local)] = 1000 + 7 * len(self.seq_of)
            self.link_of[seq] = (parent, local)
        return seq

    def _path(self, seq: int) -> list[int]:
        """The chain from a root down to ``seq``."""
        path = [seq]
        while (parent := self.link_of[path[-1]][0]) is not None:
            path.append(parent)
        return path[::-1]

    def _pick(self, choice: int) -> int | None:
        known = sorted(self.link_of)
        return known[choice % len(known)] if known else None

    def _apply(self) -> None:
        event = self.events[-1]
        assert self.index.apply(event)

    @rule(
        worker=st.integers(0, WORKERS - 1),
        tier=st.sampled_from(TIERS),
        under=st.none() | st.integers(0, 10_000),
        locals_=st.lists(LOCALS, min_size=1, max_size=6),
    )
    def store_chain(self, worker: int, tier: Tier, under: int | None, locals_: list[int]) -> None:
        """A chain below the root or below any block there is, held or not, even one no
        event has named yet (its runs wait for it)."""
        parent = None if under is None else self._pick(under)
        first, blocks = parent, []
        for local in locals_:
            parent = self._seq(parent, local)
            blocks.append((parent, local))
        self.emitters[worker].stored(tier, first, blocks)
        self._apply()
        self.model.hold((worker, worker % 2), tier, [seq for seq, _ in blocks])

    @rule(
        worker=st.integers(0, WORKERS - 1),
        tier=st.sampled_from(TIERS),
        pick=st.integers(0, 10_000),
        skip=st.integers(0, 8),
    )
    def store_path(self, worker: int, tier: Tier, pick: int, skip: int) -> None:
        """Blocks that exist already, from some depth of a chain down to its end: what
        another worker holds, what was evicted, or what a first event stored out of order."""
        seq = self._pick(pick)
        if seq is None:
            return
        path = self._path(seq)
        start = min(skip, len(path) - 1)
        blocks = [(s, self.link_of[s][1]) for s in path[start:]]
        self.emitters[worker].stored(tier, self.link_of[path[start]][0], blocks)
        self._apply()
        self.model.hold((worker, worker % 2), tier, path[start:])

    @rule(
        worker=st.integers(0, WORKERS - 1),
        src=st.sampled_from(TIERS),
        dst=st.sampled_from(TIERS),
        picks=st.lists(st.integers(0, 10_000), min_size=1, max_size=5),
    )
    def copy(self, worker: int, src: Tier, dst: Tier, picks: list[int]) -> None:
        seqs = [s for s in map(self._pick, picks) if s is not None]
        if not seqs or src == dst:
            return
        infos = [BlockInfo(s, self.link_of[s][1], self.link_of[s][0]) for s in seqs]
        self.emitters[worker].copied(src, dst, infos)
        self._apply()
        self.model.hold((worker, worker % 2), dst, seqs)

    @rule(
        worker=st.integers(0, WORKERS - 1),
        tier=st.sampled_from(TIERS),
        pick=st.integers(0, 10_000),
        keep=st.integers(0, 8),
        order=st.sampled_from(["end first", "in order", "shuffled", "doubled"]),
        extra=st.lists(st.integers(0, 10_000), max_size=3),
    )
    def remove(
        self, worker: int, tier: Tier, pick: int, keep: int, order: str, extra: list[int]
    ) -> None:
        """A chain's blocks below some depth, named as engines do (from the end back) or
        otherwise, with others that worker may or may not hold."""
        seq = self._pick(pick)
        if seq is None:
            return
        path = self._path(seq)[keep:]
        gone = path[::-1] if order == "end first" else list(path)
        if order == "shuffled":
            gone = gone[1::2] + gone[::2]
        elif order == "doubled":
            gone = gone + gone[:2]
        gone += [s for s in map(self._pick, extra) if s is not None]
        if not gone:
            return
        self.emitters[worker].removed(tier, gone)
        self._apply()
        self.model.drop(((worker, worker % 2), tier), gone)

    @rule(worker=st.integers(0, WORKERS - 1), tier=st.sampled_from(TIERS))
    def clear(self, worker: int, tier: Tier) -> None:
        self.emitters[worker].cleared(tier)
        self._apply()
        self.model.drop(((worker, worker % 2), tier))

    @rule(worker=st.integers(0, WORKERS - 1))
    def remove_worker(self, worker: int) -> None:
        """It leaves and comes back with a fresh stream: another may take its slot first."""
        expected = sum(self.model.drop(((worker, worker % 2), tier)) for tier in TIERS)
        assert self.index.remove_worker(worker) == expected
        self.emitters[worker] = self._emitter(worker)

    @invariant()
    def answers_as_the_model_does(self) -> None:
        index, model = self.index, self.model
        assert index.holders() == model.holders()
        assert len(index) == len(model.held)
        assert index.workers() == {key for holders in model.held.values() for key, _ in holders}
        for seq in self.link_of:
            chain = self._path(seq)
            locals_ = [self.link_of[s][1] for s in chain]
            expected = model.depths(chain)
            assert index.find_matches(locals_) == expected
            assert index.find_matches(chain, kind="sequence") == expected
            # one more block nobody has, and the prompt cut short inside a run
            assert index.find_matches([*locals_, 9]) == expected
            assert index.find_matches(locals_[:-1]) == model.depths(chain[:-1])
            held_prefix = 0
            while held_prefix < len(chain) and chain[held_prefix] in model.held:
                held_prefix += 1
            assert index.sequence_hashes_of(locals_) == chain[:held_prefix]


def test_a_shared_run_loses_one_holder_at_either_end() -> None:
    """Two workers hold a chain, one of them a block more: when the other drops the chain's
    end, or the first drops its start, the blocks move to the run beside them with the same
    holders, and every answer stays the model's."""
    machine = RouterTreeMachine()
    machine.store_chain(worker=0, tier=Tier.G1, under=None, locals_=[0, 1, 2])
    machine.store_path(worker=1, tier=Tier.G1, pick=2, skip=0)
    machine.store_chain(worker=1, tier=Tier.G1, under=2, locals_=[0])
    machine.answers_as_the_model_does()
    machine.remove(worker=0, tier=Tier.G1, pick=2, keep=2, order="end first", extra=[])
    machine.answers_as_the_model_does()
    machine.remove(worker=1, tier=Tier.G1, pick=0, keep=0, order="end first", extra=[])
    machine.answers_as_the_model_does()
    machine.store_path(worker=1, tier=Tier.G1, pick=0, skip=0)  # back: it joins its run
    machine.remove(worker=0, tier=Tier.G1, pick=1, keep=0, order="end first", extra=[])
    machine.answers_as_the_model_does()
    assert len(machine.index) == 4


RouterTreeMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
test_router_tree = RouterTreeMachine.TestCase
