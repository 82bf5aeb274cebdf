"""A throwaway Redis Cluster on loopback: 3 masters and 3 replicas of ``redis-server
--cluster-enabled yes``, made with ``redis-cli --cluster create``, in a temporary folder.

Used by the cluster tests and by ``bench/redis_bench.py --cluster``. Ports come from 17000-17099
(their cluster bus ports are +10000), the first six that are free when it starts. Two processes
starting a cluster at once (the suite's two pytest workers) would both see the same ports free
and start their nodes on them; the nodes of the second fail to bind, and the first's answered
for them, so the second's ``--cluster create`` mixed two clusters and timed out waiting for
``cluster_state:ok``. So the ports are chosen and bound under a lock that every process takes
(a file lock in the temporary folder), and each node must answer with its own process id.
"""

from __future__ import annotations

import fcntl
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis

PORTS = range(17000, 17100)
BUS_OFFSET = 10000
LOCK = Path(tempfile.gettempdir()) / "kvledger-redis-cluster.lock"


def available() -> str | None:
    """None when a cluster can be started here, else why not."""
    missing = [tool for tool in ("redis-server", "redis-cli") if shutil.which(tool) is None]
    return f"{' and '.join(missing)} not on PATH" if missing else None


def _free(port: int) -> bool:
    for p in (port, port + BUS_OFFSET):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                return False
    return True


class LocalCluster:
    """Start with ``start()``, stop with ``stop()`` (or use it as a context manager)."""

    def __init__(self, masters: int = 3, replicas_per_master: int = 1) -> None:
        self.size = masters * (1 + replicas_per_master)
        self.master_count = masters
        self.replicas_per_master = replicas_per_master
        self.dir = Path(tempfile.mkdtemp(prefix="kvledger-cluster-"))
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        alive = next(p for p, proc in self.procs.items() if proc.poll() is None)
        return f"redis://127.0.0.1:{alive}/0"

    def client(self) -> redis.RedisCluster:
        return redis.RedisCluster.from_url(self.url)

    def start(self) -> LocalCluster:
        try:
            with LOCK.open("a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
                ports = [p for p in PORTS if _free(p)][: self.size]
                if len(ports) < self.size:
                    raise RuntimeError(f"fewer than {self.size} free ports in {PORTS}")
                self._launch(ports)
            self._create(ports)
        except BaseException:
            self.stop()
            raise
        return self

    def _launch(self, ports: list[int]) -> None:
        """Start a node on each port and wait until each answers as itself."""
        for port in ports:
            self.procs[port] = subprocess.Popen(
                [
                    "redis-server", "--port", str(port), "--bind", "127.0.0.1",
                    "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                    "--cluster-node-timeout", "1000", "--cluster-replica-validity-factor", "0",
                    "--cluster-allow-replica-migration", "no",
                    "--dir", str(self.dir), "--save", "", "--appendonly", "no",
                    "--logfile", f"redis-{port}.log",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
        for port, proc in self.procs.items():
            node = self._node(port)

            def answers(node: redis.Redis = node, pid: int = proc.pid) -> bool:
                return int(node.info("server")["process_id"]) == pid

            self._wait(answers, f"node {port} (process {proc.pid}) to start")

    def _create(self, ports: list[int]) -> None:
        subprocess.run(
            ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
             "--cluster-replicas", str(self.replicas_per_master), "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        self.wait_ok()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _node(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=2, decode_responses=True)

    def _wait(self, check: Callable[[], object], what: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if check():
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}")
            time.sleep(0.05)

    def alive(self) -> list[int]:
        return [p for p, proc in self.procs.items() if proc.poll() is None]

    def wait_ok(self) -> None:
        """Wait until every live node says cluster_state:ok and every replica is in sync."""

        def ok() -> bool:
            for port in self.alive():
                node = self._node(port)
                if node.cluster("info")["cluster_state"] != "ok":
                    return False
                info = node.info("replication")
                if info["role"] == "slave" and info.get("master_link_status") != "up":
                    return False
            return len(self.masters()) >= self.master_count

        self._wait(ok, "cluster_state:ok")

    def masters(self) -> dict[int, list[tuple[int, int]]]:
        """Live master port -> its slot ranges, as the live nodes see them."""
        out: dict[int, list[tuple[int, int]]] = {}
        for port in self.alive():
            node = self._node(port)
            if node.info("replication")["role"] == "master":
                slots = node.execute_command("CLUSTER", "SLOTS")  # type: ignore[no-untyped-call]
                out[port] = [(int(s[0]), int(s[1])) for s in slots if int(s[2][1]) == port]
        return out

    def master_of(self, slot: int) -> int:
        for port, ranges in self.masters().items():
            if any(a <= slot <= b for a, b in ranges):
                return port
        raise LookupError(f"no live master serves slot {slot}")

    def replica_of(self, master: int) -> int:
        for port in self.alive():
            info = self._node(port).info("replication")
            if info["role"] == "slave" and int(info["master_port"]) == master:
                return port
        raise LookupError(f"no live replica of {master}")

    def cut_replica(self, replica: int) -> None:
        """Cut a replica's link to its master so that it cannot come back (it offers the master
        a password the master does not take): the master goes on confirming writes that the
        replica never receives, as with a replica that lags."""
        node = self._node(replica)
        node.config_set("masterauth", "not-the-masters")
        node.client_kill_filter(_type="master")
        self._wait(
            lambda: node.info("replication")["master_link_status"] == "down", "the link to drop"
        )

    def kill_9(self, port: int) -> None:
        """SIGKILL one node, as a crash would."""
        self.procs[port].send_signal(signal.SIGKILL)
        self.procs[port].wait()

    def wait_promoted(self, dead: int, slot: int) -> int:
        """Wait until a live master serves ``slot`` (which ``dead`` served); its port."""
        self._wait(lambda: self._serves(slot), f"a replica of {dead} to take slot {slot}")
        self.wait_ok()
        return self.master_of(slot)

    def _serves(self, slot: int) -> bool:
        try:
            self.master_of(slot)
        except LookupError:
            return False
        return all(self._node(p).cluster("info")["cluster_state"] == "ok" for p in self.alive())

    def lowest_slot(self, port: int) -> int:
        """The first slot the master on ``port`` serves: the one ``reshard`` moves."""
        return min(a for a, _b in self.masters()[port])

    def reshard(self, from_port: int, to_port: int) -> None:
        """Move the lowest slot of one master to another with ``redis-cli --cluster reshard``,
        one key per MIGRATE (``--cluster-pipeline 1``), so the slot is half moved for a while."""
        ids = {
            p: self._node(p).execute_command("CLUSTER", "MYID")  # type: ignore[no-untyped-call]
            for p in (from_port, to_port)
        }
        subprocess.run(
            ["redis-cli", "--cluster", "reshard", f"127.0.0.1:{from_port}",
             "--cluster-from", ids[from_port], "--cluster-to", ids[to_port],
             "--cluster-slots", "1", "--cluster-pipeline", "1", "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        self.wait_ok()
