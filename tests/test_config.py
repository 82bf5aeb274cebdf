"""Settings: defaults, Dynamo's aliases, the G2 bypass rule, and errors that name the setting."""

from __future__ import annotations

import os
import subprocess
import sys
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
        ("KVLEDGER_EVICTION_POLICY", "fifo", "'lru', 'arc', 'lineage' or 'multi_lru'"),
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


def _settings_in_a_fresh_process(env: dict[str, str], code: str) -> str:
    """Run ``code`` in a fresh interpreter whose environment is ``env`` (plus what Python
    needs to start) and return what it prints."""
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "PYTHONPATH")}
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**keep, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


LOAD = (
    "import sys; from kvledger.config import Settings; s = Settings.load(block_size=32); "
    "print(s.block_size, s.g2_gb, 'pydantic_settings' in sys.modules)"
)


def test_pydantic_settings_loads_only_for_settings_from_the_environment() -> None:
    """Start-up of a run configured by arguments alone does not import pydantic-settings
    (a third of ``kvledger.config``'s import); one that sets a variable does, and reads it,
    Dynamo's names and lower-case spellings included."""
    assert _settings_in_a_fresh_process({}, LOAD) == "32 0.0 False"
    assert _settings_in_a_fresh_process({"KVLEDGER_G2_GB": "2"}, LOAD) == "32 2.0 True"
    assert _settings_in_a_fresh_process({"DYN_KVBM_CPU_CACHE_GB": "3"}, LOAD) == "32 3.0 True"
    assert _settings_in_a_fresh_process({"kvledger_g2_gb": "4"}, LOAD) == "32 4.0 True"
    # a variable no setting reads leaves it unloaded
    assert _settings_in_a_fresh_process({"KVLEDGER_SHARED_DATA": "/x"}, LOAD) == "32 0.0 False"


@pytest.mark.parametrize("env", [False, True])
def test_settings_validate_alike_with_and_without_the_environment(
    env: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if env:
        monkeypatch.setenv("KVLEDGER_NUM_LAYERS", "8")
    with pytest.raises(SettingsError, match="g2_gb"):
        Settings.load(g2_gb=float("inf"))
    with pytest.raises(SettingsError, match=r"is not a key kvledger reads|extra"):
        Settings.load(blok_size=16)
    s = Settings.load(g2_gb=1.0)
    assert isinstance(s, Settings)
    assert s.num_layers == (8 if env else 32)
    with pytest.raises(ValueError):
        s.block_size = 8  # frozen either way
