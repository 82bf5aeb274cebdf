"""The public API: what the README uses is importable from ``kvledger`` itself, and importing
the package (as the CLI does) does not load torch."""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import kvledger

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def _readme_imports() -> list[tuple[str, str]]:
    """(module, name) of every ``from kvledger... import A, B`` in the README."""
    found: list[tuple[str, str]] = []
    for module, names in re.findall(r"from (kvledger[\w.]*) import ([\w, ]+)", README):
        found += [(module, name.strip()) for name in names.split(",") if name.strip()]
    return found


def test_every_import_the_readme_shows_resolves() -> None:
    imports = _readme_imports()
    assert ("kvledger", "BlockManager") in imports and ("kvledger", "LayerSeparate") in imports
    for module, name in imports:
        assert getattr(importlib.import_module(module), name) is not None, (module, name)
        if module == "kvledger":
            assert name in kvledger.__all__


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a name inside a module, not a submodule
        return False


def test_every_dotted_name_the_readme_shows_resolves() -> None:
    """``kvledger.events.log.EventLog``, ``kvledger.tiers.remote``, ...: a module, or a module
    and the names inside it (an engine's module is only found, since it imports the engine)."""
    dotted = set(re.findall(r"\bkvledger(?:\.[A-Za-z_]\w*)+", README)) - {"kvledger.__all__"}
    assert "kvledger.registry.index.RouterIndex" in dotted
    for name in sorted(dotted):
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            module = ".".join(parts[:cut])
            if _is_module(module):
                break
        rest = parts[cut:]
        if not rest:
            continue
        value: object = importlib.import_module(module)
        for attribute in rest:
            assert hasattr(value, attribute), f"{name}: {module} has no {'.'.join(rest)}"
            value = getattr(value, attribute)


def test_all_is_the_list_the_readme_gives() -> None:
    listed = re.search(r"The public API is `kvledger.__all__`:\s*(.*?)\.\n", README, re.S)
    assert listed is not None
    assert set(re.findall(r"`(\w+)`", listed.group(1))) == set(kvledger.__all__)


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
