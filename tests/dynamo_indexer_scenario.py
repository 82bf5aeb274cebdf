"""Two BlockManager workers publishing over ZMQ to Dynamo's standalone indexer.

Run by tests/test_dynamo_indexer.py inside a private network namespace (the indexer's HTTP
server binds every interface), so the ports here are fixed and only loopback exists. Prints
one JSON object: per checkpoint, the probe prompts where the indexer's per-tier longest match
for a worker differs from that worker's own ``match``.

    python tests/dynamo_indexer_scenario.py WORK_DIR

A third worker runs as a child process of its own (``--child``), so that it can be SIGKILLed
while it publishes: after each kill it is restarted on the same log and data folder, and
checks from inside that the indexer's view of it equals its own restarted state (which the
durable log rebuilds: other tests hold that), i.e. the indexer converged after the crash.
"""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kvledger import BlockManager, Settings
from kvledger.events.shared.zmq_process import ZmqPublisherProcess
from kvledger.events.shared.zmq_publish import ZmqPublisher
from kvledger.registry.hashing import TokenBlockSequence

BLOCK = 4
HTTP = "http://127.0.0.1:8090"
WORKERS = (11, 12)
KILLED = 13  # the worker run as a child process and SIGKILLed
LORA = "adapter-a"
KILLS = 3


def settings(work: Path, worker: int) -> Settings:
    return Settings.load(
        block_size=BLOCK,
        num_layers=1,
        outer_dim=1,
        inner_dim=4,
        dtype="float32",
        g1_blocks=24,
        g2_blocks=24,
        g3_blocks=48,
        eviction_policy="lineage",
        offload_filter="always",
        data_dir=work / f"w{worker}",
        worker_id=worker,
        zmq_endpoint=f"tcp://127.0.0.1:{5600 + worker}",
        zmq_replay_endpoint=f"tcp://127.0.0.1:{5700 + worker}",
        zmq_ring_size=16,  # most replays then come from the durable log
    )


def post(path: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        HTTP + path, json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.loads(response.read())


def start_indexer(log_path: Path) -> subprocess.Popen[bytes]:
    out = log_path.open("ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dynamo.indexer", "--port", "8090", "--threads", "1"],
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(HTTP + "/health", timeout=1).close()
            break
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.1)
    else:
        raise RuntimeError("the indexer did not come up")
    for worker in (*WORKERS, KILLED):
        post(
            "/register",
            {
                "instance_id": worker,
                "endpoint": f"tcp://127.0.0.1:{5600 + worker}",
                "replay_endpoint": f"tcp://127.0.0.1:{5700 + worker}",
                "block_size": BLOCK,
                "model_name": "default",
            },
        )
    time.sleep(0.5)  # let the subscriptions reach the publishers
    return proc


def serve(mgr: BlockManager, tokens: list[int], lora: str | None = None) -> None:
    """One request as an engine runs it: onboard the cached prefix, compute the rest."""
    seq = mgr.sequence(tokens, lora_name=lora)
    held = mgr.onboard(seq)
    fresh = mgr.allocate(len(seq) - len(held))
    held += mgr.register(fresh, seq, start=len(held))
    mgr.release(held)


