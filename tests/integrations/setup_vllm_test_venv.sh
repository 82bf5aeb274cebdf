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
SDIST_URL="https://files.pythonhosted.org/packages/f7/25/aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/vllm-0.33.0.tar.gz"
SDIST_SHA256="f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"

# vLLM 0.33.0 on the CPU torch wheel with the pinned modules its import chain needs: the bench
# venv's recipe, then what the offloading connector and the tests need on top of it
bash bench/setup_bench_venv.sh "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
# einops (vLLM's attention layers), kvledger's own needs, pytest and hypothesis, and NIXL
# (kvledger's G4 tier for vLLM reads other workers' blocks over it)
"${PIP[@]}" --no-deps \
    einops==0.8.2 \
    aiosqlite==0.22.1 alembic==1.20.1 greenlet==3.5.6 hiredis==3.5.0 Mako==1.4.3 \
    MarkupSafe==3.0.4 msgpack==1.2.4 pydantic-settings==2.16.3 python-dotenv==1.2.4 \
    redis==8.1.0 SQLAlchemy==2.1.9 xxhash==4.1.0 \
    pytest==9.2.0 iniconfig==2.3.1 pluggy==1.7.0 Pygments==2.21.0 \
    hypothesis==6.170.17 sortedcontainers==2.4.0 \
    nixl==1.5.1 nixl-cu12==1.5.1 nixl-cu13==1.5.1
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
