"""The engines' extra configs, checked with the machinery of ``Settings``: one rule per key,
one line per mistake naming the key and the value, nothing coerced, nothing ignored. (The
same mistakes through vLLM's and SGLang's own code run in their test venvs:
integrations/vllm_e2e/test_kvledger_spec_config.py and integrations/sglang.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvledger.config import SettingsError
from kvledger.integrations.extra_config import SglangExtraConfig, VllmExtraConfig

VLLM = {"spec_name": "KvledgerOffloadingSpec", "spec_module_path": "m", "cpu_bytes_to_use": 1 << 30}


def refused(model: Any, config: dict[str, Any]) -> str:
    with pytest.raises(SettingsError) as caught:
        model.load(config)
    message = str(caught.value)
    assert len(message.splitlines()) == 1, message
    return message


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("abc", "must be a whole number (a JSON integer), got 'abc'"),
        ("8e9", "must be a whole number (a JSON integer), got '8e9'"),
        (8e9, "must be a whole number written as one (8000000000), got 8000000000.0"),
        (float("inf"), "must be a whole number (a JSON integer), got inf"),
        (float("nan"), "must be a whole number (a JSON integer), got nan"),
        ([1], "must be a whole number (a JSON integer), got [1]"),
        (True, "must be a whole number (a JSON integer), got True"),
        (0, "Input should be greater than 0, got 0"),
    ],
)
def test_cpu_bytes_to_use_is_a_whole_number_of_bytes(value: object, said: str) -> None:
    message = refused(VllmExtraConfig, {**VLLM, "cpu_bytes_to_use": value})
    assert message == f"kv_connector_extra_config cpu_bytes_to_use: {said}"


def test_a_size_that_holds_no_chunk_is_refused() -> None:
    config = VllmExtraConfig.load({**VLLM, "cpu_bytes_to_use": 100})
    with pytest.raises(SettingsError, match="cpu_bytes_to_use 100 holds no chunk: one chunk is"):
        config.chunks(4096)
    assert VllmExtraConfig.load(VLLM).chunks(4096) == (1 << 30) // 4096


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        ({"store_threshold": "x"}, "store_threshold: must be a whole number"),
        ({"store_threshold": -1}, "store_threshold: Input should be greater than or equal to 0"),
        ({"max_tracker_size": -5}, "max_tracker_size: Input should be greater than 0, got -5"),
        ({"log_url": "nosuch://x"}, "log_url: nosuch://x: SQLAlchemy knows no database"),
        ({"eviction_policy": "arc"}, "eviction_policy: kvledger keeps G2 in LRU order"),
        ({"offload_filter": "always"}, "offload_filter only applies to a G3: set g3_blocks"),
        ({"data_dir": "/x"}, "data_dir only applies to a G3: set g3_blocks"),
        ({"g3_blocks": 4, "offload_filter": "sometimes"}, "offload_filter: Input should be"),
        ({"worker_id": 1.7}, "worker_id: must be a whole number"),
        ({"cache_policy_module_path": "x"}, "'cache_policy_module_path' is not a key kvledger"),
        ({"cpu_bytes": 1}, "'cpu_bytes' is not a key kvledger reads; did you mean 'cpu_bytes_to"),
    ],
)
def test_vllm_mistakes_are_refused_by_key(extra: dict[str, Any], said: str) -> None:
    message = refused(VllmExtraConfig, {**VLLM, **extra})
    assert message.startswith("kv_connector_extra_config") and said in message, message


def test_vllm_keys_it_reads_itself_pass_and_good_values_are_kept_as_given() -> None:
    config = VllmExtraConfig.load(
        {
            **VLLM,
            "block_size": 16,
            "offload_prompt_only": False,
            "self_describing_kv_events": True,
            "g3_blocks": 8,
            "offload_filter": "never",
            "store_threshold": 2,
            "worker_id": 3,
            "log_url": "sqlite:///x.db",
        }
    )
    assert VllmExtraConfig.load({**VLLM, "log_url": "runs/x.db"}).log_url == "runs/x.db"
    assert (config.g3_blocks, config.offload_filter, config.store_threshold) == (8, "never", 2)
    assert (config.worker_id, config.log_url) == (3, "sqlite:///x.db")


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        ({"worker_id": "abc"}, "worker_id: must be a whole number (a JSON integer), got 'abc'"),
        ({"worker_id": -3}, "worker_id: Input should be greater than or equal to 0, got -3"),
        ({"worker_id": 1.7}, "worker_id: must be a whole number (a JSON integer), got 1.7"),
        ({"capacity_pages": 0}, "capacity_pages: Input should be greater than 0, got 0"),
        ({"redis_namespace": "a:b"}, "redis_namespace: namespace 'a:b' must be"),
        ({"capcity_pages": 8}, "'capcity_pages' is not a key kvledger reads; did you mean"),
    ],
)
def test_sglang_mistakes_are_refused_by_key(extra: dict[str, Any], said: str) -> None:
    message = refused(SglangExtraConfig, {"backend_name": "kvledger", **extra})
    assert message.startswith("hicache storage backend extra config") and said in message


def test_an_sglang_data_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    taken = tmp_path / "file"
    taken.write_text("x")
    message = refused(SglangExtraConfig, {"data_dir": str(taken)})
    assert message.endswith(f"data_dir: {taken} is a file, not a folder")
