"""The light install: ``pip install kvledger`` without extras brings no torch, and runs what
never touches a tensor: ``simulate``, ``replay``, ``inspect``, ``report``, ``whatif``,
``tail``, a worker publishing to the shared registry and over ZMQ, and a router's index fed by
that stream. What needs torch says which extra to install, in one line.

The venv is built once per test session in a temporary folder: a copy of the source installed
with pip, as a user installs it (the wheel built from pyproject.toml, the dependencies it names
and nothing else, from pip's cache), over the base interpreter, so nothing of the suite's own
venv is visible. 20 to 40 s on 2 cores."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tomllib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from services import REDIS_URL, free_port, redis_or_skip

from kvledger.events.log.replay import replay
from kvledger.events.shared.registry import SharedRegistry
from kvledger.registry.index import holders_from_state

ROOT = Path(__file__).resolve().parent.parent
ROUTER = Path(__file__).resolve().parent / "zmq_router.py"
pytestmark = pytest.mark.slow
# the light venv's processes see no settings and no module path of the suite's
ENV = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith("KVLEDGER_") and k not in ("PYTHONPATH", "PYTHONHOME")
}


@pytest.fixture(scope="module")
def light(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The light venv's bin folder (removed after: 140 MB)."""
    root = tmp_path_factory.mktemp("light-install")
    source = root / "source"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for folder in sorted(set(setup["package-dir"].values())):
        shutil.copytree(
            ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__", "*.so")
        )
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    install = subprocess.run(
        [
            sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
            "-q", "--disable-pip-version-check", str(source),
        ],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert install.returncode == 0, install.stdout + install.stderr
    yield venv / "bin"
    shutil.rmtree(root, ignore_errors=True)


def _run(
    light: Path, *args: str, cwd: Path, check: bool = True
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [str(light / args[0]), *args[1:]],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=ENV,
    )
    if check:
        assert done.returncode == 0, f"{args}: {done.stdout}\n{done.stderr}"
    return done


def test_the_light_install_has_no_torch(light: Path, tmp_path: Path) -> None:
    missing = _run(light, "python", "-c", "import torch", cwd=tmp_path, check=False)
    assert missing.returncode == 1 and "No module named 'torch'" in missing.stderr
    imported = _run(
        light,
        "python",
        "-c",
        "import sys, kvledger.cli, kvledger.events.log.replay, kvledger.events.shared, "
        "kvledger.registry.index, kvledger.mocker.rerun; from kvledger import Settings, "
        "EventLog, replay, RegistryState, TokenBlockSequence, Tier, Metrics; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))",
        cwd=tmp_path,
    )
    assert imported.stdout.strip() == "[]"
    # pip built the compiled encoders (events/_speedups.c), the compiled SQLite writer
    # (events/log/_sqlite.c), the append buffer's queue (events/log/_gather.c), the pool's
    # loops (registry/_pool.c), the router index's fold (registry/_index.c), the chain hashes
    # (registry/_chain.c), the trace reader (kvledger/mocker/_trace.c) and the record makers
    # (registry/_records.c) from the source, as a user's does
    compiled = _run(
        light, "python", "-c",
        "from kvledger.events import codec; from kvledger.events.log import buffer, database; "
        "from kvledger.registry import hashing, index, pool; from kvledger.mocker import traces; "
        "from kvledger.registry import makers; "
        "print(len(codec.COMPILED), database.compiled_sqlite_path('sqlite:///a.db'), "
        "buffer.COMPILED_GATHER, pool.COMPILED, index.COMPILED_APPLY is not None, "
        "hashing.COMPILED_CHAIN, traces.COMPILED_READ is not None, makers.COMPILED_MAKERS)",
        cwd=tmp_path,
    )  # fmt: skip
    assert compiled.stdout.strip() == "4 a.db True True True True True True"


def test_what_holds_bytes_says_which_extra_to_install(light: Path, tmp_path: Path) -> None:
    for name in ("BlockManager", "LayerSeparate"):
        done = _run(
            light, "python", "-c", f"from kvledger import {name}", cwd=tmp_path, check=False
        )
        assert done.returncode == 1
        last = done.stderr.strip().splitlines()[-1]
        assert last == (
            f"ModuleNotFoundError: kvledger.{name} needs torch, which is not installed (the "
            "tiers hold KV bytes in torch tensors): pip install 'kvledger[torch]'"
        )
    # a PostgreSQL log without its driver: the command's one line, not a traceback
    url = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/kvledger"
    done = _run(light, "kvledger", "replay", url, cwd=tmp_path, check=False)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]  # argparse's usage lines come first
    assert last.startswith("kvledger replay: error: argument LOG: postgresql+psycopg://")
    assert last.endswith("driver is not installed (No module named 'psycopg'): pip install "
                         "'kvledger[postgres]'")  # fmt: skip
    assert "Traceback" not in done.stderr


