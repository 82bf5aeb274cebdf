"""The ZMQ sockets: CurveZMQ with key files as settings, checked with real subscribers with and
without the keys; a socket bound beyond loopback without CurveZMQ is reported; ports the
system picked are printed."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.auth

from kvledger import BlockManager, Settings
from kvledger.events.shared.zmq_publish import ZmqPublisher, is_loopback
from kvledger.events.shared.zmq_subscribe import ZmqSubscriber

pytestmark = pytest.mark.usefixtures("clean_env")
BLOCK = 4


def keys(folder: Path, name: str) -> tuple[Path, Path]:
    """(public, secret) certificate files made by zmq.auth, as the docs tell operators."""
    folder.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(folder), name)
    return Path(public), Path(secret)


def manager(tmp_path: Path, **extra: Any) -> BlockManager:
    return BlockManager(
        Settings.load(
            block_size=BLOCK, num_layers=1, outer_dim=1, inner_dim=4, dtype="float32",
            g1_blocks=8, data_dir=tmp_path / "data",
            zmq_endpoint="tcp://127.0.0.1:*", zmq_replay_endpoint="tcp://127.0.0.1:*",
            **extra,
        )
    )  # fmt: skip


def serve(mgr: BlockManager, prompts: int) -> int:
    for p in range(prompts):
        seq = mgr.sequence([1000 * p + t for t in range(2 * BLOCK)])
        held = mgr.onboard(seq)
        held += mgr.register(mgr.allocate(len(seq) - len(held)), seq, start=len(held))
        mgr.release(held)
    assert mgr.zmq_publisher is not None and mgr.zmq_publisher.wait_sent()
    return mgr.next_event_id - 1


def live(sub: ZmqSubscriber) -> list[int]:
    return [seq for seq, _ in sub.batches(timeout=1.5)]


def test_a_subscriber_with_the_server_key_reads_and_replays_one_without_gets_nothing(
    tmp_path: Path,
) -> None:
    public, secret = keys(tmp_path / "keys", "worker")
    wrong_public, _ = keys(tmp_path / "other", "impostor")
    with manager(tmp_path, zmq_curve_secret_key=secret) as mgr:
        pub = mgr.zmq_publisher
        assert pub is not None and pub.replay_endpoint is not None
        assert pub.curve_public_key == zmq.auth.load_certificate(str(public))[0]
        subs = {
            "with the key": ZmqSubscriber(
                pub.endpoint, replay_endpoint=pub.replay_endpoint, curve_server_key=public,
                replay_timeout=2,
            ),
            "plain": ZmqSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint,
                                   replay_timeout=2),
            "a wrong key": ZmqSubscriber(
                pub.endpoint, replay_endpoint=pub.replay_endpoint,
                curve_server_key=wrong_public, replay_timeout=2,
            ),
        }  # fmt: skip
        time.sleep(0.5)  # subscriptions reach the publisher (or fail their handshake)
        last = serve(mgr, 3)
        got = {name: live(sub) for name, sub in subs.items()}
        assert got["with the key"] == list(range(last + 1))
        assert got["plain"] == [] and got["a wrong key"] == []
        replayed = [seq for seq, _ in subs["with the key"].replay(0)]
        assert replayed == list(range(last + 1))
        for name in ("plain", "a wrong key"):
            with pytest.raises(TimeoutError):
                list(subs[name].replay(0))
        for sub in subs.values():
            sub.close()


def test_with_client_keys_only_listed_subscribers_get_in(tmp_path: Path) -> None:
    public, secret = keys(tmp_path / "keys", "worker")
    _listed_public, listed_secret = keys(tmp_path / "clients", "router")
    _, unlisted_secret = keys(tmp_path / "elsewhere", "stranger")
    with manager(
        tmp_path, zmq_curve_secret_key=secret, zmq_curve_client_keys=tmp_path / "clients"
    ) as mgr:
        pub = mgr.zmq_publisher
        assert pub is not None and pub.replay_endpoint is not None
        listed = ZmqSubscriber(
            pub.endpoint, replay_endpoint=pub.replay_endpoint,
            curve_server_key=public, curve_client_key=listed_secret, replay_timeout=2,
        )  # fmt: skip
        stranger = ZmqSubscriber(
            pub.endpoint, replay_endpoint=pub.replay_endpoint,
            curve_server_key=public, curve_client_key=unlisted_secret, replay_timeout=2,
        )  # fmt: skip
        time.sleep(0.5)
        last = serve(mgr, 2)
        assert live(listed) == list(range(last + 1))
        assert live(stranger) == []
        assert [seq for seq, _ in listed.replay(0)] == list(range(last + 1))
        with pytest.raises(TimeoutError):
            list(stranger.replay(0))
        listed.close()
        stranger.close()


def test_tail_reads_a_curve_stream_with_the_key_flags(tmp_path: Path) -> None:
    public, secret = keys(tmp_path / "keys", "worker")
    with manager(tmp_path, zmq_curve_secret_key=secret) as mgr:
        pub = mgr.zmq_publisher
        assert pub is not None and pub.replay_endpoint is not None
        serve(mgr, 2)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVLEDGER_")}
        proc = subprocess.run(
            [
                sys.executable, "-m", "kvledger.cli", "tail", "--zmq", pub.endpoint,
                "--zmq-replay", pub.replay_endpoint, "--zmq-server-key", str(public),
                "--no-follow",
            ],
            capture_output=True, text=True, timeout=60, env=env, check=False,
        )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("stored") >= 2, proc.stdout


def test_bad_key_settings_are_refused_by_name(tmp_path: Path) -> None:
    public, _secret = keys(tmp_path / "keys", "worker")
    with pytest.raises(ValueError, match="is a public certificate; CurveZMQ needs the secret"):
        manager(tmp_path, zmq_curve_secret_key=public)
    with pytest.raises(ValueError, match=r"zmq_curve_secret_key .*no such file"):
        Settings.load(zmq_endpoint="tcp://127.0.0.1:*", zmq_curve_secret_key=tmp_path / "none")
    with pytest.raises(ValueError, match="zmq_curve_client_keys needs zmq_curve_secret_key"):
        Settings.load(zmq_endpoint="tcp://127.0.0.1:*", zmq_curve_client_keys=tmp_path)


def test_binding_beyond_loopback_without_curve_is_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert is_loopback("tcp://127.0.0.1:5557") and is_loopback("ipc:///tmp/x")
    assert not is_loopback("tcp://0.0.0.0:5557") and not is_loopback("tcp://*:5557")
    _public, secret = keys(tmp_path / "keys", "worker")
    caplog.set_level(logging.WARNING, "kvledger.events.shared.zmq_publish")
    for endpoint, curve, warned in (
        ("tcp://127.0.0.1:*", None, False),
        ("tcp://0.0.0.0:*", secret, False),
        ("tcp://0.0.0.0:*", None, True),
    ):
        caplog.clear()
        ZmqPublisher(endpoint, worker_id=0, block_size=BLOCK, curve_secret_key=curve).close()
        lines = [r.getMessage() for r in caplog.records if "listens beyond" in r.getMessage()]
        assert bool(lines) == warned, lines
        if warned:
            assert "prompts' token ids included" in lines[0] and "127.0.0.1" in lines[0]


def test_ports_the_system_picked_are_printed(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLEDGER_")}
    proc = subprocess.run(
        [
            sys.executable, "-m", "kvledger.cli", "simulate", "--requests", "5",
            "--zmq-endpoint", "tcp://127.0.0.1:*", "--zmq-replay-endpoint", "tcp://127.0.0.1:*",
        ],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stderr.splitlines() if "publishing KV events on" in ln)
    ports = re.findall(r"tcp://127\.0\.0\.1:(\d+)", line)
    assert len(ports) == 2 and all(int(p) > 0 for p in ports), line
