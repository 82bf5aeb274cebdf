"""G4's NIXL agent listens where the ``g4_interface`` setting says: loopback unless the operator
names devices (or ``all``). The sockets are read from the kernel's own tables (/proc/net), for
an agent made in a child process, so only that agent's sockets are counted."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from kvledger.config import Settings, SettingsError
from kvledger.tiers.remote import nixl_unavailable_reason

pytestmark = [
    pytest.mark.skipif(
        nixl_unavailable_reason() is not None, reason=str(nixl_unavailable_reason())
    ),
    pytest.mark.usefixtures("clean_env"),
]

LISTENING = """
import json, os, sys
from kvledger.tiers.remote import RemoteAgent

def listening():
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                parts = line.split()
                if parts[3] == "0A" and parts[9] in inodes:  # LISTEN, ours
                    found.append(parts[1].split(":")[0])
    return found

devices = sys.argv[1] if sys.argv[1] != "-" else None
agent = RemoteAgent(1, devices=devices)
print("@" + json.dumps({"devices": agent.devices, "hosts": listening()}))
agent.close()
"""

LOOPBACK_HEX = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1


def agent_sockets(devices: str, env: dict[str, str] | None = None) -> tuple[str | None, set[str]]:
    """(the devices the agent was made with, the addresses it listens on, as /proc writes
    them)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KVLEDGER_", "UCX_"))}
    proc = subprocess.run(
        [sys.executable, "-c", LISTENING, devices],
        capture_output=True,
        text=True,
        timeout=60,
        env={**base, **(env or {})},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("@"))
    out = json.loads(line[1:])
    return out["devices"], set(out["hosts"])


def non_loopback_address() -> str | None:
    """An address of this machine that is not loopback (None when it has none)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: no packet is sent by a UDP connect
            address = str(s.getsockname()[0])
    except OSError:
        return None
    return None if address.startswith("127.") else address


def test_the_agent_listens_on_loopback_only_by_default() -> None:
    devices, hosts = agent_sockets("-")
    assert devices == "lo"
    assert hosts, "the agent listens somewhere"
    assert hosts <= LOOPBACK_HEX, f"listening beyond loopback: {hosts}"


def test_all_and_the_operators_ucx_setting_are_honoured() -> None:
    if non_loopback_address() is None:
        pytest.skip("this machine has no interface besides loopback to listen on")
    devices, hosts = agent_sockets("all")
    assert devices is None and not hosts <= LOOPBACK_HEX
    # an operator's UCX_NET_DEVICES is kept when the setting is not given
    devices, hosts = agent_sockets("-", env={"UCX_NET_DEVICES": "lo"})
    assert devices == "lo" and hosts <= LOOPBACK_HEX


def test_the_setting_is_checked_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLEDGER_G4_INTERFACE", "eth0; rm -rf /")
    with pytest.raises(SettingsError, match=r"g4_interface \(KVLEDGER_G4_INTERFACE\)"):
        Settings.load()
    monkeypatch.setenv("KVLEDGER_G4_INTERFACE", "lo,eth0")
    assert Settings.load().g4_interface == "lo,eth0"
