"""Workloads for the simulator: Mooncake JSONL traces and a built-in synthetic generator.

Both become ``TraceRequest``s whose prompt is given as block ids of ``trace_block_size``
tokens (Mooncake's ``hash_ids``: equal ids mean equal prefixes). ``request_hashes`` turns
them into the engine's own block size: each trace block splits into ``trace_block_size /
block_size`` engine blocks, so the simulator never needs the token ids themselves.
"""

from __future__ import annotations

import json
import math
import os
import random
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from kvledger.registry.hashing import chain_sequence_hashes, local_hashes

MOONCAKE_BLOCK_TOKENS = 512


class TraceRequest(NamedTuple):
    """One request of a workload. A named tuple rather than a frozen dataclass: a trace holds
    thousands and is read at every start, and a frozen dataclass sets each field through
    ``object.__setattr__``."""

    arrival_ms: float
    input_length: int
    output_length: int
    block_ids: tuple[int, ...]
    trace_block_size: int = MOONCAKE_BLOCK_TOKENS


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file and line."""


ReadRows = Callable[[str, type[TraceRequest], int], "list[TraceRequest] | None"]
COMPILED_READ: ReadRows | None = None
"""The plain trace read in one pass (``kvledger/mocker/_trace.c``): the rows the Python reader
gives, or None for a text it does not take (not ASCII, another field, a float where a whole
number belongs, a row that fails a check, ...), which the Python reader then reads and names
the fault of. None where the module was not built (no C compiler at install). It is what
``load_mooncake`` tries first unless ``KVLEDGER_PYTHON_TRACE=1`` is in the environment (to
measure the Python reader, or to rule the compiled one out)."""
try:
    from kvledger.mocker import _trace
except ImportError:  # the json reader serves
    pass
else:
    COMPILED_READ = _trace.read
_read_plain = COMPILED_READ if os.environ.get("KVLEDGER_PYTHON_TRACE", "") in ("", "0") else None


def load_mooncake(path: str | Path) -> list[TraceRequest]:
    """Read a Mooncake trace: one JSON object per line with ``timestamp`` (ms),
    ``input_length``, ``output_length`` and ``hash_ids`` (512-token blocks)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:  # a binary file, or text in another encoding (UTF-16)
        raise TraceError(
            f"{path}: not a Mooncake trace: byte {exc.start} is not UTF-8 text "
            "(a trace is JSON lines in UTF-8)"
        ) from None
    if _read_plain is not None:
        plain_rows = _read_plain(text, TraceRequest, MOONCAKE_BLOCK_TOKENS)
        if plain_rows is not None:
            return plain_rows
    return _read_rows(path, text)


def _read_rows(path: Path, text: str) -> list[TraceRequest]:
    """The rows of a trace's text through ``json``, each checked: what ``load_mooncake`` falls
    back to for a text the compiled reader does not take, and where every message is made."""
    requests: list[TraceRequest] = []
    numbered = [
        (n, line) for n, line in enumerate(text.splitlines(), 1) if line and not line.isspace()
    ]
    rows = _decode_all(line for _, line in numbered)
    if rows is None or len(rows) != len(numbered):  # a line that is not one value: which
        rows = [_decode_row(path, lineno, line) for lineno, line in numbered]
    # JSON's true and false read as ints to every check but an exact type test, so where the
    # text holds neither word the block ids are checked by one C conversion a row
    plain = "true" not in text and "false" not in text
    for (lineno, _), row in zip(numbered, rows, strict=True):
        if not isinstance(row, dict):
            raise TraceError(
                f"{path}:{lineno}: not a Mooncake trace row (a JSON object with timestamp, "
                f"input_length, output_length and hash_ids), got a {type(row).__name__}"
            )
        try:
            req = TraceRequest(
                arrival_ms=_timestamp(row["timestamp"]),
                input_length=_whole("input_length", row["input_length"]),
                output_length=_whole("output_length", row["output_length"]),
                block_ids=_hash_ids(row["hash_ids"], plain),
            )
        except (ValueError, KeyError, TypeError) as exc:
            what = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
            raise TraceError(f"{path}:{lineno}: not a Mooncake trace row ({what})") from None
        needed = -(-req.input_length // MOONCAKE_BLOCK_TOKENS)
        if req.input_length <= 0 or len(req.block_ids) != needed:
            raise TraceError(
                f"{path}:{lineno}: input_length {req.input_length} needs {needed} hash_ids, "
                f"got {len(req.block_ids)}"
            )
        requests.append(req)
    if not requests:
        raise TraceError(f"{path}: no requests in trace")
    return requests


def _decode_all(lines: Iterator[str]) -> list[Any] | None:
    """Every line's JSON value, read as one array: a single call into the decoder for the
    whole trace, where a call a line cost a short simulation a tenth of its start-up. None
    when the text is not one: the caller then reads line by line, which names the line."""
    try:
        values = json.loads("[" + ",".join(lines) + "]")
    except ValueError:
        return None
    return values if isinstance(values, list) else None


# the scanner json.loads ends in; typeshed does not declare the attribute
_scan_json: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]
_JSON_SPACE = " \t\r\n"


