"""The optional dependencies, and the extra that installs each.

``pip install kvledger`` is the light core: the event log, replay, ``whatif``/``report``,
``tail``, the router index and the shared registry, none of which touches a tensor. What holds
KV bytes (the tiers, and so ``BlockManager`` and the engine integrations) needs torch, and a
PostgreSQL log needs its driver; without them, the user is told which extra to install in one
line rather than shown an ``ImportError``.
"""

from __future__ import annotations

#: top-level module -> (what it is for, the extra that installs it)
EXTRAS = {
    "torch": ("the tiers hold KV bytes in torch tensors", "torch"),
    "psycopg": ("the driver of PostgreSQL event logs", "postgres"),
}


def missing_extra(exc: BaseException, needed_by: str | None = None) -> str | None:
    """The one-line message for ``exc`` when it says an optional dependency is not installed
    (naming ``needed_by``, the thing that needs it, when given); None for any other error (a
    missing module of kvledger's own is a bug, not a setting)."""
    if not isinstance(exc, ModuleNotFoundError) or exc.name is None:
        return None
    module = exc.name.partition(".")[0]
    found = EXTRAS.get(module)
    if found is None:
        return None
    why, extra = found
    who = f"{needed_by} needs {module}, which" if needed_by else module
    return f"{who} is not installed ({why}): pip install 'kvledger[{extra}]'"
