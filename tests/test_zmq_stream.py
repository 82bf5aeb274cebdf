"""The ZMQ event stream: vLLM's frames and schema, replay from memory and from the log,
sequence numbers across restarts, counted drops, and our own readers (subscriber, tail,
RouterIndex)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

zmq = pytest.importorskip("zmq", reason="needs pyzmq")
pytest.importorskip("msgspec", reason="decodes like vLLM with msgspec (dev extra)")

import msgspec  # noqa: E402
from vllm_schema import vllm_classes  # noqa: E402

from kvledger import BlockManager, Settings  # noqa: E402
from kvledger.events.log import EventLog  # noqa: E402
from kvledger.events.shared.zmq_process import ZmqPublisherProcess  # noqa: E402
from kvledger.events.shared.zmq_publish import ZmqPublisher  # noqa: E402
from kvledger.events.shared.zmq_subscribe import END_SEQ_VALUE, ZmqSubscriber  # noqa: E402
from kvledger.events.types import Stored, Tier  # noqa: E402
from kvledger.events.vllm_events import VllmStreamError, decode_batch, to_events  # noqa: E402
from kvledger.registry.hashing import TokenBlockSequence  # noqa: E402
from kvledger.registry.index import RouterIndex  # noqa: E402

BLOCK = 4
KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared = vllm_classes()


def _settings(tmp_path: Path, **extra: Any) -> Settings:
    values: dict[str, Any] = {
        "block_size": BLOCK,
        "num_layers": 1,
        "outer_dim": 1,
        "inner_dim": 4,
        "dtype": "float32",
        "g1_blocks": 8,
        "g2_blocks": 8,
        "g3_blocks": 16,
        "offload_filter": "always",
        "data_dir": tmp_path / "data",
        "worker_id": 3,
        "zmq_endpoint": "tcp://127.0.0.1:*",
        "zmq_replay_endpoint": "tcp://127.0.0.1:*",
        "zmq_topic": "kv",
    }
    values.update(extra)
    return Settings.load(**values)


def _serve(mgr: BlockManager, tokens: list[int], **keys: str) -> None:
    seq = mgr.sequence(tokens, **keys)
    held = mgr.onboard(seq)
    held += mgr.register(mgr.allocate(len(seq) - len(held)), seq, start=len(held))
    mgr.release(held)


def _prompts(n: int, blocks: int = 3) -> list[list[int]]:
    return [[100 * i + t for t in range(BLOCK * blocks)] for i in range(n)]


def _publisher(mgr: BlockManager) -> ZmqPublisher | ZmqPublisherProcess:
    publisher = mgr.zmq_publisher
    assert publisher is not None
    return publisher


def _replayed(endpoint: str, start: int) -> list[tuple[bytes, int, bytes]]:
    """Every (topic, seq, payload) a replay socket answers from ``start``, raw."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    out: list[tuple[bytes, int, bytes]] = []
    try:
        while True:
            assert sock.poll(5000), "no replay answer"
            empty, topic, seq, payload = sock.recv_multipart()
            assert empty == b""
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert topic == payload == b""
                return out
            out.append((topic, int.from_bytes(seq, "big"), payload))
    finally:
        sock.close()


@pytest.fixture
def subscriber_factory() -> Iterator[Any]:
    made: list[Any] = []

    def make(endpoint: str, topic: bytes = b"kv") -> Any:
        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, topic)
        sock.connect(endpoint)
        made.append(sock)
        return sock

    yield make
    for sock in made:
        sock.close()


