from collections.abc import Callable, Sequence
from typing import TypeVar

R = TypeVar("R")

def maker(cls: type[R], names: Sequence[str], /) -> Callable[..., R]: ...
