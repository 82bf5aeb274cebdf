from collections.abc import Callable, Iterable
from typing import Any

def bind(
    index: type[Any],
    node: type[Any],
    stored: type[Any],
    removed: type[Any],
    python_apply: Callable[..., bool],
    /,
) -> Callable[..., bool]: ...
def count(counts: dict[int, int], keys: Iterable[int], /) -> None: ...
def uncount(counts: dict[int, int], keys: Iterable[int], /) -> None: ...
