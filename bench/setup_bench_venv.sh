#!/usr/bin/env bash
# Builds .bench-venv: a separate virtual environment holding vLLM 0.33.0, used only by
# bench/registry_bench.py to run vLLM's own BlockPool as the reference.
#
# vLLM's full dependency set pulls CUDA builds and GBs of serving stack, none of which its
# block pool uses. So: the CPU torch wheel first (pip resolves torch==2.13.0 to the CPU build
# where one is offered; installing it first keeps anything later from pulling another torch),
# then vLLM with --no-deps, then exactly the modules that `import vllm.v1.core.block_pool`
# executes (its import chain runs through vllm.config, transformers and xgrammar), pinned so
# the environment is the same every time and within vLLM 0.33.0's own version bounds.
#
# Usage: bash bench/setup_bench_venv.sh [VENV_DIR]   (default: .bench-venv in the repo root)
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${1:-.bench-venv}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)

"${PIP[@]}" torch==2.13.0
"${PIP[@]}" --no-deps vllm==0.33.0
"${PIP[@]}" --no-deps \
    aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7 \
    annotated-types==0.8.0 anyio==4.16.0 apache-tvm-ffi==0.1.11 attrs==26.1.0 \
    cachetools==8.0.1 cbor2==6.3.0 certifi==2026.10.18 charset-normalizer==3.5.2 \
    cloudpickle==3.1.2 fastapi==0.136.3 frozenlist==1.8.0 h11==0.16.0 httpcore2==2.16.2 \
    httpx2==2.16.2 huggingface_hub==2.4.0 idna==3.20 llguidance==1.7.6 msgspec==0.22.0 \
    multidict==7.2.1 numpy==2.4.6 openai==3.54.0 openai-harmony==0.0.8 packaging==26.3 \
    partial-json-parser==0.2.1.1.post7 pillow==13.0.0 prometheus_client==0.26.0 \
    propcache==0.5.4 psutil==7.2.2 py-cpuinfo==9.0.0 pybase64==1.5.1 pydantic==2.14.3 \
    pydantic_core==2.50.4 PyYAML==6.0.3 pyzmq==27.3.0 regex==2026.11.15 requests==2.34.2 \
    safetensors==0.8.0 sniffio==1.3.1 starlette==1.10.0 tokenizers==0.23.3 tqdm==4.70.1 \
    transformers==5.20.2 truststore==0.10.5 typing-inspection==0.4.5 urllib3==2.8.0 \
    uvloop==0.23.0 xgrammar==0.2.8 yarl==1.25.1

"$VENV/bin/python" -c "from vllm.v1.core.block_pool import BlockPool; import vllm; \
print('bench venv ready: vllm', vllm.__version__)"
