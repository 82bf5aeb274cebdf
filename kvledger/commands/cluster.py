"""``kvledger simulate --workers N``: a cluster of mock engines behind a router, in one process.

Each worker has its own tiers, its own event ids and (unless ``--no-log``) its own event log,
``worker-<id>.db`` in the ``--log`` folder, so ``kvledger replay``, ``report`` and ``whatif``
read a worker as they read any log; ``kvledger whatif FOLDER --workers 6`` re-runs the whole
cluster's recorded requests with other cluster settings. Several values of ``--workers`` or
``--router`` make one run per combination, printed side by side and charted by ``--plot``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from kvledger.commands.cluster_args import MANIFEST
from kvledger.commands.runlog import lookup_recorder, replay_matches
from kvledger.config import Settings
from kvledger.events.files import open_private, private_folder, write_private
from kvledger.events.types import Tier
from kvledger.mocker.cache import SimulatedCache, tiered_pools
from kvledger.mocker.cluster import Cluster, ClusterEngine, ClusterWorker, cluster_summary
from kvledger.mocker.engine import Bandwidth, EngineConfig, SimClock
from kvledger.mocker.feeds import MemoryFeed, RedisFeed, ZmqFeed, open_feed, worker_sink
from kvledger.mocker.router import build_router
from kvledger.mocker.routing import KvRouterConfig
from kvledger.mocker.stats import CountingEmitter
from kvledger.mocker.traces import TraceRequest, iter_arrivals
from kvledger.progress import Progress
from kvledger.registry.index import RouterIndex

if TYPE_CHECKING:
    from kvledger.builder import Worker


RECORDED_SETTINGS = (
    "block_size",
    "g1_blocks",
    "g2_blocks",
    "g3_blocks",
    "g2_gb",
    "g3_gb",
    "eviction_policy",
    "offload_filter",
    "timing_model",
    "admission_rule",
    "cache_partial_blocks",
    "speedup_ratio",
    "max_num_batched_tokens",
    "max_num_seqs",
    "watermark",
    "g1_g2_gbps",
    "g2_g3_gbps",
    "g1_g3_gbps",
)
"""The settings a cluster run's manifest keeps, so that ``whatif`` re-runs it as it ran."""

REQUESTS = "requests.jsonl"
"""The requests a cluster run was given, one JSON object a line in arrival order
(``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids`` of ``block_size``-token
blocks): what the workers' logs cannot say exactly (when a request arrived, as opposed to when
it was admitted; how many tokens it generated, as opposed to how many blocks)."""


@dataclass(frozen=True)
class ClusterOptions:
    """The cluster settings of one run."""

    workers: int
    router: str = "kv"
    feed: str = "memory"
    feed_delay_ms: float = 0.0
    router_config: KvRouterConfig = field(default_factory=KvRouterConfig)
    seed: int = 0
    g4: bool = False
    g4_gbps: float = 12.5
    redis_url: str | None = None
    #: pace simulated time at this many times the wall clock (0: as fast as possible)
    sim_speedup: float = 0.0

    def manifest(self, settings: Settings) -> dict[str, Any]:
        return {
            "workers": self.workers,
            "router": self.router,
            "router_feed": self.feed,
            "feed_delay_ms": self.feed_delay_ms,
            "router_config": {
                name: getattr(self.router_config, name) for name in KvRouterConfig.FLOATS
            },
            "seed": self.seed,
            "g4": self.g4,
            "g4_gbps": self.g4_gbps,
            "settings": {name: getattr(settings, name) for name in RECORDED_SETTINGS},
        }


