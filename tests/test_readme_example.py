"""The README's library example runs as written, in an empty folder, on a machine without a
GPU: the test reads the snippet out of README.md, so the README cannot drift from the code."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def library_example() -> str:
    section = README.read_text().split("## Library API", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README's Library API section has no python block"
    return match.group(1)


def test_the_library_example_runs_as_written_in_an_empty_folder(tmp_path: Path) -> None:
    (tmp_path / "example.py").write_text(library_example())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVLEDGER_", "DYN_KVBM_"))}
    env["CUDA_VISIBLE_DEVICES"] = ""  # as on a laptop without a GPU
    proc = subprocess.run(
        [sys.executable, "example.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("MatchResult(")
    data = tmp_path / "kvledger-data"
    assert (data / "events.db").is_file() and (data / "g3-slots.bin").is_file()
