"""The router's view: which worker holds which prefix, on which tier.

A KV-aware router does not need parents or token ids, only "for this prompt, how many leading
blocks does each worker already hold, and where". This index answers that from the same event
stream the registry folds, and can be rebuilt from a stream or a log at any time: it is a cache of
the events, never a source of truth.

A prompt can be looked up by sequence hashes (each names a whole prefix) or by local hashes,
which is what a router computes from tokens without chaining them; a local-hash lookup walks the
``(parent sequence hash, local hash) -> sequence hash`` links that Stored events reveal.

A router asks once per request, so the query is the hot path, and prompts run to hundreds of
blocks. The links are therefore kept as a radix tree whose nodes hold runs of chained blocks
that the same slots hold: one int per run with a bit per (worker, dp_rank, tier). A query
compares a slice of its hashes with a node's run (a list comparison, in C) and ANDs one mask
per run, not per block: a table lookup per block measured slower than Dynamo's Rust tree on
long prompts. A node splits where a chain branches or its blocks' holders start to differ, and
joins its only child again when their holders become equal. A block nobody holds any more stays
in the tree, with no holder, while blocks below it are held, so that storing it again links
them up as the per-block link table did; it goes once nothing below it is held.

A router's index also folds every event every worker emits, and on short prompts that fold
costs more than the queries: ``apply``'s usual cases (a Stored chain new to everyone, a
Removed of a run's end) run compiled where ``registry/_index.c`` was built (``COMPILED_APPLY``),
over the same nodes and dicts, and leave every other case to the Python methods below.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import repeat
from typing import Literal, TypeAlias, TypeVar

from kvledger.events.types import (
    AnyEvent,
    Baseline,
    BlockInfo,
    Cleared,
    Offloaded,
    Onboarded,
    Removed,
    Stored,
    Tier,
)
from kvledger.registry.state import RegistryState, take_next

WorkerKey: TypeAlias = tuple[int, int]
"""(worker_id, dp_rank): what a router routes to."""

Depths: TypeAlias = dict[WorkerKey, dict[Tier, int]]
HashKind: TypeAlias = Literal["local", "sequence"]
K = TypeVar("K")

_TIER_ORDER = tuple(Tier)
_TIERS = len(_TIER_ORDER)


def tier_bit(tier: Tier) -> int:
    """A tier's bit in a holder mask (G1 -> 1, G2 -> 2, G3 -> 4, G4 -> 8)."""
    return 1 << (int(tier) - 1)


def tiers_of(mask: int) -> list[Tier]:
    return [tier for tier in Tier if mask & tier_bit(tier)]


def holders_from_state(state: RegistryState) -> dict[int, dict[int, int]]:
    """``sequence_hash -> {worker_id: tier mask}`` of a folded registry.

    This is the shape the shared Redis registry stores, so a replayed log can be compared
    with it directly.
    """
    out: dict[int, dict[int, int]] = {}
    for (worker, tier), blocks in state.snapshot().items():
        bit = tier_bit(tier)
        for seq in blocks:
            per_worker = out.setdefault(seq, {})
            per_worker[worker] = per_worker.get(worker, 0) | bit
    return out


class _Node:
    """A run of chained blocks, each the parent of the next, held by the same slots.

    The root and the hosts of blocks stored under a parent nobody has shown yet are nodes with
    an empty run (an orphan host's ``locals`` names that parent). A node whose run a collision
    keeps out of the tree (another block already has its link) has no parent.
    """

    __slots__ = ("seqs", "locals", "bits", "children", "parent")

    def __init__(
        self,
        seqs: list[int],
        locals_: list[int],
        bits: int,
        parent: _Node | None,
        children: dict[int, _Node] | None = None,
    ) -> None:
        self.seqs = seqs
        self.locals = locals_
        # the (worker, dp_rank, tier) slots holding every block of the run; 0: nobody does
        self.bits = bits
        # first local hash of each child's run -> the child
        self.children: dict[int, _Node] = {} if children is None else children
        self.parent = parent


def _set_bits(bits: int) -> Iterator[int]:
    """Each set bit of ``bits`` as a mask of its own, lowest first: one per holder slot."""
    while bits:
        low = bits & -bits
        yield low
        bits ^= low


