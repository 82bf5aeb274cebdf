"""The steps of ``bench/gpu_wheels.sh`` that are not downloads: slim the NIXL wheel, cut the
slices of vLLM and SGLang that kvledger's integrations import, and check that everything fits.

The GPU machine has Python 3.12, torch for CUDA 13, CuPy, Triton and pytest, and nothing can be
downloaded there; what the check needs beyond that travels with the working tree, 64 MiB at most
in all. Subcommands (``gpu_wheels.sh`` runs them in this order):

- ``requirements``: kvledger's own dependencies, less what the GPU image has (torch, numpy);
- ``engine-deps ENGINE_PYTHON MODULE PACKAGE``: the third-party distributions (``name==version``)
  that importing ``MODULE`` loads in the engine's test venv, less torch, numpy, triton and torch's
  own dependencies (the image has them);
- ``slim WHEEL``: rewrite a ``nixl_cuXX`` wheel without what kvledger never loads (``SLIM_DROP``);
- ``slice ENGINE_PYTHON MODULE PACKAGE DEST``: copy, unmodified, every module of ``PACKAGE``
  (``vllm``, ``sglang``) that importing ``MODULE`` loads in the engine's test venv into ``DEST``;
- ``verify-slice PYTHON MODULE PACKAGE DEST``: import ``MODULE`` with ``DEST`` first on the path
  and fail unless every ``PACKAGE`` module came from ``DEST``;
- ``fit DIR``: the working tree plus ``DIR`` against the 64 MiB limit; prints each wheel and
  slice with its size, and what the check leaves out if something must stay behind.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 64 * 2**20  # what travels with the working tree to the GPU machine
IMAGE_HAS = ("torch", "numpy", "triton", "pytest")  # and all they require

SLIM_DROP = {
    r"^nixl_ep_cu\d+/": "NIXL EP (expert-parallel kernels, built for torch 2.12-2.14)",
    r"^nixl_cu\d+\.scripts/": "example and telemetry programs",
    r"^nixl_cu\d+-[^/]+\.data/": "C++ headers and pkg-config files",
    r"/ucx/libucx_perftest_": "UCX perftest modules (loaded by ucx_perftest only)",
}

#: what the check leaves out when a group of carried files stays behind, in the order they go
GROUPS = {
    "sglang": "the sglang part (kvledger's SGLang page path)",
    "vllm": "the vllm part (kvledger's vLLM worker-side copies)",
    "kvikio": "GDS: the g3 part runs G3 through O_DIRECT pwritev/preadv instead of kvikio",
    "nixl": "the g4 part (G4 over NIXL) and the suite's NIXL tests",
}


def requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [
        dep
        for dep in project["dependencies"]
        if normalize(re.split(r"[\s\[<>=!~;]", dep, maxsplit=1)[0]) not in IMAGE_HAS
    ]


CLOSURE = """
import importlib, importlib.metadata as md, json, os, re, sys
for name in ("torch", "numpy", "kvledger.tiers", "kvledger.config", "kvledger.events.log"):
    importlib.import_module(name)
before = set(sys.modules)
importlib.import_module(sys.argv[1])
new = set(sys.modules) - before
package, image = sys.argv[2], sys.argv[3].split(",")
files = sorted({sys.modules[m].__file__ for m in new
                if m.split(".")[0] == package and getattr(sys.modules[m], "__file__", None)})
root = os.path.dirname(os.path.dirname(sys.modules[package].__file__))
owners = md.packages_distributions()
dists = {d for m in new - {package} for d in owners.get(m.split(".")[0], [])}

def requirements(name, extras, seen):  # a distribution and all it requires, installed
    key = re.sub(r"[-_.]+", "-", name).lower()
    if key in seen:
        return
    try:
        requires = md.requires(name) or []
    except md.PackageNotFoundError:
        return
    seen.add(key)
    for req in requires:
        wanted = re.search(r"extra == .([A-Za-z0-9_.-]+)", req)
        if wanted is None or wanted.group(1) in extras:
            dep = re.match(r"([A-Za-z0-9_.-]+)(?:\\[([^\\]]*)\\])?", req)
            requirements(dep.group(1), (dep.group(2) or "").split(","), seen)

provided = set()
for name in image:
    requirements(name, [], provided)
json.dump({"files": files, "root": root, "provided": sorted(provided),
           "dists": sorted(f"{d}=={md.version(d)}" for d in dists)}, sys.stdout)