def _decode_row(path: Path, lineno: int, line: str) -> Any:
    """A line's JSON value. The decoder's scanner is called directly: ``json.loads`` wraps it
    in two Python calls and two regular expressions per line, which cost a short simulation
    as much as its imports. A line it does not read whole goes to ``json.loads`` for its
    error message."""
    text = line.strip(_JSON_SPACE)
    try:
        row, end = _scan_json(text, 0)
        if end == len(text):
            return row
    except (StopIteration, ValueError):
        pass
    try:
        return json.loads(line)
    except ValueError as exc:
        raise TraceError(f"{path}:{lineno}: not a Mooncake trace row ({exc})") from None


def _timestamp(value: object) -> float:
    # json reads NaN, Infinity and 1e400 as floats; each would silently reorder the arrivals.
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"timestamp must be a finite number of milliseconds, got {value!r}")
    return float(value)


def _whole(name: str, value: object) -> int:
    # int() would turn 1024.5 into 1024 and true into 1: refused, not guessed at
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    return value


def _hash_ids(values: object, plain: bool = False) -> tuple[int, ...]:
    """The block ids of a row, checked at C speed: a trace holds hundreds of thousands.
    ``plain``: the trace holds no JSON true or false, so an array of u64 taking the list is
    the whole check (it refuses floats, strings, negative and oversized ints)."""
    if not isinstance(values, list):
        raise ValueError(f"hash_ids must be a list, got {values!r}")
    if plain:
        try:
            array("Q", values)
        except (TypeError, OverflowError):
            pass  # the checks below name the first bad one
        else:
            return tuple(values)
    if values and (set(map(type, values)) != {int} or min(values) < 0 or max(values) >> 64):
        for value in values:
            _hash_id(value)  # names the first bad one
    return tuple(values)


def _hash_id(value: object) -> int:
    # int() would turn 1.5 into 1 and true into 1: two different blocks under one name.
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 64:
        raise ValueError(f"hash_ids must be whole numbers in 0..2**64-1, got {value!r}")
    return value


def synthetic(
    num_requests: int = 2000,
    *,
    block_size: int = 16,
    system_prompts: int = 8,
    system_blocks: int = 32,
    sessions: int = 200,
    turn_blocks: tuple[int, int] = (4, 24),
    output_tokens: tuple[int, int] = (16, 256),
    rate_per_s: float = 50.0,
    seed: int = 0,
) -> list[TraceRequest]:
    """Chat-like traffic: a few shared system prompts and multi-turn sessions.

    Each turn of a session resends the whole conversation so far (system prompt + earlier
    turns) plus a new user message, which is what makes prefix caching pay off.
    """
    rng = random.Random(seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    prompts = [fresh(system_blocks) for _ in range(system_prompts)]
    history: list[list[int]] = [list(rng.choice(prompts)) for _ in range(sessions)]
    out: list[TraceRequest] = []
    now_ms = 0.0
    for _ in range(num_requests):
        now_ms += rng.expovariate(rate_per_s) * 1000.0
        s = rng.randrange(sessions)
        history[s] = history[s] + fresh(rng.randint(*turn_blocks))
        ids = history[s]
        out.append(
            TraceRequest(
                arrival_ms=round(now_ms, 3),
                input_length=len(ids) * block_size - rng.randrange(block_size),
                output_length=rng.randint(*output_tokens),
                block_ids=tuple(ids),
                trace_block_size=block_size,
            )
        )
        if rng.random() < 0.1:  # the conversation ends; a new one starts in this slot
            history[s] = list(rng.choice(prompts))
    return out


def request_hashes(req: TraceRequest, block_size: int) -> tuple[list[int], list[int]]:
    """(sequence hashes, local hashes) of a request's blocks at the engine's ``block_size``.

    The last block may be partial; it is hashed like the rest because trace block ids
    already name it uniquely (Mooncake hashes partial tail blocks too).
    """
    if req.trace_block_size % block_size:
        raise TraceError(
            f"block size {block_size} must divide the trace's {req.trace_block_size}-token blocks"
        )
    split = req.trace_block_size // block_size
    if split == 1:
        local = list(req.block_ids)
    else:
        n_blocks = -(-req.input_length // block_size)
        ids = [bid * split + i for bid in req.block_ids for i in range(split)][:n_blocks]
        local = local_hashes(ids, 1)
    return chain_sequence_hashes(local), local


def iter_arrivals(requests: list[TraceRequest]) -> Iterator[TraceRequest]:
    """Requests in arrival order (stable for equal timestamps)."""
    return iter(sorted(requests, key=lambda r: r.arrival_ms))


def is_event_log(location: str) -> bool:
    """Whether a ``--trace`` argument names an event log (a URL, or a SQLite file) rather
    than a Mooncake JSONL file."""
    if "://" in location:
        return True
    try:
        with open(location, "rb") as f:
            return f.read(16) == b"SQLite format 3\x00"
    except OSError:
        return False
