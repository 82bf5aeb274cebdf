"""kvledger: a KV-cache block manager with an event-sourced registry."""

# The subpackages registry/, tiers/, events/ and migrations/ live in top-level folders of the
# repository and are mapped into this package at install time. When Python runs from the
# repository root this folder shadows the installed package; extending the path lets the
# installed mapping supply the rest.
__path__ = __import__("pkgutil").extend_path(__path__, __name__)

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # Lazy: importing kvledger for its CLI or settings should not pay for torch.
    if name == "BlockManager":
        from kvledger.manager import BlockManager

        return BlockManager
    if name == "Settings":
        from kvledger.config import Settings

        return Settings
    raise AttributeError(f"module 'kvledger' has no attribute {name!r}")