def options_from_args(args: argparse.Namespace, settings: Settings) -> list[ClusterOptions]:
    """One ``ClusterOptions`` per combination of ``--workers`` and ``--router``."""
    if args.engine != "on":
        raise ValueError("--workers runs mock engines: it needs --engine on")
    if args.feed_delay_ms < 0:
        raise ValueError(f"--feed-delay-ms must be >= 0, got {args.feed_delay_ms}")
    if args.g4 and not settings.g2_capacity:
        raise ValueError("--g4: peers send blocks from their G2; give --g2-blocks N")
    config = KvRouterConfig(**(args.router_config or {}))
    return [
        ClusterOptions(
            workers=n,
            router=router,
            feed=args.router_feed,
            feed_delay_ms=args.feed_delay_ms,
            router_config=config,
            seed=args.seed,
            g4=args.g4,
            g4_gbps=args.g4_gbps,
            redis_url=args.redis_url or settings.redis_url,
            sim_speedup=args.speedup,
        )
        for router in (args.router or ["kv"])
        for n in args.workers
    ]


# -- building and running one cluster ----------------------------------------------------------


@dataclass
class ClusterOutcome:
    summary: dict[str, Any]
    replay_ok: bool
    #: the router's (or G4's) view of the workers' blocks at the end, when there was one
    index: RouterIndex | None = None


def _peers(
    worker_id: int,
    index: RouterIndex | None,
    feed: MemoryFeed | ZmqFeed | RedisFeed | None,
    bandwidth: Bandwidth,
    gbps: float,
) -> Callable[[list[int], int], tuple[int, float]]:
    """G4 for one worker: how many blocks after its cached ``local`` ones a peer holds on G2,
    found in the shared registry (Redis feed) or the router's index (the others), and what
    they cost: over the network into G2, then up to G1."""
    per_block_ms = bandwidth.bytes_per_block / (gbps * 1e9) * 1e3

    def depths(hashes: list[int]) -> dict[int, int]:
        if isinstance(feed, RedisFeed):
            return {w: d.get(Tier.G2, 0) for w, d in feed.registry.prefix_depths(hashes).items()}
        assert index is not None
        found = index.find_matches(hashes, kind="sequence")
        return {key[0]: d.get(Tier.G2, 0) for key, d in found.items()}

    def peers(hashes: list[int], local: int) -> tuple[int, float]:
        best = max((d for w, d in depths(hashes).items() if w != worker_id), default=0)
        n = best - local
        if n <= 0:
            return 0, 0.0
        return n, n * per_block_ms + bandwidth.copy_ms(Tier.G2, Tier.G1, n)

    return peers


