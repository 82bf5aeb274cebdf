"""``kv_connector_extra_config`` mistakes, through vLLM's own scheduler and connector (runs in
the vLLM test venv): each is refused at start-up in one line naming the key and the value,
before anything is created, never coerced (``true`` is not a size) or ignored (``arc``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tests.kvledger.test_kvledger_offloading_e2e import PAGE, Engine

from kvledger.config import SettingsError

KEY = "kv_connector_extra_config"


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"cpu_bytes_to_use": "abc"}, "cpu_bytes_to_use: must be a whole number"),
        ({"cpu_bytes_to_use": "8e9"}, "cpu_bytes_to_use: must be a whole number"),
        ({"cpu_bytes_to_use": 8e9}, "cpu_bytes_to_use: must be a whole number written as one"),
        ({"cpu_bytes_to_use": float("inf")}, "cpu_bytes_to_use: must be a whole number"),
        ({"cpu_bytes_to_use": float("nan")}, "cpu_bytes_to_use: must be a whole number"),
        ({"cpu_bytes_to_use": [64 * PAGE]}, "cpu_bytes_to_use: must be a whole number"),
        ({"cpu_bytes_to_use": True}, "cpu_bytes_to_use: must be a whole number"),
        ({"cpu_bytes_to_use": 100}, "cpu_bytes_to_use 100 holds no chunk"),
        ({"store_threshold": "x"}, "store_threshold: must be a whole number"),
        ({"store_threshold": -2}, "store_threshold: Input should be greater than or equal to 0"),
        ({"max_tracker_size": -5}, "max_tracker_size: Input should be greater than 0"),
        ({"eviction_policy": "arc"}, "eviction_policy: kvledger keeps G2 in LRU order"),
        ({"offload_filter": "always"}, "offload_filter only applies to a G3: set g3_blocks"),
        ({"g3_blocks": -5}, "g3_blocks: Input should be greater than or equal to 0"),
        ({"worker_id": 1.5}, "worker_id: must be a whole number"),
        ({"cpu_bytes": 64 * PAGE}, "'cpu_bytes' is not a key kvledger reads; did you mean"),
    ],
)
def test_a_bad_key_is_refused_in_one_line_naming_it(
    tmp_path: Path, extra: dict[str, Any], named: str
) -> None:
    log = tmp_path / "run.db"
    with pytest.raises(SettingsError) as caught:
        Engine(f"sqlite:///{log}", **extra)
    message = str(caught.value)
    assert len(message.splitlines()) == 1, message
    assert KEY in message and named in message, message
    assert not log.exists()


@pytest.mark.parametrize(
    ("log_url", "named"),
    [
        ("mysql://u:pw@127.0.0.1/x", "log_url: mysql://u:***@127.0.0.1/x: the mysql driver"),
        ("nosuch://x", "log_url: nosuch://x: SQLAlchemy knows no database 'nosuch'"),
    ],
)
def test_a_bad_log_url_is_refused_naming_it(log_url: str, named: str) -> None:
    with pytest.raises(SettingsError) as caught:
        Engine(log_url)
    message = str(caught.value)
    assert len(message.splitlines()) == 1 and named in message, message
    assert "pw" not in message


def test_vllms_own_keys_pass_and_good_ones_are_taken(tmp_path: Path) -> None:
    engine = Engine(
        f"sqlite:///{tmp_path / 'ok.db'}",
        store_threshold=2,
        max_tracker_size=10,
        eviction_policy="lru",
        offload_prompt_only=True,
        self_describing_kv_events=False,
    )
    try:
        assert engine.manager.store_threshold == 2
        assert engine.manager.max_tracker_size == 10
    finally:
        engine.manager.shutdown()
        engine.kvledger_worker.shutdown()
