from collections.abc import Callable
from typing import Any

def bind(
    index: type[Any],
    node: type[Any],
    stored: type[Any],
    removed: type[Any],
    python_apply: Callable[..., bool],
    /,
) -> Callable[..., bool]: ...