def test_frames_decode_as_vllm_batches_with_tokens_on_every_tier(
    tmp_path: Path, subscriber_factory: Any
) -> None:
    with BlockManager(_settings(tmp_path)) as mgr:
        publisher = _publisher(mgr)
        sub = subscriber_factory(publisher.endpoint)
        sub.poll(300)  # let the subscription reach the publisher
        time.sleep(0.3)
        prompts = _prompts(4)
        for tokens in prompts:
            _serve(mgr, tokens)
        _serve(mgr, prompts[0], lora_name="adapter-a", salt="s1")
        mgr.wait_idle(10)
        assert publisher.wait_sent()
        last = mgr.next_event_id - 1
        frames = []
        while sub.poll(1000):
            frames.append(sub.recv_multipart())
            if int.from_bytes(frames[-1][1], "big") == last:
                break
    assert all(len(f) == 3 and f[0] == b"kv" for f in frames)
    seqs = [int.from_bytes(f[1], "big") for f in frames]
    assert seqs == list(range(seqs[0], last + 1))  # one batch per event, numbered by event id
    batches = [msgspec.msgpack.decode(f[2], type=KVEventBatch) for f in frames]
    stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    media = {e.medium for e in stored}
    assert media == {"GPU", "CPU", "STORAGE"}
    by_block: dict[tuple[str | None, int], list[int]] = {}
    for e in stored:
        assert len(e.token_ids) == BLOCK * len(e.block_hashes)  # tokens on every tier
        for i, h in enumerate(e.block_hashes):
            by_block[(e.medium, h)] = e.token_ids[i * BLOCK : (i + 1) * BLOCK]
    plain = TokenBlockSequence(prompts[1], BLOCK)
    for medium in ("GPU", "CPU", "STORAGE"):
        assert by_block[(medium, plain.sequence_hashes[2])] == prompts[1][2 * BLOCK : 3 * BLOCK]
    lora = TokenBlockSequence(prompts[0], BLOCK, lora_name="adapter-a", salt="s1")
    named = [e for e in stored if e.block_hashes[0] in lora.sequence_hashes]
    assert named and {e.lora_name for e in named} == {"adapter-a"}
    assert all(e.extra_keys == [("adapter-a", "s1")] * len(e.block_hashes) for e in named)
    assert any(isinstance(e, BlockRemoved) for b in batches for e in b.events)  # evictions


@pytest.mark.parametrize("zmq_process", [False, True], ids=["thread", "process"])
def test_replay_reaches_back_through_the_log_and_numbers_continue_after_restart(
    tmp_path: Path, zmq_process: bool
) -> None:
    settings = _settings(tmp_path, zmq_ring_size=4, zmq_process=zmq_process)
    with BlockManager(settings) as mgr:
        for tokens in _prompts(5):
            _serve(mgr, tokens)
        mgr.wait_idle(10)
        publisher = _publisher(mgr)
        assert publisher.wait_sent()
        first_run = _replayed(publisher.replay_endpoint or "", 0)
        first_last = mgr.next_event_id - 1
    # every batch, though the ring holds only the newest 4: the rest came from the log
    assert [seq for _, seq, _ in first_run] == list(range(first_last + 1))
    assert {topic for topic, _, _ in first_run} == {b"kv"}
    with BlockManager(settings) as mgr:  # a restart: Cleared G1 and G2, G3 recovered
        publisher = _publisher(mgr)
        _serve(mgr, _prompts(6)[5])
        mgr.wait_idle(10)
        assert publisher.wait_sent()
        second_run = _replayed(publisher.replay_endpoint or "", 0)
        live_tail = _replayed(publisher.replay_endpoint or "", first_last + 1)
    seqs = [seq for _, seq, _ in second_run]
    assert seqs == list(range(len(seqs))) and seqs[-1] > first_last  # never goes back
    assert second_run[: first_last + 1] == first_run  # the same bytes, live or from the log
    assert live_tail == second_run[first_last + 1 :]
    # the restart's Cleared of G1 and G2 became removals of those tiers' blocks: G3 stays
    restart = [
        e
        for _, _, payload in live_tail
        for e in msgspec.msgpack.decode(payload, type=KVEventBatch).events
    ]
    assert not any(isinstance(e, AllBlocksCleared) for e in restart)
    assert {e.medium for e in restart if isinstance(e, BlockRemoved)} >= {"GPU", "CPU"}