def _common(a: list[int], i: int, b: list[int], j: int, k: int) -> int:
    """How many of ``a[i:i+k]`` and ``b[j:j+k]`` agree from the start, given that the first
    do and not all do: a binary search of slice comparisons, each in C."""
    lo, hi = 1, k
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[i : i + mid] == b[j : j + mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _shared_step(run: list[int], seq: int, hashes: list[int], depth: int) -> int:
    """How many blocks of a node's ``run`` the prompt ``hashes`` goes on with from ``depth``,
    where it holds ``seq`` (in the run): the step a walk down the prompt takes at the node."""
    at = 0 if run[0] == seq else run.index(seq)
    step = min(len(run) - at, len(hashes) - depth)
    if step > 1 and run[at : at + step] != hashes[depth : depth + step]:
        step = _common(run, at, hashes, depth, step)
    return step


def _matched(run: list[int], hashes: list[int], pos: int) -> int:
    """How many blocks of ``run`` match ``hashes`` from ``pos`` on, given the first does."""
    k = len(hashes) - pos
    if k >= len(run):
        if hashes[pos : pos + len(run)] == run:
            return len(run)
        k = len(run)
    elif run[:k] == hashes[pos:]:
        return k
    return _common(run, 0, hashes, pos, k)


class RouterIndex:
    """Prefix holders per worker and tier, folded from events.

    Events from one worker must arrive in event-id order. A repeat (an id at or below the last
    one applied for that worker) is ignored, so replaying an overlapping stream is harmless; a gap
    raises ``EventOrderError`` unless ``strict=False``, because an index built over a missing
    event silently disagrees with the worker.

    A block keeps the place in the tree where it was first stored while it or a block below it
    is held: a stream that names it again under another parent (or gives a second block the
    link of one already there) changes its holders, not the links, and a local-hash query
    answers for the blocks the links lead to (``sequence_hashes_of``).
    """

    __slots__ = (
        "_node_of",
        "_root",
        "_orphans",
        "_live",
        "_places",
        "_where",
        "_slot_of",
        "_owners",
        "_free_slots",
        "last_event_id",
    )

    def __init__(self) -> None:
        # sequence hash -> the node whose run holds it (held by nobody where its node's bits
        # are 0: kept for the blocks below it)
        self._node_of: dict[int, _Node] = {}
        self._root = _Node([], [], 0, None)
        # parent sequence hash nobody has stored -> host of the runs stored under it
        self._orphans: dict[int, _Node] = {}
        self._live = 0  # blocks someone holds
        # (worker, dp_rank, tier) -> (its bit, the nodes with that bit: for Cleared and worker
        # removal); _where: the same sets by bit
        self._places: dict[tuple[int, int, Tier], tuple[int, set[_Node]]] = {}
        self._where: dict[int, set[_Node]] = {}
        # (worker, dp_rank) -> its slot; its tier t has bit ``slot * _TIERS + t - 1``
        self._slot_of: dict[WorkerKey, int] = {}
        # bit position -> (worker key, tier) it stands for (stale for a free slot: no bit set)
        self._owners: list[tuple[WorkerKey, Tier]] = []
        self._free_slots: list[int] = []
        self.last_event_id: dict[int, int] = {}

    @classmethod
    def from_events(cls, events: Iterable[AnyEvent], *, strict: bool = True) -> RouterIndex:
        index = cls()
        for event in events:
            index.apply(event, strict=strict)
        return index

    def __len__(self) -> int:
        """Number of distinct blocks held by anyone on any tier."""
        return self._live

    # -- folding -------------------------------------------------------------------------

    def apply(self, event: AnyEvent, *, strict: bool = True) -> bool:
        """Fold one event in; False (and no change) for a repeat."""
        last = self.last_event_id
        if event.event_id == last.get(event.worker_id, -1) + 1:  # the usual case
            last[event.worker_id] = event.event_id
        elif not take_next(last, event, strict=strict):
            return False
        place = self._places.get((event.worker_id, event.dp_rank, event.tier))
        if place is None:
            place = self._place(event.worker_id, event.dp_rank, event.tier)
        bit, where = place
        if isinstance(event, Stored):
            if event.blocks:
                seqs = [seq for seq, _ in event.blocks]
                locals_ = [local for _, local in event.blocks]
                parent = event.parent_hash
                # the usual case first: a chain new to everyone
                if not self._node_of.keys().isdisjoint(seqs) or not self._grow(
                    bit, where, parent, seqs, locals_
                ):
                    self._store(bit, where, parent, seqs, locals_)
        elif isinstance(event, Offloaded | Onboarded):
            self._store_infos(bit, where, event.blocks)
        elif isinstance(event, Removed):
            self._drop(bit, where, event.sequence_hashes)
        elif isinstance(event, Cleared):
            self._clear_all(bit, where)
        else:  # pragma: no cover - the union above is exhaustive
            raise TypeError(f"not an event: {event!r}")
        return True

    def apply_baseline(self, baseline: Baseline) -> None:
        """Take a worker's whole holding on one tier (the shared registry replaced its entries
        by its log's fold): what it held there before goes, its next event is the one after
        ``baseline.event_id``."""
        self.last_event_id[baseline.worker_id] = baseline.event_id
        key = (baseline.worker_id, baseline.dp_rank, baseline.tier)
        place = self._places.get(key) or self._place(*key)
        bit, where = place
        self._clear_all(bit, where)
        self._store_infos(bit, where, chain_order(baseline.blocks))

    def remove_worker(self, worker_id: int) -> int:
        """Forget all a worker holds (it left, or its lease lapsed); returns blocks dropped."""
        dropped = 0
        for where in [where for where in self._places if where[0] == worker_id]:
            bit, nodes = self._places.pop(where)
            del self._where[bit]
            dropped += sum(len(node.seqs) for node in nodes)
            self._clear_all(bit, nodes)
        for key in [key for key in self._slot_of if key[0] == worker_id]:
            # no bit of its slot is set any more, so a new worker can take it over
            self._free_slots.append(self._slot_of.pop(key))
        self.last_event_id.pop(worker_id, None)
        return dropped

    def _place(self, worker_id: int, dp_rank: int, tier: Tier) -> tuple[int, set[_Node]]:
        """The bit and node set of a (worker, dp_rank, tier), made on first use."""
        key = (worker_id, dp_rank)
        slot = self._slot_of.get(key)
        if slot is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._owners) // _TIERS
            self._slot_of[key] = slot
            self._owners[slot * _TIERS : (slot + 1) * _TIERS] = [(key, t) for t in _TIER_ORDER]
        bit = 1 << (slot * _TIERS + int(tier) - 1)
        place = self._places[(worker_id, dp_rank, tier)] = (bit, set())
        self._where[bit] = place[1]
        return place

    def _store_infos(self, bit: int, where: set[_Node], infos: Sequence[BlockInfo]) -> None:
        """Hold blocks that each name their parent, as chains where one is the next's parent."""
        seqs: list[int] = []
        locals_: list[int] = []
        parent: int | None = None
        for seq, local, above in infos:
            if seqs and above == seqs[-1]:
                seqs.append(seq)
                locals_.append(local)
                continue
            if seqs:
                self._store(bit, where, parent, seqs, locals_)
            seqs, locals_, parent = [seq], [local], above
        if seqs:
            self._store(bit, where, parent, seqs, locals_)

    def _store(
        self, bit: int, where: set[_Node], parent: int | None, seqs: list[int], locals_: list[int]
    ) -> None:
        """Hold a chain of blocks, the first one under ``parent``."""
        n = len(seqs)
        node_of = self._node_of
        known = list(map(node_of.get, seqs))  # only whether each is: nodes change below
        if known.count(None) == n and self._grow(bit, where, parent, seqs, locals_):
            return  # the usual case: all new to everyone
        pos = 0
        while pos < n:
            if known[pos] is None:
                end = pos + 1
                if known[end:].count(None) == n - end:  # the usual case: all new from here
                    end = n
                while end < n and known[end] is None:
                    end += 1
                new, new_locals = seqs[pos:end], locals_[pos:end]
                # still all new (a chain can name a block twice), and none twice among them
                if not node_of.keys().isdisjoint(new) or not self._grow(
                    bit, where, parent, new, new_locals
                ):
                    for seq, local in zip(new, new_locals, strict=True):  # one at a time
                        self._store(bit, where, parent, [seq], [local])
                        parent = seq
            else:
                end = self._hold(bit, where, seqs, pos)
            parent = seqs[end - 1]
            pos = end

    def _grow(
        self, bit: int, where: set[_Node], parent: int | None, seqs: list[int], locals_: list[int]
    ) -> bool:
        """Add a chain of blocks new to everyone under ``parent``; False (and no block added)
        where the chain names a block twice."""
        node_of = self._node_of
        host: _Node | None
        if parent is None:
            host = self._root
        else:
            host = node_of.get(parent)
            if host is None:
                host = self._orphans.get(parent)
                if host is None:
                    host = self._orphans[parent] = _Node([], [parent], 0, None)
            elif host.seqs[-1] != parent:
                at = host.seqs.index(parent) + 1
                # None: the link is another block's
                host = None if host.locals[at] == locals_[0] else self._split(host, at)[0]
        # (a host with no run, the root or an orphan's, has no holder: never ``bit``)
        extend = host is not None and host.bits == bit and not host.children
        node = host if extend and host is not None else _Node(seqs, locals_, bit, None)
        n = len(seqs)
        before = len(node_of)
        node_of.update(zip(seqs, repeat(node)))
        if len(node_of) - before != n:  # cheaper than a set of the chain every time
            for seq in seqs:
                node_of.pop(seq, None)
            return False
        if extend:  # the usual case: the run goes on
            node.seqs += seqs
            node.locals += locals_
        else:
            where.add(node)
            if host is not None and locals_[0] not in host.children:
                host.children[locals_[0]] = node
                node.parent = host
            # else it stays out of the tree: see _Node
        self._live += n
        if self._orphans:  # (a list first: adopting splits the node, and seqs may be its run)
            for seq in [seq for seq in seqs if seq in self._orphans]:
                self._adopt(seq)
        return True

    def _adopt(self, seq: int) -> None:
        """Hang the runs stored under ``seq`` before it was known below it."""
        host = self._orphans.pop(seq)
        node = self._node_of[seq]
        if node.seqs[-1] != seq:
            node = self._split(node, node.seqs.index(seq) + 1)[0]
        above: set[_Node] = set()  # a stream can name a block's descendant as its parent
        walk: _Node | None = node
        while walk is not None:
            above.add(walk)
            walk = walk.parent
        for local, child in host.children.items():
            if local in node.children or child in above:
                child.parent = None  # its link is another block's, or would make a loop
            else:
                node.children[local] = child
                child.parent = node

    def _hold(self, bit: int, where: set[_Node], seqs: list[int], pos: int) -> int:
        """Hold the known blocks from ``seqs[pos]`` on along its node's run; returns where the
        chain leaves that run."""
        first = seqs[pos]
        node = self._node_of[first]
        run = node.seqs
        at = 0 if run[0] == first else run.index(first)
        k = min(len(run) - at, len(seqs) - pos)
        if k > 1 and run[at : at + k] != seqs[pos : pos + k]:
            k = _common(run, at, seqs, pos, k)
        if not node.bits & bit:
            if not node.bits:
                self._live += k
            if not self._shift(node, at, at + k, node.bits | bit):
                node = self._isolate(node, at, at + k)
                node.bits |= bit
                where.add(node)
                self._merge(node)
        return pos + k

    def _drop(self, bit: int, where: set[_Node], seqs: Sequence[int]) -> None:
        """Clear ``bit`` on each of ``seqs`` that has it (once each, however often a stream
        repeats one; what was never stored changes nothing)."""
        node_of = self._node_of
        n = len(seqs)
        node = node_of.get(seqs[0]) if n else None
        if node is not None and node.bits & bit:
            run = node.seqs
            if n <= len(run) and run[-n:] == list(reversed(seqs)):
                # the usual eviction: the end of a run, named from its last block back
                if n < len(run) and node.bits == bit and not node.children:
                    for seq in seqs:  # only this slot held them: they go for good
                        del node_of[seq]
                    del run[-n:], node.locals[-n:]
                    self._live -= n
                else:
                    self._unhold(bit, where, node, len(run) - n, len(run))
                return
        names = seqs if isinstance(seqs, list) else list(seqs)
        # the runs of consecutive blocks to clear, as (node, start, end): engines name a
        # chain's blocks from its end back (or in order), so each block found is followed by
        # the rest of its run, compared in one slice
        found: list[tuple[_Node, int, int]] = []
        i = 0
        while i < n:
            seq = names[i]
            node = node_of.get(seq)
            if node is None or not node.bits & bit:
                i += 1
                continue
            run = node.seqs
            at = len(run) - 1 if run[-1] == seq else run.index(seq)
            lo, hi, taken = at, at + 1, 1
            k = min(at + 1, n - i)
            if k > 1:  # back towards the run's start
                back = run[at + 1 - k : at + 1]
                back.reverse()
                taken = k if back == names[i : i + k] else _common(back, 0, names, i, k)
                lo = at + 1 - taken
            k = min(len(run) - at, n - i)
            if taken == 1 and k > 1:  # on towards its end
                taken = k if run[at : at + k] == names[i : i + k] else _common(run, at, names, i, k)
                hi = at + taken
            found.append((node, lo, hi))
            i += taken
        if len(found) == 1:
            node, lo, hi = found[0]
            self._unhold(bit, where, node, lo, hi)
            return
        if len({id(node) for node, _lo, _hi in found}) == len(found):
            # a chain across nodes: each found again by its first block, as nodes change
            spans = [(node.seqs[lo], hi - lo) for node, lo, hi in found]
        else:  # a stream naming blocks twice: overlaps merged per node
            spans = self._spans(found)
        for first, length in spans:
            node = node_of[first]
            at = 0 if node.seqs[0] == first else node.seqs.index(first)
            self._unhold(bit, where, node, at, at + length)

    @staticmethod
    def _spans(found: list[tuple[_Node, int, int]]) -> list[tuple[int, int]]:
        """Offset ranges per node merged where they overlap, as (first block, length)."""
        per_node: dict[_Node, list[tuple[int, int]]] = {}
        for node, lo, hi in found:
            per_node.setdefault(node, []).append((lo, hi))
        spans: list[tuple[int, int]] = []
        for node, ranges in per_node.items():
            ranges.sort()
            start, end = ranges[0]
            for lo, hi in ranges[1:]:
                if lo > end:
                    spans.append((node.seqs[start], end - start))
                    start = lo
                end = max(end, hi)
            spans.append((node.seqs[start], end - start))
        return spans

    def _unhold(self, bit: int, where: set[_Node], node: _Node, start: int, end: int) -> None:
        """Clear ``bit`` on ``node``'s blocks ``start:end``, all of which have it."""
        if node.bits == bit and end == len(node.seqs) and not node.children:
            # the usual eviction: the end of a run only this slot held goes for good
            if start:
                node_of = self._node_of
                for seq in node.seqs[start:]:
                    del node_of[seq]
                self._live -= end - start
                del node.seqs[start:], node.locals[start:]
                return
        elif self._shift(node, start, end, node.bits & ~bit):
            if node.bits == bit:
                self._live -= end - start
            return
        else:
            node = self._isolate(node, start, end)
        node.bits &= ~bit
        where.discard(node)
        if not node.bits:
            self._live -= len(node.seqs)
            if not node.children:
                self._collect(node, merge=True)
                return
        self._merge(node)

    def _shift(self, node: _Node, start: int, end: int, bits: int) -> bool:
        """Where ``node``'s blocks ``start:end``, about to be held by ``bits``, are its run's
        end and its only child has those holders (or its start, and its parent does), move
        them there: what a split and a join would do, without the new node. False if not."""
        seqs, locals_ = node.seqs, node.locals
        if start and end == len(seqs):
            if len(node.children) != 1:
                return False
            (child,) = node.children.values()
            if child.bits != bits:
                return False
            moved = seqs[start:]
            child.seqs[:0] = moved
            child.locals[:0] = locals_[start:]
            node.children = {locals_[start]: child}
            del seqs[start:], locals_[start:]
            self._node_of.update(zip(moved, repeat(child)))
            return True
        parent = node.parent
        if (
            start
            or end == len(seqs)
            or parent is None
            or not parent.seqs
            or parent.bits != bits
            or len(parent.children) != 1
        ):
            return False
        moved = seqs[:end]
        parent.seqs += moved
        parent.locals += locals_[:end]
        parent.children = {locals_[end]: node}
        del seqs[:end], locals_[:end]
        self._node_of.update(zip(moved, repeat(parent)))
        return True

    def _clear_all(self, bit: int, where: set[_Node]) -> None:
        """Clear ``bit`` on every node that has it (Cleared, a worker leaving)."""
        nodes = list(where)
        where.clear()
        keep = ~bit
        for node in nodes:
            node.bits &= keep
            if not node.bits:
                self._live -= len(node.seqs)
        node_of = self._node_of
        for node in nodes:  # runs left to no one and with nothing below go
            if not node.bits and not node.children and node_of.get(node.seqs[0]) is node:
                self._collect(node, merge=False)

    # -- the tree's shape ----------------------------------------------------------------

    def _split(self, node: _Node, at: int) -> tuple[_Node, _Node]:
        """Cut ``node``'s run before offset ``at`` (0 < at < len); returns (head, tail). The
        shorter part moves to a new node, since its blocks are the ones to point there."""
        seqs, locals_ = node.seqs, node.locals
        if 2 * at >= len(seqs):
            moved = tail = _Node(seqs[at:], locals_[at:], node.bits, node, node.children)
            for child in tail.children.values():
                child.parent = tail
            node.children = {locals_[at]: tail}
            del seqs[at:], locals_[at:]
            head = node
        else:
            parent = node.parent
            moved = head = _Node(seqs[:at], locals_[:at], node.bits, parent, {locals_[at]: node})
            if parent is not None:
                parent.children[locals_[0]] = head
            node.parent = head
            del seqs[:at], locals_[:at]
            tail = node
        self._node_of.update(zip(moved.seqs, repeat(moved)))
        where = self._where
        for low in _set_bits(node.bits):
            where[low].add(moved)
        return head, tail

    def _isolate(self, node: _Node, start: int, end: int) -> _Node:
        """The node whose run is exactly ``node``'s blocks ``start:end``, split out."""
        if end < len(node.seqs):
            node = self._split(node, end)[0]
        if start:
            node = self._split(node, start)[1]
        return node

    def _merge(self, node: _Node) -> None:
        """Join ``node`` with its parent and its child where each is the other's only
        relative and the holders are the same: fewer, longer runs for queries to compare."""
        parent = node.parent
        if (
            parent is not None
            and parent.seqs
            and parent.bits == node.bits
            and len(parent.children) == 1
        ):
            node = self._join(parent, node)
        if len(node.children) == 1:
            (child,) = node.children.values()
            if child.bits == node.bits:
                self._join(node, child)

    def _join(self, upper: _Node, lower: _Node) -> _Node:
        """Make one node of ``upper`` and its only child ``lower``; returns it. The shorter
        run's blocks move, as in ``_split``."""
        if len(upper.seqs) >= len(lower.seqs):
            keep, gone = upper, lower
            upper.seqs += lower.seqs
            upper.locals += lower.locals
            upper.children = lower.children
            for child in upper.children.values():
                child.parent = upper
        else:
            keep, gone = lower, upper
            lower.seqs[:0] = upper.seqs
            lower.locals[:0] = upper.locals
            parent = lower.parent = upper.parent
            if parent is not None:
                parent.children[upper.locals[0]] = lower
        self._node_of.update(zip(gone.seqs, repeat(keep)))
        where = self._where
        for low in _set_bits(gone.bits):
            where[low].discard(gone)
        return keep

    def _collect(self, node: _Node, *, merge: bool) -> None:
        """Drop a run nobody holds and with nothing below it, and the runs above it that are
        left the same way."""
        node_of = self._node_of
        while True:
            for seq in node.seqs:
                del node_of[seq]
            parent = node.parent
            if parent is None:
                return
            del parent.children[node.locals[0]]
            if not parent.seqs:  # the root, or an orphan host
                if not parent.children and parent is not self._root:
                    del self._orphans[parent.locals[0]]
                return
            if parent.bits or parent.children:
                if merge:
                    self._merge(parent)
                return
            node = parent

    # -- queries -------------------------------------------------------------------------

    def sequence_hashes_of(self, local_hashes: Sequence[int]) -> list[int]:
        """The longest known chain of sequence hashes for a prompt's local hashes."""
        hashes = local_hashes if isinstance(local_hashes, list) else list(local_hashes)
        out: list[int] = []
        children = self._root.children
        pos, n = 0, len(hashes)
        while pos < n:
            node = children.get(hashes[pos])
            if node is None or not node.bits:
                break
            k = _matched(node.locals, hashes, pos)
            out += node.seqs[:k]
            if k < len(node.seqs):
                break
            pos += k
            children = node.children
        return out

    def find_matches(self, hashes: Sequence[int], *, kind: HashKind = "local") -> Depths:
        """For each holder, how many leading blocks of the prompt it holds on each tier.

        A depth counts consecutive blocks from the start: a hole ends it, because a block after
        a missing one cannot be reused without recomputing the missing one.
        """
        if kind == "local":
            return self._local_depths(hashes)
        if kind == "sequence":
            return self._sequence_depths(hashes)
        raise ValueError(f"kind must be 'local' or 'sequence', got {kind!r}")

    def _local_depths(self, local_hashes: Sequence[int]) -> Depths:
        hashes = local_hashes if isinstance(local_hashes, list) else list(local_hashes)
        depths: Depths = {}
        alive = depth = 0
        children = self._root.children
        n = len(hashes)
        while depth < n:
            node = children.get(hashes[depth])
            if node is None:
                break
            run = node.locals
            end = depth + len(run)
            full = hashes[depth:end] == run
            if not full:  # the prompt ends or turns off inside the run
                end = depth + _matched(run, hashes, depth)
            if depth:
                still = alive & node.bits
                if still != alive:
                    self._record(depths, alive ^ still, depth)
                    alive = still
                    if not alive:
                        return depths
            else:
                alive = node.bits
                if not alive:
                    return depths
            depth = end
            if not full:
                break
            children = node.children
        if alive:
            self._record(depths, alive, depth)
        return depths

    def _sequence_depths(self, sequence_hashes: Sequence[int]) -> Depths:
        hashes = sequence_hashes if isinstance(sequence_hashes, list) else list(sequence_hashes)
        node_of = self._node_of
        depths: Depths = {}
        alive = depth = 0
        n = len(hashes)
        while depth < n:
            seq = hashes[depth]
            node = node_of.get(seq)
            bits, step = 0, 1
            if node is not None:
                bits, step = node.bits, _shared_step(node.seqs, seq, hashes, depth)
            if depth:
                still = alive & bits
                if still != alive:
                    self._record(depths, alive ^ still, depth)
                    alive = still
            else:
                alive = bits
            if not alive:
                return depths
            depth += step
        if alive:
            self._record(depths, alive, depth)
        return depths

    def tier_reach(self, sequence_hashes: Sequence[int]) -> dict[WorkerKey, list[int]]:
        """For each holder, how far the prompt's leading blocks reach on its faster tiers:
        ``[G1, G1 or G2, G1 to G3, G1 to G4]``, each the number of leading blocks held, without
        a hole, on one of those tiers.

        A router that weighs hits by tier wants this rather than ``find_matches``: a prefix
        whose first blocks are on G1 and the rest on G2 (G1 evicted them, write-through had
        copied them) is reused whole, the G1 part at GPU speed and the rest as host hits, while
        each tier alone holds only a piece of it.
        """
        hashes = sequence_hashes if isinstance(sequence_hashes, list) else list(sequence_hashes)
        node_of = self._node_of
        owners = self._owners
        slots = (len(owners) + _TIERS - 1) // _TIERS
        lowest = sum(1 << (slot * _TIERS) for slot in range(slots))  # each slot's G1 bit
        reach: dict[WorkerKey, list[int]] = {}
        alive = [0] * _TIERS  # per level, the slots (their lowest bit) still reaching
        depth, n = 0, len(hashes)
        while depth < n:
            seq = hashes[depth]
            node = node_of.get(seq)
            bits, step = 0, 1
            if node is not None:
                bits, step = node.bits, _shared_step(node.seqs, seq, hashes, depth)
            held = 0
            any_alive = False
            for level in range(_TIERS):
                held |= (bits >> level) & lowest
                still = held if not depth else alive[level] & held
                if depth and still != alive[level]:
                    self._reached(reach, alive[level] ^ still, level, depth)
                alive[level] = still
                any_alive = any_alive or bool(still)
            if not any_alive:
                return reach
            depth += step
        for level in range(_TIERS):
            if alive[level]:
                self._reached(reach, alive[level], level, depth)
        return reach

    def _reached(
        self, reach: dict[WorkerKey, list[int]], ended: int, level: int, depth: int
    ) -> None:
        """``depth`` at ``level`` for every slot whose lowest bit is set in ``ended``."""
        owners = self._owners
        while ended:
            low = ended & -ended
            key = owners[low.bit_length() - 1][0]
            levels = reach.get(key)
            if levels is None:
                levels = reach[key] = [0] * _TIERS
            levels[level] = depth
            ended ^= low

    def _record(self, depths: Depths, ended: int, depth: int) -> None:
        """``depth`` for every slot whose bit is set in ``ended``."""
        owners = self._owners
        while ended:
            low = ended & -ended
            key, tier = owners[low.bit_length() - 1]
            per_tier = depths.get(key)
            if per_tier is None:
                per_tier = depths[key] = {}
            per_tier[tier] = depth
            ended ^= low

    def holders(self) -> dict[int, dict[int, int]]:
        """``sequence_hash -> {worker_id: tier mask}``, dp ranks folded together."""
        owners = self._owners
        per_node: dict[_Node, dict[int, int]] = {}
        out: dict[int, dict[int, int]] = {}
        for seq, node in self._node_of.items():
            if not node.bits:
                continue
            merged = per_node.get(node)
            if merged is None:
                merged = per_node[node] = {}
                for low in _set_bits(node.bits):
                    (worker, _dp), tier = owners[low.bit_length() - 1]
                    merged[worker] = merged.get(worker, 0) | tier_bit(tier)
            out[seq] = dict(merged)
        return out

    def workers(self) -> set[WorkerKey]:
        return {
            (worker, dp) for (worker, dp, _tier), (_bit, nodes) in self._places.items() if nodes
        }


