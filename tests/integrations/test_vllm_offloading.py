"""vLLM 0.33's own offloading tests, and kvledger's end-to-end test through vLLM's scheduler,
run in the vLLM test venv (vLLM cannot share this interpreter: it pins its own numpy, torch
build and transformers). Build the venv with ``bash tests/integrations/setup_vllm_test_venv.sh``.

With ``KVLEDGER_VLLM_MANAGER=1`` the harness conftest points every test module that builds
vLLM's ``CPUOffloadingManager`` at kvledger's manager: the manager tests of
``tests/v1/kv_offload/cpu/test_manager.py`` and the connector tests that use a real manager.
Tests that read that class's private parts are skipped, each with its reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".vllm-test-venv"
PYTHON = VENV / "bin" / "python"
VLLM_TESTS = VENV / "vllm-tests"
HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.skipif(
    not (PYTHON.exists() and (VLLM_TESTS / "pyproject.toml").exists()),
    reason="the vLLM test venv is absent: bash tests/integrations/setup_vllm_test_venv.sh",
)

CONNECTOR_TESTS = [
    "tests/v1/kv_connector/unit/offloading_connector/test_scheduler.py",
    "tests/v1/kv_connector/unit/offloading_connector/test_events.py",
    "tests/v1/kv_connector/unit/offloading_connector/test_metrics.py",
]


def run_in_vllm_venv(*targets: str) -> subprocess.CompletedProcess[str]:
    """pytest in the vLLM test venv on ``targets``, with this checkout's harness and test."""
    shutil.copy(HERE / "vllm_harness" / "conftest.py", VLLM_TESTS / "tests" / "conftest.py")
    ours = VLLM_TESTS / "tests" / "kvledger"
    ours.mkdir(exist_ok=True)
    (ours / "__init__.py").touch()
    shutil.copy(HERE / "vllm_e2e" / "test_kvledger_offloading_e2e.py", ours)
    env = {
        **os.environ,
        "KVLEDGER_VLLM_MANAGER": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_LOGGING_LEVEL": "ERROR",
    }
    cmd = [str(PYTHON), "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
    cmd += ["-c", "pyproject.toml", "--rootdir", ".", *targets]
    return subprocess.run(
        cmd, cwd=VLLM_TESTS, env=env, capture_output=True, text=True, timeout=1200, check=False
    )


def assert_passed(proc: subprocess.CompletedProcess[str]) -> None:
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and " failed" not in proc.stdout, tail


def test_vllm_manager_tests_pass_against_kvledgers_manager() -> None:
    assert_passed(run_in_vllm_venv("tests/v1/kv_offload/cpu/test_manager.py"))


def test_kvledger_spec_end_to_end_through_vllm_scheduler_and_connector() -> None:
    assert_passed(run_in_vllm_venv("tests/kvledger"))


@pytest.mark.slow
def test_vllm_offloading_connector_tests_pass() -> None:
    assert_passed(run_in_vllm_venv(*CONNECTOR_TESTS))