def test_lora_blocks_read_back_from_the_log_go_out_without_tokens(tmp_path: Path) -> None:
    """The log keeps no LoRA names: a LoRA block replayed from it goes out without tokens (a
    router skips it) rather than under the name its tokens have without the LoRA."""
    settings = _settings(tmp_path, g2_blocks=0, g3_blocks=0, zmq_ring_size=1)
    lora_tokens, plain_tokens = [7] * BLOCK * 2, [8] * BLOCK * 2
    with BlockManager(settings) as mgr:
        _serve(mgr, lora_tokens, lora_name="adapter-a")
        _serve(mgr, plain_tokens)
        _serve(mgr, [9] * BLOCK)  # the one batch the ring keeps
        publisher = _publisher(mgr)
        assert publisher.wait_sent()
        replayed = _replayed(publisher.replay_endpoint or "", 0)
    stored = [
        e
        for _, _, payload in replayed[:-1]
        for e in msgspec.msgpack.decode(payload, type=KVEventBatch).events
    ]
    lora = TokenBlockSequence(lora_tokens, BLOCK, lora_name="adapter-a").sequence_hashes
    assert [(e.block_hashes, e.token_ids) for e in stored] == [
        (lora, []),
        (TokenBlockSequence(plain_tokens, BLOCK).sequence_hashes, plain_tokens),
    ]


def test_a_slow_subscriber_costs_counted_drops_that_replay_recovers() -> None:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    ctx = zmq.Context.instance()
    publisher = ZmqPublisher(
        "inproc://kvledger-slow",
        replay_endpoint="inproc://kvledger-slow-replay",
        worker_id=1,
        block_size=BLOCK,
        hwm=1,
        collector=registry,
        context=ctx,
    )
    slow = ctx.socket(zmq.SUB)
    slow.setsockopt(zmq.RCVHWM, 1)
    slow.setsockopt(zmq.SUBSCRIBE, b"")
    slow.connect("inproc://kvledger-slow")
    try:
        time.sleep(0.2)
        n = 500
        for i in range(n):
            publisher(
                Stored(
                    event_id=i,
                    worker_id=1,
                    dp_rank=0,
                    tier=Tier.G1,
                    ts=float(i),
                    parent_hash=None,
                    blocks=((i + 1, i + 1),),
                    token_ids=((1, 2, 3, 4),),
                )
            )
        assert publisher.wait_sent()
        assert publisher.dropped > 0  # the engine did not wait for the slow reader
        assert registry.get_sample_value("kvledger_zmq_dropped_messages_total") == (
            publisher.dropped
        )
        reader = ZmqSubscriber(
            "inproc://kvledger-slow", replay_endpoint="inproc://kvledger-slow-replay"
        )
        with reader:
            seqs = [seq for seq, _ in reader.replay(0)]
        assert seqs == list(range(n))
    finally:
        slow.close()
        publisher.close()


def _empty_batch(seq: int) -> list[bytes]:
    """A publisher's frames for batch ``seq`` (no events)."""
    return [b"kv", seq.to_bytes(8, "big"), msgpack.packb([float(seq), [], None])]


def _answer_replay(replies: Any, ident: bytes, first: int) -> None:
    """Replay batches ``first``..5 and the end marker to the subscriber ``ident``."""
    for seq in range(first, 6):
        replies.send_multipart([ident, b"", *_empty_batch(seq)])
    replies.send_multipart([ident, b"", b"", END_SEQ_VALUE.to_bytes(8, "big"), b""])


def _read_past_a_gap(
    name: str, replay_timeout: float, answer: Callable[[Any], None]
) -> tuple[list[int], ZmqSubscriber]:
    """A publisher on ``inproc://name`` sends batches 0, 1 and 5, then goes quiet; ``answer``
    serves its replay socket from a thread. The batches a subscriber read, and the subscriber."""
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"inproc://{name}")
    replies = ctx.socket(zmq.ROUTER)
    replies.bind(f"inproc://{name}-replay")
    thread = threading.Thread(target=answer, args=(replies,), daemon=True)
    thread.start()
    sub = ZmqSubscriber(
        f"inproc://{name}",
        replay_endpoint=f"inproc://{name}-replay",
        replay_timeout=replay_timeout,
    )
    try:
        with sub:
            time.sleep(0.2)  # the subscription reaches the publisher
            for seq in (0, 1, 5):
                pub.send_multipart(_empty_batch(seq))
            seen = [seq for seq, _ in sub.batches(timeout=2.0)]
    finally:
        thread.join(10)
        pub.close()
        replies.close()
    return seen, sub


