"""Reading a vLLM-compatible ZMQ event stream: ours (``ZmqPublisher``) or an engine's.

The subscriber checks sequence numbers as Dynamo's indexer does: the first batch it expects is
``start_seq`` (0 by default: everything), and a batch after a gap makes it ask the replay
socket for the missing ones before going on, so what it yields has no holes. Without a replay
endpoint a gap is reported (``gaps``) and reading goes on. A replay that gets no answer (the
publisher died while it answered, or is restarting, or is still rebuilding a long replay from
its log) leaves the gap open: the batch that showed it is dropped, and the next batch asks
again, or, if none comes within the wait, the subscriber asks again by itself (a restarted
publisher that went quiet still fills the gap from its log). Each unanswered ask doubles the
next one's wait, from ``replay_timeout`` up to ``MAX_REPLAY_WAIT``.

A publisher that speaks CurveZMQ is read with its public key (``curve_server_key``: the
``NAME.key`` certificate zmq.auth made with its secret one); ``curve_client_key`` is this
subscriber's own secret certificate, which a publisher that admits only listed subscribers
needs (otherwise a fresh key pair is made for each socket).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

import zmq
import zmq.auth

from kvledger.events.types import AnyEvent
from kvledger.events.vllm_events import decode_batch, to_events

log = logging.getLogger(__name__)

Batch = tuple[float, list[dict[str, Any]], int | None]
END_SEQ_VALUE = (1 << 64) - 1
MAX_REPLAY_WAIT = 60.0
"""The longest a subscriber waits for a replay after unanswered ones (``replay_timeout`` is
the first wait; a longer ``replay_timeout`` is kept as it is)."""


class ZmqSubscriber:
    """Batches of one publisher, in sequence order, with replay of whatever was missed."""

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        start_seq: int = 0,
        replay_timeout: float = 10.0,
        context: zmq.Context[Any] | None = None,
        curve_server_key: str | os.PathLike[str] | None = None,
        curve_client_key: str | os.PathLike[str] | None = None,
    ) -> None:
        if curve_client_key is not None and curve_server_key is None:
            raise ValueError("curve_client_key needs curve_server_key (the publisher's)")
        self._curve = _client_keys(curve_server_key, curve_client_key)
        ctx = context if context is not None else zmq.Context.instance()
        self._ctx = ctx
        self._sub = ctx.socket(zmq.SUB)
        self._secure(self._sub)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self._replay_timeout = replay_timeout
        self._replay_wait = replay_timeout
        """How long the next replay is waited for: doubled after each unanswered one, up to
        ``MAX_REPLAY_WAIT`` (a publisher that rebuilds a long replay from its log, on a busy
        machine, can take longer than ``replay_timeout`` to send the first batch; asking again
        as often would give it the same work again each time and never wait long enough),
        back to ``replay_timeout`` once a replay is answered."""
        self.next_seq = start_seq
        #: (first missing, first seen after) of each gap that could not be replayed
        self.gaps: list[tuple[int, int]] = []
        #: replays asked for and not answered in ``replay_timeout`` (asked again later)
        self.replay_timeouts = 0
        #: the last batch dropped because its gap could not be replayed yet (None: no gap open)
        self._dropped: int | None = None

    def close(self) -> None:
        self._sub.close()

    def _secure(self, sock: zmq.Socket[Any]) -> None:
        if self._curve is not None:
            server, (public, secret) = self._curve
            sock.curve_serverkey = server
            sock.curve_publickey, sock.curve_secretkey = public, secret

    def __enter__(self) -> ZmqSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def batches(self, timeout: float | None = None) -> Iterator[tuple[int, Batch]]:
        """``(seq, (ts, events, dp_rank))`` as they come; stops after ``timeout`` seconds
        without a message (None: never)."""
        poll_ms = None if timeout is None else int(timeout * 1000)
        while True:
            wait = poll_ms
            if self._dropped is not None:  # a gap is open: do not wait past the retry
                retry_ms = int(self._replay_wait * 1000)
                wait = retry_ms if wait is None else min(wait, retry_ms)
            if not self._sub.poll(wait):
                if self._dropped is not None:
                    yield from self._ask_again(self._dropped)
                    if timeout is None:
                        continue
                return
            frames = self._sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                raise ValueError(
                    f"a KV event message is [topic, u64 seq, payload], got {len(frames)} frames"
                )
            seq = int.from_bytes(frames[1], "big")
            if seq < self.next_seq:
                continue  # already had it (from a replay)
            if seq > self.next_seq:
                try:
                    yield from self._fill(self.next_seq, seq)
                except TimeoutError as exc:
                    # the publisher died while it answered (or before), or restarts: the gap
                    # stays open, this batch is dropped, and the next one (or the idle retry)
                    # asks again (a restarted publisher serves it from its log)
                    log.warning("%s; asking again", exc)
                    self.replay_timeouts += 1
                    self._dropped = seq if self._dropped is None else max(self._dropped, seq)
                    continue
                if seq < self.next_seq:
                    continue
            self.next_seq = seq + 1
            if self._dropped is not None and self._dropped < self.next_seq:
                self._dropped = None
            yield seq, decode_batch(frames[2])

    def _ask_again(self, dropped: int) -> Iterator[tuple[int, Batch]]:
        """Replay an open gap with no batch to show it: its publisher went quiet."""
        try:
            yield from self._fill(self.next_seq, dropped + 1)
        except TimeoutError as exc:
            log.warning("%s; asking again", exc)
            self.replay_timeouts += 1
            return
        self._dropped = None

    def replay(self, start: int) -> Iterator[tuple[int, Batch]]:
        """Every batch the publisher can replay from ``start`` on."""
        if self._replay_endpoint is None:
            raise ValueError("this subscriber has no replay endpoint")
        sock = self._ctx.socket(zmq.DEALER)
        self._secure(sock)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self._replay_endpoint)
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                if not sock.poll(int(self._replay_wait * 1000)):
                    waited = self._replay_wait
                    self._replay_wait = min(2 * waited, max(MAX_REPLAY_WAIT, waited))
                    raise TimeoutError(
                        f"no replay answer from {self._replay_endpoint} in {waited:g} s"
                    )
                frames = sock.recv_multipart()
                # [b"", topic, seq, payload]; vLLM's end marker: [b"", b"", -1, b""]
                body = frames[1:] if frames and frames[0] == b"" else frames
                if len(body) != 3:
                    raise ValueError(f"a replayed message has 3 frames, got {len(body)}")
                seq = int.from_bytes(body[1], "big")
                if seq == END_SEQ_VALUE:
                    self._replay_wait = self._replay_timeout
                    return
                yield seq, decode_batch(body[2])
        finally:
            sock.close()

    def _fill(self, missing: int, seen: int) -> Iterator[tuple[int, Batch]]:
        if self._replay_endpoint is None:
            self.gaps.append((missing, seen))
            return
        for seq, batch in self.replay(missing):
            if seq >= self.next_seq:
                self.next_seq = seq + 1
                yield seq, batch
        if self.next_seq < seen:
            self.gaps.append((self.next_seq, seen))

    def events(self, worker_id: int, timeout: float | None = None) -> Iterator[AnyEvent]:
        """The stream as our events, numbered from 0 in the order read (for ``RouterIndex``,
        ``kvledger tail``): a vLLM batch has no per-event ids."""
        next_id = 0
        for _seq, batch in self.batches(timeout):
            converted = to_events(worker_id, next_id, batch)
            next_id += len(converted)
            yield from converted


def _client_keys(
    server: str | os.PathLike[str] | None, client: str | os.PathLike[str] | None
) -> tuple[bytes, tuple[bytes, bytes]] | None:
    """(the publisher's public key, this subscriber's key pair), read from zmq.auth
    certificates, or None without CurveZMQ."""
    if server is None:
        return None
    try:
        server_public, _ = zmq.auth.load_certificate(os.fspath(server))
        if client is None:
            return server_public, zmq.curve_keypair()
        public, secret = zmq.auth.load_certificate(os.fspath(client))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read a CurveZMQ certificate: {exc}") from None
    if secret is None:
        raise ValueError(f"{client} is a public certificate; give the secret one (.key_secret)")
    return server_public, (public, secret)