def workload(mgrs: dict[int, BlockManager], prompts: list[list[int]], n: int, seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(n):
        worker = rng.choice(WORKERS)
        prompt = rng.choice(prompts)
        tail = [rng.randrange(1000) for _ in range(BLOCK * rng.randrange(0, 3))]
        serve(mgrs[worker], prompt + tail, LORA if rng.random() < 0.2 else None)
    for mgr in mgrs.values():
        mgr.wait_idle(30)
        _publisher(mgr).wait_sent()


def _publisher(mgr: BlockManager) -> ZmqPublisher | ZmqPublisherProcess:
    publisher = mgr.zmq_publisher
    assert publisher is not None
    return publisher


def indexer_view(tokens: list[int], lora: str | None) -> dict[int, tuple[int, int, int]]:
    query: dict[str, Any] = {"token_ids": tokens, "model_name": "default"}
    if lora is not None:
        query["lora_name"] = lora
    answer = post("/query", query)
    out = {}
    for worker in (*WORKERS, KILLED):
        got = answer.get("instances", {}).get(str(worker))
        out[worker] = (0, 0, 0) if got is None else (got["gpu"], got["cpu"], got["disk"])
    return out


Probe = tuple[list[int], str | None]


def mismatches(mgrs: dict[int, BlockManager], probes: list[Probe]) -> list[str]:
    bad = []
    for i, (tokens, lora) in enumerate(probes):
        seen = indexer_view(tokens, lora)
        for worker, mgr in mgrs.items():
            m = mgr.match(TokenBlockSequence(tokens, BLOCK, lora_name=lora))
            want = (m.g1 * BLOCK, (m.g1 + m.g2) * BLOCK, m.total * BLOCK)
            if seen[worker] != want:
                bad.append(f"probe {i} worker {worker}: indexer {seen[worker]} worker {want}")
    return bad


def converged(mgrs: dict[int, BlockManager], probes: list[Probe], wait: float = 15) -> list[str]:
    deadline = time.monotonic() + wait
    while True:
        bad = mismatches(mgrs, probes)
        if not bad or time.monotonic() > deadline:
            return bad
        time.sleep(0.3)


def prompts_and_probes() -> tuple[list[list[int]], list[Probe]]:
    rng = random.Random(7)
    prompts = [[rng.randrange(1000) for _ in range(BLOCK * rng.randrange(2, 7))] for _ in range(9)]
    plain = prompts + [p[: BLOCK * 2] for p in prompts] + [[999] * BLOCK * 3]
    return prompts, [(p, None) for p in plain]


def child(work: Path, mode: str, seed: int) -> None:
    """Worker ``KILLED`` in a process of its own. ``busy``: says it started, then serves
    requests until it is killed. ``restart``: serves a few, then prints how the indexer's
    view of it differs from its own state (converged, or what is left after the wait)."""
    prompts, probes = prompts_and_probes()
    mgrs = {KILLED: BlockManager(settings(work, KILLED))}
    rng = random.Random(seed)
    if mode == "busy":
        print("started", flush=True)
        while True:
            tail = [rng.randrange(1000) for _ in range(BLOCK * rng.randrange(0, 3))]
            serve(mgrs[KILLED], rng.choice(prompts) + tail)
    workload_one(mgrs[KILLED], prompts, 10, rng)
    print(json.dumps(converged(mgrs, probes, wait=30)), flush=True)
    mgrs[KILLED].close()


def workload_one(mgr: BlockManager, prompts: list[list[int]], n: int, rng: random.Random) -> None:
    for _ in range(n):
        tail = [rng.randrange(1000) for _ in range(BLOCK * rng.randrange(0, 3))]
        serve(mgr, rng.choice(prompts) + tail)
    mgr.wait_idle(30)
    _publisher(mgr).wait_sent()


def replays_in_flight(indexer_log: Path, worker: int) -> int:
    """Replays the indexer asked ``worker`` for and has not finished, by its own log."""
    text = ANSI.sub("", indexer_log.read_text(errors="replace"))
    asked = len(re.findall(rf"Requesting replay from engine self\.worker_id={worker}\b", text))
    done = len(re.findall(rf"Replay complete worker_id={worker}\b", text))
    return asked - done


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def kill_rounds(work: Path, rounds: int) -> list[list[str]]:
    """SIGKILL the child worker while it publishes, restart it, and collect what the
    indexer got wrong about it after each restart (empty lists: it converged).

    The kill comes at a random moment while the worker publishes live, not while it serves
    the indexer a replay: Dynamo's indexer (1.6.1) waits for a replay it asked for without a
    time limit, so a publisher killed in the middle of one leaves that worker's stream stalled
    in the indexer until the indexer restarts, whatever the publisher does next (a vLLM
    engine killed then does the same to it)."""
    here = [sys.executable, __file__, str(work), "--child"]
    found = []
    rng = random.Random(11)
    indexer_log = work / "indexer.log"
    for number in range(rounds):
        busy = subprocess.Popen([*here, "busy", str(number)], stdout=subprocess.PIPE, text=True)
        assert busy.stdout is not None and busy.stdout.readline().strip() == "started"
        time.sleep(rng.uniform(0.3, 1.2))
        deadline = time.monotonic() + 30
        while replays_in_flight(indexer_log, KILLED) and time.monotonic() < deadline:
            time.sleep(0.01)
        busy.send_signal(signal.SIGKILL)
        busy.wait()
        done = subprocess.run(
            [*here, "restart", str(100 + number)], capture_output=True, text=True, timeout=120
        )
        if done.returncode != 0:
            raise RuntimeError(f"restart {number} failed: {done.stderr[-2000:]}")
        found.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return found


def main(work: Path) -> None:
    prompts, probes = prompts_and_probes()
    # LoRA blocks go out with their LoRA name: checked live, since the durable log does not
    # keep the name (a router replaying from it gets them without tokens, and skips them)
    with_lora: list[Probe] = probes + [(p, LORA) for p in prompts]
    indexer_log = work / "indexer.log"
    report: dict[str, Any] = {}
    mgrs = {w: BlockManager(settings(work, w)) for w in WORKERS}
    indexer = start_indexer(indexer_log)
    try:
        workload(mgrs, prompts, 120, seed=1)
        report["live"] = converged(mgrs, with_lora)
        report["lora_cached"] = sum(
            1
            for tokens, lora in with_lora
            for mgr in mgrs.values()
            if lora and mgr.match(TokenBlockSequence(tokens, BLOCK, lora_name=lora)).total
        )
        report["counts"] = {w: {t.name: n for t, n in m.counts().items()} for w, m in mgrs.items()}

        # the indexer goes down; the workers go on; a new one catches up by replay
        indexer.kill()
        indexer.wait()
        workload(mgrs, prompts, 60, seed=2)
        indexer = start_indexer(indexer_log)
        report["indexer_restart"] = converged(mgrs, probes)  # caught up by replay alone

        # a worker restarts: G1 and G2 come back empty (Cleared), G3 is recovered
        mgrs[WORKERS[0]].close()
        mgrs[WORKERS[0]] = BlockManager(settings(work, WORKERS[0]))
        recovery = mgrs[WORKERS[0]].recovery
        report["g3_recovered"] = 0 if recovery is None else recovery.recovered
        # the indexer's subscription reaches the new socket after the restart's own Cleared
        # and Removed went out: the newest batch is sent again then, the indexer sees its gap
        # and replays it, with no further event from the worker
        report["worker_restart"] = converged(mgrs, probes)
        workload(mgrs, prompts, 60, seed=5)  # onboards from the recovered G3 among them
        report["after_restart"] = converged(mgrs, probes)
        report["events"] = {w: m.next_event_id for w, m in mgrs.items()}
        report["dropped"] = sum(_publisher(m).dropped for m in mgrs.values())

        # a third worker is SIGKILLed while it publishes, and restarted on the same log
        report["killed"] = kill_rounds(work, KILLS)
    finally:
        for mgr in mgrs.values():
            mgr.close()
        indexer.kill()
        indexer.wait()
    print(json.dumps(report))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[2] == "--child":
        child(Path(sys.argv[1]), sys.argv[3], int(sys.argv[4]))
    else:
        main(Path(sys.argv[1]))