def test_a_gap_whose_replay_went_unanswered_is_asked_again_when_the_stream_goes_quiet() -> None:
    """A restarted publisher sends one batch and then nothing: the subscriber's first replay
    request gets no answer (as from a publisher killed while it answered), and no later batch
    comes to show the gap again. The subscriber asks again by itself and reads every batch."""
    asked: list[int] = []

    def answer(replies: Any) -> None:
        for attempt in range(2):  # the first request goes unanswered
            if not replies.poll(5000):
                return
            ident, _, start = replies.recv_multipart()
            asked.append(int.from_bytes(start, "big"))
            if attempt == 1:
                _answer_replay(replies, ident, asked[-1])

    seen, sub = _read_past_a_gap("kvledger-quiet", 0.3, answer)
    assert seen == [0, 1, 2, 3, 4, 5]
    assert asked == [2, 2] and sub.replay_timeouts == 1 and not sub.gaps


def test_a_replay_slower_than_the_timeout_is_waited_for_longer_each_time() -> None:
    """A publisher that takes 1.5x ``replay_timeout`` to answer every replay (one rebuilding a
    long replay from its log on a busy machine): asked as often as the timeout, it would never
    be waited for long enough. The second ask waits twice as long and gets the batches."""
    asked: list[int] = []
    delay = 0.45

    def answer(replies: Any) -> None:
        due: list[tuple[float, bytes, int]] = []  # each request answered `delay` after it came
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            wait = 50 if not due else max(0, int((due[0][0] - time.monotonic()) * 1000))
            if replies.poll(wait):
                ident, _, start = replies.recv_multipart()
                asked.append(int.from_bytes(start, "big"))
                due.append((time.monotonic() + delay, ident, asked[-1]))
            while due and due[0][0] <= time.monotonic():
                _, ident, first = due.pop(0)
                _answer_replay(replies, ident, first)

    seen, sub = _read_past_a_gap("kvledger-slow", 0.3, answer)
    assert seen == [0, 1, 2, 3, 4, 5]
    assert asked == [2, 2] and sub.replay_timeouts == 1 and not sub.gaps


def test_router_index_and_tail_read_the_stream(tmp_path: Path) -> None:
    with BlockManager(_settings(tmp_path, g2_blocks=0, g3_blocks=0, g1_blocks=32)) as mgr:
        prompts = _prompts(3)
        for tokens in prompts:
            _serve(mgr, tokens)
        publisher = _publisher(mgr)
        assert publisher.wait_sent()
        with ZmqSubscriber(
            publisher.endpoint, replay_endpoint=publisher.replay_endpoint, topic="kv"
        ) as reader:
            events = []
            next_id = 0
            for _seq, batch in reader.replay(0):
                converted = to_events(3, next_id, batch)
                next_id += len(converted)
                events += converted
        index = RouterIndex.from_events(events)
        for tokens in prompts:
            seq = TokenBlockSequence(tokens, BLOCK)
            depths = index.find_matches(seq.local_hashes, kind="local")
            assert depths[(3, 0)][Tier.G1] == mgr.match(seq).g1 == 3
        tail = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvledger.cli",
                "tail",
                "--zmq",
                publisher.endpoint,
                "--zmq-replay",
                publisher.replay_endpoint or "",
                "--zmq-topic",
                "kv",
                "--worker-id",
                "3",
                "--no-follow",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert tail.returncode == 0, tail.stderr
    lines = tail.stdout.splitlines()
    assert len(lines) == 3 and all(" w3#" in line and "stored 3" in line for line in lines)


