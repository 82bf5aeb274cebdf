from collections import OrderedDict
from collections.abc import Iterable, Sequence

def match(
    by_hash: dict[int, int],
    ref: list[int],
    queue: OrderedDict[int, None] | None,
    revived: list[int],
    sequence_hashes: Iterable[int],
    /,
) -> list[int]: ...
def name_new(
    ref: list[int],
    hashes: list[int | None],
    local_of: list[int],
    parent_of: list[int | None],
    by_hash: dict[int, int],
    slots: Sequence[int],
    blocks: Sequence[tuple[int, int]],
    parent_hash: int | None,
    /,
) -> int: ...
def release(
    ref: list[int],
    hashes: list[int | None],
    free: list[int],
    inactive: dict[int, None],
    order: list[int],
    unused: int,
    /,
) -> int: ...
def take(ref: list[int], slots: list[int], /) -> None: ...
def drop(by_hash: dict[int, int], hashes: list[int | None], slots: list[int], /) -> list[int]: ...
def oldest(queue: OrderedDict[int, None], count: int, /) -> list[int]: ...
