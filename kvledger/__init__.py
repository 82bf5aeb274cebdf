"""kvledger: a KV-cache block manager with an event-sourced registry.

The public API is what ``__all__`` lists: ``from kvledger import BlockManager, Settings, ...``.
Each name is imported on first use, so importing kvledger for its CLI or settings does not
pay for torch; in an install without torch (``pip install kvledger``, no ``torch`` extra) the
names that hold KV bytes (``BlockManager``, the layouts) say which extra to install.
"""

# The subpackages registry/, tiers/, events/ and migrations/ live in top-level folders of the
# repository and are mapped into this package at install time. When Python runs from the
# repository root this folder shadows the installed package; extending the path lets the
# installed mapping supply the rest.
__path__ = __import__("pkgutil").extend_path(__path__, __name__)

from typing import TYPE_CHECKING

from kvledger.extras import missing_extra as _missing_extra

__version__ = "0.1.0"

#: public name -> the module that defines it
_HOMES = {
    "BlockManager": "kvledger.manager",
    "G3Recovery": "kvledger.recovery",
    "G4Link": "kvledger.manager",
    "Settings": "kvledger.config",
    "SettingsError": "kvledger.config",
    "Metrics": "kvledger.metrics",
    "PoolExhausted": "kvledger.registry.errors",
    "PoolBusy": "kvledger.registry.errors",
    "G3InUse": "kvledger.tiers.disk.lock",
    "BlockShape": "kvledger.tiers.layout",
    "LayerSeparate": "kvledger.tiers.layout",
    "Tier": "kvledger.events.types",
    "AnyEvent": "kvledger.events.types",
    "MatchResult": "kvledger.registry.tiered",
    "TokenBlockSequence": "kvledger.registry.hashing",
    "RegistryState": "kvledger.registry.state",
    "EventLog": "kvledger.events.log",
    "replay": "kvledger.events.log.replay",
}

__all__ = [
    "AnyEvent",
    "BlockManager",
    "BlockShape",
    "EventLog",
    "G3InUse",
    "G3Recovery",
    "G4Link",
    "LayerSeparate",
    "MatchResult",
    "Metrics",
    "PoolBusy",
    "PoolExhausted",
    "RegistryState",
    "Settings",
    "SettingsError",
    "Tier",
    "TokenBlockSequence",
    "replay",
]

if TYPE_CHECKING:
    from kvledger.config import Settings, SettingsError
    from kvledger.events.log import EventLog
    from kvledger.events.log.replay import replay
    from kvledger.events.types import AnyEvent, Tier
    from kvledger.manager import BlockManager, G4Link
    from kvledger.metrics import Metrics
    from kvledger.recovery import G3Recovery
    from kvledger.registry.errors import PoolBusy, PoolExhausted
    from kvledger.registry.hashing import TokenBlockSequence
    from kvledger.registry.state import RegistryState
    from kvledger.registry.tiered import MatchResult
    from kvledger.tiers.disk.lock import G3InUse
    from kvledger.tiers.layout import BlockShape, LayerSeparate


assert set(__all__) == set(_HOMES)


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'kvledger' has no attribute {name!r}")
    from importlib import import_module

    try:
        value = getattr(import_module(home), name)
    except ModuleNotFoundError as exc:
        message = _missing_extra(exc, needed_by=f"kvledger.{name}")
        if message is None:
            raise
        raise ModuleNotFoundError(message, name=exc.name) from None
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