def test_bad_input_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(VllmStreamError, match="not msgpack"):
        decode_batch(b"\xc1")
    with pytest.raises(VllmStreamError, match=r"\[ts, events, dp_rank\]"):
        decode_batch(msgpack.packb({"ts": 1}))
    bad_medium = msgpack.packb(
        [1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": "TAPE"}], 0]
    )
    with pytest.raises(VllmStreamError, match="unknown medium 'TAPE'"):
        to_events(0, 0, decode_batch(bad_medium))
    with pytest.raises(ValueError, match="zmq_replay_endpoint needs zmq_endpoint"):
        Settings.load(zmq_replay_endpoint="tcp://127.0.0.1:*")
    with pytest.raises(ValueError, match="cannot bind the ZMQ publisher"):
        ZmqPublisher("nonsense://x", worker_id=0, block_size=BLOCK)


def test_a_publisher_process_refuses_what_it_cannot_serve_in_one_line(tmp_path: Path) -> None:
    with EventLog(str(tmp_path / "w.db")) as log:
        with pytest.raises(ValueError, match="cannot bind the ZMQ publisher"):
            ZmqPublisherProcess("tcp://no-such-host:*", log=log, worker_id=0, block_size=BLOCK)
        event = Stored(
            event_id=0, worker_id=0, dp_rank=0, tier=Tier.G1, ts=1.0, parent_hash=None,
            blocks=((7, 8),),
        )  # fmt: skip
        log.append(event)  # the log still works
        log.flush()
        assert log.last_event_id(0) == 0


_KILLED_PARENT = """
import sys
from kvledger.events.log import EventLog
from kvledger.events.shared.zmq_process import ZmqPublisherProcess
from kvledger.events.types import Stored, Tier
log = EventLog(sys.argv[1])
publisher = ZmqPublisherProcess("tcp://127.0.0.1:*", log=log, worker_id=0, block_size=4)
print(publisher.pid, flush=True)
i = 0
while True:  # an engine at work: the child is handed batches until the kill
    log.append(Stored(event_id=i, worker_id=0, dp_rank=0, tier=Tier.G1, ts=1.0,
                      parent_hash=None, blocks=((2 * i + 1, 2 * i + 2),)))
    i += 1
"""


def test_a_publisher_process_ends_with_its_parent_killed(tmp_path: Path) -> None:
    """SIGKILL of the engine's process closes the pipe: the child sends what it was given and
    exits, so a restart can bind the endpoint (``test_shared_kill`` restarts at once), and it
    prints no traceback for the parent it can no longer tell (the stderr it shares with it)."""
    parent = subprocess.Popen(
        [sys.executable, "-c", _KILLED_PARENT, str(tmp_path / "w.db")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None and parent.stderr is not None
    child = int(parent.stdout.readline())
    time.sleep(0.5)  # batches flow to the child
    parent.kill()
    parent.wait()
    _wait_gone(child)
    said = parent.stderr.read()  # the child's end is closed once it has exited
    assert "Traceback" not in said and "BrokenPipeError" not in said, said
    with EventLog(str(tmp_path / "w.db")) as log:
        assert log.last_event_id(0) > 0  # the parent was killed while appending


def _wait_gone(pid: int) -> None:
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and b"Z" not in _state(pid):
        assert time.monotonic() < deadline, f"process {pid} is still running"
        time.sleep(0.05)


def _state(pid: int) -> bytes:
    """The process's state letter (Z: exited, waiting to be reaped by init)."""
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return b"Z"


def test_a_dead_publisher_process_is_reported_and_the_engine_goes_on(tmp_path: Path) -> None:
    log = EventLog(str(tmp_path / "w.db"))
    publisher = ZmqPublisherProcess("tcp://127.0.0.1:*", log=log, worker_id=0, block_size=BLOCK)
    try:
        os.kill(publisher.pid, signal.SIGKILL)  # the child crashed, or an operator killed it
        _wait_gone(publisher.pid)
        for event_id in range(3):
            log.append(
                Stored(
                    event_id=event_id, worker_id=0, dp_rank=0, tier=Tier.G1, ts=1.0,
                    parent_hash=None, blocks=((7 + event_id, 8),),
                )
            )  # fmt: skip
        assert not publisher.wait_sent(5)  # nothing can be sent: said, not waited on forever
        assert publisher.error is not None
        log.flush()
        assert log.last_event_id(0) == 2  # the log, and so the engine, went on
    finally:
        publisher.close(timeout=5)
        log.close()
