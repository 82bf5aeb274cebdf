"""Settings: defaults, Dynamo's aliases, the G2 bypass rule, and errors that name the setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvledger.config import Settings, SettingsError
from kvledger.events.types import Tier

pytestmark = pytest.mark.usefixtures("clean_env")


def test_defaults_need_nothing_installed() -> None:
    s = Settings.load()
    assert s.block_size == 16
    assert s.offload_path == (Tier.G1,)
    assert s.log_url == "sqlite:///kvledger-data/events.db"
    assert s.bytes_per_block == 32 * 2 * 16 * 1024 * 2


def test_prefix_and_keywords(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLEDGER_BLOCK_SIZE", "32")
    monkeypatch.setenv("KVLEDGER_EVICTION_POLICY", "multi_lru")
    s = Settings.load()
    assert (s.block_size, s.eviction_policy) == (32, "multi_lru")
    assert Settings.load(block_size=64).block_size == 64


def test_dynamo_aliases_and_override_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_KVBM_CPU_CACHE_GB", "2")
    s = Settings.load()
    assert s.g2_capacity == 2 * (1 << 30) // s.bytes_per_block
    monkeypatch.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "77")
    monkeypatch.setenv("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", "500")
    s = Settings.load()
    assert (s.g2_capacity, s.g3_capacity) == (77, 500)
    assert s.offload_path == (Tier.G1, Tier.G2, Tier.G3)


def test_disk_without_cpu_cache_offloads_straight_to_disk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DYN_KVBM_DISK_CACHE_GB", "1")
    monkeypatch.setenv("DYN_KVBM_CPU_CACHE_GB", "0")  # zero counts as unset, as in Dynamo
    assert Settings.load().offload_path == (Tier.G1, Tier.G3)


@pytest.mark.parametrize(
    ("env", "value", "named"),
    [
        ("KVLEDGER_BLOCK_SIZE", "abc", "block_size (KVLEDGER_BLOCK_SIZE)"),
        ("KVLEDGER_BLOCK_SIZE", "0", "block_size"),
        ("KVLEDGER_EVICTION_POLICY", "fifo", "'lru', 'lineage' or 'multi_lru'"),
        ("DYN_KVBM_CPU_CACHE_GB", "-1", "DYN_KVBM_CPU_CACHE_GB"),
        ("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", "lots", "g3_blocks"),
        ("KVLEDGER_EVENT_LOG_URL", "events.db", "(KVLEDGER_EVENT_LOG_URL): must be a URL"),
        ("KVLEDGER_OFFLOAD_FILTER", "sometimes", "'always', 'seen_twice' or 'never'"),
        ("KVLEDGER_REDIS_LINGER_S", "-0.5", "redis_linger_s (KVLEDGER_REDIS_LINGER_S)"),
        ("KVLEDGER_REDIS_LINGER_S", "60", "redis_linger_s"),
    ],
)
def test_bad_values_name_the_setting(
    monkeypatch: pytest.MonkeyPatch, env: str, value: str, named: str
) -> None:
    monkeypatch.setenv(env, value)
    with pytest.raises(SettingsError) as info:
        Settings.load()
    assert named in str(info.value)
    assert repr(value) in str(info.value) or "must be a URL" in str(info.value)


def test_unknown_keyword_is_refused() -> None:
    with pytest.raises(SettingsError, match="blok_size"):
        Settings.load(blok_size=16)


def test_values_from_variables_are_parsed_for_every_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every variable's value is text: a bounded int, a bool and a path each become their type
    (KVLEDGER_OUTER_DIM=1 once failed as "should be 1 or 2"); names ignore case."""
    monkeypatch.setenv("KVLEDGER_OUTER_DIM", "1")
    monkeypatch.setenv("KVLEDGER_LOG_LOOKUPS", "off")
    monkeypatch.setenv("kvledger_data_dir", "/tmp/somewhere")
    s = Settings.load()
    assert (s.outer_dim, s.log_lookups, s.data_dir) == (1, False, Path("/tmp/somewhere"))
    monkeypatch.setenv("KVLEDGER_OUTER_DIM", "3")
    with pytest.raises(SettingsError, match="outer_dim"):
        Settings.load()
