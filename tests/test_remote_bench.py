"""The G4 bench and its UCX diagnosis run where there is no GPU: DRAM rows move and check real
bytes between two processes over NIXL, GPU rows are skipped with the reason, and the
``UCX_PROTO_INFO`` parser picks the data-path table out of UCX's output. No timing is asserted."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kvledger.tiers.remote import nixl_unavailable_reason

BENCH = Path(__file__).resolve().parent.parent / "bench"
needs_nixl = pytest.mark.skipif(
    nixl_unavailable_reason() is not None, reason=str(nixl_unavailable_reason())
)
SMALL = ["--blocks", "4", "--block-mib", "0.25", "--repeat", "1"]


def diag_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("nixl_ucx_diag", BENCH / "nixl_ucx_diag.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, NIXL_LOG_LEVEL="WARN")
    return subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )


@needs_nixl
@pytest.mark.parametrize("op", ["read", "write"])
def test_bench_moves_verified_bytes_between_two_processes(op: str) -> None:
    out = run("nixl_bench.py", "--op", op, *SMALL)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1].removeprefix("RESULT "))
    assert result["route"] == "dram->dram" and result["op"] == op
    assert result["bytes"] == 4 * 256 * 1024
    assert result["nixl_gbps"] > 0
    assert "bytes verified" in out.stdout


@needs_nixl
def test_diag_reports_ucx_and_runs_what_this_machine_can(tmp_path: Path) -> None:
    report = tmp_path / "diag.json"
    out = run(
        "nixl_ucx_diag.py",
        "--rows",
        "dram-read,vram-read",
        "--settings",
        "default",
        "--json",
        str(report),
        *SMALL,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "UCX version: 1." in out.stdout
    assert "NIXL flavour loaded: nixl_cu" in out.stdout
    rows = {r["route"]: r for r in json.loads(report.read_text())}
    dram = rows["dram->dram"]
    assert dram["exit"] == 0 and dram["nixl_gbps"] > 0
    assert any("remote memory read by ucp_get" in line for line in dram["protocols"])
    if diag_module().cuda_reason() is not None:
        assert rows["vram->vram"]["skipped"]
        assert "skipped: " in out.stdout


PROTO_INFO = """\
[1.1] [h:1 :0]   +--------+-------------+-----------------+
[1.1] [h:1 :0]   | kvl-w2-1 intra-node cfg#1                 |
[1.1] [h:1 :0]   | active message by ucp_am_send* from host memory |
[1.1] [h:1 :0]   +--------+-------------+-----------------+
[1.1] [h:1 :0]   |  Range | Description | Config |
[1.1] [h:1 :0]   | 8185..inf | multi-frag copy-in | tcp/lo |
[1.1] [h:1 :0]   +--------+-------------+-----------------+
[1.2] [h:1 :0]   +--------+-------------+-----------------+
[1.2] [h:1 :0]   | kvl-w2-1 intra-node cfg#1                 |
[1.2] [h:1 :0]   | remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda |
[1.2] [h:1 :0]   +--------+-------------+-----------------+
[1.2] [h:1 :0]   |  Range | Description | Config |
[1.2] [h:1 :0]   +--------+-------------+-----------------+
[1.2] [h:1 :0]   | 0..inf | software emulation | tcp/lo |
[1.2] [h:1 :0]   +--------+-------------+-----------------+
[1.3] [h:1 :0] ucp_worker.c:1997 UCX  INFO  kvl-w2-1 intra-node cfg#1 rma_am(tcp/lo)  am(tcp/lo)
"""


def test_proto_info_parser_keeps_the_data_path_not_the_active_messages() -> None:
    lines = diag_module().protocols(PROTO_INFO + PROTO_INFO, "read")
    assert lines == [
        "intra-node cfg#1: remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda",
        "            0..inf | software emulation | tcp/lo",
        "  lanes: cfg#1 rma_am(tcp/lo)  am(tcp/lo)",
    ]
    assert diag_module().protocols(PROTO_INFO, "write") == [
        "  lanes: cfg#1 rma_am(tcp/lo)  am(tcp/lo)"
    ]
