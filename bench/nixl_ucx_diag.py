"""Why NIXL moves GPU memory slowly here: UCX's build, its CUDA transports, and a settings matrix.

One run on a CUDA machine answers it; on a machine without CUDA the GPU rows are skipped with
the reason and the DRAM rows still run. Three parts:

1. The stack: torch and its CUDA, which NIXL flavour loaded (``nixl_cu12``/``nixl_cu13``), the
   UCX version and module directory bundled in that wheel, whether the CUDA libraries UCX's
   ``libuct_cuda`` needs (``libcuda.so.1``, ``libnvidia-ml.so.1``) resolve, NVLink state, and
   whether CUDA IPC works between two processes at all (torch, no UCX).
2. ``ucx_info -d``'s substance from the bundled library itself (the wheel ships no
   ``ucx_info``): a UCP context and worker made through ``ctypes`` print their transports, with
   ``UCX_LOG_LEVEL=debug`` lines about module loading and ``cuda_ipc`` kept.
3. ``bench/nixl_bench.py`` once per (route, op, UCX settings) with ``UCX_PROTO_INFO=y``: GB/s,
   and the protocol UCX chose for ``ucp_get`` (READ) or ``ucp_put`` (WRITE) into that memory.
   Each row gets only its own ``UCX_*`` settings (the caller's are dropped).

Suspected cause under test (bench/RESULTS.md): UCX's ``cuda_ipc`` disables GET zero-copy unless
NVML reports active NVLinks (``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=auto``), so a NIXL READ (``ucp_get``)
of VRAM falls back to a host-staged path over TCP while a WRITE (``ucp_put``) uses ``cuda_ipc``.

    python bench/nixl_ucx_diag.py                 # everything (~5 min on a GPU machine)
    python bench/nixl_ucx_diag.py --only-info     # parts 1-2
    python bench/nixl_ucx_diag.py --rows vram-read --settings default,get_zcopy
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).with_name("nixl_bench.py")

# name -> UCX environment added to the run
SETTINGS: dict[str, dict[str, str]] = {
    "default": {},
    "get_zcopy": {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"},
    "tls_cuda": {"UCX_TLS": "cuda_ipc,cuda_copy,sm,self"},
    "tls_cuda+get_zcopy": {
        "UCX_TLS": "cuda_ipc,cuda_copy,sm,self",
        "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y",
    },
    "get_zcopy+rndv+memtype": {
        "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y",
        "UCX_RNDV_SCHEME": "get_zcopy",
        "UCX_MEMTYPE_CACHE": "n",
    },
    "no_emulation": {"UCX_PROTO_EMULATION_ENABLE": "n"},
    "rma_pipeline": {"UCX_RMA_PPLN_ENABLE": "y"},
}

# name -> (src, dst, op, settings it runs with)
ROWS: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    "dram-read": ("dram", "dram", "read", ("default",)),
    "dram-write": ("dram", "dram", "write", ("default",)),
    "vram-read": ("vram", "vram", "read", tuple(SETTINGS)),
    "vram-write": ("vram", "vram", "write", ("default", "get_zcopy")),
    "dram-to-vram-read": (
        "dram",
        "vram",
        "read",
        ("default", "get_zcopy", "tls_cuda", "no_emulation", "rma_pipeline"),
    ),
}

LOG_PREFIX = re.compile(r"^\[[0-9.]+\]\s+\[[^\]]*\]\s*")
INFO_KEEP = re.compile(
    r"cuda|nvlink|gdr|module\.c|get zcopy|UCX_\w+=|ucp_context.*(?:md|resource)|# ",
    re.IGNORECASE,
)


def cuda_reason() -> str | None:
    """Why VRAM rows cannot run here (None when they can), without creating a CUDA context in
    this process (the children must be the first to touch the GPU)."""
    try:
        import torch
    except ImportError as exc:
        return f"torch cannot be imported: {exc}"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"
    return None


# -- part 1 and 2: the stack and UCX's own view (run in a child, see --ucx-info) -------------


def nixl_flavour() -> tuple[str, Path] | None:
    """The NIXL wheel this process loads and the directory of the libraries it bundles."""
    from kvledger.tiers.remote.nixl import nixl_flavour as loaded_flavour

    name = loaded_flavour()  # loads it: through the meta package when installed
    if name is None:
        return None
    root = Path(sys.modules[name].__file__ or "").parent.parent
    return name, root / f"{name}.libs"


def try_dlopen(name: str) -> str:
    try:
        ctypes.CDLL(name)
    except OSError as exc:
        return f"MISSING ({exc})"
    return "ok"


def print_stack() -> None:
    import torch

    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        print(
            f"GPU 0: {props.name}, cc {props.major}.{props.minor}, "
            f"{props.total_memory / 2**30:.0f} GiB; visible GPUs: {torch.cuda.device_count()}"
        )
    else:
        print("torch sees no GPU")
    print(f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}")
    found = nixl_flavour()
    if found is None:
        print("no NIXL flavour module loaded")
        return
    flavour, libs = found
    print(f"NIXL flavour loaded: {flavour} (chosen for torch's CUDA {torch.version.cuda})")
    ucp = sorted(glob.glob(str(libs / "libucp-*.so*")))
    print(f"bundled libucp: {ucp[0] if ucp else 'NOT FOUND in ' + str(libs)}")
    modules = sorted(Path(p).name for p in glob.glob(str(libs / "ucx" / "*.so*")))
    print(f"UCX module dir {libs / 'ucx'}: {', '.join(modules) or 'EMPTY'}")
    for lib in ("libcuda.so.1", "libnvidia-ml.so.1"):
        print(f"  {lib:22} (needed by libuct_cuda): {try_dlopen(lib)}")
    major = (torch.version.cuda or "0").split(".")[0]
    print(
        f"  libcudart.so.{major:8} (needed by libucm_cuda): {try_dlopen(f'libcudart.so.{major}')}"
    )
    if not any("gdrcopy" in m for m in modules):
        print("  no libuct_cuda_gdrcopy module in the wheel: gdr_copy is not available")
    smi = shutil.which("nvidia-smi")
    if smi:
        for args in (["nvlink", "--status"], ["topo", "-m"]):
            out = subprocess.run([smi, *args], capture_output=True, text=True, timeout=30)
            text = (out.stdout + out.stderr).strip() or "(no output)"
            print(f"$ nvidia-smi {' '.join(args)}\n{text}")
    if ucp:
        print_ucx_resources(ucp[0])


def print_ucx_resources(libucp_path: str) -> None:
    """``ucx_info -d``/``-v``'s substance: a context and a worker made with the same library
    NIXL uses, printing their transports (the UCX log lines of the same calls follow)."""
    lib = ctypes.CDLL(libucp_path)
    lib.ucp_get_version_string.restype = ctypes.c_char_p
    print(f"UCX version: {lib.ucp_get_version_string().decode()}")
    major, minor, release = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
    lib.ucp_get_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(release))
    config = ctypes.c_void_p()
    if lib.ucp_config_read(None, None, ctypes.byref(config)) != 0:
        print("ucp_config_read failed")
        return
    # ucp_params_t and ucp_worker_params_t begin with uint64 field_mask; the params struct
    # then has uint64 features. Zeroed room beyond covers the fields left out of the mask.
    params = (ctypes.c_uint64 * 64)()
    params[0] = 1  # UCP_PARAM_FIELD_FEATURES
    params[1] = (1 << 1) | (1 << 6)  # UCP_FEATURE_RMA | UCP_FEATURE_AM, as NIXL asks
    context = ctypes.c_void_p()
    status = lib.ucp_init_version(major, minor, params, config, ctypes.byref(context))
    lib.ucp_config_release(config)
    if status != 0:
        print(f"ucp_init failed: status {status}")
        return
    libc = ctypes.CDLL(None)
    stdout = ctypes.c_void_p.in_dll(libc, "stdout")
    sys.stdout.flush()
    lib.ucp_context_print_info(context, stdout)
    worker_params = (ctypes.c_uint64 * 64)()
    worker = ctypes.c_void_p()
    if lib.ucp_worker_create(context, worker_params, ctypes.byref(worker)) == 0:
        lib.ucp_worker_print_info(worker, stdout)
        lib.ucp_worker_destroy(worker)
    libc.fflush(None)
    lib.ucp_cleanup(context)


def _ipc_owner(queue: object, done: object, nbytes: int) -> None:
    import torch

    queue.put(torch.full((nbytes,), 7, dtype=torch.uint8, device="cuda"))  # type: ignore[attr-defined]
    done.wait(120)  # type: ignore[attr-defined]


def cuda_ipc_probe(nbytes: int = 128 << 20) -> None:
    """CUDA IPC without UCX: torch hands a device tensor to this process through
    ``cudaIpcGetMemHandle``/``cudaIpcOpenMemHandle``. If this fails, no UCX setting can make
    ``cuda_ipc`` work here (container without a shared IPC/PID namespace, or another GPU)."""
    import torch
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_ipc_owner, args=(queue, done, nbytes))
    proc.start()
    try:
        remote = queue.get(timeout=120)
        local = torch.empty_like(remote)
        local.copy_(remote)
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(5):
            local.copy_(remote)
        torch.cuda.synchronize()
        gbps = 5 * nbytes / (time.perf_counter() - started) / 1e9
        ok = bool((local == 7).all())
        print(
            f"CUDA IPC between two processes without UCX (torch): works, {gbps:.1f} GB/s "
            f"device copy from the other process's memory, bytes {'ok' if ok else 'WRONG'}"
        )
    except Exception as exc:
        print(f"CUDA IPC between two processes without UCX FAILED: {type(exc).__name__}: {exc}")
    finally:
        done.set()
        proc.join(30)


def ucx_info_child() -> None:
    import torch

    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")  # a context, as the bench processes have one
    print_stack()
    if torch.cuda.is_available():
        cuda_ipc_probe()


def run_info() -> None:
    print("== 1-2. stack and UCX resources (UCX_LOG_LEVEL=debug, filtered)")
    env = dict(os.environ, UCX_LOG_LEVEL="debug", NIXL_LOG_LEVEL="WARN")
    try:
        out = subprocess.run(
            [sys.executable, __file__, "--ucx-info-child"],
            capture_output=True,
            text=True,
            timeout=180,
            env=env,
        )
    except subprocess.TimeoutExpired as exc:
        print(f"ucx info timed out: {exc}")
        return
    for line in (out.stdout + out.stderr).splitlines():
        if "UCX  DEBUG" in line or "UCX  TRACE" in line:
            if INFO_KEEP.search(line):
                print("  " + LOG_PREFIX.sub("", line))
        else:
            print("  " + line)
    if out.returncode:
        print(f"  (exit code {out.returncode})")


# -- part 3: the matrix ------------------------------------------------------------------------


def protocols(text: str, op: str) -> list[str]:
    """The UCX_PROTO_INFO tables for ``ucp_get`` (READ) or ``ucp_put`` (WRITE), deduplicated,
    and the lanes of each endpoint configuration. A table is printed as a box: a line naming
    the endpoint configuration (``... intra-node cfg#1``), one naming the operation and memory
    types, then ``Range | Description | Config`` rows. The active-message tables (``multi-frag
    copy-in | tcp/lo`` for host memory) describe control traffic, not the data path."""
    wanted = "remote memory read" if op == "read" else "remote memory write"
    tables: list[tuple[str, ...]] = []
    table: list[str] | None = None
    config = ""
    for raw in [*text.splitlines(), ""]:
        line = LOG_PREFIX.sub("", raw).strip()
        boxed = line.startswith("|") and line.endswith("|")
        cells = [c.strip() for c in line.strip("|").split("|")] if boxed else []
        if len(cells) == 1 and "cfg#" in cells[0]:
            config = cells[0].split(" ", 1)[-1]  # drop the agent name
        elif len(cells) == 1:
            if table:
                tables.append(tuple(table))
            table = [f"{config}: {cells[0]}"] if wanted in cells[0] else None
        elif table is not None and len(cells) >= 3 and cells[0] != "Range":
            table.append(f"    {cells[0]:>14} | {cells[1]} | {' | '.join(cells[2:])}")
        elif table is not None and not line.startswith(("|", "+")):
            tables.append(tuple(table))  # the box ended
            table = None
    lanes = {
        line[line.index("cfg#") :].strip()
        for line in text.splitlines()
        if "ucp_worker" in line and "cfg#" in line and "|" not in line
    }
    lines = [row for t in dict.fromkeys(tables) for row in t]
    return lines + [f"  lanes: {lane}" for lane in sorted(lanes)]


def run_row(src: str, dst: str, op: str, setting: str, args: argparse.Namespace) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    env.update(SETTINGS[setting])
    env.update(UCX_PROTO_INFO="y", UCX_LOG_LEVEL="info", NIXL_LOG_LEVEL="WARN")
    cmd = [
        sys.executable,
        str(BENCH),
        *("--src", src, "--dst", dst, "--op", op),
        *("--blocks", str(args.blocks), "--block-mib", str(args.block_mib)),
        *("--repeat", str(args.repeat)),
    ]
    started = time.monotonic()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.row_timeout, env=env)
        text, code = out.stdout + out.stderr, out.returncode
    except subprocess.TimeoutExpired as exc:
        partial = exc.stdout or b""
        text = partial.decode(errors="replace") if isinstance(partial, bytes) else partial
        code = 124
    result: dict[str, Any] = {"route": f"{src}->{dst}", "op": op, "setting": setting, "exit": code}
    for line in text.splitlines():
        if line.startswith("RESULT "):
            result.update(json.loads(line[len("RESULT ") :]))
    result["seconds"] = round(time.monotonic() - started, 1)
    result["protocols"] = protocols(text, op)
    if "nixl_gbps" not in result:
        tail = [ln for ln in text.splitlines() if ln.strip()][-8:]
        result["error"] = tail
    return result


def run_matrix(args: argparse.Namespace) -> list[dict[str, Any]]:
    reason = cuda_reason()
    results: list[dict[str, Any]] = []
    for name in args.rows.split(","):
        src, dst, op, settings = ROWS[name]
        chosen = [s for s in settings if args.settings is None or s in args.settings.split(",")]
        for setting in chosen:
            env_text = " ".join(f"{k}={v}" for k, v in SETTINGS[setting].items()) or "(none)"
            title = f"== {src}->{dst} {op.upper()} [{setting}] {env_text}"
            if "vram" in (src, dst) and reason:
                print(f"{title}\n   skipped: {reason}", flush=True)
                skipped = {"route": f"{src}->{dst}", "op": op, "setting": setting}
                results.append(skipped | {"skipped": reason})
                continue
            r = run_row(src, dst, op, setting, args)
            results.append(r)
            if args.json:  # after every row: a run stopped by a time limit keeps what it has
                Path(args.json).write_text(json.dumps(results, indent=1))
            if "nixl_gbps" in r:
                print(
                    f"{title}\n   NIXL {r['nixl_gbps']:9.2f} GB/s   reference copy_ "
                    f"{r['ref_gbps']:9.2f} GB/s   ({r['seconds']} s)",
                    flush=True,
                )
            else:
                print(f"{title}\n   FAILED (exit {r['exit']}): " + " / ".join(r["error"]))
            for line in r["protocols"] or ["   (no UCX_PROTO_INFO table for this operation)"]:
                print("   " + line, flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {', '.join(ROWS)}")
    p.add_argument("--settings", help=f"only these (comma list of {', '.join(SETTINGS)})")
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--block-mib", type=float, default=2.0)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--row-timeout", type=float, default=60.0)
    p.add_argument("--only-info", action="store_true")
    p.add_argument("--json", metavar="FILE", help="also write the matrix as JSON here")
    p.add_argument("--ucx-info-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.ucx_info_child:
        ucx_info_child()
        return
    for name in args.rows.split(","):
        if name not in ROWS:
            p.error(f"unknown row {name!r}")
    reason = cuda_reason()
    print(f"CUDA: {reason or 'available'}", flush=True)
    run_info()
    if args.only_info:
        return
    print("== 3. settings matrix (bench/nixl_bench.py per row, UCX_PROTO_INFO=y)", flush=True)
    results = run_matrix(args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
