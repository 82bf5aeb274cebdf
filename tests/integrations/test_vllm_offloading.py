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
NAMES_TESTS = "tests/kvledger/test_kvledger_manager_names.py"
LOG_TESTS = "tests/kvledger/test_kvledger_manager_log.py"
VIEWS_TESTS = "tests/kvledger/test_kvledger_manager_views.py"
CONFIG_TESTS = "tests/kvledger/test_kvledger_spec_config.py"
POLICY_TESTS = "tests/kvledger/test_kvledger_policies.py"
DISK_TIER_TESTS = "tests/kvledger/test_kvledger_disk_tier.py"
TIERING_E2E_TESTS = "tests/kvledger/test_kvledger_tiering_e2e.py"
PEER_TIER_TESTS = "tests/kvledger/test_kvledger_peer_tier.py"
#: vLLM's own tests of a secondary tier, run with kvledger's G3 tier in the place of vLLM's
#: fs tier and example tier (the harness conftest says which cannot apply, and why)
VLLM_TIER_TESTS = [
    "tests/v1/kv_offload/tiering/test_fs_tier.py",
    "tests/v1/kv_offload/tiering/test_tiering_offloading.py",
]
#: vLLM's ARC tests that use only the manager's public API: they run with kvledger's ARC
#: (``cache_policy="arc"``); the others read ARCCachePolicy's own lists (skipped, with why)
ARC_PUBLIC_API_TESTS = [
    "test_already_stored_chunk_not_evicted_during_prepare_store[arc]",
    "test_eviction_with_load",
]


@dataclass
class FileOutcome:
    passed: int = 0
    passed_names: list[str] = field(default_factory=list)
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
    cmd += [E2E_TESTS, NAMES_TESTS, LOG_TESTS, VIEWS_TESTS]
    cmd += [POLICY_TESTS, DISK_TIER_TESTS, TIERING_E2E_TESTS, PEER_TIER_TESTS, *VLLM_TIER_TESTS]
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
            outcome.passed_names.append(name)
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
    # only tests of CPUOffloadingManager's and its policies' private parts are skipped
    assert all("not applicable to kvledger" in why for why in outcome.skipped)


@pytest.mark.parametrize("name", ARC_PUBLIC_API_TESTS)
def test_vllms_arc_tests_pass_with_kvledgers_arc(
    vllm_run: dict[str, FileOutcome], name: str
) -> None:
    outcome = check(vllm_run, MANAGER_TESTS)
    assert name in outcome.passed_names, f"{name} did not pass: {outcome.skipped}"


def test_every_kvledger_policy_for_vllm_users(vllm_run: dict[str, FileOutcome]) -> None:
    # kvledger's manager and vLLM's CPU manager (through cache_policy_module_path) run lru,
    # arc, lineage and multi_lru; kvledger's ARC hits as vLLM's does; lineage keeps prefixes
    outcome = check(vllm_run, POLICY_TESTS)
    assert outcome.passed == 9 and not outcome.skipped


@pytest.mark.parametrize("target", CONNECTOR_TESTS)
def test_vllm_offloading_connector_tests_pass(
    vllm_run: dict[str, FileOutcome], target: str
) -> None:
    assert not check(vllm_run, target).skipped


def test_kvledger_spec_end_to_end_through_vllm_scheduler_and_connector(
    vllm_run: dict[str, FileOutcome],
) -> None:
    # through G2, and the retired G3 setting refused naming where G3 went
    assert check(vllm_run, E2E_TESTS).passed == 2


def test_kvledger_manager_names_blocks_with_parent_links(
    vllm_run: dict[str, FileOutcome],
) -> None:
    outcome = check(vllm_run, NAMES_TESTS)
    assert outcome.passed == 2 and not outcome.skipped


def test_kvledger_manager_hands_its_log_batches_and_bounds_the_hold(
    vllm_run: dict[str, FileOutcome],
) -> None:
    outcome = check(vllm_run, LOG_TESTS)
    assert outcome.passed == 3 and not outcome.skipped


def test_kv_connector_extra_config_mistakes_are_refused_by_name(
    vllm_run: dict[str, FileOutcome],
) -> None:
    outcome = check(vllm_run, CONFIG_TESTS)
    assert outcome.passed >= 19 and not outcome.skipped


@pytest.mark.parametrize("target", VLLM_TIER_TESTS)
def test_vllms_tiering_tests_pass_with_kvledgers_g3_tier(
    vllm_run: dict[str, FileOutcome], target: str
) -> None:
    outcome = check(vllm_run, target)
    # not applicable (with why), or vLLM's own skip of a test of the fs tier's C extension
    others = [why for why in outcome.skipped if "not applicable to kvledger" not in why]
    assert all("fs_io_C extension not built" in why for why in others), others
    # reported by name, so a run that stops exercising the tier shows
    print(f"{target}: {outcome.passed} passed with kvledger's G3 tier:")
    for name in outcome.passed_names:
        print(f"  {name}")


def test_kvledger_g3_tier_through_vllms_tier_interface(vllm_run: dict[str, FileOutcome]) -> None:
    # round trip, checksum failure as a per-key miss, eviction between lookup and load,
    # vLLM events, warm restart, bad settings refused, a log inside a data_dir not made yet;
    # the log replays to the tier
    outcome = check(vllm_run, DISK_TIER_TESTS)
    assert outcome.passed == 14 and not outcome.skipped


def test_g2_to_kvledger_g3_and_back_through_vllms_scheduler(
    vllm_run: dict[str, FileOutcome],
) -> None:
    # TieringOffloadingSpec with kvledger's G3 tier and policy: bytes G1 -> CPU -> G3 -> CPU
    # -> G1 identical, the log replays to the tier, a restarted engine serves the file; with
    # kvledger's G4 tier, engine B (G1 wiped, its model writing nothing) loads engine A's
    # blocks over NIXL from another process, and a block A reuses between B's lookup and read
    # is recomputed by B, whose engine goes on
    outcome = check(vllm_run, TIERING_E2E_TESTS)
    assert outcome.passed == 4 and not outcome.skipped


def test_worker_b_reads_worker_as_blocks_over_nixl_as_g4(vllm_run: dict[str, FileOutcome]) -> None:
    # two processes, real Redis and NIXL agents: B's promotions read A's exported blocks
    # byte-identical; a block A drops (or reuses) between B's lookup and read is a miss for
    # that key and B goes on; each worker's log replays to its state; the agent listens on
    # the devices KVLEDGER_G4_INTERFACE names
    outcome = vllm_run.get(PEER_TIER_TESTS)
    if outcome is not None and outcome.skipped and not outcome.passed and not outcome.failed:
        pytest.skip(f"kvledger's G4 tier test did not run: {outcome.skipped[0]}")
    assert check(vllm_run, PEER_TIER_TESTS).passed == 6


def test_the_vllm_manager_publishes_to_the_shared_registry_and_serves_metrics(
    vllm_run: dict[str, FileOutcome],
) -> None:
    # the one builder gives vLLM's manager what every entry point gets: its G2 blocks in the
    # shared registry as its log folds (a claimed worker id), kvledger's metrics on loopback
    # and vLLM's own KV events (it publishes its own stream) tell what the log replays to
    outcome = check(vllm_run, VIEWS_TESTS)
    assert outcome.passed == 3 and not outcome.skipped
