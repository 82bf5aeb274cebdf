#!/usr/bin/env bash
# Downloads, here, what bench/gpu_check.py needs on a GPU machine whose image has only Python,
# torch for CUDA, CuPy, Triton and pytest, and where nothing can be downloaded: kvledger's own
# dependencies, kvikio and NIXL for that CUDA, and the slices of vLLM and SGLang that kvledger's
# integrations import (their wheels are far too large to carry). Everything lands in .gpu-wheels/
# (git ignores it), and must travel with the working tree, 64 MiB at most in all.
#
#   .gpu-wheels/core/     kvledger's dependencies (less torch, numpy), pytest-timeout
#   .gpu-wheels/kvikio/   kvikio, libkvikio, rapids-logger, cuda-pathfinder
#   .gpu-wheels/nixl/     nixl-cuXX, slimmed (bench/gpu_wheels.py slim says what goes)
#   .gpu-wheels/sglang/   what importing SGLang's storage interface needs beyond the image
#   .gpu-wheels/fill/     installed only where the image lacks them: setuptools, nvidia-cufile
#   .gpu-wheels/{vllm,sglang}-slice/  the engines' own modules kvledger's integrations import,
#                                     copied unmodified from the test venvs (make vllm-venv, ...)
#
# Then it checks the fit (leaving groups behind, and saying what the check then leaves out, when
# it does not) and prints the command that installs all this there and runs the check.
#
# Usage: bash bench/gpu_wheels.sh [--python-version 3.12] [--cuda 13]
set -euo pipefail
cd "$(dirname "$0")/.."

PYVER=3.12
CUDA=13
while [ $# -gt 0 ]; do
    case "$1" in
        --python-version) PYVER="$2"; shift 2 ;;
        --cuda) CUDA="$2"; shift 2 ;;
        *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
    esac
done
NIXL_VERSION=1.5.1     # the release the G4 figures in bench/RESULTS.md were measured with
KVIKIO_VERSION='26.10.*'
CUFILE=nvidia-cufile
[ "$CUDA" = 12 ] && CUFILE=nvidia-cufile-cu12

make -s .venv/.installed vllm-venv sglang-venv   # the venvs the slices are cut from
PY=.venv/bin/python
DIR=.gpu-wheels
rm -rf "$DIR"
mkdir -p "$DIR"/{core,kvikio,nixl,sglang,fill}

TAG=${PYVER/./}
DOWNLOAD=("$PY" -m pip download -q --disable-pip-version-check --only-binary=:all:
    --python-version "$PYVER" --implementation cp --abi "cp$TAG"
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)

echo "== downloading wheels for CPython $PYVER manylinux x86-64, CUDA $CUDA"
# shellcheck disable=SC2046  # one requirement per line
"${DOWNLOAD[@]}" -d "$DIR/core" $("$PY" bench/gpu_wheels.py requirements | tr '\n' ' ')
"${DOWNLOAD[@]}" -d "$DIR/core" --no-deps pytest-timeout
"${DOWNLOAD[@]}" -d "$DIR/kvikio" --no-deps "kvikio-cu$CUDA==$KVIKIO_VERSION" \
    "libkvikio-cu$CUDA==$KVIKIO_VERSION" 'rapids-logger==0.3.*' cuda-pathfinder
"${DOWNLOAD[@]}" -d "$DIR/nixl" --no-deps "nixl-cu$CUDA==$NIXL_VERSION"
SGLANG_DEPS=$("$PY" bench/gpu_wheels.py engine-deps .sglang-test-venv/bin/python \
    kvledger.integrations.sglang sglang | tr '\n' ' ')
# shellcheck disable=SC2086
"${DOWNLOAD[@]}" -d "$DIR/sglang" --no-deps $SGLANG_DEPS
"${DOWNLOAD[@]}" -d "$DIR/fill" --no-deps 'setuptools>=68' "$CUFILE"
printf 'setuptools>=68\n%s\n' "$CUFILE" >"$DIR/fill/requirements.txt"
VLLM_DEPS=$("$PY" bench/gpu_wheels.py engine-deps .vllm-test-venv/bin/python \
    kvledger.integrations.vllm.worker vllm)
if [ -n "$VLLM_DEPS" ]; then
    mkdir -p "$DIR/vllm"
    # shellcheck disable=SC2086
    "${DOWNLOAD[@]}" -d "$DIR/vllm" --no-deps $VLLM_DEPS
fi

echo "== slimming NIXL"
"$PY" bench/gpu_wheels.py slim "$DIR"/nixl/nixl_cu*.whl

echo "== cutting the engine slices"
"$PY" bench/gpu_wheels.py slice .vllm-test-venv/bin/python \
    kvledger.integrations.vllm.worker vllm "$DIR/vllm-slice"
"$PY" bench/gpu_wheels.py verify-slice "$PY" kvledger.integrations.vllm.worker vllm \
    "$DIR/vllm-slice"
"$PY" bench/gpu_wheels.py slice .sglang-test-venv/bin/python \
    kvledger.integrations.sglang sglang "$DIR/sglang-slice"
"$PY" bench/gpu_wheels.py verify-slice .sglang-test-venv/bin/python \
    kvledger.integrations.sglang sglang "$DIR/sglang-slice"

echo "== what travels"
FIT=0
"$PY" bench/gpu_wheels.py fit "$DIR" || FIT=$?
echo
echo "On the GPU machine, with the working tree and $DIR/ copied there, run (under 10 minutes:"
echo "the install, then the check's 450 s budget):"
echo
echo "    bash bench/gpu_run.sh"
exit "$FIT"
