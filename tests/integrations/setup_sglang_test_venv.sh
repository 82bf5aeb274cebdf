#!/usr/bin/env bash
# Builds .sglang-test-venv: SGLang 0.5.23 (--no-deps) and the pinned modules that importing its
# HiCache storage interface and backend factory executes, layered over the project's .venv.
#
# The layer: a venv whose own site-packages holds only SGLang and those modules, plus a .pth
# line that adds the project venv's site-packages (processing its .pth files, so the editable
# kvledger resolves) after them. torch, numpy, pytest, redis and kvledger come from .venv; the
# SGLang pins never enter .venv, so the rest of the suite runs on what it always did. Not the
# vLLM test venv either: vLLM picks other code paths where triton imports (HAS_TRITON).
#
# What the pins are for: `import sglang.srt.mem_cache.hicache_storage` runs sglang/__init__.py,
# which imports its frontend language (aiohttp, requests, tqdm, IPython) and
# sglang/srt/utils/common.py (orjson, psutil, pybase64, requests, starlette, and triton: an
# unconditional `import triton` whose module it patches at import time). The rest of that
# path comes from .venv: torch, numpy, pillow (matplotlib's), pydantic, msgspec, pyzmq,
# packaging, typing_extensions, pygments (pytest's). charset-normalizer is not imported, but
# requests, which declares it, warns on every import without it.
#
# tests/integrations/test_sglang_hicache.py runs tests/integrations/sglang/ in this venv; it
# skips, saying so, while the venv is absent. 15 to 30 s on 2 cores (most of it unpacking triton).
#
# Usage: bash tests/integrations/setup_sglang_test_venv.sh [VENV_DIR] [BASE_VENV]
#        (defaults: .sglang-test-venv over .venv)
set -euo pipefail

cd "$(dirname "$0")/../.."
VENV="${1:-.sglang-test-venv}"
BASE="${2:-.venv}"

if [ "$(realpath -m "$VENV")" = "$(realpath -m "$BASE")" ]; then
    echo "the SGLang test venv cannot be the venv it layers over ($BASE)" >&2
    exit 2
fi
# afresh each time (--clear), so a pin dropped here leaves nothing behind; the base venv's
# interpreter, so the layer runs the same Python as what it layers over
"$BASE/bin/python" -m venv --clear --without-pip "$VENV"
BASE_SITE="$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
echo "import site; site.addsitedir('$BASE_SITE')" >"$SITE/_kvledger_base.pth"

# the base venv's pip installs into the layer; --no-compile: only the few modules the tests
# import get compiled, on first import, instead of all of SGLang
PIP=("$BASE/bin/python" -m pip --python "$VENV/bin/python" install -q
    --disable-pip-version-check --no-deps --no-compile)
"${PIP[@]}" sglang==0.5.23 \
    aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 anyio==4.16.0 attrs==26.1.0 \
    certifi==2026.10.19.post1 charset-normalizer==3.5.2 frozenlist==1.8.0 idna==3.20 \
    ipython==9.18.1 multidict==7.2.1 orjson==3.13.0 propcache==0.5.4 psutil==7.2.2 \
    pybase64==1.5.1 requests==2.34.2 starlette==1.10.0 tqdm==4.70.1 traitlets==5.16.1 \
    triton==3.9.0 urllib3==2.8.0 yarl==1.25.1

"$VENV/bin/python" -I -c "
import kvledger, torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
print('SGLang test venv ready: kvledger from', kvledger.__file__)"
