#!/usr/bin/env bash
# Builds .vllm-test-venv: vLLM 0.33.0 (CPU torch, --no-deps, the pinned modules its offloading
# code and tests import), kvledger installed editable into it, pytest, and vLLM 0.33.0's own
# tests (tests/ of its source distribution, checked against its sha256) with
# tests/integrations/vllm_harness/conftest.py as their root conftest and a minimal
# facebook/opt-125m config so that they run offline.
#
# tests/integrations/test_vllm_offloading.py runs vLLM's tests and kvledger's end-to-end test in
# this venv; it skips, saying so, while the venv is absent. Takes about 5 minutes on 2 cores
# with a warm pip cache (torch alone is ~200 MB to fetch otherwise).
#
# Usage: bash tests/integrations/setup_vllm_test_venv.sh [VENV_DIR]  (default: .vllm-test-venv)
set -euo pipefail

cd "$(dirname "$0")/../.."
VENV="${1:-.vllm-test-venv}"
PYTHON="${PYTHON:-python3}"
SDIST_URL="https://files.pythonhosted.org/packages/f7/25/aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/vllm-0.33.0.tar.gz"
SDIST_SHA256="f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)

"${PIP[@]}" torch==2.13.0
"${PIP[@]}" --no-deps vllm==0.33.0
# what `import vllm.v1.core.sched.scheduler` and the offloading connector execute (as in
# bench/setup_bench_venv.sh), then einops (vLLM's attention layers), then kvledger's own needs
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
    uvloop==0.23.0 xgrammar==0.2.8 yarl==1.25.1 \
    einops==0.8.2 \
    aiosqlite==0.22.1 alembic==1.20.1 greenlet==3.5.6 hiredis==3.5.0 Mako==1.4.3 \
    MarkupSafe==3.0.4 msgpack==1.2.4 pydantic-settings==2.16.3 python-dotenv==1.2.4 \
    redis==8.1.0 SQLAlchemy==2.1.9 xxhash==4.1.0 \
    pytest==9.2.0 iniconfig==2.3.1 pluggy==1.7.0 Pygments==2.21.0
"${PIP[@]}" --no-deps -e . --config-settings editable_mode=strict

# vLLM's tests: only in its source distribution (the wheel has none)
TESTS="$VENV/vllm-tests"
if [ ! -f "$TESTS/pyproject.toml" ]; then
    SDIST="$(mktemp -d)/vllm-0.33.0.tar.gz"
    "$VENV/bin/python" - "$SDIST_URL" "$SDIST" "$SDIST_SHA256" <<'PY'
import hashlib, sys, urllib.request
url, path, want = sys.argv[1:]
urllib.request.urlretrieve(url, path)
got = hashlib.sha256(open(path, "rb").read()).hexdigest()
sys.exit(0 if got == want else f"vllm sdist sha256 {got} != {want}")
PY
    mkdir -p "$TESTS"
    tar xzf "$SDIST" -C "$TESTS" --strip-components=1 vllm-0.33.0/tests vllm-0.33.0/pyproject.toml
    rm -f "$SDIST"
fi
# vLLM's root conftest imports its serving stack and model downloads: ours replaces it
cp tests/integrations/vllm_harness/conftest.py "$TESTS/tests/conftest.py"
mkdir -p "$TESTS/facebook/opt-125m"
cp tests/integrations/vllm_harness/opt-125m-config.json "$TESTS/facebook/opt-125m/config.json"

"$VENV/bin/python" -c "import vllm, kvledger.integrations.vllm.manager; \
print('vLLM test venv ready: vllm', vllm.__version__)"