def python_count(counts: dict[int, int], keys: Iterable[int]) -> None:
    """``counts[key] = counts.get(key, 0) + 1`` for each key: a router's count of the active
    requests that hold each block, as it routes one (``kvledger.mocker.router.WorkerLoad``)."""
    for key in keys:
        counts[key] = counts.get(key, 0) + 1


def python_uncount(counts: dict[int, int], keys: Iterable[int]) -> None:
    """``counts[key] - 1`` for each key, the key gone at 0 (a request finished); KeyError for a
    key not there."""
    for key in keys:
        left = counts[key] - 1
        if left:
            counts[key] = left
        else:
            del counts[key]


PYTHON_APPLY = RouterIndex.apply
"""The Python fold of one event: the reference the compiled one is held to."""
COMPILED_APPLY: Callable[[RouterIndex, AnyEvent], bool] | None = None
"""``RouterIndex.apply`` compiled (``registry/_index.c``), which hands every case but the usual
Stored and Removed to ``PYTHON_APPLY`` and the methods it calls; None where the module was not
built (no C compiler at install). It is the class's ``apply`` unless ``KVLEDGER_PYTHON_INDEX=1``
is in the environment (to measure the Python fold, or to rule the compiled one out)."""
Counting: TypeAlias = Callable[[dict[int, int], Iterable[int]], None]
COMPILED_COUNTS: tuple[Counting, Counting] | None = None
"""``python_count`` and ``python_uncount`` compiled, the same way: a request's twenty to a few
hundred blocks are a loop of dict updates, twice a request."""
count: Counting = python_count
uncount: Counting = python_uncount
"""What a router counts with: the compiled pair unless not built or switched off."""
try:
    from kvledger.registry import _index
