"""Loading NIXL, which is optional: nothing in this package imports it at module import time.

The ``nixl`` meta package picks ``nixl_cu12`` or ``nixl_cu13`` from the CUDA that torch was built
with (the first one installed when there is none); only one of them may be loaded per process,
so everything here goes through ``nixl._api`` and never names a flavour.
"""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def nixl_unavailable_reason() -> str | None:
    """Why NIXL cannot be used in this process, or None when it can."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config  # noqa: F401
    except Exception as exc:  # ImportError, or OSError from its native libraries
        return (
            f"nixl cannot be imported ({type(exc).__name__}: {exc}); pip install 'kvledger[remote]'"
        )
    return None


def nixl_api() -> Any:
    """The ``nixl._api`` module; raises RuntimeError naming the cause when it is missing."""
    reason = nixl_unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    import nixl._api

    return nixl._api
