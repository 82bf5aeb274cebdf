#!/usr/bin/env bash
# Installs SGLang 0.5.23 with --no-deps, plus the pinned modules that importing its HiCache
# storage interface and backend factory executes (`sglang/__init__.py` pulls in its HTTP
# client, utilities and triton), into a venv (default: this checkout's .venv). torch must
# already be there (the project's CPU torch). tests/test_sglang_backend.py skips without it.
#
# Usage: bash tests/integrations/setup_sglang.sh [VENV_DIR]  (default: .venv)
set -euo pipefail

cd "$(dirname "$0")/../.."
VENV="${1:-.venv}"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps)

"${PIP[@]}" sglang==0.5.23
"${PIP[@]}" \
    aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 anyio==4.16.0 attrs==26.1.0 \
    certifi==2026.10.19.post1 charset-normalizer==3.5.2 frozenlist==1.8.0 idna==3.20 \
    ipython==9.18.1 multidict==7.2.1 orjson==3.13.0 propcache==0.5.4 psutil==7.2.2 \
    pybase64==1.5.1 requests==2.34.2 starlette==1.10.0 tqdm==4.70.1 traitlets==5.16.1 \
    triton==3.9.0 urllib3==2.8.0 yarl==1.25.1

"$VENV/bin/python" -c "
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
print('sglang HiCache storage interface importable')"
