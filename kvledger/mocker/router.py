"""Routers of a simulated cluster: which worker each request goes to.

- ``round_robin``: request i goes to worker i mod N, in arrival order (Dynamo's
  ``round_robin``).
- ``random``: a uniformly random worker, from a seeded generator.
- ``kv``: Dynamo's KV router. For each worker it weighs the work the request would add there
  against the prefix already cached there, and picks the cheapest:

  ``cost = prefill_load_scale * max(0, raw_prefill_blocks - overlap_credit_blocks)
  + decode_blocks + decode_active_request_weight * active_requests``, where

  - ``raw_prefill_blocks = (active prefill tokens + the request's prompt tokens) / block
    size``: the prompt work already routed to the worker and not yet prefilled, plus this
    request's whole prompt (0 without ``router_track_prefill_tokens``);
  - ``overlap_credit_blocks = overlap_score_credit * device + host_cache_hit_weight * host +
    disk_cache_hit_weight * disk + shared_cache_multiplier * shared``: the request's leading
    blocks the worker holds on G1 (device), then those that continue the prefix on G2 (host)
    and on G3 (disk), and the blocks past its device prefix that a peer can send (G4, when
    peers share their G2);
  - ``decode_blocks``: the distinct blocks of the requests active on the worker, plus this
    request's blocks not among them.

  A worker's active prefill tokens grow by the request's uncached part (its prompt less its
  device prefix) when it is routed there and drop when its first token is out; its active
  blocks are freed when it finishes. The cached prefixes come from a ``RouterIndex`` fed by
  the workers' own events. With ``router_temperature`` 0 the cheapest worker wins and ties
  are broken at random (Dynamo does the same, unseeded); above 0 a worker is drawn with
  probability ``exp(-(cost - min) / ((max - min) * temperature))``, normalised.

The setting names and defaults are Dynamo 1.6's ``KvRouterConfig``: credit 1.0 for a G1 hit,
0.75 for a host (G2) hit, 0.25 for a disk (G3) hit, prefill load scale 1.0, temperature 0,
no active-request weight, and a shared-cache multiplier of 0.5 when a shared cache (here G4)
is on.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import ClassVar

from kvledger.events.types import Tier
from kvledger.mocker.routing import ROUTERS, KvRouterConfig
from kvledger.registry.index import RouterIndex, count, uncount

_G1, _G2 = Tier.G1, Tier.G2


class WorkerLoad:
    """What the router has sent a worker and not yet heard back about: Dynamo's active
    sequences of one worker."""

    __slots__ = ("blocks", "requests", "prefill", "prefill_tokens")

    def __init__(self) -> None:
        #: sequence hash -> how many active requests hold it
        self.blocks: dict[int, int] = {}
        #: request -> its prompt's sequence hashes
        self.requests: dict[int, list[int]] = {}
        #: request -> prompt tokens it still has to prefill (until its first token)
        self.prefill: dict[int, int] = {}
        self.prefill_tokens = 0

    def active_prefix(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` active requests hold.

        A sequence hash names its whole prefix, so a held block's predecessors are held too:
        the held blocks of a prompt are a prefix of it, found by bisection.
        """
        blocks = self.blocks
        n = len(hashes)
        if not n or hashes[0] not in blocks:
            return 0  # the usual case: nothing of it is active
        if hashes[-1] in blocks:
            return n
        low, high = 1, n - 1  # hashes[low - 1] is held, hashes[high] is not
        while low < high:
            mid = (low + high) // 2
            if hashes[mid] in blocks:
                low = mid + 1
            else:
                high = mid
        return low

    def add(self, request: int, hashes: list[int], prefill_tokens: int) -> None:
        count(self.blocks, hashes)
        self.requests[request] = hashes
        if prefill_tokens > 0:
            self.prefill[request] = prefill_tokens
            self.prefill_tokens += prefill_tokens

    def prefill_done(self, request: int) -> None:
        self.prefill_tokens -= self.prefill.pop(request, 0)

    def free(self, request: int) -> None:
        self.prefill_done(request)
        hashes = self.requests.pop(request, None)
        if hashes is not None:
            uncount(self.blocks, hashes)


