from types import TracebackType

sqlite_version_number: int

class Writer:
    def __init__(
        self, path: str, synchronous: str, busy_timeout_ms: int, insert_sql: str
    ) -> None: ...
    def commit(self, batch: list[tuple[int, int, str, int, float, bytes]], /) -> None: ...
    def close(self) -> None: ...
    def __enter__(self) -> Writer: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
        /,
    ) -> bool: ...
