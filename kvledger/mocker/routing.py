"""The names a cluster's command line chooses from (routers, router feeds) and the KV router's
settings, apart from the router and its index: parsing ``kvledger simulate``'s arguments loads
this module alone, and only a cluster run loads the router (``python -X importtime``: the
router and ``RouterIndex`` were a tenth of a single-worker run's own imports).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import ClassVar

ROUTERS = ("round_robin", "random", "kv")
FEEDS = ("memory", "zmq", "redis")


@dataclass(frozen=True, slots=True)
class KvRouterConfig:
    """The KV router's weights, named as Dynamo's ``KvRouterConfig`` names them."""

    overlap_score_credit: float = 1.0
    prefill_load_scale: float = 1.0
    host_cache_hit_weight: float = 0.75
    disk_cache_hit_weight: float = 0.25
    shared_cache_multiplier: float = 0.5
    decode_active_request_weight: float = 0.0
    router_temperature: float = 0.0
    router_track_prefill_tokens: bool = True

    #: the settings a command line may give, as ``--name value``
    FLOATS: ClassVar[tuple[str, ...]] = (
        "overlap_score_credit",
        "prefill_load_scale",
        "host_cache_hit_weight",
        "disk_cache_hit_weight",
        "shared_cache_multiplier",
        "decode_active_request_weight",
        "router_temperature",
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool):
                continue
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{f.name} must be a finite number >= 0, got {value!r}")
