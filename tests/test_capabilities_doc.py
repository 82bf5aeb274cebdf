"""docs/capabilities.md names, in each cell of its table, the test that proves it: each one
must exist, so the table cannot claim what no test checks."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "docs" / "capabilities.md"
NAMED = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def test_every_cell_names_a_test_that_exists() -> None:
    text = TABLE.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    cells = [cell for row in rows[1:] for cell in row.strip("|").split("|")[1:]]
    assert len(cells) == 18  # six capabilities, three entry points
    for cell in cells:
        assert "✔" in cell, f"a cell without its check mark: {cell.strip()}"
        found = NAMED.findall(cell)
        assert found, f"a cell that names no test: {cell.strip()}"
        for path, name in found:
            source = (ROOT / path).read_text()
            assert re.search(rf"^def {name}\(", source, re.M), f"{path}::{name} does not exist"