def test_the_log_commands_run_without_torch(light: Path, tmp_path: Path) -> None:
    log = tmp_path / "kvledger-data" / "events.db"
    _run(
        light, "kvledger", "simulate", "--requests", "300", "--g1-blocks", "256",
        "--g2-blocks", "128", "--g3-blocks", "512", "--dump-state", "live.state",
        cwd=tmp_path,
    )  # fmt: skip
    assert log.exists()
    verified = _run(light, "kvledger", "replay", str(log), "--verify", "live.state", cwd=tmp_path)
    assert "verify: states agree" in verified.stdout
    replayed = json.loads(
        _run(light, "kvledger", "replay", str(log), "--json", cwd=tmp_path).stdout
    )
    assert replayed["digest"] == replay(str(log)).digest()  # the suite's own replay agrees
    windows = ("--windows", "4", "--json")
    report = json.loads(_run(light, "kvledger", "report", str(log), *windows, cwd=tmp_path).stdout)
    assert len(report["windows"]) == 4
    whatif = _run(
        light, "kvledger", "whatif", str(log), "--g1-blocks", "128,512", "--json", cwd=tmp_path
    )
    runs = json.loads(whatif.stdout)
    assert runs["baseline_reproduces"] is True
    assert len(runs["runs"]) == 3  # the run's own settings, then the two others
    inspected = _run(light, "kvledger", "inspect", "--check", str(log), cwd=tmp_path)
    assert "every row with a checksum" in inspected.stdout
    newest = ("tail", "-n", "5", "--no-follow", str(log))
    tail = _run(light, "kvledger", *newest, cwd=tmp_path)
    assert len(tail.stdout.splitlines()) == 5
    ours = subprocess.run(
        [sys.executable, "-m", "kvledger.cli", *newest], capture_output=True, text=True, check=True
    )
    assert tail.stdout == ours.stdout


@pytest.fixture
def namespace() -> Iterator[SharedRegistry]:
    registry = SharedRegistry(redis_or_skip(), f"light-{uuid.uuid4().hex[:8]}")
    yield registry
    registry.delete_namespace()


@pytest.mark.redis
def test_a_router_index_fed_over_zmq_equals_the_workers_log(
    light: Path, tmp_path: Path, namespace: SharedRegistry
) -> None:
    """A light worker publishes to the shared registry and over ZMQ; a light router folds the
    stream into a ``RouterIndex`` (catching up through the replay socket), and ``kvledger
    tail`` reads the same stream: each view is the fold of the worker's log."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    log = tmp_path / "worker.db"
    worker = subprocess.Popen(
        [
            str(light / "kvledger"), "worker", "--worker-id", "5", "--redis-url", REDIS_URL,
            "--namespace", namespace.namespace, "--log", str(log), "--requests", "60",
            "--blocks", "128", "--seed", "3", "--linger", "--zmq-endpoint", endpoint,
            "--zmq-replay-endpoint", replay_endpoint,
        ],
        cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert worker.stdout is not None
        line = worker.stdout.readline()
        assert line, f"the worker exited with {worker.wait()}: {worker.communicate()[1]}"
        done = json.loads(line)
        assert done["done"] and done["drained"]
        batches = done["last_event_id"] + 1
        folded = holders_from_state(replay(str(log)))
        assert folded and namespace.snapshot() == folded

        router = _run(
            light, "python", str(ROUTER), endpoint, replay_endpoint, "5", str(batches),
            cwd=tmp_path,
        )  # fmt: skip
        seen = json.loads(router.stdout)
        assert seen["batches"] == batches
        holders = {int(s): {int(w): m for w, m in h.items()} for s, h in seen["holders"].items()}
        assert holders == folded

        tail = _run(
            light, "kvledger", "tail", "--zmq", endpoint, "--zmq-replay", replay_endpoint,
            "--worker-id", "5", "--no-follow", cwd=tmp_path,
        )  # fmt: skip
        assert len(tail.stdout.splitlines()) == batches
        assert all(" w5#" in line for line in tail.stdout.splitlines())
    finally:
        worker.send_signal(signal.SIGTERM)
        stderr = worker.communicate(timeout=30)[1]
    assert worker.returncode == 0, stderr