class Router:
    """Picks a worker (an index into the cluster's workers) for each request."""

    name: ClassVar[str]
    #: its picks do not depend on what the workers hold or do
    stateless: ClassVar[bool] = False

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"a cluster needs at least 1 worker, got {workers}")
        self.workers = workers
        #: requests routed to each worker
        self.routed = [0] * workers

    def route(self, request: int, hashes: list[int], prompt_tokens: int) -> int:
        """The worker for ``request`` (``hashes``: its prompt's full blocks)."""
        worker = self._pick(request, hashes, prompt_tokens)
        self.routed[worker] += 1
        return worker

    def _pick(self, request: int, hashes: list[int], prompt_tokens: int) -> int:
        raise NotImplementedError

    def prefill_done(self, worker: int, request: int) -> None:
        """``request``'s first token came out of ``worker``."""

    def finished(self, worker: int, request: int) -> None:
        """``request`` finished on ``worker``."""


class RoundRobinRouter(Router):
    name = "round_robin"
    stateless = True

    def __init__(self, workers: int) -> None:
        super().__init__(workers)
        self._next = 0

    def _pick(self, request: int, hashes: list[int], prompt_tokens: int) -> int:
        worker = self._next
        self._next = (worker + 1) % self.workers
        return worker


class RandomRouter(Router):
    name = "random"
    stateless = True

    def __init__(self, workers: int, *, seed: int = 0) -> None:
        super().__init__(workers)
        self._rng = random.Random(seed)

    def _pick(self, request: int, hashes: list[int], prompt_tokens: int) -> int:
        return self._rng.randrange(self.workers)


