"""A one-line progress bar for long commands (simulate, sweep, replay)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO


class Progress:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal, so piped or
    logged output stays clean. Calls closer than 0.1 s apart are dropped (except the last), so
    callers may report as often as they like."""

    def __init__(
        self, total: int, label: str, unit: str = "requests", stream: TextIO | None = None
    ) -> None:
        self.total = max(total, 1)
        self.label = label
        self.unit = unit
        self.stream = sys.stderr if stream is None else stream  # the stderr of now, not of import
        self.enabled = self.stream.isatty()
        self._last = 0.0
        self.listeners: list[Callable[[int], None]] = []

    def __call__(self, done: int) -> None:
        now = time.monotonic()
        if now - self._last < 0.1 and done < self.total:
            return
        self._last = now
        for listener in self.listeners:
            listener(done)
        if self.enabled:
            width = 30
            filled = width * min(done, self.total) // self.total
            bar = "#" * filled + "." * (width - filled)
            self.stream.write(f"\r{self.label} [{bar}] {done}/{self.total} {self.unit}")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._last:  # end the line only if a bar was drawn on it
            self.stream.write("\n")
            self.stream.flush()
