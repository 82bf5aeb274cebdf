"""kvledger's SGLang HiCache backend tests (``tests/integrations/sglang/``), run in the SGLang
test venv: SGLang's import chain needs triton, aiohttp and more that this suite's venv does not
carry, so they run in a venv layered over it (``make sglang-venv``, which ``make test`` runs;
``tests/integrations/setup_sglang_test_venv.sh`` says what it holds and why). One test here per
test function there, so a failure names the SGLang test that failed.
"""

from __future__ import annotations

import ast
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from xml.etree import ElementTree

import pytest

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".sglang-test-venv" / "bin" / "python"
SGLANG_TESTS = Path(__file__).resolve().parent / "sglang"

pytestmark = pytest.mark.skipif(
    not PYTHON.exists(),
    reason="the SGLang test venv is absent (building it fetches SGLang 0.5.23 from PyPI): "
    "run `make sglang-venv` (or `bash tests/integrations/setup_sglang_test_venv.sh`)",
)


def sglang_test_functions() -> list[str]:
    """The test functions of the SGLang test files, read without importing them (they import
    SGLang, which this interpreter lacks)."""
    names = []
    for path in sorted(SGLANG_TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text(), str(path))
        names += [
            f"{path.stem}::{node.name}"
            for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
        ]
    return names


@dataclass
class Run:
    returncode: int
    output: str
    passed: dict[str, int] = field(default_factory=dict)
    failed: dict[str, list[str]] = field(default_factory=dict)
    skipped: dict[str, list[str]] = field(default_factory=dict)


@pytest.fixture(scope="module")
def sglang_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One pytest run in the SGLang test venv over every SGLang test file; outcomes per test
    function (a parametrized function's cases counted together)."""
    report = tmp_path_factory.mktemp("sglang") / "report.xml"
    cmd = [str(PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]
    proc = subprocess.run(
        [*cmd, str(SGLANG_TESTS)],
        cwd=REPO,
        env=os.environ,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    run = Run(proc.returncode, proc.stdout[-3000:] + proc.stderr[-3000:])
    if not report.exists():
        pytest.fail(f"the SGLang test run reported nothing:\n{run.output}")
    for case in ElementTree.parse(report).iter("testcase"):
        module = case.get("classname", "").rsplit(".", 1)[-1]
        name = f"{module}::{case.get('name', '').split('[')[0]}"
        if case.find("failure") is not None or case.find("error") is not None:
            run.failed.setdefault(name, []).append(case.get("name", ""))
        elif (skip := case.find("skipped")) is not None:
            run.skipped.setdefault(name, []).append(skip.get("message", ""))
        else:
            run.passed[name] = run.passed.get(name, 0) + 1
    return run


@pytest.mark.parametrize("function", sglang_test_functions())
def test_sglang_backend_test_passes_in_the_sglang_venv(sglang_run: Run, function: str) -> None:
    assert function not in sglang_run.failed, f"failed: {sglang_run.failed[function]}"
    assert function not in sglang_run.skipped, f"skipped: {sglang_run.skipped[function]}"
    assert sglang_run.passed.get(function, 0) > 0, f"{function} did not run:\n{sglang_run.output}"


def test_the_sglang_run_is_whole(sglang_run: Run) -> None:
    """Nothing ran that is not reported above, nothing failed outside a test (collection,
    fixtures), and the run's exit status says so too."""
    reported = set(sglang_run.passed) | set(sglang_run.failed) | set(sglang_run.skipped)
    assert reported == set(sglang_test_functions()), sglang_run.output
    assert sglang_run.returncode == 0, sglang_run.output
