from collections.abc import Sequence
from types import TracebackType

_Row = tuple[int, int, str, int, float, bytes]

sqlite_version_number: int

class Connection:
    """A connection to a log file and its one prepared statement."""

    def close(self) -> None: ...
    def __enter__(self) -> Connection: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
        /,
    ) -> bool: ...

class Writer(Connection):
    def __init__(
        self, path: str, synchronous: str, busy_timeout_ms: int, insert_sql: str
    ) -> None: ...
    def __enter__(self) -> Writer: ...
    def commit(self, batch: list[_Row] | list[_Row | Sequence[_Row]], /) -> None: ...

class Reader(Connection):
    def __init__(self, path: str, sql: str, busy_timeout_ms: int) -> None: ...
    def __enter__(self) -> Reader: ...
    def read(self, max_rows: int, /) -> tuple[bytes, bytes, bytes, bytes, bytes] | None: ...