"""


def closure(python: str, module: str, package: str) -> dict[str, Any]:
    """What importing ``module`` in ``python`` loads beyond torch and kvledger: ``package``'s
    module files (below ``root``) and the distributions of the other modules; ``provided``:
    the image's packages (``IMAGE_HAS``), kvledger's, and all they require, in that venv."""
    provided = (*IMAGE_HAS, "kvledger")
    out = subprocess.run(
        [os.path.abspath(python), "-P", "-c", CLOSURE, module, package, ",".join(provided)],
        capture_output=True,
        text=True,
        check=True,
        cwd=tempfile.gettempdir(),
    )
    found: dict[str, Any] = json.loads(out.stdout)
    return found


def engine_deps(python: str, module: str, package: str) -> list[str]:
    found = closure(python, module, package)
    skip = {"kvledger", package, *found["provided"]}
    return [d for d in found["dists"] if normalize(d.split("==")[0]) not in skip]


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def slim(wheel: Path) -> dict[str, int]:
    """Rewrite ``wheel`` in place without the files ``SLIM_DROP`` names (its RECORD too);
    returns the bytes dropped per reason."""
    patterns = {re.compile(p): why for p, why in SLIM_DROP.items()}
    dropped: dict[str, int] = {}
    slimmed = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slimmed, "w", zipfile.ZIP_DEFLATED) as dst:
        gone: set[str] = set()
        for info in src.infolist():
            why = next((w for p, w in patterns.items() if p.search(info.filename)), None)
            if why is not None:
                dropped[why] = dropped.get(why, 0) + info.compress_size
                gone.add(info.filename)
        for info in src.infolist():
            if info.filename in gone:
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = "".join(f"{ln}\n" for ln in lines if ln.split(",")[0] not in gone).encode()
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=6)
    slimmed.replace(wheel)
    return dropped


def cut_slice(python: str, module: str, package: str, dest: Path) -> list[str]:
    """Copy the ``package`` modules that importing ``module`` loads into ``dest``, each at its
    path below the folder that holds the package."""
    found = closure(python, module, package)
    if not found["files"]:
        raise SystemExit(f"importing {module} in {python} loaded no {package} module")
    shutil.rmtree(dest, ignore_errors=True)
    copied = []
    for f in found["files"]:
        rel = Path(f).relative_to(found["root"])
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dest / rel)
        copied.append(str(rel))
    return copied


VERIFY = """
import importlib, sys
module, package, dest = sys.argv[1:4]
importlib.import_module(module)
outside = sorted(m for m, mod in sys.modules.items() if m.split(".")[0] == package
                 and getattr(mod, "__file__", None) and not mod.__file__.startswith(dest))
if outside:
    raise SystemExit(f"{package} modules from outside {dest}: {outside}")
print(f"{module} imports with {package} from {dest} only")
"""


def verify_slice(python: str, module: str, package: str, dest: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(dest.resolve()))
    subprocess.run(
        [os.path.abspath(python), "-P", "-c", VERIFY, module, package, str(dest.resolve())],
        check=True,
        env=env,
        cwd=tempfile.gettempdir(),
    )


def tree_bytes() -> int:
    """The working tree as it travels: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
        cwd=ROOT,
    ).stdout.split(b"\0")
    paths = [ROOT / os.fsdecode(p) for p in listed if p]
    return sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def mib(n: int) -> str:
    return f"{n / 2**20:6.2f} MiB"


def fit(carried: Path) -> bool:
    """Print what travels and whether it fits; drop groups (``GROUPS`` order) until it does."""
    tree = tree_bytes()
    print(f"{'working tree (tracked + untracked, not ignored)':60} {mib(tree)}")
    for wheel in sorted(carried.glob("*/*.whl"), key=lambda p: -p.stat().st_size):
        print(f"  {wheel.parent.name + '/' + wheel.name:58} {mib(wheel.stat().st_size)}")
    for folder in sorted(carried.glob("*-slice")):
        count = sum(1 for _ in folder.rglob("*.py"))
        print(f"  {folder.name + f' ({count} modules)':58} {mib(folder_bytes(folder))}")
    total = tree + folder_bytes(carried)
    print(f"{'total':60} {mib(total)} of {mib(LIMIT)}")
    left_out = []
    for group, what in GROUPS.items():
        if total <= LIMIT:
            break
        paths = [carried / group, carried / f"{group}-slice"]
        size = sum(folder_bytes(p) for p in paths if p.exists())
        if size:
            for p in paths:
                shutil.rmtree(p, ignore_errors=True)
            total -= size
            left_out.append(f"{group} ({mib(size).strip()}): {what}")
    if left_out:
        print("does not fit: left behind, so the check leaves out:")
        for line in left_out:
            print(f"  - {line}")
        print(f"{'total now':60} {mib(total)}")
    fits = total <= LIMIT
    print(f"fits: {'yes' if fits else 'NO'}, {mib(LIMIT - total).strip()} to spare")
    return fits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("requirements")
    for name in ("engine-deps", "slice", "verify-slice"):
        s = sub.add_parser(name)
        s.add_argument("python")
        s.add_argument("module")
        s.add_argument("package")
        if name != "engine-deps":
            s.add_argument("dest", type=Path)
    s = sub.add_parser("slim")
    s.add_argument("wheel", type=Path)
    s = sub.add_parser("fit")
    s.add_argument("dir", type=Path)
    args = p.parse_args()
    if args.command == "requirements":
        print("\n".join(requirements()))
    elif args.command == "engine-deps":
        print("\n".join(engine_deps(args.python, args.module, args.package)))
    elif args.command == "slim":
        before = args.wheel.stat().st_size
        for why, size in slim(args.wheel).items():
            print(f"  {args.wheel.name}: dropped {mib(size).strip()}: {why}")
        print(f"  {args.wheel.name}: {mib(before).strip()} -> {mib(args.wheel.stat().st_size)}")
    elif args.command == "slice":
        copied = cut_slice(args.python, args.module, args.package, args.dest)
        print(f"  {args.dest}: {len(copied)} {args.package} modules that {args.module} imports")
    elif args.command == "verify-slice":
        verify_slice(args.python, args.module, args.package, args.dest)
    elif args.command == "fit":
        sys.exit(0 if fit(args.dir) else 1)


if __name__ == "__main__":
    main()
