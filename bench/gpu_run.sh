#!/usr/bin/env bash
# On the GPU machine: install what bench/gpu_wheels.sh packed into .gpu-wheels/ into a venv
# layered over the image's Python (torch, CuPy, Triton and pytest stay the image's; nothing is
# downloaded, nothing in the image is changed), then run bench/gpu_check.py with the engine
# slices. The summary and each part's log go to $OUT when it is set, else
# kvledger-data/gpu-check. Arguments are passed on to gpu_check.py (e.g. --only g1-g2,g4).
#
# Usage: bash bench/gpu_run.sh [gpu_check.py arguments]   (PYTHON=... picks the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
W=.gpu-wheels
OUT="${OUT:-kvledger-data/gpu-check}"
mkdir -p "$OUT"
if [ ! -d "$W/core" ]; then
    echo "no $W/core: run bash bench/gpu_wheels.sh where packages can be downloaded" >&2
    exit 2
fi

PY="${PYTHON:-}"
for candidate in python3 python; do
    if [ -z "$PY" ] && "$candidate" -c 'import torch' 2>/dev/null; then PY="$candidate"; fi
done
[ -n "$PY" ] || { echo "no Python here imports torch; set PYTHON" >&2; exit 2; }
echo "== image: $("$PY" -c 'import sys, torch; print(sys.executable, sys.version.split()[0],
    "torch", torch.__version__, "CUDA", torch.version.cuda)')"

# A venv of our own whose site-packages come first, then the image's (added by a .pth: it works
# whether the image's Python is a system one or itself a venv).
VENV=.gpu-venv
"$PY" -m venv --clear --without-pip "$VENV"
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
"$PY" -c 'import site; print("\n".join(site.getsitepackages()))' |
    sed 's/.*/import site; site.addsitedir("&")/' >"$SITE/_image_site.pth"
PIP=("$PY" -m pip --python "$VENV/bin/python" install -q --no-index --disable-pip-version-check)

shopt -s nullglob
WHEELS=()
for group in "$W"/*/; do  # every group but fill/, which goes in only where the image lacks it
    [ "$(basename "$group")" = fill ] || WHEELS+=("$group"*.whl)
done
started=$(date +%s)
echo "== installing ${#WHEELS[@]} wheels"
"${PIP[@]}" --no-deps "${WHEELS[@]}"
"${PIP[@]}" --find-links "$W/fill" -r "$W/fill/requirements.txt"   # only where the image lacks it
"${PIP[@]}" --no-deps --no-build-isolation .
echo "== installed in $(($(date +%s) - started)) s"

ARGS=(--out "$OUT")
[ -d "$W/vllm-slice" ] && ARGS+=(--vllm-python "$VENV/bin/python" --vllm-path "$W/vllm-slice")
[ -d "$W/sglang-slice" ] && ARGS+=(--sglang-python "$VENV/bin/python" --sglang-path "$W/sglang-slice")
exec "$VENV/bin/python" bench/gpu_check.py "${ARGS[@]}" "$@"