def run_one(
    settings: Settings,
    opts: ClusterOptions,
    requests: Sequence[TraceRequest],
    *,
    log_dir: Path | None,
    note: Callable[[str], None],
    label: str = "simulate",
) -> ClusterOutcome:
    """Build the cluster ``opts`` describes, run ``requests`` through it, check each worker's
    log replays to its live state, and summarise."""
    base = settings.worker_id
    worker_ids = [base + i for i in range(opts.workers)]
    needs_index = opts.router == "kv" or opts.g4
    index = RouterIndex() if needs_index else None
    clocks = [SimClock() for _ in worker_ids]
    feed = None
    if index is not None:
        feed = open_feed(
            opts.feed,
            index,
            block_size=settings.block_size,
            delay_ms=opts.feed_delay_ms,
            epoch=lambda: clocks[0].epoch,
            redis_url=opts.redis_url,
        )
    logs: list[Worker] = []  # each worker's log and its buffer (kvledger.builder)
    urls: list[str] = []
    workers: list[ClusterWorker] = []
    config = EngineConfig.from_settings(settings)
    try:
        if log_dir is not None:
            private_folder(log_dir)
            write_requests(log_dir / REQUESTS, requests)
        for wid, clock in zip(worker_ids, clocks, strict=True):
            mine = settings.replace(worker_id=wid)
            logged: Worker | None = None
            log = None
            if log_dir is not None:
                # the one builder; SQLAlchemy and the rest load only for a run that logs
                from kvledger.builder import open_worker

                url = f"sqlite:///{log_dir / f'worker-{wid}.db'}"
                # the feed's publishers are the simulated router's transport: built by the feed
                logged = open_worker(mine.replace(event_log_url=url), redis=False, zmq=False)
                log = logged.event_log
                logs.append(logged)
                urls.append(url)
            feed_sink = feed.publisher(wid, log) if feed is not None else None
            emitter = CountingEmitter(
                worker_sink(None if logged is None else logged.sink, feed_sink),
                worker_id=wid,
                dp_rank=0,
                clock=clock,
            )
            cache = SimulatedCache(tiered_pools(settings, emitter))
            if logged is not None:
                previous = logged.last_event_id
                if previous >= 0:
                    note(
                        f"{log_dir} already holds a run of worker {wid}; this run continues "
                        "its log after a Cleared event per tier (a restart)"
                    )
                cache.tiered.resume(previous)
                if settings.log_lookups:
                    cache.lookups = lookup_recorder(logged, mine, clock)
            engine = ClusterEngine(cache, config, clock=clock)
            if opts.g4:
                engine.peers = _peers(wid, index, feed, config.bandwidth, opts.g4_gbps)
            workers.append(ClusterWorker(wid, cache, emitter, engine))
        router = build_router(
            opts.router,
            index=index,
            worker_ids=worker_ids,
            block_size=settings.block_size,
            config=opts.router_config,
            seed=opts.seed,
            tiers=bool(settings.g2_capacity or settings.g3_capacity),
            shared=opts.g4,
        )
        progress = Progress(len(requests), label)
        cluster = Cluster(
            workers,
            router,
            feed=feed,
            sim_speedup=opts.sim_speedup,
            progress=progress,
            # how stale the index was at each decision: worth its cost with a real feed or
            # a delay (in memory, a step's events are out when it ends)
            index_last_ids=(
                (lambda: index.last_event_id)
                if index is not None and (opts.feed != "memory" or opts.feed_delay_ms)
                else None
            ),
        )
        try:
            run = cluster.run(requests)
        finally:
            progress.close()
    finally:
        if feed is not None:
            feed.close()
        for logged_worker in logs:
            logged_worker.close()
    out = cluster_summary(run, settings.block_size)
    replay_ok = True
    for mine, w, url in zip(out["per_worker"], workers, urls, strict=False):
        ok = replay_matches(url, w.worker_id, w.cache.tiered.state(), note)
        replay_ok = replay_ok and ok
        assert log_dir is not None
        mine["log"] = str(log_dir / f"worker-{w.worker_id}.db")  # as `kvledger replay` takes it
        mine["replay_matches"] = ok
    if log_dir is not None:
        recorded = opts.manifest(settings)
        recorded["outcome"] = {key: out["cluster"].get(key) for key in OUTCOME}
        write_private(log_dir / MANIFEST, (json.dumps(recorded, indent=1) + "\n").encode())
    out["cluster"].update(
        feed=opts.feed if index is not None else None,
        feed_delay_ms=opts.feed_delay_ms,
        g4=opts.g4,
        seed=opts.seed,
        router_config=opts.manifest(settings)["router_config"] if opts.router == "kv" else None,
        log=str(log_dir) if log_dir is not None else None,
        replay_matches=replay_ok if urls else None,
    )
    return ClusterOutcome(out, replay_ok, index)


OUTCOME = ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_mean", "hit_rate", "routed")
"""What a manifest keeps of its run's outcome: what a ``whatif`` baseline must give back."""


def write_requests(path: Path, requests: Sequence[TraceRequest]) -> None:
    with open_private(path) as out:
        for r in iter_arrivals(list(requests)):
            row = {
                "timestamp": r.arrival_ms,
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": list(r.block_ids),
                "block_size": r.trace_block_size,
            }
            out.write(json.dumps(row, separators=(",", ":")).encode() + b"\n")


