from kvledger.mocker.traces import TraceRequest

def read(
    text: str, row_type: type[TraceRequest], block_tokens: int, /
) -> list[TraceRequest] | None: ...
