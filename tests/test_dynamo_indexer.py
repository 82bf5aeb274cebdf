"""Dynamo's own standalone indexer reads our ZMQ stream and agrees with every worker.

``python -m dynamo.indexer`` (ai-dynamo-runtime) subscribes to the workers' PUB sockets, asks
their replay sockets for whatever it missed, and answers ``POST /query`` with each worker's
longest match per tier. Its HTTP server binds every interface, so the scenario runs inside a
private network namespace (``unshare -rn``: only a loopback interface, nothing reachable from
outside) and talks to it on loopback. The scenario itself is tests/dynamo_indexer_scenario.py:
two workers with G1+G2+G3 and the lineage policy, a workload with evictions, offloads and
onboards (some requests under a LoRA adapter, queried by its name), the indexer killed and
restarted (it catches up from the replay sockets, which read the durable log), a worker
restart (``Cleared`` of G1 and G2, G3 recovered), and a third worker SIGKILLed while it
publishes, three times, and restarted on its log.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCENARIO = Path(__file__).with_name("dynamo_indexer_scenario.py")


def _namespace_prefix() -> list[str]:
    """The command that runs a process in a private network namespace, or skip."""
    if importlib.util.find_spec("dynamo") is None or importlib.util.find_spec("zmq") is None:
        pytest.skip("needs ai-dynamo-runtime and pyzmq (the dev extra)")
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs unshare(1) to run the indexer in a private network namespace")
    probe = subprocess.run(
        [unshare, "-rn", "true"], capture_output=True, text=True, timeout=30, check=False
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot make a private network namespace here: {probe.stderr.strip()}")
    return [unshare, "-rn", "sh", "-c", 'ip link set lo up 2>/dev/null; exec "$@"', "sh"]


@pytest.mark.slow
def test_dynamo_indexer_agrees_with_every_worker_per_tier(tmp_path: Path) -> None:
    command = [*_namespace_prefix(), sys.executable, str(SCENARIO), str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    # the workload filled every tier, so evictions, offloads and onboards all happened
    for counts in report["counts"].values():
        assert counts == {"G1": 24, "G2": 24, "G3": 48}
    assert report["g3_recovered"] > 0
    assert report["lora_cached"] > 0  # LoRA blocks were among those compared
    for phase in ("live", "indexer_restart", "worker_restart", "after_restart"):
        assert report[phase] == [], (phase, report[phase][:5])
    # a worker SIGKILLed while publishing, three times: after each restart the indexer's view
    # of it equals its restarted state
    assert report["killed"] == [[], [], []], report["killed"]