def read_requests(path: Path) -> list[TraceRequest]:
    requests = []
    with path.open() as rows:
        for lineno, line in enumerate(rows, 1):
            try:
                row = json.loads(line)
                requests.append(
                    TraceRequest(
                        float(row["timestamp"]),
                        int(row["input_length"]),
                        int(row["output_length"]),
                        tuple(int(h) for h in row["hash_ids"]),
                        int(row["block_size"]),
                    )
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a recorded request ({exc})") from None
    if not requests:
        raise ValueError(f"{path}: no requests")
    return requests


# -- the command's output --------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def print_cluster_table(
    results: list[dict[str, Any]], header: dict[str, Any], out: TextIO | None = None
) -> None:
    """One line per run; with a single run, one line per worker under it."""
    out = sys.stdout if out is None else out
    print(
        f"workload {header['workload']}, block size {header['block_size']}; per worker "
        + " ".join(f"{t} {n}" for t, n in header["capacity"].items() if n)
        + f" blocks; engine {header['engine_model']}",
        file=out,
    )
    cols = (
        f"{'workers':>7}  {'router':<11} {'TTFT p50':>10} {'TTFT p99':>10} {'TPOT':>7}  "
        f"{'hit rate':>8} {'G1':>6} {'G2':>6} {'G3':>6} {'G4':>6}  {'reuse':>6}  "
        f"{'imbalance':>9} {'preempt':>7} {'wall s':>7}"
    )
    print(cols, file=out)
    for r in results:
        c = r["cluster"]
        by = c["hit_rate_by_tier"]
        print(
            f"{c['workers']:>7}  {c['router']:<11} {_ms(c.get('ttft_ms_p50')):>10} "
            f"{_ms(c.get('ttft_ms_p99')):>10} {c.get('tpot_ms_mean', 0):>7.1f}  "
            f"{100 * c['hit_rate']:>7.1f}% "
            + " ".join(f"{100 * by[t]:>5.1f}%" for t in ("G1", "G2", "G3", "G4"))
            + f"  {100 * c['token_hit_rate_all_admissions']:>5.1f}%"
            f"  {c['load_imbalance']:>9.2f} {c['preemptions']:>7} {c['wall_s']:>7.2f}",
            file=out,
        )
    if len(results) == 1:
        r = results[0]
        print(
            f"\n{'worker':>7}  {'requests':>8} {'TTFT p50':>10} {'TTFT p99':>10} "
            f"{'TPOT':>7}  {'hit rate':>8} {'preempt':>7} {'events':>9}  log",
            file=out,
        )
        for w in r["per_worker"]:
            log = w.get("log") or "-"
            if w.get("replay_matches") is False:
                log += "  REPLAY MISMATCH"
            print(
                f"{w['worker_id']:>7}  {w['requests']:>8} {_ms(w.get('ttft_ms_p50')):>10} "
                f"{_ms(w.get('ttft_ms_p99')):>10} {w.get('tpot_ms_mean', 0):>7.1f}  "
                f"{100 * w['hit_rate']:>7.1f}% {w['preemptions']:>7} "
                f"{w['events_written']:>9}  {log}",
                file=out,
            )
        c = r["cluster"]
        if "router_events_behind" in c:
            b = c["router_events_behind"]
            print(
                f"\nrouter index behind the workers ({c['feed']} feed"
                + (f" + {c['feed_delay_ms']:g} ms" if c["feed_delay_ms"] else "")
                + f"): p50 {b['p50']} events, p99 {b['p99']}, max {b['max']}; "
                f"{100 * b['stale_decisions']:.1f}% of decisions saw a stale index",
                file=out,
            )
        if c.get("log"):
            ok = c["replay_matches"]
            print(
                f"\nOne event log per worker in {c['log']}: "
                + (
                    "each replays to its worker's final state (`kvledger replay "
                    f"{r['per_worker'][0]['log']}`); `kvledger whatif {c['log']} --workers N` "
                    "re-runs the cluster."
                    if ok
                    else "REPLAY MISMATCH: a log does not rebuild its worker's state."
                ),
                file=out,
            )


