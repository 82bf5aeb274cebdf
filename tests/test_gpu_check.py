"""The GPU check kit where there is no GPU: ``bench/gpu_check.py``'s dry run checks that every
piece it would run imports and says it skipped; its CPU rehearsal runs every part at toy sizes
through the same orchestration (time boxes, failures, the summary) the GPU run uses; the wheel
kit slims NIXL's wheel into one pip still installs, cuts the vLLM slice the check carries, and
says what stays behind when the set does not fit. No timing is asserted."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
VLLM_PYTHON = ROOT / ".vllm-test-venv" / "bin" / "python"
SGLANG_PYTHON = ROOT / ".sglang-test-venv" / "bin" / "python"
PARTS = ["gpu-tests", "g1-g2", "g3", "g4", "vllm", "sglang"]

no_cuda = pytest.mark.skipif(
    torch.cuda.is_available(), reason="with CUDA the check measures: run it by hand"
)


def check(
    out: Path, *args: str, timeout: float = 600
) -> tuple[subprocess.CompletedProcess[str], Any]:
    scratch = out / "scratch"  # not the default under the checkout's kvledger-data
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH / "gpu_check.py"),
            "--out",
            str(out),
            "--scratch",
            str(scratch),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    summary = out / "summary.json"
    return done, json.loads(summary.read_text()) if summary.exists() else None


def wheels_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_wheels", BENCH / "gpu_wheels.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def engine_import(engine: str, python: Path, result: str) -> None:
    """An engine part imports where its test venv exists, and is unavailable, saying how to
    get it, where it does not."""
    if python.exists():
        assert result == "ok", f"{engine}: {result}"
    else:
        assert result.startswith("unavailable") and f"make {engine}-venv" in result


@no_cuda
def test_dry_run_checks_every_piece_imports_and_says_it_skipped(tmp_path: Path) -> None:
    done, summary = check(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert '"skipped": "no CUDA device"' in done.stdout
    assert summary["skipped"] == "no CUDA device"
    assert list(summary["imports"]) == PARTS
    for part in ("gpu-tests", "g1-g2", "g3", "g4"):
        assert summary["imports"][part] == "ok", f"{part}: {summary['imports'][part]}"
    engine_import("vllm", VLLM_PYTHON, summary["imports"]["vllm"])
    engine_import("sglang", SGLANG_PYTHON, summary["imports"]["sglang"])
    assert "parts" not in summary  # nothing was measured


@no_cuda
def test_dry_run_fails_when_a_piece_does_not_import(tmp_path: Path) -> None:
    # the vLLM part given an interpreter and a path without vLLM's modules: a broken kit
    done, summary = check(
        tmp_path, "--only", "vllm", "--vllm-python", sys.executable, "--vllm-path", str(tmp_path)
    )
    assert done.returncode == 1
    assert "No module named 'vllm'" in summary["imports"]["vllm"]


def rows(part: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["route"]: row for row in part["report"]["rows"]}


@no_cuda
@pytest.mark.slow
def test_cpu_rehearsal_runs_every_part_into_one_summary(tmp_path: Path) -> None:
    done, summary = check(tmp_path, "--cpu-rehearsal")
    parts = summary["parts"]
    assert list(parts) == PARTS
    for name, part in parts.items():
        if (
            name in ("vllm", "sglang")
            and not (VLLM_PYTHON if name == "vllm" else SGLANG_PYTHON).exists()
        ):
            assert part["status"] == "unavailable"
            continue
        assert part["status"] == "ok", f"{name}: {part}"
        assert (tmp_path / part["log"]).exists()
    assert done.returncode == 0, done.stdout[-3000:]
    assert parts["gpu-tests"]["passed"] == 0 and parts["gpu-tests"]["skipped"] > 0

    g1_g2 = rows(parts["g1-g2"])
    for route in ("G1->G2", "G2->G1", "G1->G2 layers apart", "G2->G1 fully contiguous"):
        assert len(g1_g2[route]["ratios"]) == 2  # every repetition's ratio, here --reps 2
        assert g1_g2[route]["reference"] == "memcpy (copy_)"
    assert any(route.endswith("(direct)") for route in g1_g2)
    assert isinstance(parts["g1-g2"]["met"], bool)
    g3 = rows(parts["g3"])
    assert {"G2->G3", "G3->G2", "G1->G3", "G3->G1"} <= set(g3)
    assert g3["G3 I/O path"]["value"].startswith("posix")  # no kvikio without CUDA here

    g4 = {(r["route"], r["op"], r["setting"]): r for r in parts["g4"]["rows"]}
    assert g4[("dram->dram", "read", "default")]["nixl_gbps"] > 0
    assert "CPU build" in g4[("vram->vram", "read", "default")]["skipped"]
    assert parts["g4"]["met"] is None  # VRAM not measured here, and the summary says so
    assert any("NIXL flavour loaded" in line for line in parts["g4"]["stack"])
    if VLLM_PYTHON.exists():
        assert "vLLM load G2->G1, one allocation" in rows(parts["vllm"])
    if SGLANG_PYTHON.exists():
        assert "SGLang batch_get_v1 into host pool" in rows(parts["sglang"])
    table = done.stdout[: done.stdout.index("{")]
    assert "g1-g2: G1->G2 and G2->G1 >= 0.9" in table and "g4: " in table


@no_cuda
def test_a_part_over_its_box_or_failing_is_recorded_and_the_rest_still_run(
    tmp_path: Path,
) -> None:
    done, summary = check(
        tmp_path,
        "--cpu-rehearsal",
        *("--only", "g1-g2,vllm,g3", "--boxes", "g1-g2=0.5"),
        *("--vllm-python", sys.executable, "--vllm-path", str(tmp_path)),
    )
    parts = summary["parts"]
    assert done.returncode == 1
    assert parts["g1-g2"]["status"] == "timeout" and parts["g1-g2"]["exit"] == 124
    assert parts["vllm"]["status"] == "failed"
    assert any("No module named 'vllm'" in line for line in parts["vllm"]["log_tail"])
    assert parts["g3"]["status"] == "ok" and "G2->G3" in rows(parts["g3"])


def test_nixl_loads_its_flavour_without_the_meta_package() -> None:
    """The remote-cu12/-cu13 extras install one flavour and no ``nixl`` meta package."""
    if importlib.util.find_spec("nixl_cu13") is None:
        pytest.skip("nixl-cu13 is not installed")
    code = (
        "import sys; sys.modules['nixl'] = None\n"  # as if the meta package were absent
        "from kvledger.tiers.remote.nixl import nixl_api, nixl_flavour\n"
        "api = nixl_api(); print(nixl_flavour(), api.__name__)"
    )
    done = subprocess.run(
        [sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    expected = f"nixl_cu{torch.version.cuda.split('.')[0]}" if torch.version.cuda else "nixl_cu13"
    assert done.stdout.split() == [expected, f"{expected}._api"]


def fake_nixl_wheel(path: Path, files: dict[str, bytes]) -> None:
    info = "nixl_cu13-1.5.1.dist-info"
    files = {
        **files,
        f"{info}/METADATA": b"Metadata-Version: 2.1\nName: nixl-cu13\nVersion: 1.5.1\n",
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = "".join(f"{name},,{len(data)}\n" for name, data in files.items())
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
        wheel.writestr(f"{info}/RECORD", record + f"{info}/RECORD,,\n")


def test_slim_drops_what_kvledger_never_loads_and_pip_installs_the_rest(tmp_path: Path) -> None:
    wheel = tmp_path / "nixl_cu13-1.5.1-py3-none-any.whl"
    kept = {
        "nixl_cu13/__init__.py": b"",
        "nixl_cu13/_api.py": b"API = 1\n",
        "nixl_cu13.libs/ucx/libuct_cuda.so.0.0.0": b"\0" * 64,
        "nixl_cu13.libs/nixl/libplugin_UCX.so": b"\0" * 64,
    }
    gone = {
        "nixl_ep_cu13/nixl_ep_cpp_torch214.cpython-312-x86_64-linux-gnu.so": b"\1" * 4096,
        "nixl_cu13.scripts/telemetry_reader": b"\1" * 100,
        "nixl_cu13-1.5.1.data/headers/asio.hpp": b"//",
        "nixl_cu13.libs/ucx/libucx_perftest_cuda.so.0.0.0": b"\1" * 100,
    }
    fake_nixl_wheel(wheel, {**kept, **gone})
    dropped = wheels_module().slim(wheel)
    assert len(dropped) == 4 and all(size > 0 for size in dropped.values())
    with zipfile.ZipFile(wheel) as slimmed:
        names = set(slimmed.namelist())
        record = slimmed.read("nixl_cu13-1.5.1.dist-info/RECORD").decode()
    assert set(kept) <= names and not set(gone) & names
    assert not any(name in record for name in gone)
    target = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index"]
    done = subprocess.run(
        [*pip, "--target", str(target), str(wheel)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert (target / "nixl_cu13" / "_api.py").read_text() == "API = 1\n"


def test_fit_leaves_groups_behind_in_order_and_says_what_the_check_loses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gw = wheels_module()
    carried = tmp_path / ".gpu-wheels"
    for group, mib in [("core", 1), ("sglang", 20), ("nixl", 45)]:
        (carried / group).mkdir(parents=True)
        with (carried / group / f"{group}.whl").open("wb") as f:
            f.truncate(mib << 20)  # sparse: the size counts, nothing is written
    assert gw.fit(carried) is True
    out = capsys.readouterr().out
    assert "does not fit: left behind" in out and "the sglang part" in out
    assert not (carried / "sglang").exists() and (carried / "nixl").exists()
    assert "fits: yes" in out


def test_requirements_leave_out_what_the_gpu_image_has() -> None:
    names = [r.split(">")[0].split("[")[0] for r in wheels_module().requirements()]
    assert "sqlalchemy" in names and "pyzmq" in names
    assert "torch" not in names and "numpy" not in names


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="needs the vLLM test venv (make vllm-venv)")
def test_vllm_slice_holds_every_vllm_module_the_worker_imports(tmp_path: Path) -> None:
    gw = wheels_module()
    dest = tmp_path / "vllm-slice"
    copied = gw.cut_slice(str(VLLM_PYTHON), "kvledger.integrations.vllm.worker", "vllm", dest)
    assert "vllm/v1/kv_offload/base.py" in copied and "vllm/__init__.py" in copied
    # the main venv has no vLLM: with the slice alone on the path the worker imports
    gw.verify_slice(sys.executable, "kvledger.integrations.vllm.worker", "vllm", dest)
    (dest / "vllm" / "v1" / "kv_offload" / "base.py").unlink()
    with pytest.raises(subprocess.CalledProcessError):
        gw.verify_slice(sys.executable, "kvledger.integrations.vllm.worker", "vllm", dest)
