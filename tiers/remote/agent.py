"""One NIXL agent per worker: registers its tier memory and READs other workers' blocks.

Reads are one-sided: the reader names remote addresses from the owner's ``AgentCard`` and
NIXL (UCX) moves the bytes without the owner's Python code running. So everything that can go
wrong on the other side shows up here as a transfer that errors or never finishes: a dead owner
(the UCX endpoint reports the peer gone), an owner that stopped responding (the read is still in
progress at the deadline).

A read that failed (an error state, or NIXL raising because the peer is gone) is over: its
handle is released and the connection dropped; the next read reconnects from the card. A read
still in progress at its deadline is *not* over: releasing its handle and dropping the
connection does not stop UCX from writing the bytes when the owner resumes (measured: a stopped
owner sent all 128 MiB into the released destination after SIGCONT). So such a read is kept,
under an id, until ``settle()`` sees it end; until then the caller must not reuse its
destination slots, and the owner counts as stalled (``stalled_workers``).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvledger.events.types import Tier
from kvledger.tiers.base import MemoryTier
from kvledger.tiers.layout import BlockShape, FullyContiguous
from kvledger.tiers.remote.directory import AgentCard, Region, shape_key
from kvledger.tiers.remote.nixl import nixl_api

log = logging.getLogger(__name__)

Pairs = Sequence[tuple[int, int]]


@dataclass(frozen=True, slots=True)
class ReadOutcome:
    """``ok`` when every byte arrived; otherwise ``reason`` is one of ``timeout``,
    ``disconnected`` (the owner is gone) or ``error`` (NIXL refused or failed the read)."""

    ok: bool
    reason: str | None = None
    detail: str = ""
    seconds: float = 0.0
    in_flight: int | None = None
    """Set on a timeout: the id of the read, which may still write into its destination."""


_ENV_LOCK = threading.Lock()


def net_devices(devices: str | None) -> str | None:
    """The devices an agent's UCX uses: ``devices`` as UCX names them (``lo``, ``eth0``,
    ``mlx5_0:1``, comma-separated), ``all`` for every one, or None for the operator's
    ``UCX_NET_DEVICES`` when set and loopback otherwise: nothing listens beyond this machine
    unless asked to."""
    if devices is None:
        return os.environ.get("UCX_NET_DEVICES") or "lo"
    return None if devices == "all" else devices


@contextmanager
def _ucx_devices(devices: str | None) -> Iterator[None]:
    """``UCX_NET_DEVICES`` as ``devices`` while an agent is made (UCX reads its environment
    when the agent's context is created), then as it was. The lock keeps two agents made at
    once in this process from seeing each other's."""
    with _ENV_LOCK:
        saved = os.environ.get("UCX_NET_DEVICES")
        if devices is None:
            os.environ.pop("UCX_NET_DEVICES", None)
        else:
            os.environ["UCX_NET_DEVICES"] = devices
        try:
            yield
        finally:
            if saved is None:
                os.environ.pop("UCX_NET_DEVICES", None)
            else:
                os.environ["UCX_NET_DEVICES"] = saved


class RemoteAgent:
    """A NIXL agent with the UCX backend, holding this worker's registered tier memory.

    Thread-safe: reads and registrations are serialised by one lock (NIXL agents are created
    without internal locking here).
    """

    def __init__(
        self, worker_id: int, *, name: str | None = None, devices: str | None = None
    ) -> None:
        api = nixl_api()
        self.worker_id = worker_id
        self.name = name or f"kvl-w{worker_id}-{os.getpid()}-{secrets.token_hex(4)}"
        self.devices = net_devices(devices)
        """The network devices UCX listens and reads on (None: every one, UCX's default)."""
        with _ucx_devices(self.devices):
            self._agent: Any = api.nixl_agent(self.name, api.nixl_agent_config(backends=["UCX"]))
        if "UCX" not in self._agent.backends:
            raise RuntimeError("NIXL loaded but its UCX backend could not be created")
        self._lock = threading.Lock()
        self._regions: dict[Tier, Region] = {}
        self._reg_descs: list[Any] = []
        self._peers: dict[int, str] = {}  # worker id -> agent name loaded from its card
        self._unsettled: dict[int, tuple[Any, int]] = {}  # read id -> (handle, worker id)
        self._read_ids = 0

    # -- registration ------------------------------------------------------------------------

    def register(self, tier: MemoryTier) -> Region:
        """Register a tier's slots (a ``FullyContiguous`` layout: one run of memory)."""
        layout = tier.layout
        if not isinstance(layout, FullyContiguous):
            raise ValueError(
                f"{tier.tier.name} must have a FullyContiguous layout to be read over NIXL, "
                f"it has {type(layout).__name__}"
            )
        dev = layout.tensor.device
        region = Region(
            tier=tier.tier,
            mem_type="VRAM" if dev.type == "cuda" else "DRAM",
            device_id=(dev.index or 0) if dev.type == "cuda" else 0,
            address=layout.tensor.data_ptr(),
            num_slots=layout.num_blocks,
            stride=tier.shape.block_bytes,
        )
        return self.register_region(region)

    def register_region(self, region: Region) -> Region:
        """Register a run of memory that is not a tier's tensor under ``region.tier``: a G3
        file mapped into memory (``MappedG3``), whose slots peers then read in place."""
        with self._lock:
            if region.tier in self._regions:
                raise ValueError(f"{region.tier.name} is already registered with this agent")
            descs = self._agent.register_memory(
                [(region.address, region.num_slots * region.stride, region.device_id, "")],
                region.mem_type,
            )
            self._reg_descs.append(descs)
            self._regions[region.tier] = region
        return region

    def region(self, tier: Tier) -> Region:
        try:
            return self._regions[tier]
        except KeyError:
            raise ValueError(f"{tier.name} is not registered with NIXL agent {self.name}") from None

    def card(self, shape: BlockShape) -> AgentCard:
        """This agent as others must see it (metadata taken after every registration)."""
        with self._lock:
            metadata = bytes(self._agent.get_agent_metadata())
            regions = tuple(self._regions.values())
        return AgentCard(
            self.worker_id, self.name, metadata, shape_key(shape), shape.block_bytes, regions
        )

    # -- reading -----------------------------------------------------------------------------

    def read(
        self,
        card: AgentCard,
        src: Region,
        dst_tier: Tier,
        pairs: Pairs,
        *,
        timeout_s: float,
    ) -> ReadOutcome:
        """READ ``(remote slot, local slot)`` pairs from ``src`` of ``card`` into ``dst_tier``.

        Never raises for the remote side's failures and never returns before the transfer is
        finished or abandoned (see the module docstring).
        """
        return self._transfer("READ", card, src, dst_tier, pairs, timeout_s)

    def write(
        self,
        card: AgentCard,
        dst: Region,
        src_tier: Tier,
        pairs: Pairs,
        *,
        timeout_s: float,
    ) -> ReadOutcome:
        """WRITE ``(remote slot, local slot)`` pairs from local ``src_tier`` into ``dst`` of
        ``card``; the same contract as ``read``.

        G4 pulls (``read``); this is the push direction, kept because UCX does not treat the
        two alike: on a GPU without NVLink its ``cuda_ipc`` transport serves PUT but not GET by
        default (``bench/RESULTS.md``), so a push protocol is the fallback to measure.
        """
        return self._transfer("WRITE", card, dst, src_tier, pairs, timeout_s)

    def _transfer(
        self,
        op: str,
        card: AgentCard,
        remote_region: Region,
        local_tier: Tier,
        pairs: Pairs,
        timeout_s: float,
    ) -> ReadOutcome:
        local_region = self.region(local_tier)
        nbytes = card.block_bytes
        if nbytes > remote_region.stride or nbytes > local_region.stride:
            raise ValueError(
                f"remote blocks are {nbytes} bytes, more than the remote slots "
                f"({remote_region.stride}) or the local ones ({local_region.stride}) hold"
            )
        if not pairs:
            return ReadOutcome(True)
        local, remote = _descriptors(remote_region, local_region, pairs, nbytes)
        started = time.monotonic()
        with self._lock:
            handle = None
            try:
                peer = self._connect(card)
                handle = self._agent.initialize_xfer(
                    op,
                    self._agent.get_xfer_descs(local, local_region.mem_type),
                    self._agent.get_xfer_descs(remote, remote_region.mem_type),
                    peer,
                )
                state = self._agent.transfer(handle)
                state = self._wait(handle, state, started + timeout_s)
            except Exception as exc:  # NIXL raises e.g. nixlRemoteDisconnectError
                outcome = ReadOutcome(False, _reason(exc), f"{type(exc).__name__}: {exc}")
            else:
                if state == "DONE":
                    outcome = ReadOutcome(True)
                elif state == "PROC":
                    self._read_ids += 1
                    self._unsettled[self._read_ids] = (handle, card.worker_id)
                    handle = None  # kept: it may still write (see the module docstring)
                    outcome = ReadOutcome(
                        False, "timeout", f"not finished after {timeout_s} s", 0, self._read_ids
                    )
                else:
                    outcome = ReadOutcome(False, "error", f"transfer state {state}")
            if not outcome.ok and outcome.in_flight is None:
                self._drop_peer(card.worker_id)
            if handle is not None:
                self._release(handle)
        seconds = time.monotonic() - started
        return ReadOutcome(outcome.ok, outcome.reason, outcome.detail, seconds, outcome.in_flight)

    def settle(self) -> list[int]:
        """Ids of reads abandoned at their deadline that have ended since (done, failed, or
        their owner gone): their destinations are safe to reuse now."""
        ended: list[int] = []
        with self._lock:
            for read_id, (handle, worker) in list(self._unsettled.items()):
                try:
                    state = self._agent.check_xfer_state(handle)
                except Exception:  # the peer is gone: nothing more can arrive
                    state = "ERR"
                if state == "PROC":
                    continue
                del self._unsettled[read_id]
                self._release(handle)
                if state != "DONE":
                    self._drop_peer(worker)
                ended.append(read_id)
        return ended

    def stalled_workers(self) -> set[int]:
        """Workers with a read still in flight past its deadline."""
        with self._lock:
            return {worker for _, worker in self._unsettled.values()}

    def _wait(self, handle: Any, state: str, deadline: float) -> str:
        """Poll until the transfer leaves PROC or the deadline passes; spin briefly first
        (small reads finish in microseconds), then sleep in short steps to spare the CPU."""
        spins = 0
        while state == "PROC":
            if time.monotonic() >= deadline:
                return "PROC"
            spins += 1
            if spins > 200:
                time.sleep(0.0002)
            state = self._agent.check_xfer_state(handle)
        return str(state)

    def _connect(self, card: AgentCard) -> str:
        known = self._peers.get(card.worker_id)
        if known == card.agent_name:
            return known
        if known is not None:  # the worker restarted: its old agent is gone
            self._drop_peer(card.worker_id)
        loaded = self._agent.add_remote_agent(card.metadata)
        name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if name != card.agent_name:
            self._agent.remove_remote_agent(name)
            raise ValueError(
                f"card of worker {card.worker_id} names agent {card.agent_name!r} "
                f"but its metadata is agent {name!r}"
            )
        self._peers[card.worker_id] = name
        return name

    def _drop_peer(self, worker_id: int) -> None:
        name = self._peers.pop(worker_id, None)
        if name is None:
            return
        try:
            self._agent.remove_remote_agent(name)
        except Exception as exc:
            log.debug("removing NIXL agent %s: %s", name, exc)

    def _release(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as exc:
            log.debug("releasing a NIXL transfer handle: %s", exc)

    def close(self) -> None:
        """Disconnect from every peer and deregister memory."""
        with self._lock:
            for handle, _ in self._unsettled.values():
                self._release(handle)
            self._unsettled.clear()
            for worker in list(self._peers):
                self._drop_peer(worker)
            for descs in self._reg_descs:
                try:
                    self._agent.deregister_memory(descs)
                except Exception as exc:
                    log.debug("deregistering NIXL memory: %s", exc)
            self._reg_descs.clear()
            self._regions.clear()


def _descriptors(
    remote_region: Region, local_region: Region, pairs: Pairs, nbytes: int
) -> tuple[np.ndarray, np.ndarray]:
    """Nx3 ``(address, length, device)`` arrays (local, remote). Where both sides space their
    slots alike, one row per run of ``(remote slot, local slot)`` pairs consecutive on both
    sides, so a batch of neighbouring blocks moves as one descriptor; otherwise (a G3 file's
    page-aligned slots read into packed host slots) one row of ``nbytes`` per block."""
    runs: list[list[int]] = []  # [remote slot, local slot, count]
    same = remote_region.stride == local_region.stride
    for r, loc in pairs:
        if same and runs and runs[-1][0] + runs[-1][2] == r and runs[-1][1] + runs[-1][2] == loc:
            runs[-1][2] += 1
        else:
            runs.append([r, loc, 1])
    local_len = local_region.stride if same else nbytes
    remote_len = remote_region.stride if same else nbytes
    local = np.array(
        [
            (local_region.slot_address(loc), n * local_len, local_region.device_id)
            for _, loc, n in runs
        ],
        dtype=np.uint64,
    )
    remote = np.array(
        [
            (remote_region.slot_address(r), n * remote_len, remote_region.device_id)
            for r, _, n in runs
        ],
        dtype=np.uint64,
    )
    for r, loc, n in runs:  # the last slot of each run must exist too
        remote_region.slot_address(r + n - 1)
        local_region.slot_address(loc + n - 1)
    return local, remote


def _reason(exc: Exception) -> str:
    text = f"{type(exc).__name__} {exc}".upper()
    return "disconnected" if "DISCONNECT" in text or "NOT_FOUND" in text else "error"