def _log_dirs(
    args: argparse.Namespace, settings: Settings, runs: list[ClusterOptions]
) -> list[Path | None]:
    """Where each run's worker logs go: ``--log`` (a folder), by default ``cluster`` in the
    data folder; with several runs, a sub-folder per run."""
    if args.no_log:
        return [None] * len(runs)
    root = Path(args.log) if args.log else settings.data_dir / "cluster"
    if "://" in str(args.log or ""):
        raise ValueError(
            f"--log with --workers names a folder (one SQLite log per worker), got {args.log!r}"
        )
    if root.exists() and not root.is_dir():
        raise ValueError(f"--log with --workers names a folder; {root} is a file")
    if args.log and not root.parent.is_dir():  # the operator's path: a typo creates nothing
        raise ValueError(f"--log: folder {root.parent} does not exist; create it first")
    if len(runs) == 1:
        return [root]
    return [root / f"{o.router}-{o.workers}w" for o in runs]


def run_command(
    args: argparse.Namespace,
    settings: Settings,
    requests: list[TraceRequest],
    workload: str,
    note: Callable[[str], None],
) -> int:
    """``kvledger simulate --workers ...``: every combination asked for, then the output."""
    if args.zmq_endpoint or args.metrics_port or args.dump_state:
        raise ValueError(
            "--zmq-endpoint, --metrics-port and --dump-state are for one worker; a cluster "
            "publishes with --router-feed zmq and writes a log per worker"
        )
    runs = options_from_args(args, settings)
    dirs = _log_dirs(args, settings, runs)
    results: list[dict[str, Any]] = []
    ok = True
    for opts, log_dir in zip(runs, dirs, strict=True):
        label = f"simulate {opts.router} x{opts.workers}"
        outcome = run_one(settings, opts, requests, log_dir=log_dir, note=note, label=label)
        results.append(outcome.summary)
        ok = ok and outcome.replay_ok
    header = {
        "workload": workload,
        "block_size": settings.block_size,
        "capacity": {
            "G1": settings.g1_blocks,
            "G2": settings.g2_capacity,
            "G3": settings.g3_capacity,
        },
        "engine_model": (
            f"{settings.timing_model} timing, {settings.admission_rule} admission, partial "
            f"blocks {'cached' if settings.cache_partial_blocks else 'not cached'}, "
            f"policy {settings.eviction_policy}"
        ),
        "policy": settings.eviction_policy,
        "offload_filter": settings.offload_filter,
    }
    for r in results:
        r.update(header)
    if args.plot:
        from kvledger.plots import plot_cluster

        plot_cluster(results, args.plot, title=f"kvledger simulate: {workload}")
        for r in results:
            r["plot"] = str(args.plot)
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else {"runs": results}, sort_keys=True))
    else:
        print_cluster_table(results, header)
        if args.plot:
            print(f"\nplot: {args.plot}")
    return 0 if ok else 1


# -- whatif on a cluster's logs ------------------------------------------------------------


