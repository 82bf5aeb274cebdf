"""Python in a fresh process with one of kvledger's ``KVLEDGER_PYTHON_*`` switches set.

Each switch is read once, when its module is imported, so the tests of the compiled parts check
it in a process of its own: this is the one way they start it.
"""

from __future__ import annotations

import os
import subprocess
import sys


def python_with(
    variable: str, value: str, code: str, *args: str, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """``python -c code args...`` with ``variable=value`` added to this environment; its
    output as text (``check``: a failure raises)."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env={**os.environ, variable: value},
        capture_output=True,
        text=True,
        check=check,
    )
