"""Routers reading the shared registry's event stream with a consumer group.

Several router replicas can share one group (each entry goes to one of them) or use one group
each (each sees every entry). An entry is acknowledged only after its event was applied, so a
router that dies mid-batch gets the unacknowledged entries again (``claim_pending``); applying an
event twice is harmless because consumers skip ids they have already applied.

A namespace split over several shards has one stream per shard, and each worker's events (and
its purge notice) go to its home shard's stream, so order per worker holds; a subscriber reads
every shard's stream, each with its own group of the same name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis

from kvledger.events import codec
from kvledger.events.shared.registry import SharedRegistry
from kvledger.events.types import AnyEvent, Baseline, Lookup, Released, RunInfo
from kvledger.events.wire import WireFormatError, decode_baseline, unpack_stream_entry


class StreamSubscriber:
    """Feeds ``on_event`` from the stream, ``on_purge(worker_id)`` when a worker's entries
    were dropped (its lease lapsed, it left, or they are being replaced), and
    ``on_baseline(baseline)`` with a worker's whole holding on a tier when they were replaced
    by its log's fold (``RouterIndex`` has all three: ``apply``, ``remove_worker``,
    ``apply_baseline``)."""

    def __init__(
        self,
        registry: SharedRegistry,
        group: str,
        consumer: str,
        *,
        on_event: Callable[[AnyEvent], object],
        on_purge: Callable[[int], object],
        on_baseline: Callable[[Baseline], object],
        start_id: str = "0",
    ) -> None:
        self.client = registry.client
        self.streams = list(registry.stream_keys)
        self.group = group
        self.consumer = consumer
        self.on_event = on_event
        self.on_purge = on_purge
        self.on_baseline = on_baseline
        self.start_id = start_id
        self._next_blocking = 0
        for stream in self.streams:
            self._ensure_group(stream)

    def _ensure_group(self, stream: str) -> None:
        try:
            self.client.xgroup_create(stream, self.group, id=self.start_id, mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def poll(self, count: int = 1000, block_ms: int | None = None) -> int:
        """Apply and acknowledge up to ``count`` new entries per stream; returns how many
        entries were handled (each holds one apply call's events, a purge notice, or a
        baseline). With several streams, ``block_ms`` waits on one of them (in turn) only when
        none had anything."""
        handled = sum(self._read(stream, count, None) for stream in self.streams)
        if handled or block_ms is None:
            return handled
        stream = self.streams[self._next_blocking % len(self.streams)]
        self._next_blocking += 1
        return self._read(stream, count, block_ms)

    def _read(self, stream: str, count: int, block_ms: int | None) -> int:
        try:
            reply = self.client.xreadgroup(
                self.group, self.consumer, {stream: ">"}, count=count, block=block_ms
            )
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self._ensure_group(stream)  # the stream was flushed away; start over on the new one
            return 0
        return self._handle(reply)

    def claim_pending(self, min_idle_ms: int = 0, count: int = 1000) -> int:
        """Take over entries another consumer of the group read but never acknowledged."""
        handled = 0
        for stream in self.streams:
            _next, entries, *_ = self.client.xautoclaim(
                stream, self.group, self.consumer, min_idle_ms, start_id="0-0", count=count
            )
            handled += self._handle([[stream, entries]])
        return handled

    def _handle(self, reply: Any) -> int:
        handled = 0
        for stream, entries in reply or ():
            ids: list[bytes] = []
            for entry_id, fields in entries:
                if b"e" in fields:
                    for event in decode_stream_entry(fields[b"e"]):
                        self.on_event(event)
                elif b"r" in fields:  # one event an entry, as earlier versions wrote
                    self.on_event(decode_stream_record(fields[b"r"]))
                elif b"b" in fields:
                    self.on_baseline(decode_baseline(fields[b"b"]))
                elif b"purged" in fields:
                    self.on_purge(int(fields[b"w"]))
                ids.append(entry_id)
            if ids:
                self.client.xack(stream, self.group, *ids)
                handled += len(ids)
        return handled


def decode_stream_entry(entry: bytes) -> list[AnyEvent]:
    """The events of one apply call's stream entry (``wire.pack_stream_entry``), in id order."""
    try:
        records = unpack_stream_entry(entry)
    except WireFormatError as exc:
        raise codec.CodecError(str(exc)) from None
    return [decode_stream_record(record) for record in records]


def decode_stream_record(record: bytes) -> AnyEvent:
    """An event of the shared registry's stream: its durable-log record (``codec.decode``
    checks its checksum)."""
    event = codec.decode(record)
    if isinstance(event, Lookup | Released | RunInfo):
        raise codec.CodecError(f"the stream carries transitions only, got {event!r}")
    return event
