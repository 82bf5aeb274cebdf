"""The compiled trace reader (``kvledger/mocker/_trace.c``) against the Python one.

The compiled reader takes only a plain text and returns None for anything else, which the
Python reader then reads (and names the fault of). So for every text the two must give the same
rows where the compiled one answers, the compiled one must answer for every plain text (or it
would cost nothing to be wrong), and ``load_mooncake`` must give what the Python reader gives or
raise what it raises. The texts are drawn rows written in varied but valid JSON, and the same
with one thing broken: a field missing, added or given twice, a float, sign, boolean or leading
zero where a whole number belongs, too many or too few block ids, values past 64 bits, escapes,
other line breaks and non-ASCII text.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from switches import python_with

from kvledger.mocker import traces
from kvledger.mocker.traces import MOONCAKE_BLOCK_TOKENS, TraceError, TraceRequest

COMPILED = traces.COMPILED_READ
pytestmark = pytest.mark.skipif(
    COMPILED is None, reason="kvledger.mocker._trace is not built (no C compiler at install)"
)

FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
SPACE = st.sampled_from(["", " ", "  ", "\t"])


@st.composite
def rows(draw: st.DrawFn) -> str:
    """One plain row as a line of JSON: any key order, any JSON spacing, an integer or
    decimal timestamp."""
    blocks = draw(st.integers(1, 6))
    input_length = draw(
        st.integers((blocks - 1) * MOONCAKE_BLOCK_TOKENS + 1, blocks * MOONCAKE_BLOCK_TOKENS)
    )
    ids = draw(st.lists(st.integers(0, 2**64 - 1), min_size=blocks, max_size=blocks))
    stamp = draw(
        st.one_of(
            st.integers(-(10**6), 10**12).map(str),
            st.floats(-1e9, 1e15, allow_nan=False).map(repr),
            st.sampled_from(["0", "-0", "1e3", "2.5E-3", "1E+2", "0.125"]),
        )
    )
    values = {
        "timestamp": stamp,
        "input_length": str(input_length),
        "output_length": str(draw(st.integers(0, 10**6))),
        "hash_ids": "[" + draw(SPACE) + ("," + draw(SPACE)).join(map(str, ids)) + "]",
    }
    order = draw(st.permutations(FIELDS))
    sp = draw(SPACE)
    members = [f'{sp}"{k}"{draw(SPACE)}:{draw(SPACE)}{values[k]}{draw(SPACE)}' for k in order]
    return draw(SPACE) + "{" + ",".join(members) + "}" + draw(SPACE)


@st.composite
def texts(draw: st.DrawFn) -> str:
    lines = draw(st.lists(st.one_of(rows(), rows(), rows(), SPACE), min_size=1, max_size=6))
    end = draw(st.sampled_from(["\n", "\r\n"]))
    return end.join(lines) + draw(st.sampled_from(["", end]))


BREAKS = [
    ('"output_length"', '"output_len"'),  # a field missing, another added
    ('"hash_ids"', '"hash_ids": [], "extra"'),  # a field added
    ('"input_length"', '"input_length": 1, "input_length"'),  # a field given twice
    ('"input_length":', '"input_length": 1.0, "x":'),
    ("[", "[-1, "),  # a negative block id
    ("[", "[true, "),
    ("[", "[1.5, "),
    ("[", "[18446744073709551616, "),  # 2**64
    ("[", "[01, "),  # a leading zero
    ("[", "[7, "),  # one block id too many
    (",", ", "),  # harmless: still plain
    ('"output_length":', '"output_length": -'),  # a negative output length
    ('"output_length":', '"output_length": 1e0, "y":'),
    ('"timestamp":', '"timestamp": NaN, "t":'),
    ('"timestamp":', '"timestamp": 1e400, "t":'),
    ('"timestamp":', '"timestamp": true, "t":'),
    ('"timestamp":', '"timestamp": "1", "t":'),
    ('"timestamp"', '"times\\u0074amp"'),  # an escape: the same key, read by json
    ("{", "\u00e9{"),  # non-ASCII text
    ("{", "{\x0b"),  # a line break of str.splitlines, not of JSON
    ("}", "}\r "),  # a lone carriage return
    ("}", "}}"),
    ("}", "} x"),
    ("]", "]]"),
]


def python_read(text: str) -> list[TraceRequest] | str:
    """The Python reader's rows, or its message."""
    try:
        return traces._read_rows(Path("t.jsonl"), text)
    except TraceError as exc:
        return str(exc)