except ImportError:  # the Python fold and counts serve
    pass
else:
    COMPILED_APPLY = _index.bind(RouterIndex, _Node, Stored, Removed, PYTHON_APPLY)
    COMPILED_COUNTS = (_index.count, _index.uncount)
    if os.environ.get("KVLEDGER_PYTHON_INDEX", "") in ("", "0"):
        RouterIndex.apply = COMPILED_APPLY  # type: ignore[method-assign]
        count, uncount = COMPILED_COUNTS


def chain_order(blocks: Sequence[BlockInfo]) -> list[BlockInfo]:
    """``blocks`` with each block right after its parent where the parent is among them (a
    fold lists blocks by hash), so that they store as a few long chains, not one by one."""
    children: dict[int | None, list[BlockInfo]] = {}
    present = {b.sequence_hash for b in blocks}
    for block in blocks:
        above = block.parent_hash if block.parent_hash in present else None
        children.setdefault(above, []).append(block)
    ordered: list[BlockInfo] = []
    stack = list(reversed(children.get(None, [])))
    while stack:
        block = stack.pop()
        ordered.append(block)
        stack.extend(reversed(children.get(block.sequence_hash, [])))
    if len(ordered) < len(blocks):  # a cycle of parents (not a real fold): keep the rest too
        seen = {b.sequence_hash for b in ordered}
        ordered += [b for b in blocks if b.sequence_hash not in seen]
    return ordered


