"""A worker's ZMQ publisher whose sockets live in a child interpreter.

Why a process: one event is one ZMQ batch of three frames, and pyzmq gives the interpreter up
for every frame it sends. Beside an engine thread that runs Python without pause, each of those
45k sends a second at 15k events/s waits for the interpreter to come back, and a publisher
thread fell more than a second behind the log (``bench/zmq_bench.py --emit-only``), even at a
0.1 ms switch interval. Mapping events to vLLM batches holds the interpreter without giving it
up, so it stays in the engine's process, on the engine's own event objects, exactly as the
thread maps them (``BatchMapper``): the log's writer only queues each committed batch, and a
feeder thread maps it and hands the batches to the child in one pipe write (a slow child never
holds up a commit). The child sends them, keeps the ring, and serves replays, reading the log
(opened read-only by its URL, which travels through the pipe with the other settings, never on
a command line) for anything older than its ring.

When the parent dies (even by SIGKILL) the pipe closes, and the child sends what it was given
(all of it committed) and exits; a restart's child that finds the endpoint still bound by it
tries again for a few seconds.

Frames on the child's stdin: a 4-byte big-endian length, then a kind byte and its body:
``C`` the settings (JSON, first), ``B`` batches (msgpack list of (sequence number, payload,
payload for replay)), ``W`` a marker (u64) the child answers once everything before it was
sent. The child answers with JSON lines on stdout: ``ready`` (the bound endpoints) or
``error``, then ``sent`` for each marker and the counters whenever they change.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import IO, Any

import msgpack
import zmq

from kvledger.events.log import Committed, EventLog
from kvledger.events.shared.zmq_publish import (
    BatchMapper,
    Mapped,
    TokenIds,
    ZmqPublisher,
    dropped_counter,
)
from kvledger.events.types import AnyEvent

log = logging.getLogger(__name__)

_HEADER = struct.Struct(">I")
START_TIMEOUT_S = 60.0
"""How long the parent waits for the child to open the log and bind its sockets."""
REPORT_EVERY_S = 0.2
"""How often the child tells the parent its counters when they changed."""
REBIND_FOR_S = 10.0
"""How long a child keeps trying an endpoint still bound (by the child of a killed worker)."""


class ZmqPublisherProcess:
    """``ZmqPublisher``'s surface (``endpoint``, ``replay_endpoint``, ``curve_public_key``, the
    counters, ``wait_sent``, ``close``) for a publisher that runs in a child interpreter.

    ``log`` is the worker's durable log; the child opens it read-only by its URL. ``options``
    are ``ZmqPublisher``'s keyword arguments (``replay_endpoint``, ``topic``, ``ring_size``,
    ``token_ids``, the CurveZMQ files, ...). Raises ``ValueError`` when the child cannot bind
    its sockets or open the log, naming why.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        log: EventLog,
        worker_id: int,
        block_size: int,
        dp_rank: int = 0,
        token_ids: TokenIds = "keep",
        collector: object | None = None,
        **options: Any,
    ) -> None:
        self.worker_id = worker_id
        self.published = 0
        self.dropped = 0
        self.last_seen_id = -1
        """The newest committed event handed to this publisher."""
        self.sent_id = -1
        """The newest event the child sent or dropped, or the parent skipped (in the seed)."""
        self.replays_abandoned = 0
        self.error: BaseException | None = None
        """Set when the child died or stopped reading (its events stay in the log)."""
        self._log: EventLog | None = log
        self._dropped_metric = dropped_counter(collector)
        self._mapper = BatchMapper(block_size, dp_rank, token_ids)
        self._queue: deque[AnyEvent | bytes] = deque()  # events to map, and frames
        self._wake = threading.Event()
        self._closing = False
        self._markers: dict[int, threading.Event] = {}
        self._next_marker = 0
        self._lock = threading.Lock()
        # subscribe first, then fold what is committed: an event committed in between is
        # both folded and handed over, and skipped by its id
        log.on_commit(self._committed, worker_id=worker_id)
        try:
            self._mapper.seed_from(log, worker_id)
        except BaseException:
            log.off_commit(self._committed)
            raise
        self._child = subprocess.Popen(
            [sys.executable, "-m", __name__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        try:
            options.update(block_size=block_size, dp_rank=dp_rank, token_ids=token_ids)
            ready = self._start(endpoint, log, worker_id, options)
        except BaseException:
            log.off_commit(self._committed)
            self._log = None
            with contextlib.suppress(OSError):
                self._child.kill()
            self._child.wait()
            raise
        self.endpoint: str = ready["endpoint"]
        self.replay_endpoint: str | None = ready["replay_endpoint"]
        key = ready["curve_public_key"]
        self.curve_public_key: bytes | None = None if key is None else key.encode()
        self._feeder = threading.Thread(target=self._feed, name="kvledger-zmq-feeder", daemon=True)
        self._reader = threading.Thread(target=self._read, name="kvledger-zmq-reader", daemon=True)
        self._feeder.start()
        self._reader.start()

    def _start(
        self, endpoint: str, log: EventLog, worker_id: int, options: dict[str, Any]
    ) -> dict[str, Any]:
        assert self._child.stdin is not None and self._child.stdout is not None
        settings = {
            "endpoint": endpoint,
            "log_url": log.url,
            "worker_id": worker_id,
            **{k: os.fspath(v) if isinstance(v, os.PathLike) else v for k, v in options.items()},
        }
        _write_frame(self._child.stdin, b"C" + json.dumps(settings).encode())
        self._child.stdin.flush()
        line = _read_line(self._child.stdout, START_TIMEOUT_S)
        if line is None:
            raise ValueError(
                f"the ZMQ publisher's process exited before it was ready "
                f"(status {self._child.poll()}); its messages are above"
            )
        said: dict[str, Any] = json.loads(line)
        if "error" in said:
            raise ValueError(said["error"])
        ready: dict[str, Any] = said["ready"]
        return ready

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self._child.pid

    # -- the log's writer: never blocks ------------------------------------------------------

    def _committed(self, batch: Sequence[Committed]) -> None:
        self._queue.extend(event for event, _record in batch)
        if batch:
            self.last_seen_id = batch[-1][0].event_id
        self._wake.set()

    @property
    def behind(self) -> int:
        """Events committed to the worker's log that the child has not sent (or dropped)
        yet (``kvbm_view_behind_events{view="zmq"}``)."""
        return max(0, self.last_seen_id - self.sent_id)

    # -- the parent's threads -------------------------------------------------------------------

    def _feed(self) -> None:
        stdin = self._child.stdin
        assert stdin is not None
        queue, mapped = self._queue, self._mapper.mapped
        try:
            while True:
                batches: list[Mapped] = []
                while queue:
                    item = queue.popleft()
                    if type(item) is bytes:  # a marker: what came before it goes first
                        if batches:
                            _write_frame(stdin, b"B" + msgpack.packb(batches))
                            batches = []
                        _write_frame(stdin, item)
                    elif (one := mapped(item)) is not None:  # type: ignore[arg-type]
                        batches.append(one)
                    else:  # in the seed already: nothing to send
                        with self._lock:  # (the reader raises it too)
                            self.sent_id = max(self.sent_id, item.event_id)  # type: ignore[union-attr]
                if batches:
                    _write_frame(stdin, b"B" + msgpack.packb(batches))
                stdin.flush()
                if self._closing and not queue:
                    return
                self._wake.wait(0.5)
                self._wake.clear()
        except (BrokenPipeError, ValueError, OSError) as exc:  # the child is gone
            self._fail(exc)
        finally:
            with contextlib.suppress(OSError, ValueError):
                stdin.close()

    def _read(self) -> None:
        stdout = self._child.stdout
        assert stdout is not None
        for line in stdout:
            said = json.loads(line)
            with self._lock:
                self.published = said.get("published", self.published)
                dropped = said.get("dropped", self.dropped)
                if self._dropped_metric is not None and dropped > self.dropped:
                    self._dropped_metric.inc(dropped - self.dropped)
                self.dropped = dropped
                self.replays_abandoned = said.get("replays_abandoned", self.replays_abandoned)
                self.sent_id = max(self.sent_id, said.get("sent_id", -1))
                marker = self._markers.pop(said["sent"], None) if "sent" in said else None
            if marker is not None:
                marker.set()
        if not self._closing:
            self._fail(RuntimeError(f"exited with status {self._child.wait()}"))

    def _fail(self, exc: BaseException) -> None:
        if self.error is None and not self._closing:
            self.error = exc
            log.error(
                "worker %d: the ZMQ publisher's process stopped (%s); events stay in the log, "
                "and routers catch up by replay once a worker publishes again",
                self.worker_id,
                exc,
            )
        with self._lock:  # whoever waits for a marker learns it now, not at its timeout
            waiting, self._markers = list(self._markers.values()), {}
        for marker in waiting:
            marker.set()

    # -- the engine's side ----------------------------------------------------------------

    def wait_sent(self, timeout: float = 5.0) -> bool:
        """Wait until every event appended to the log so far was sent (or dropped); False on
        timeout or when the child is gone."""
        if self._log is not None:
            self._log.flush()
        if self.error is not None:
            return False
        done = threading.Event()
        with self._lock:
            marker = self._next_marker
            self._next_marker += 1
            self._markers[marker] = done
        self._queue.append(b"W" + marker.to_bytes(8, "big"))
        self._wake.set()
        return done.wait(timeout) and self.error is None

    def close(self, timeout: float = 5.0) -> None:
        """Hand the child what is queued, let it send it and exit (killed past ``timeout``)."""
        if self._log is not None:
            self._log.off_commit(self._committed)
            self._log = None
        self._closing = True
        self._wake.set()
        self._feeder.join(timeout)
        try:
            self._child.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("ZMQ publisher's process did not finish within %.1f s", timeout)
            self._child.kill()
            self._child.wait()
        self._reader.join(timeout)

    def __enter__(self) -> ZmqPublisherProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _write_frame(out: IO[bytes], frame: bytes) -> None:
    out.write(_HEADER.pack(len(frame)))
    out.write(frame)


def _read_frame(inp: IO[bytes]) -> bytes | None:
    header = inp.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    frame = inp.read(size)
    return frame if len(frame) == size else None


def _read_line(out: IO[bytes], timeout: float) -> bytes | None:
    """The child's first line, or None when it exits first (a hung child is killed)."""
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(out.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if reader.is_alive():
        raise ValueError(f"the ZMQ publisher's process was not ready within {timeout:.0f} s")
    return got[0] if got and got[0] else None


# -- the child ---------------------------------------------------------------------------------


def _open(settings: dict[str, Any], opened: EventLog) -> ZmqPublisher:
    """The publisher, trying an endpoint still bound (a killed worker's child that is sending
    its last batches) again for a while."""
    deadline = time.monotonic() + REBIND_FOR_S
    while True:
        try:
            return ZmqPublisher(**settings, log=opened, subscribe=False)
        except ValueError as exc:
            cause = exc.__context__
            in_use = isinstance(cause, zmq.ZMQError) and cause.errno == zmq.EADDRINUSE
            if not in_use or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def child_main() -> int:
    """Run a publisher for the parent on the other end of stdin/stdout."""
    inp, out = sys.stdin.buffer, sys.stdout
    # the main thread and the reporter's: a report reads the counters and says them in one
    # hold, so the parent never gets an older count after a newer one
    saying = threading.RLock()

    def say(message: dict[str, Any]) -> None:
        with saying:
            try:
                out.write(json.dumps(message) + "\n")
                out.flush()
            except BrokenPipeError:  # the parent is gone (killed): nobody is left to tell, and
                # the interpreter's last flush at exit must not fail on it either
                os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())

    first = _read_frame(inp)
    if first is None or first[:1] != b"C":
        say({"error": "the ZMQ publisher's process got no settings"})
        return 2
    settings = json.loads(first[1:])
    try:
        opened = EventLog(settings.pop("log_url"), read_only=True)
    except Exception as exc:
        say({"error": f"the ZMQ publisher's process cannot open the log: {exc}"})
        return 1
    try:
        publisher = _open(settings, opened)
    except (ValueError, OSError) as exc:
        say({"error": str(exc)})
        opened.close()
        return 1
    say(
        {
            "ready": {
                "endpoint": publisher.endpoint,
                "replay_endpoint": publisher.replay_endpoint,
                "curve_public_key": None
                if publisher.curve_public_key is None
                else publisher.curve_public_key.decode(),
            }
        }
    )
    counters = (0, 0, 0, -1)

    def report(extra: dict[str, Any] | None = None) -> None:
        nonlocal counters
        with saying:
            now = (
                publisher.published,
                publisher.dropped,
                publisher.replays_abandoned,
                publisher.sent_id,
            )
            if now != counters or extra:
                counters = now
                published, dropped, abandoned, sent_id = now
                say(
                    {
                        "published": published,
                        "dropped": dropped,
                        "replays_abandoned": abandoned,
                        "sent_id": sent_id,
                        **(extra or {}),
                    }
                )

    done = threading.Event()

    def report_while_running() -> None:
        """The sender thread sends after a frame's ``report``: its progress (``sent_id``, the
        parent's ``behind``) reaches the parent this way, also when no frame follows."""
        while not done.wait(REPORT_EVERY_S):
            report()

    reporter = threading.Thread(target=report_while_running, name="kvledger-zmq-reporter")
    reporter.start()
    try:
        while (frame := _read_frame(inp)) is not None:
            kind, body = frame[:1], frame[1:]
            if kind == b"B":
                publisher.send_mapped(map(tuple, msgpack.unpackb(body)))
                report()
            elif kind == b"W":
                publisher.wait_sent(60)
                report({"sent": int.from_bytes(body, "big")})
    finally:
        done.set()
        reporter.join()
        publisher.close()  # sends what it was given: all of it is committed
        report()
        opened.close()
    return 0


if __name__ == "__main__":
    sys.exit(child_main())
