"""Settings: defaults, Dynamo's aliases, the G2 bypass rule, and errors that name the setting."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger import config, settings_model
from kvledger.config import RULES, Rule, Settings, SettingsError
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
    "import sys; from kvledger.config import Settings; s = Settings.load(block_size=32{}); "
    "print(s.block_size, s.g2_gb, 'pydantic' in sys.modules, 'pydantic_settings' in sys.modules)"
)


def test_pydantic_loads_only_for_the_environment_or_what_needs_parsing() -> None:
    """Start-up of a run configured by plain arguments alone imports neither pydantic nor
    pydantic-settings (90 of a short ``kvledger simulate`` run's 190 ms of start-up); one that
    sets a variable imports both, and reads it, Dynamo's names and lower-case spellings
    included; a value given as text is parsed by pydantic alone."""
    plain = LOAD.format("")
    assert _settings_in_a_fresh_process({}, plain) == "32 0.0 False False"
    assert _settings_in_a_fresh_process({"KVLEDGER_G2_GB": "2"}, plain) == "32 2.0 True True"
    assert _settings_in_a_fresh_process({"DYN_KVBM_CPU_CACHE_GB": "3"}, plain) == "32 3.0 True True"
    assert _settings_in_a_fresh_process({"kvledger_g2_gb": "4"}, plain) == "32 4.0 True True"
    # a variable no setting reads leaves them unloaded, and so does a bare setting name
    assert _settings_in_a_fresh_process({"KVLEDGER_SHARED_DATA": "/x"}, plain) == (
        "32 0.0 False False"
    )
    assert _settings_in_a_fresh_process({"G2_GB": "5"}, plain) == "32 0.0 False False"
    assert _settings_in_a_fresh_process({}, LOAD.format(", g2_gb='1.5'")) == "32 1.5 True False"


def _candidates(rule: Rule) -> st.SearchStrategy[object]:
    """Values a caller might pass for a setting: around its bounds, of every type the
    settings hold, and a few that only parsing (or refusing) can settle."""
    edges = [b for b in (rule.gt, rule.ge, rule.lt, rule.le) if b is not None]
    near = [int(b) + d for b in edges for d in (-1, 0, 1)]
    return st.one_of(
        st.sampled_from([None, True, False, 0, 1, -1, 0.5, 2.0, 1 << 64, "", "lru", "keep"]),
        st.sampled_from([math.inf, -math.inf, math.nan, 1e300, 1 << 60]),
        st.sampled_from(near or [7]),
        st.sampled_from([float(n) for n in near] or [7.0]),
        st.floats(allow_nan=True, allow_infinity=True),
        st.integers(),
        st.text(max_size=4),
        st.just(Path("kvledger-data")),
        st.sampled_from(["1", "8e9", "true", "fsync", "multi_lru", "tcp://127.0.0.1:5557"]),
    )


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_plain_values_are_taken_as_pydantic_takes_them(data: st.DataObject) -> None:
    """What ``Settings`` takes without pydantic (a plain value of the setting's type within
    its rule) pydantic takes too, with the same value and type; what it does not take it
    leaves to pydantic, whose report then names the setting."""
    names = data.draw(st.lists(st.sampled_from(sorted(RULES)), max_size=4, unique=True))
    values = {name: data.draw(_candidates(RULES[name]), label=name) for name in names}
    defaults = {f.name: f.default for f in dataclasses.fields(Settings) if f.init}
    taken = config._plain({**defaults, **values})
    try:
        parsed, _given = settings_model.validate(Settings, values, environment=False)
    except SettingsError as exc:
        assert taken is None, f"{values} taken without pydantic, refused by it: {exc}"
        return
    if taken is not None:
        assert taken == parsed
        assert [type(v) for v in taken.values()] == [type(parsed[k]) for k in taken]


def test_replace_checks_and_counts_what_it_changes() -> None:
    s = Settings.load(block_size=32)
    changed = s.replace(worker_id=3, g2_gb=1)
    assert (changed.worker_id, changed.g2_gb, changed.block_size) == (3, 1.0, 32)
    assert changed.fields_set == {"block_size", "worker_id", "g2_gb"}
    assert s.worker_id == 0 and s.fields_set == {"block_size"}
    with pytest.raises(SettingsError, match="worker_id"):
        s.replace(worker_id=-1)
    with pytest.raises(SettingsError, match="blok_size"):
        s.replace(blok_size=8)


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
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.block_size = 8  # type: ignore[misc]  # frozen either way