def whatif_cluster(args: argparse.Namespace) -> dict[str, Any]:
    """Re-run a cluster run's requests with its recorded settings (the baseline, which must
    give back what the run had) and with each combination of the values given."""
    folder = Path(args.log)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        base = Settings.load(**manifest["settings"])
        recorded = ClusterOptions(
            workers=int(manifest["workers"]),
            router=manifest["router"],
            feed="memory",  # a real feed's lag is not repeatable; its delay knob is
            feed_delay_ms=float(manifest["feed_delay_ms"]),
            router_config=KvRouterConfig(**manifest["router_config"]),
            seed=int(manifest["seed"]),
            g4=bool(manifest["g4"]),
            g4_gbps=float(manifest["g4_gbps"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{folder / MANIFEST}: not a cluster manifest ({exc})") from None
    requests = read_requests(folder / REQUESTS)
    runs: list[tuple[Settings, ClusterOptions]] = [(base, recorded)]
    for n in args.workers or [recorded.workers]:
        for router in args.router or [recorded.router]:
            for g1 in args.g1_blocks or [base.g1_blocks]:
                for g2 in args.g2_blocks if args.g2_blocks is not None else [base.g2_capacity]:
                    for g3 in args.g3_blocks if args.g3_blocks is not None else [base.g3_capacity]:
                        settings = base.replace(
                            g1_blocks=g1,
                            g2_blocks=g2,
                            g3_blocks=g3,
                            g2_gb=0.0,  # the block counts say it all now
                            g3_gb=0.0,
                        )
                        opts = replace(recorded, workers=n, router=router)
                        if (g1, g2, g3, opts) != (
                            base.g1_blocks,
                            base.g2_capacity,
                            base.g3_capacity,
                            recorded,
                        ):
                            runs.append((settings, opts))

    def quiet(_message: str) -> None:
        pass

    results = []
    for settings, opts in runs:
        outcome = run_one(settings, opts, requests, log_dir=None, note=quiet, label="whatif")
        summary = outcome.summary
        summary["capacity"] = {
            "G1": settings.g1_blocks,
            "G2": settings.g2_capacity,
            "G3": settings.g3_capacity,
        }
        results.append(summary)
    had = manifest.get("outcome", {})
    again = {key: results[0]["cluster"].get(key) for key in OUTCOME}
    return {
        "log": str(folder),
        "workers_recorded": recorded.workers,
        "router_recorded": recorded.router,
        "feed_recorded": manifest["router_feed"],
        "requests": len(requests),
        "block_size": base.block_size,
        "recorded": had,
        "baseline_reproduces": had == again,
        "runs": results,
    }


def print_whatif_cluster(out: dict[str, Any], file: TextIO | None = None) -> None:
    file = sys.stdout if file is None else file
    print(
        f"{out['log']}: {out['requests']} requests run by {out['workers_recorded']} workers "
        f"(router {out['router_recorded']}), block size {out['block_size']}; the first line "
        "re-runs them with the recorded settings",
        file=file,
    )
    print(
        f"{'workers':>7}  {'router':<11} {'G1':>6} {'G2':>6} {'G3':>6} {'TTFT p50':>10} "
        f"{'TTFT p99':>10} {'TPOT':>7} {'hit rate':>8} {'imbalance':>9}",
        file=file,
    )
    base = out["runs"][0]["cluster"]
    for i, r in enumerate(out["runs"]):
        c, cap = r["cluster"], r["capacity"]
        delta = ""
        if i:
            d = (c.get("ttft_ms_p50", 0) - base.get("ttft_ms_p50", 0)) / max(
                base.get("ttft_ms_p50", 1), 1e-9
            )
            delta = f"  TTFT p50 {d:+.0%} vs baseline"
        print(
            f"{c['workers']:>7}  {c['router']:<11} {cap['G1']:>6} {cap['G2']:>6} "
            f"{cap['G3']:>6} {_ms(c.get('ttft_ms_p50')):>10} {_ms(c.get('ttft_ms_p99')):>10} "
            f"{c.get('tpot_ms_mean', 0):>7.1f} {100 * c['hit_rate']:>7.1f}% "
            f"{c['load_imbalance']:>9.2f}{delta}",
            file=file,
        )
    if out["baseline_reproduces"]:
        print("\nThe baseline gives back what the recorded run had.", file=file)
    else:
        print(
            f"\nBASELINE DIFFERS from the recorded run ({out['recorded']}); "
            + (
                f"it ran with the {out['feed_recorded']} feed, whose lag a re-run (memory "
                "feed) does not repeat"
                if out["feed_recorded"] != "memory"
                else "the run was made by another kvledger, or its files were changed"
            ),
            file=file,
        )
