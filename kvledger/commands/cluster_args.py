"""The command-line arguments of a cluster run (``simulate --workers N``), apart from the
cluster code itself so that ``kvledger simulate --help`` loads nothing more."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvledger.commands.args import choices, non_negative_int, positive_float, positive_ints
from kvledger.mocker.routing import FEEDS, ROUTERS, KvRouterConfig

MANIFEST = "cluster.json"
"""What a cluster run's log folder says about the run besides the workers' logs: the cluster
settings a ``whatif`` of the folder starts from."""


def is_cluster_folder(location: str) -> bool:
    """Whether ``location`` is a cluster run's log folder (it holds the run's manifest)."""
    return (Path(location) / MANIFEST).is_file()


def router_config(text: str) -> dict[str, float]:
    """``NAME=VALUE[,NAME=VALUE...]`` with ``KvRouterConfig``'s (Dynamo's) setting names."""
    out: dict[str, float] = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in KvRouterConfig.FLOATS:
            raise argparse.ArgumentTypeError(
                f"expected NAME=VALUE with NAME one of {', '.join(KvRouterConfig.FLOATS)}, "
                f"got {part!r}"
            )
        try:
            out[name] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: not a number: {value!r}") from None
    return out


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster (a run of several mock workers behind a router)")
    g.add_argument(
        "--workers",
        type=positive_ints,
        metavar="N[,N...]",
        help="run a cluster of N workers (engine on); several values: one run each",
    )
    g.add_argument(
        "--router",
        type=choices(ROUTERS),
        metavar="|".join(ROUTERS),
        help="how requests are spread (default kv; several: one run each)",
    )
    g.add_argument(
        "--router-feed",
        choices=FEEDS,
        default="memory",
        help="how the router learns the workers' events: in memory, or through the real ZMQ "
        "publishers or the shared registry in Redis (default memory)",
    )
    g.add_argument(
        "--feed-delay-ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="events reach the router this many simulated ms after they happen (default 0)",
    )
    g.add_argument(
        "--router-config",
        type=router_config,
        metavar="NAME=VALUE[,...]",
        help="KV router weights by Dynamo's names: "
        + ", ".join(f"{f}" for f in KvRouterConfig.FLOATS),
    )
    g.add_argument(
        "--seed",
        type=non_negative_int,
        default=0,
        help="seed of the random router and of the KV router's tie-breaks (default 0)",
    )
    g.add_argument(
        "--g4",
        action="store_true",
        help="workers onboard blocks that a peer holds on G2 (needs --g2-blocks)",
    )
    g.add_argument(
        "--g4-gbps",
        type=positive_float,
        default=12.5,
        metavar="GB/s",
        help="peer-to-peer bandwidth for G4 copies (default 12.5: a 100 Gb/s link)",
    )
    g.add_argument("--redis-url", metavar="URL", help="Redis for --router-feed redis")