def load(tmp_path: Path, text: str) -> list[TraceRequest] | str:
    path = tmp_path / "t.jsonl"
    path.write_text(text, encoding="utf-8", newline="")
    try:
        return traces.load_mooncake(path)
    except TraceError as exc:
        return str(exc).replace(str(path), "t.jsonl")


@settings(max_examples=300, deadline=None)
@given(text=texts())
def test_a_plain_trace_reads_as_the_python_reader_reads_it(text: str) -> None:
    assert COMPILED is not None
    python = python_read(text)
    compiled = COMPILED(text, TraceRequest, MOONCAKE_BLOCK_TOKENS)
    if isinstance(python, str):  # only whitespace: no rows
        assert compiled is None
        return
    assert compiled is not None, text
    assert compiled == python
    assert all(type(row) is TraceRequest for row in compiled)
    assert [type(v) for v in compiled[0]] == [float, int, int, tuple, int]
    assert [repr(row.arrival_ms) for row in compiled] == [repr(row.arrival_ms) for row in python]


@settings(max_examples=300, deadline=None)
@given(text=texts(), data=st.data())
def test_a_broken_trace_falls_to_the_python_reader(
    tmp_path_factory: pytest.TempPathFactory, text: str, data: st.DataObject
) -> None:
    """Whatever one break does, load_mooncake gives the Python reader's rows or message."""
    old, new = data.draw(st.sampled_from(BREAKS))
    lines = text.split("\n")
    at = data.draw(st.integers(0, len(lines) - 1))
    lines[at] = lines[at].replace(old, new, 1)
    broken = "\n".join(lines)
    assert COMPILED is not None
    compiled = COMPILED(broken, TraceRequest, MOONCAKE_BLOCK_TOKENS)
    python = python_read(broken)
    if compiled is not None:
        assert compiled == python
    assert load(tmp_path_factory.mktemp("t"), broken) == python


def test_each_break_is_refused_or_read_alike(tmp_path: Path) -> None:
    """Each break on its own, on one row: the compiled reader declines every one that is not
    plain (None), and reads the harmless one."""
    assert COMPILED is not None
    row = json.dumps({"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [4, 9]})
    assert COMPILED(row, TraceRequest, MOONCAKE_BLOCK_TOKENS) == [
        TraceRequest(5.0, 600, 3, (4, 9), MOONCAKE_BLOCK_TOKENS)
    ]
    for old, new in BREAKS:
        broken = row.replace(old, new, 1)
        compiled = COMPILED(broken, TraceRequest, MOONCAKE_BLOCK_TOKENS)
        assert (compiled is not None) == ((old, new) == (",", ", ")), broken
        assert load(tmp_path, broken) == python_read(broken)
    # rows that fail the Python reader's own checks after decoding
    for bad in ('"input_length": 0', '"input_length": 1100', '"input_length": 400'):
        broken = row.replace('"input_length": 600', bad)
        assert COMPILED(broken, TraceRequest, MOONCAKE_BLOCK_TOKENS) is None
        assert "needs" in str(python_read(broken))


def test_the_shared_traces_read_alike() -> None:
    """Both Mooncake traces of the shared data, whole."""
    assert COMPILED is not None
    folder = Path(os.environ.get("KVLEDGER_SHARED_DATA", Path(__file__).parents[2] / "shared/data"))
    found = sorted((folder / "mooncake").glob("*.jsonl"))
    if not found:
        pytest.skip(f"no Mooncake traces under {folder}")
    for path in found:
        text = path.read_text(encoding="utf-8")
        compiled = COMPILED(text, TraceRequest, MOONCAKE_BLOCK_TOKENS)
        assert compiled is not None and compiled == python_read(text)


def test_bad_arguments() -> None:
    assert COMPILED is not None
    with pytest.raises(TypeError):
        COMPILED(b"{}", TraceRequest, 512)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        COMPILED("", dict, 512)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive"):
        COMPILED("", TraceRequest, 0)


@pytest.mark.parametrize("value, compiled", [("1", False), ("0", True), ("", True)])
def test_the_switch_turns_the_compiled_reader_off(value: str, compiled: bool) -> None:
    """``KVLEDGER_PYTHON_TRACE=1``: load_mooncake reads through json alone."""
    code = "from kvledger.mocker import traces as m; print(m._read_plain is m.COMPILED_READ)"
    out = python_with("KVLEDGER_PYTHON_TRACE", value, code)
    assert out.stdout.split() == [str(compiled)]