def prefix_depths(masks: Iterable[Mapping[K, int]]) -> dict[K, dict[Tier, int]]:
    """Per holder and tier, how many of the leading blocks it holds without a hole.

    ``masks`` gives, block by block, each holder's tier mask; it is consumed only while some
    holder is still matching, so a lazy iterable stops at the first block nobody holds.
    """
    depths: dict[K, dict[Tier, int]] = {}
    alive: dict[K, int] = {}
    for position, holders in enumerate(masks):
        if position == 0:
            alive = {key: mask for key, mask in holders.items() if mask}
            for key, mask in alive.items():
                depths[key] = {tier: 1 for tier in tiers_of(mask)}
            continue
        for key in list(alive):
            mask = alive[key] & holders.get(key, 0)
            if not mask:
                del alive[key]
                continue
            alive[key] = mask
            per_tier = depths[key]
            for tier in tiers_of(mask):
                per_tier[tier] += 1
        if not alive:
            break
    return depths


def overlap_scores(
    depths: Mapping[WorkerKey, Mapping[Tier, int]], tier: Tier
) -> dict[WorkerKey, int]:
    """Depths on one tier in the shape Dynamo's ``OverlapScores.scores`` has."""
    return {key: per_tier[tier] for key, per_tier in depths.items() if per_tier.get(tier)}