class KvRouter(Router):
    """Dynamo's cost over ``index`` (the workers' cached prefixes) and its own load tracking.

    ``worker_ids[i]`` is the id worker i's events carry. ``tiers``: weigh G2 and G3 hits
    (the index then answers per tier, which costs more than a G1-only query). ``shared``: G4
    is on, so blocks past a worker's device prefix that another worker holds on G2 earn
    ``shared_cache_multiplier``.
    """

    name = "kv"

    def __init__(
        self,
        index: RouterIndex,
        worker_ids: Sequence[int],
        *,
        block_size: int,
        config: KvRouterConfig | None = None,
        seed: int = 0,
        tiers: bool = False,
        shared: bool = False,
    ) -> None:
        super().__init__(len(worker_ids))
        self.index = index
        self.worker_ids = list(worker_ids)
        self._slot = {(w, 0): i for i, w in enumerate(self.worker_ids)}
        self.block_size = block_size
        self.config = config if config is not None else KvRouterConfig()
        self.loads = [WorkerLoad() for _ in worker_ids]
        self.tiers = tiers
        self.shared = shared
        self._rng = random.Random(seed)
        #: blocks of the chosen worker's device prefix over blocks asked, summed
        self.overlap_blocks = 0
        self.asked_blocks = 0

    def devices(self, hashes: list[int]) -> list[int]:
        """Per worker: the leading blocks of ``hashes`` it holds on G1 (its device prefix)."""
        out = [0] * self.workers
        slot = self._slot
        for key, per_tier in self.index.find_matches(hashes, kind="sequence").items():
            i = slot.get(key)
            if i is not None:
                out[i] = per_tier.get(_G1, 0)
        return out

    def overlaps(self, hashes: list[int]) -> list[tuple[int, int, int, int]]:
        """Per worker: (device, host, disk, shared) blocks, as the cost weighs them."""
        n = self.workers
        if not self.tiers and not self.shared:
            return [(device, 0, 0, 0) for device in self.devices(hashes)]
        out = [(0, 0, 0, 0)] * n
        slot = self._slot
        reach = self.index.tier_reach(hashes)
        g2_depth = [0] * n  # for G4: how far each worker's G2 alone reaches
        if self.shared:
            for key, per_tier in self.index.find_matches(hashes, kind="sequence").items():
                i = slot.get(key)
                if i is not None:
                    g2_depth[i] = per_tier.get(_G2, 0)
        for key, (g1, g12, g123, _g1234) in reach.items():
            i = slot.get(key)
            if i is None:
                continue
            if self.tiers:
                out[i] = (g1, g12 - g1, g123 - g12, 0)
            else:
                out[i] = (g1, 0, 0, 0)
        if self.shared:
            # the best peer for each worker: the deepest G2 among the others
            order = sorted(range(n), key=g2_depth.__getitem__, reverse=True)
            for i in range(n):
                peer = order[0] if order[0] != i else (order[1] if n > 1 else i)
                device, host, disk, _ = out[i]
                beyond = g2_depth[peer] - (device + host + disk) if peer != i else 0
                out[i] = (device, host, disk, max(0, beyond))
        return out

    def costs(self, hashes: list[int], prompt_tokens: int) -> tuple[list[float], list[int]]:
        """Each worker's cost, and its device prefix (in blocks) for this prompt."""
        cfg = self.config
        bs = self.block_size
        credit = cfg.overlap_score_credit
        scale, per_request = cfg.prefill_load_scale, cfg.decode_active_request_weight
        track = cfg.router_track_prefill_tokens
        if self.tiers or self.shared:
            host_w, disk_w = cfg.host_cache_hit_weight, cfg.disk_cache_hit_weight
            shared_w = cfg.shared_cache_multiplier
            found = self.overlaps(hashes)
            devices = [device for device, _host, _disk, _shared in found]
            credits = [
                credit * device + host_w * host + disk_w * disk + shared_w * shared
                for device, host, disk, shared in found
            ]
        else:  # G1 alone: the other terms would add 0.0, which changes no float
            devices = self.devices(hashes)
            credits = [credit * device for device in devices]
        costs: list[float] = []
        n = len(hashes)
        first = hashes[0] if n else None
        # (indexing rather than zip(strict=True): its keyword costs more than the check
        # earns, once a request; there is a credit per load by construction)
        for i, load in enumerate(self.loads):
            # Dynamo's arithmetic, in its order, so that ties are ties here too
            raw = (load.prefill_tokens + prompt_tokens) / bs if track else 0.0
            prefill = raw - credits[i]
            blocks = load.blocks
            cost: float = len(blocks) + n
            if first in blocks:
                cost -= load.active_prefix(hashes)
            if prefill > 0:
                cost += scale * prefill
            if per_request:
                cost += per_request * len(load.requests)
            costs.append(cost)
        return costs, devices

    def _pick(self, request: int, hashes: list[int], prompt_tokens: int) -> int:
        costs, devices = self.costs(hashes, prompt_tokens)
        temperature = self.config.router_temperature
        worker = self._cheapest(costs) if temperature == 0 else self._sample(costs, temperature)
        device = devices[worker]
        uncached = max(0, prompt_tokens - device * self.block_size)
        tracked = uncached if self.config.router_track_prefill_tokens else 0
        self.loads[worker].add(request, hashes, tracked)
        self.overlap_blocks += device
        self.asked_blocks += len(hashes)
        return worker

    def _cheapest(self, costs: list[float]) -> int:
        """The cheapest worker; among equals, each is as likely (reservoir sampling)."""
        if len(set(costs)) == len(costs):
            # no two alike: the loop below would draw nothing and find the one minimum
            return costs.index(min(costs))
        best, best_cost, ties = 0, math.inf, 0
        rng = self._rng
        for i, cost in enumerate(costs):
            if cost < best_cost:
                best, best_cost, ties = i, cost, 1
            elif cost == best_cost:
                ties += 1
                if rng.randrange(ties) == 0:
                    best = i
        return best

    def _sample(self, costs: list[float], temperature: float) -> int:
        low, high = min(costs), max(costs)
        if low == high:
            return self._rng.randrange(len(costs))
        span = (high - low) * temperature
        weights = [math.exp(-(c - low) / span) for c in costs]
        return self._rng.choices(range(len(costs)), weights)[0]

    def prefill_done(self, worker: int, request: int) -> None:
        self.loads[worker].prefill_done(request)

    def finished(self, worker: int, request: int) -> None:
        self.loads[worker].free(request)


def build_router(
    name: str,
    *,
    index: RouterIndex | None,
    worker_ids: Sequence[int],
    block_size: int,
    config: KvRouterConfig | None = None,
    seed: int = 0,
    tiers: bool = False,
    shared: bool = False,
) -> Router:
    """The router called ``name`` (one of ``ROUTERS``)."""
    if name == "round_robin":
        return RoundRobinRouter(len(worker_ids))
    if name == "random":
        return RandomRouter(len(worker_ids), seed=seed)
    if name == "kv":
        if index is None:
            raise ValueError("the kv router needs an index of the workers' blocks")
        return KvRouter(
            index,
            worker_ids,
            block_size=block_size,
            config=config,
            seed=seed,
            tiers=tiers,
            shared=shared,
        )
    raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {name!r}")
