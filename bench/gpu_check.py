"""Every GPU path of kvledger in one time-boxed run: one JSON summary and a short table.

A GPU is at hand only now and then, for minutes, so this is one command that runs, on one GPU,
within ``--budget`` seconds (default 450: under 8 minutes with the install), each of:

- ``gpu-tests``: the suite's tests marked ``gpu`` (``pytest -m gpu`` over the files that mark
  them), counts and the names of failures;
- ``g1-g2``: ``bench/transfer_bench.py --skip-g3 --reps 7``: every G1 <-> G2 copy route
  (one-op gather, layers in separate allocations, fully contiguous, the direct route for a few
  blocks) and the engine's own copies alone on 1, 2 and 4 streams, each against one pinned
  ``copy_`` of the same bytes, with every repetition's ratio;
- ``g3``: ``bench/transfer_bench.py --skip-memory``: G2 <-> G3 and G1 <-> G3 through kvikio
  (``--g3-backend kvikio`` when it imports; it says whether it ran GPUDirect Storage or its
  compatibility mode), and kvikio on device memory straight, against O_DIRECT reads and writes;
- ``g4``: ``bench/nixl_ucx_diag.py``: the UCX/NIXL stack and NVLink state, then NIXL between two
  processes, from GPU memory (READ and WRITE) and from host memory, with the UCX settings
  kvledger uses (UCX's defaults) and with ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y``, against a device
  copy, with the protocol UCX chose for each;
- ``vllm``, ``sglang``: ``bench/engine_paths_bench.py``: kvledger's vLLM worker-side copies and
  SGLang page path on CUDA tensors, with the engines' own modules (``--vllm-python``/
  ``--vllm-path``, ``--sglang-python``/``--sglang-path``; default: the test venvs).

Each part is a subprocess in its own process group, killed at the end of its time box (its box
plus what earlier parts left unused); a part that fails or runs over is recorded as such, with
its log, and the rest still run. On a machine without CUDA it checks that every piece it would
run imports, in the interpreter and with the path it would run with, prints
``"skipped": "no CUDA device"`` and exits 0 (1 when a piece does not import; a part with no
engine modules at all is reported unavailable). ``--cpu-rehearsal`` runs every part here at toy
sizes instead: it checks the check, and measures nothing.

    python bench/gpu_check.py                     # here: the dry run
    bash bench/gpu_run.sh                         # on the GPU machine: install, then this
    python bench/gpu_check.py --out DIR --only g1-g2,g4

Writes ``DIR/summary.json`` and each part's log and JSON beside it (``--out``, default
``kvledger-data/gpu-check``); scratch files (G3) go to ``--scratch`` and are removed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvledger.events.files import private_folder
from kvledger.tiers.disk.fileio import kvikio_unavailable_reason

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
TARGET_G1_G2 = 0.9
TARGET_G4_VRAM = 0.5


@dataclass
class Part:
    """One piece of the check: the command that measures it, and what it must import."""

    name: str
    box_s: float
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    imports: list[str] = field(default_factory=list)  # modules, imported with bench/ on the path
    then: str = ""  # a statement run after them (loading an optional native library)
    import_command: list[str] | None = None  # or a command that checks its own imports
    json_out: Path | None = None
    unavailable: str | None = None  # why it cannot run here at all
    toy: list[str] = field(default_factory=list)  # arguments for toy sizes (--cpu-rehearsal)


def gpu_test_files() -> list[str]:
    """The test files that mark tests ``gpu``."""
    marked = re.compile(r"pytest\.mark\.gpu\b")
    return sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if marked.search(p.read_text())
    )


def engine_interpreter(python: str | None, venv: str) -> str | None:
    if python:
        return python
    candidate = ROOT / venv / "bin" / "python"
    return str(candidate) if candidate.exists() else None


def bench(script: str, *args: str | Path, python: str | None = None) -> list[str]:
    return [python or sys.executable, str(BENCH / script), *map(str, args)]


def make_parts(args: argparse.Namespace, out: Path, scratch: Path) -> list[Part]:
    pytest = [sys.executable, "-P", "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"]
    g3_backend = "kvikio" if kvikio_unavailable_reason() is None else "auto"
    parts = [
        Part(
            "gpu-tests",
            80,
            [*pytest, f"--junitxml={out / 'gpu-tests.xml'}", *gpu_test_files()],
            import_command=[*pytest, "--collect-only", *gpu_test_files()],
        ),
        Part(
            "g1-g2",
            60,
            bench("transfer_bench.py", "--skip-g3", "--reps", "7", "--json", out / "g1-g2.json"),
            imports=["transfer_bench"],
            json_out=out / "g1-g2.json",
            toy=["--blocks", "16", "--layers", "4", "--reps", "2"],
        ),
        Part(
            "g3",
            95,
            bench(
                "transfer_bench.py",
                *("--skip-memory", "--reps", "5", "--g3-backend", g3_backend),
                *("--g3-dir", scratch, "--json", out / "g3.json"),
            ),
            imports=["transfer_bench", "kvledger.tiers.disk.fileio"],
            json_out=out / "g3.json",
            toy=["--blocks", "16", "--layers", "4", "--reps", "2"],
        ),
        Part(
            "g4",
            135,
            bench(
                "nixl_ucx_diag.py",
                *("--rows", "vram-read,vram-write,dram-read", "--settings", "default,get_zcopy"),
                *("--repeat", "5", "--row-timeout", "40", "--json", out / "g4.json"),
            ),
            env={"NIXL_LOG_LEVEL": "WARN"},
            imports=["nixl_ucx_diag", "nixl_bench"],
            then="from kvledger.tiers.remote.nixl import nixl_api; nixl_api()",
            json_out=out / "g4.json",
            toy=["--blocks", "4", "--block-mib", "0.25", "--repeat", "1"],
        ),
    ]
    for engine, python, path, venv, reps in [
        ("vllm", args.vllm_python, args.vllm_path, ".vllm-test-venv", "7"),
        ("sglang", args.sglang_python, args.sglang_path, ".sglang-test-venv", "5"),
    ]:
        interpreter = engine_interpreter(python, venv) or (sys.executable if path else None)
        missing = (
            f"no {engine} modules: pass --{engine}-path (the slice bench/gpu_wheels.sh packs) or "
            f"--{engine}-python, or run make {engine}-venv"
        )
        parts.append(
            Part(
                engine,
                40,
                bench(
                    "engine_paths_bench.py",
                    *(engine, "--reps", reps, "--dir", scratch, "--json", out / f"{engine}.json"),
                    python=interpreter,
                ),
                env={"PYTHONPATH": str(Path(path).resolve())} if path else {},
                import_command=bench(
                    "engine_paths_bench.py", engine, "--imports-only", python=interpreter
                ),
                json_out=out / f"{engine}.json",
                unavailable=None if interpreter else missing,
                toy=["--blocks", "8", "--regions", "4", "--page-kib", "16", "--reps", "2"],
            )
        )
    return parts


# -- running ------------------------------------------------------------------------------------


def run(command: list[str], env: dict[str, str], limit_s: float, log: Path) -> tuple[int, float]:
    """Run ``command`` in its own process group, output to ``log``; kill the group at
    ``limit_s``. Returns the exit code (124 on the time limit) and the seconds it ran."""
    full_env = dict(os.environ, **env)
    started = time.monotonic()
    with log.open("w") as sink:
        sink.write(f"$ {' '.join(command)}\n")
        sink.flush()
        proc = subprocess.Popen(
            command, cwd=ROOT, env=full_env, stdout=sink, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            code = proc.wait(timeout=max(limit_s, 1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the part and every process it started
            proc.wait()
            code = 124
    return code, round(time.monotonic() - started, 1)


def log_tail(log: Path, lines: int = 12) -> list[str]:
    text = log.read_text(errors="replace").splitlines() if log.exists() else []
    return [ln[:300] for ln in text[-lines:]]


def run_part(part: Part, limit_s: float, out: Path) -> dict[str, Any]:
    if part.unavailable:
        return {"status": "unavailable", "reason": part.unavailable}
    log = out / f"{part.name}.log"
    for stale in (part.json_out, out / f"{part.name}.xml"):  # from an earlier run
        if stale is not None:
            stale.unlink(missing_ok=True)
    code, seconds = run(part.command, part.env, limit_s, log)
    result: dict[str, Any] = {"seconds": seconds, "box_s": round(limit_s), "exit": code}
    result["status"] = "ok" if code == 0 else "timeout" if code == 124 else "failed"
    if part.json_out is not None and part.json_out.exists():
        try:
            result["report"] = json.loads(part.json_out.read_text())
        except json.JSONDecodeError as exc:  # cut off mid-write at the end of its box
            result["report_error"] = f"{part.json_out.name}: {exc}"
    if code != 0:
        result["log_tail"] = log_tail(log)
    result["log"] = log.name
    return result


def check_imports(part: Part, out: Path) -> str:
    """Why a piece of ``part`` does not import where it would run, or "ok"."""
    if part.unavailable:
        return f"unavailable: {part.unavailable}"
    if part.import_command is not None:
        command = part.import_command
    else:
        code = (
            f"import sys; sys.path.insert(0, {str(BENCH)!r}); import importlib; "
            f"[importlib.import_module(m) for m in {part.imports!r}]; {part.then}"
        )
        command = [sys.executable, "-P", "-c", code]
    log = out / f"{part.name}.imports.log"
    code_, _ = run(command, part.env, 300, log)
    return "ok" if code_ == 0 else " / ".join(log_tail(log, 4))


# -- the summary --------------------------------------------------------------------------------


def summarize_tests(out: Path) -> dict[str, Any]:
    xml = out / "gpu-tests.xml"
    if not xml.exists():
        return {}
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    total = int(suite.get("tests", 0))
    failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    skipped = int(suite.get("skipped", 0))
    names = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return {
        "passed": total - failed - skipped,
        "failed": failed,
        "skipped": skipped,
        "failures": names,
    }


def summarize_g1_g2(report: dict[str, Any]) -> dict[str, Any]:
    rows = {r["route"]: r for r in report.get("rows", [])}
    every = [x for route in ("G1->G2", "G2->G1") for x in rows.get(route, {}).get("ratios", [])]
    return {
        "target": f"G1->G2 and G2->G1 >= {TARGET_G1_G2} of a pinned copy_ in every repetition",
        "met": min(every) >= TARGET_G1_G2 if every else None,
        "lowest": min(every) if every else None,
    }


def summarize_g4(report: list[dict[str, Any]], log: Path) -> dict[str, Any]:
    device_copy = next(
        (r["ref_gbps"] for r in report if r.get("route") == "vram->vram" and "ref_gbps" in r), None
    )
    rows = []
    for r in report:
        row = {k: r[k] for k in ("route", "op", "setting", "nixl_gbps", "ref_gbps") if k in r}
        if "nixl_gbps" in r and r.get("ref_gbps"):
            row["ratio"] = round(r["nixl_gbps"] / r["ref_gbps"], 4)
            if device_copy:
                row["vs_device_copy"] = round(r["nixl_gbps"] / device_copy, 4)
        for k in ("skipped", "error", "protocols"):
            if k in r:
                row[k] = r[k]
        rows.append(row)
    default = next(
        (r for r in rows if (r.get("route"), r.get("op"), r.get("setting"))
         == ("vram->vram", "read", "default")), {},
    )  # fmt: skip
    ratio = default.get("ratio")
    summary: dict[str, Any] = {
        "target": f"VRAM->VRAM READ with kvledger's UCX settings >= {TARGET_G4_VRAM} of a device "
        "copy, or the measured cause",
        "met": None if ratio is None else ratio >= TARGET_G4_VRAM,
        "vram_read_ratio": ratio,
        "rows": rows,
    }
    if ratio is not None and ratio < TARGET_G4_VRAM:
        fix = next(
            (r for r in rows if (r.get("route"), r.get("op"), r.get("setting"))
             == ("vram->vram", "read", "get_zcopy")), {},
        )  # fmt: skip
        write = next(
            (r for r in rows if (r.get("route"), r.get("op"), r.get("setting"))
             == ("vram->vram", "write", "default")), {},
        )  # fmt: skip
        summary["cause"] = {
            "protocols_default": default.get("protocols", []),
            "with_get_zcopy_ratio": fix.get("ratio"),
            "write_default_ratio": write.get("ratio"),
        }
    if log.exists():
        keep = re.compile(r"NIXL flavour|UCX version|CUDA IPC|NVLink|nvlink|GPU 0:|get zcopy")
        summary["stack"] = [
            ln.strip()[:200] for ln in log.read_text().splitlines() if keep.search(ln)
        ][:20]
    return summary


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    smi = shutil.which("nvidia-smi")
    if smi:
        query = "--query-gpu=name,driver_version,memory.total"
        done = subprocess.run(
            [smi, query, "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
        info["gpus"] = [ln.strip() for ln in done.stdout.splitlines() if ln.strip()]
    return info


def table(summary: dict[str, Any]) -> list[str]:
    lines = [f"{'part':10} {'status':12} {'s':>6}  figures"]
    for name, r in summary["parts"].items():
        figures = ""
        report = r.get("report")
        if name == "gpu-tests" and "passed" in r:
            figures = f"{r['passed']} passed, {r['failed']} failed, {r['skipped']} skipped"
        elif name in ("g1-g2", "g3", "vllm", "sglang") and isinstance(report, dict):
            figures = "; ".join(
                f"{row['route']} {row['ratio']:.3f}"
                + (
                    f" [{min(row['ratios']):.2f}-{max(row['ratios']):.2f}]"
                    if row.get("ratios")
                    else ""
                )
                for row in report.get("rows", [])
                if "ratio" in row
            )
        elif name == "g4" and "rows" in r:
            figures = "; ".join(
                f"{x['route']} {x['op']} [{x['setting']}] {x.get('nixl_gbps', '-')} GB/s"
                + (f" ({x['ratio']:.3f})" if "ratio" in x else "")
                for x in r["rows"]
            )
        elif r.get("reason") or r.get("log_tail"):
            figures = (r.get("reason") or r["log_tail"][-1])[:160]
        lines.append(f"{name:10} {r['status']:12} {r.get('seconds', ''):>6}  {figures}")
    for name in ("g1-g2", "g4"):
        r = summary["parts"].get(name, {})
        if "met" in r:
            verdict = {True: "met", False: "NOT met", None: "not measured"}[r["met"]]
            lines.append(f"{name}: {r['target']}: {verdict}")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "kvledger-data" / "gpu-check"))
    p.add_argument("--scratch", default=str(ROOT / "kvledger-data" / "gpu-check-scratch"))
    p.add_argument("--budget", type=float, default=450, help="seconds for all parts together")
    p.add_argument("--only", help="comma list of parts to run")
    p.add_argument("--vllm-python", help="interpreter for the vLLM part")
    p.add_argument("--vllm-path", help="folder with vLLM's modules, put on PYTHONPATH")
    p.add_argument("--sglang-python", help="interpreter for the SGLang part")
    p.add_argument("--sglang-path", help="folder with SGLang's modules, put on PYTHONPATH")
    p.add_argument("--boxes", help="time boxes to change, e.g. g4=200,vllm=60 (seconds)")
    p.add_argument("--dry-run", action="store_true", help="only the import checks, even on CUDA")
    p.add_argument(
        "--cpu-rehearsal",
        action="store_true",
        help="run every part here without CUDA, at toy sizes: checks the check, measures nothing",
    )
    args = p.parse_args()
    started = time.monotonic()
    out, scratch = Path(args.out), Path(args.scratch)
    private_folder(out)  # owner-only, as kvledger makes its folders (and a missing parent)
    private_folder(scratch)
    parts = make_parts(args, out, scratch)
    names = [part.name for part in parts]
    if args.only:
        wanted = args.only.split(",")
        if set(wanted) - set(names):
            p.error(f"unknown parts {sorted(set(wanted) - set(names))}; parts: {names}")
        parts = [part for part in parts if part.name in wanted]
    for item in args.boxes.split(",") if args.boxes else []:
        name, _, seconds = item.partition("=")
        if name not in names:
            p.error(f"--boxes: unknown part {name!r}; parts: {names}")
        for part in parts:
            if part.name == name:
                part.box_s = float(seconds)
    if args.cpu_rehearsal:
        for part in parts:
            part.command += part.toy
    summary: dict[str, Any] = {"check": "kvledger gpu_check", "machine": machine()}
    if args.dry_run or not (torch.cuda.is_available() or args.cpu_rehearsal):
        summary["skipped"] = "no CUDA device" if not torch.cuda.is_available() else "--dry-run"
        summary["imports"] = {part.name: check_imports(part, out) for part in parts}
        summary["kvikio"] = kvikio_unavailable_reason() or "importable"
        broken = [k for k, v in summary["imports"].items() if v != "ok" and "unavailable" not in v]
        code = 1 if broken else 0
    else:
        summary["rehearsal"] = args.cpu_rehearsal
        summary["budget_s"] = args.budget
        summary["parts"] = {}
        deadline = started + args.budget
        for i, part in enumerate(parts):
            # its own box, plus what the parts before it left of theirs, within the budget
            left_over = sum(x.box_s for x in parts[:i]) - (time.monotonic() - started)
            limit = min(part.box_s + max(left_over, 0), deadline - time.monotonic())
            if limit < min(part.box_s, 5):
                summary["parts"][part.name] = {"status": "no time left", "seconds": 0}
                continue
            print(f"== {part.name} (up to {limit:.0f} s)", flush=True)
            summary["parts"][part.name] = run_part(part, limit, out)
        parts_out = summary["parts"]
        if "gpu-tests" in parts_out:
            parts_out["gpu-tests"].update(summarize_tests(out))
        if isinstance(parts_out.get("g1-g2", {}).get("report"), dict):
            parts_out["g1-g2"].update(summarize_g1_g2(parts_out["g1-g2"]["report"]))
        g3 = parts_out.get("g3", {}).get("report")
        if isinstance(g3, dict):
            kvikio = [r for r in g3.get("rows", []) if r["route"] == "kvikio path"]
            parts_out["g3"]["kvikio"] = (
                kvikio[0]["detail"] if kvikio else kvikio_unavailable_reason()
            )
        if isinstance(parts_out.get("g4", {}).get("report"), list):
            g4 = parts_out["g4"]
            g4.update(summarize_g4(g4.pop("report"), out / "g4.log"))
        code = 0 if all(r["status"] == "ok" for r in parts_out.values()) else 1
        for line in table(summary):
            print(line)
    shutil.rmtree(scratch, ignore_errors=True)
    summary["wall_s"] = round(time.monotonic() - started, 1)
    text = json.dumps(summary, indent=1, default=str)
    (out / "summary.json").write_text(text)
    print(text)
    return code


if __name__ == "__main__":
    sys.exit(main())
