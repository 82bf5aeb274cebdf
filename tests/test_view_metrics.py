"""``kvbm_view_behind_events``: how far the views outside the process (the shared registry in
Redis, the ZMQ stream) are behind the worker's log, read off the publishers at every scrape.

A private ``redis-server`` is stopped (SIGSTOP) while the worker goes on committing: the
registry's gauge counts exactly the events committed meanwhile, the ZMQ stream's stays at 0,
and once Redis runs again both read 0.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
import uuid
from pathlib import Path

import pytest
from event_streams import prompt_pool, worker_events
from services import free_port, start_redis, wait_until

from kvledger.builder import open_worker
from kvledger.config import Settings
from kvledger.metrics import Metrics

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]
WORKER = 3


@pytest.mark.parametrize("zmq_process", [True, False], ids=["zmq-child", "zmq-thread"])
def test_the_gauges_count_what_each_view_lacks_of_the_log(
    tmp_path: Path, zmq_process: bool
) -> None:
    port = free_port()
    server = start_redis(port, tmp_path)
    settings = Settings.load(
        worker_id=WORKER,
        event_log_url=f"sqlite:///{tmp_path / 'events.db'}",
        redis_url=f"redis://127.0.0.1:{port}/0",
        redis_namespace=f"behind-{uuid.uuid4().hex[:8]}",
        zmq_endpoint="tcp://127.0.0.1:0",
        zmq_process=zmq_process,
    )
    metrics = Metrics(bytes_per_block=settings.bytes_per_block)
    worker = open_worker(settings, metrics=metrics)

    def behind(view: str) -> float | None:
        return metrics.collector.get_sample_value("kvbm_view_behind_events", {"view": view})

    try:
        assert worker.event_log is not None and worker.publisher is not None
        assert worker.zmq is not None
        events = worker_events(1, WORKER, 300, prompt_pool(1))
        worker.event_log.append_many(events[:100])
        worker.event_log.flush()
        wait_until(lambda: behind("redis") == 0 and behind("zmq") == 0, "the views caught up")
        assert worker.publisher.applied_id == events[99].event_id

        os.kill(server.pid, signal.SIGSTOP)  # Redis stalls: the registry falls behind
        try:
            worker.event_log.append_many(events[100:])
            worker.event_log.flush()
            wait_until(lambda: behind("zmq") == 0, "the ZMQ stream kept up")
            time.sleep(0.5)  # the registry gets none of it meanwhile
            assert behind("redis") == len(events) - 100
        finally:
            os.kill(server.pid, signal.SIGCONT)
        wait_until(lambda: behind("redis") == 0, "the registry caught up once Redis ran again")
        assert worker.publisher.applied_id == events[-1].event_id
    finally:
        worker.close(drain_timeout=5)
        server.kill()
        server.wait()
