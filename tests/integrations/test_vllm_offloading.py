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
from dataclasses import dataclass, field
from pathlib import Path
from xml.etree import ElementTree

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


MANAGER_TESTS = "tests/v1/kv_offload/cpu/test_manager.py"
E2E_TESTS = "tests/kvledger/test_kvledger_offloading_e2e.py"
G3_MANAGER_TESTS = "tests/kvledger/test_kvledger_manager_g3.py"
NAMES_TESTS = "tests/kvledger/test_kvledger_manager_names.py"
MACHINE_TESTS = "tests/kvledger/test_kvledger_manager_g3_machine.py"
WORKER_TESTS = "tests/kvledger/test_kvledger_worker_g3.py"
LOG_TESTS = "tests/kvledger/test_kvledger_manager_log.py"
CONFIG_TESTS = "tests/kvledger/test_kvledger_spec_config.py"


@dataclass
class FileOutcome:
    passed: int = 0
    failed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, FileOutcome]:
    """One pytest run in the vLLM test venv (its start-up costs ~15 s), over every target,
    with this checkout's harness and kvledger's own tests (``vllm_e2e/``) copied in; outcomes
    per test file."""
    shutil.copy(HERE / "vllm_harness" / "conftest.py", VLLM_TESTS / "tests" / "conftest.py")
    ours = VLLM_TESTS / "tests" / "kvledger"
    ours.mkdir(exist_ok=True)
    (ours / "__init__.py").touch()
    for test_file in (HERE / "vllm_e2e").glob("test_*.py"):
        shutil.copy(test_file, ours)
    report = tmp_path_factory.mktemp("vllm") / "report.xml"
    env = {
        **os.environ,
        "KVLEDGER_VLLM_MANAGER": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_LOGGING_LEVEL": "ERROR",
    }
    cmd = [str(PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]
    cmd += ["-c", "pyproject.toml", "--rootdir", ".", MANAGER_TESTS, *CONNECTOR_TESTS]
    cmd += [E2E_TESTS, G3_MANAGER_TESTS, NAMES_TESTS, MACHINE_TESTS, WORKER_TESTS, LOG_TESTS]
    cmd += [CONFIG_TESTS]
    proc = subprocess.run(
        cmd, cwd=VLLM_TESTS, env=env, capture_output=True, text=True, timeout=1200, check=False
    )
    if not report.exists():
        pytest.fail(
            f"the vLLM test run reported nothing:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        )
    outcomes: dict[str, FileOutcome] = {}
    for case in ElementTree.parse(report).iter("testcase"):
        path = case.get("classname", "").split(".")
        name = case.get("name", "")
        module = "/".join(p for p in path if not p[:1].isupper()) + ".py"
        outcome = outcomes.setdefault(module, FileOutcome())
        if case.find("failure") is not None or case.find("error") is not None:
            outcome.failed.append(name)
        elif (skip := case.find("skipped")) is not None:
            outcome.skipped.append(f"{name}: {skip.get('message', '')}")
        else:
            outcome.passed += 1
    return outcomes


def check(outcomes: dict[str, FileOutcome], target: str) -> FileOutcome:
    outcome = outcomes.get(target)
    assert outcome is not None, f"{target} did not run: {sorted(outcomes)}"
    assert not outcome.failed, f"{target}: failed {outcome.failed}"
    assert outcome.passed > 0
    return outcome


def test_vllm_manager_tests_pass_against_kvledgers_manager(
    vllm_run: dict[str, FileOutcome],
) -> None:
    outcome = check(vllm_run, MANAGER_TESTS)
    # only tests of CPUOffloadingManager's private parts and ARC policy are skipped
    assert all("not applicable to kvledger" in why for why in outcome.skipped)


@pytest.mark.parametrize("target", CONNECTOR_TESTS)
def test_vllm_offloading_connector_tests_pass(
    vllm_run: dict[str, FileOutcome], target: str
) -> None:
    assert not check(vllm_run, target).skipped


def test_kvledger_spec_end_to_end_through_vllm_scheduler_and_connector(
    vllm_run: dict[str, FileOutcome],
) -> None:
    # through G2, through G3 below a small G2, and a bad G3 setting refused
    assert check(vllm_run, E2E_TESTS).passed == 3


def test_kvledger_manager_with_g3_through_vllms_interface(
    vllm_run: dict[str, FileOutcome],
) -> None:
    outcome = check(vllm_run, G3_MANAGER_TESTS)
    assert outcome.passed == 10 and not outcome.skipped


def test_kvledger_worker_moves_bytes_through_g3(vllm_run: dict[str, FileOutcome]) -> None:
    outcome = check(vllm_run, WORKER_TESTS)
    assert outcome.passed == 3 and not outcome.skipped


def test_kvledger_manager_names_blocks_with_parent_links(
    vllm_run: dict[str, FileOutcome],
) -> None:
    outcome = check(vllm_run, NAMES_TESTS)
    assert outcome.passed == 3 and not outcome.skipped


def test_kvledger_manager_hands_its_log_batches_and_bounds_the_hold(
    vllm_run: dict[str, FileOutcome],
) -> None:
    outcome = check(vllm_run, LOG_TESTS)
    assert outcome.passed == 3 and not outcome.skipped


def test_kv_connector_extra_config_mistakes_are_refused_by_name(
    vllm_run: dict[str, FileOutcome],
) -> None:
    outcome = check(vllm_run, CONFIG_TESTS)
    assert outcome.passed == 19 and not outcome.skipped


def test_kvledger_manager_with_g3_as_a_state_machine(vllm_run: dict[str, FileOutcome]) -> None:
    outcome = vllm_run.get(MACHINE_TESTS)
    if outcome is not None and outcome.skipped and not outcome.passed and not outcome.failed:
        pytest.skip(
            "the vLLM test venv has no hypothesis: rerun "
            f"tests/integrations/setup_vllm_test_venv.sh ({outcome.skipped[0]})"
        )
    assert check(vllm_run, MACHINE_TESTS).passed == 2
