"""Decoding sequences that the mock engine advances in aggregate instead of one by one.

Under load most running sequences are in the same state step after step: they decode one
token, fit in the blocks they hold and do not finish. Touching each of them every step is what
made an engine step cost O(running sequences) in Python. A sequence in that state is *parked*
here: its counters are frozen at the step it was parked, with the step at which it next needs
attention (a new block, a block to name, its last token) on a heap. Until then it counts only
in two sums: how many parked sequences decode (one token each per step) and their total
context. At its event step, or when it must be touched for another reason (preempted), it is
brought up to date, exactly as if every step had been applied to it.
"""

from __future__ import annotations

import heapq
from operator import attrgetter
from typing import Generic, Protocol, TypeVar

from kvledger.mocker.cache import Admission


class Decoding(Protocol):
    """What parking needs of a running sequence (the engine's ``_Sequence``)."""

    order: int  # position in the running queue: later admissions have larger values
    parked_at: int  # step it was parked at, -1 when not parked
    computed: int
    generated: int
    tokens: int
    output_length: int
    admission: Admission | None


S = TypeVar("S", bound=Decoding)


class SteadyDecoders(Generic[S]):
    """Parked decoding sequences plus the running ones that are not parked (``active``)."""

    def __init__(self, block_size: int, *, naming: bool) -> None:
        self.block_size = block_size
        #: blocks are named only when full: stop before a held block fills up
        self.naming = naming
        self.count = 0
        self._offset = 0  # sum over parked of (tokens when parked - step when parked)
        self._events: list[tuple[int, int, int, S]] = []  # (step, order, parked_at, s)
        #: running sequences not parked, by identity
        self.active: dict[int, S] = {}

    def context(self, step: int) -> int:
        """Tokens held by the parked sequences at the start of ``step``."""
        return self._offset + self.count * step

    def add(self, s: S) -> None:
        """A sequence joined the running queue."""
        self.active[id(s)] = s

    def park(self, s: S, step: int) -> None:
        """Park ``s`` from ``step`` on if it will decode at least two quiet steps in a row."""
        if s.computed != s.tokens - 1 or not s.generated:
            return  # still prefilling (its next token is the prompt's last, or its first)
        admission = s.admission
        assert admission is not None
        bs = self.block_size
        # (comparisons rather than min(): once per step per sequence, the builtin costs more)
        quiet = len(admission.slots) * bs - s.computed  # steps its blocks still take
        if self.naming:
            fills = (admission.registered + 1) * bs - s.computed - 1
            if fills < quiet:
                quiet = fills
        last = s.output_length - s.generated - 1
        if last < quiet:
            quiet = last  # steps before its event step
        if quiet < 1:
            return
        s.parked_at = step
        heapq.heappush(self._events, (step + quiet, s.order, step, s))
        self.count += 1
        self._offset += s.tokens - step
        del self.active[id(s)]

    def wake(self, s: S, step: int) -> None:
        """Bring a parked ``s`` up to the start of ``step`` and make it active again."""
        k = step - s.parked_at
        self.count -= 1
        self._offset -= s.tokens - s.parked_at
        s.computed += k
        s.generated += k
        s.tokens += k
        s.parked_at = -1
        self.active[id(s)] = s

    def leave(self, s: S, step: int) -> None:
        """``s`` leaves the running queue (finished or preempted): up to date, forgotten."""
        if s.parked_at >= 0:
            self.wake(s, step)
        del self.active[id(s)]

    def due(self, step: int) -> list[S]:
        """Wake the sequences whose event is at ``step``; the active ones in queue order."""
        events = self._events
        while events and events[0][0] <= step:
            _, _, parked_at, s = heapq.heappop(events)
            if s.parked_at == parked_at:  # not woken since
                self.wake(s, step)
        return sorted(self.active.values(), key=_ORDER)

    def wake_all(self, step: int) -> None:
        for _, _, parked_at, s in self._events:
            if s.parked_at == parked_at:
                self.wake(s, step)
        self._events.clear()

    def next_event(self) -> int | None:
        """The first step at which a parked sequence needs attention (None: none parked)."""
        events = self._events
        while events and events[0][3].parked_at != events[0][2]:
            heapq.heappop(events)
        return events[0][0] if events else None


_ORDER = attrgetter("order")  # (a sort key in C: no Python call per sequence)
