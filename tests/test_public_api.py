"""The public API: what the README uses is importable from ``kvledger`` itself, and importing
the package (as the CLI does) does not load torch."""

from __future__ import annotations

import subprocess
import sys

import kvledger

README_NAMES = {
    "BlockManager",
    "Settings",
    "SettingsError",
    "PoolExhausted",
    "G3InUse",
    "Tier",
    "MatchResult",
    "EventLog",
    "replay",
    "RegistryState",
    "TokenBlockSequence",
    "Metrics",
}


def test_all_lists_the_names_the_readme_uses() -> None:
    assert set(kvledger.__all__) >= README_NAMES


def test_every_public_name_is_the_object_of_its_home_module() -> None:
    from kvledger.events.types import Tier
    from kvledger.manager import BlockManager
    from kvledger.registry.errors import PoolExhausted

    for name in kvledger.__all__:
        assert getattr(kvledger, name) is not None
    assert kvledger.BlockManager is BlockManager
    assert kvledger.PoolExhausted is PoolExhausted
    assert kvledger.Tier is Tier


def test_an_unknown_name_is_a_clear_attribute_error() -> None:
    try:
        kvledger.NoSuchThing  # noqa: B018
    except AttributeError as exc:
        assert "NoSuchThing" in str(exc)
    else:
        raise AssertionError("kvledger.NoSuchThing did not raise")


def test_importing_kvledger_does_not_load_torch() -> None:
    code = (
        "import sys, kvledger, kvledger.cli; from kvledger import Settings, Tier, PoolExhausted;"
        " print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
