"""``kvledger simulate``: run a workload through a simulated worker and report its cache.

Engine off is a pure cache replay (capacity planning); engine on runs the mock engine's
scheduler for time to first token. Either way every block transition goes to the event log,
and the run ends by replaying that log and checking it rebuilds the live per-tier state.

A log that already holds events of this worker id (an earlier run) is continued, not mixed
up: the run starts with a ``Cleared`` event on each tier, as a restarted worker would send,
so replaying the whole log gives this run's final state. ``--log`` picks another log.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from kvledger.commands.args import (
    add_zmq_args,
    choices,
    log_location,
    non_negative_int,
    output_file,
    port,
    positive_float,
    positive_int,
    publishing_line,
    zmq_settings,
)
from kvledger.commands.cluster_args import add_cluster_args
from kvledger.commands.runlog import lookup_recorder, replay_matches
from kvledger.config import Settings
from kvledger.events.types import AnyEvent, lookup_stream
from kvledger.mocker.cache import SimulatedCache, tiered_pools
from kvledger.mocker.engine import EngineConfig, MockEngine, SimClock
from kvledger.mocker.engine_off import replay_cache
from kvledger.mocker.stats import TIERS, CountingEmitter, SimStats
from kvledger.mocker.traces import (
    MOONCAKE_BLOCK_TOKENS,
    TraceRequest,
    is_event_log,
    load_mooncake,
    synthetic,
)
from kvledger.progress import Progress
from kvledger.registry.emitter import EventEmitter
from kvledger.registry.policies import POLICY_NAMES
from kvledger.registry.tiered import OFFLOAD_FILTERS

if TYPE_CHECKING:  # the log and metrics modules load SQLAlchemy, numpy, prometheus: only
    # a run that uses them pays for importing them (a --no-log run starts twice as fast)
    from kvledger.builder import Worker
    from kvledger.metrics import Metrics

POLICIES = POLICY_NAMES
#: the settings that make the mock engine behave like Dynamo's mocker (``--dynamo``)
DYNAMO_MODEL: dict[str, Any] = {
    "timing_model": "dynamo",
    "admission_rule": "whole_prompt",
    "cache_partial_blocks": False,
    "eviction_policy": "lru",
}
SYNTHETIC_REQUESTS = 2000
TIMELINE_POINTS = 200


def add_workload_args(
    p: argparse.ArgumentParser, *, engine_default: str, several_policies: bool = False
) -> None:
    """Arguments shared by ``simulate`` and ``sweep``; unset ones come from Settings. With
    ``several_policies``, ``--policy`` takes a comma-separated list."""
    p.add_argument(
        "--trace",
        metavar="PATH|LOG",
        help="Mooncake JSONL trace, or an event log with lookup records (a SQLite file or URL): "
        "its requests as recorded (default: built-in synthetic workload)",
    )
    p.add_argument(
        "--block-size",
        type=positive_int,
        metavar="N",
        help="tokens per block (default: settings; 512 with a Mooncake trace)",
    )
    p.add_argument("--requests", type=positive_int, metavar="N", help="only the first N requests")
    p.add_argument("--g1-blocks", type=positive_int, metavar="N")
    p.add_argument("--g2-blocks", type=non_negative_int, metavar="N", help="0: no G2")
    p.add_argument("--g3-blocks", type=non_negative_int, metavar="N", help="0: no G3")
    if several_policies:
        p.add_argument(
            "--policy",
            type=choices(POLICIES),
            metavar="|".join(POLICIES),
            help="G1 eviction policies, comma-separated: one line each",
        )
    else:
        p.add_argument("--policy", choices=POLICIES, help="G1 eviction policy")
    p.add_argument("--offload-filter", choices=OFFLOAD_FILTERS, help="which blocks go to G3")
    p.add_argument(
        "--engine",
        choices=("on", "off"),
        default=engine_default,
        help=f"mock engine with timing, or a pure cache replay (default: {engine_default})",
    )
    p.add_argument(
        "--speedup",
        type=float,
        default=0.0,
        metavar="X",
        help="engine on: simulated seconds per wall second (0 = as fast as possible)",
    )
    p.add_argument(
        "--timing-model",
        choices=("linear", "dynamo"),
        help="engine on: step cost, linear StepCosts or Dynamo mocker's polynomial",
    )
    p.add_argument(
        "--admission-rule",
        choices=("watermark", "whole_prompt"),
        help="engine on: keep the G1 watermark free, or admit only when the whole uncached "
        "prompt fits (Dynamo)",
    )
    p.add_argument(
        "--partial-blocks",
        choices=("cache", "free"),
        help="engine on: cache a prompt's partial last block, or free it unnamed (Dynamo)",
    )
    p.add_argument(
        "--speedup-ratio",
        type=positive_float,
        metavar="X",
        help="engine on, dynamo timing: divide each step's cost by X",
    )
    p.add_argument(
        "--dynamo",
        action="store_true",
        help="behave like Dynamo's mocker: dynamo timing, whole_prompt admission, partial "
        "blocks freed, LRU (each flag above still overrides)",
    )


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "simulate",
        help="replay a workload through a simulated worker's cache tiers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_workload_args(p, engine_default="on")
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--log",
        metavar="LOG",
        type=log_location,
        help="event log: SQLite file or URL (default: settings' log URL)",
    )
    where.add_argument(
        "--no-log",
        action="store_true",
        help="write no event log (and so no closing replay check): the fastest run",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        type=output_file,
        help="chart hit rate and tier occupancy (a cluster: TTFT and hit rate per run)",
    )
    p.add_argument(
        "--arrival-speedup",
        type=positive_float,
        metavar="X",
        help="requests arrive X times faster than the trace says (Dynamo's arrival_speedup_ratio)",
    )
    p.add_argument("--metrics-port", type=port, metavar="N", help="serve kvbm_* metrics on N")
    add_zmq_args(p)
    p.add_argument(
        "--dump-state",
        metavar="FILE",
        type=output_file,
        help="write the final live state for `kvledger replay LOG --verify FILE`",
    )
    add_cluster_args(p)
    p.set_defaults(func=run)


# -- building a run ----------------------------------------------------------------------


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings with the command line's choices on top of the environment's.

    A Mooncake trace's blocks are 512 tokens, so with ``--trace`` and no block size given
    (flag or ``KVLEDGER_BLOCK_SIZE``) the block size is 512.
    """
    overrides: dict[str, Any] = {}
    for arg, name in (
        ("block_size", "block_size"),
        ("g1_blocks", "g1_blocks"),
        ("g2_blocks", "g2_blocks"),
        ("g3_blocks", "g3_blocks"),
        ("policy", "eviction_policy"),
        ("offload_filter", "offload_filter"),
        ("timing_model", "timing_model"),
        ("admission_rule", "admission_rule"),
        ("speedup_ratio", "speedup_ratio"),
    ):
        value = getattr(args, arg, None)
        if value is not None:
            overrides[name] = value
    overrides.update(zmq_settings(args))
    partial = getattr(args, "partial_blocks", None)
    if partial is not None:
        overrides["cache_partial_blocks"] = partial == "cache"
    if getattr(args, "dynamo", False):
        for name, value in DYNAMO_MODEL.items():
            overrides.setdefault(name, value)
    settings = Settings.load(**overrides)
    if args.trace and "block_size" not in settings.fields_set:
        if is_event_log(args.trace):
            from kvledger.mocker.rerun import recorded_block_size

            block_size = recorded_block_size(args.trace)
        else:
            block_size = MOONCAKE_BLOCK_TOKENS
        settings = Settings.load(**overrides, block_size=block_size)
    return settings


def load_workload(args: argparse.Namespace, settings: Settings) -> tuple[list[TraceRequest], str]:
    if args.trace:
        if is_event_log(args.trace):
            from kvledger.mocker.rerun import trace_from_log

            requests, _ = trace_from_log(args.trace)
        else:
            requests = load_mooncake(args.trace)
        if args.requests is not None:
            requests = sorted(requests, key=lambda r: r.arrival_ms)[: args.requests]
        name = Path(args.trace).name
    else:
        count = args.requests if args.requests is not None else SYNTHETIC_REQUESTS
        requests = synthetic(count, block_size=settings.block_size)
        name = "built-in synthetic workload"
    speedup = getattr(args, "arrival_speedup", None)
    if speedup is not None and speedup != 1:
        requests = [r._replace(arrival_ms=r.arrival_ms / speedup) for r in requests]
        name += f" (arrivals x{speedup:g})"
    return requests, name


def build_cache(
    settings: Settings, emitter: EventEmitter, metrics: Metrics | None = None
) -> SimulatedCache:
    tiered = tiered_pools(settings, emitter)
    if metrics is None:
        return SimulatedCache(tiered)
    from kvledger.mocker.metered import MeteredCache

    return MeteredCache(tiered, metrics)


def engine_clock(args: argparse.Namespace) -> SimClock | None:
    """The mock engine's clock for ``--engine on`` (events carry simulated time), else None."""
    return SimClock() if args.engine == "on" else None


def run_workload(
    cache: SimulatedCache,
    requests: list[TraceRequest],
    settings: Settings,
    *,
    clock: SimClock | None,
    speedup: float = 0.0,
    progress: Callable[[int], None] | None = None,
    sample_every: int = 0,
) -> SimStats:
    """Run ``requests`` through ``cache``: with the mock engine on ``clock`` (the clock the
    cache's emitter was built with), or engine off when ``clock`` is None."""
    if clock is None:
        if speedup:
            raise ValueError("--speedup needs --engine on (engine off has no clock)")
        return replay_cache(
            requests, cache, settings.block_size, progress=progress, sample_every=sample_every
        )
    config = EngineConfig.from_settings(settings, speedup=speedup)
    engine = MockEngine(cache, config, clock=clock)
    return engine.run(requests, progress=progress, sample_every=sample_every)


# -- the command -------------------------------------------------------------------------


@dataclass
class Outcome:
    summary: dict[str, Any]
    stats: SimStats
    replay_ok: bool


def simulate(args: argparse.Namespace, note: Callable[[str], None]) -> Outcome:
    settings = settings_from_args(args)
    requests, workload = load_workload(args, settings)
    worker_id = settings.worker_id
    metrics = None
    if args.metrics_port:
        from kvledger.metrics import Metrics

        metrics = Metrics(bytes_per_block=settings.bytes_per_block)
    url = ""
    shown: str | None = None  # the log's URL as printed; None: no log
    worker: Worker | None = None
    if not args.no_log:
        # the log, its buffer and the ZMQ publisher come from the one builder; SQLAlchemy,
        # pyzmq and the rest load only for a run that writes a log
        from kvledger.builder import open_worker
        from kvledger.events.log.schema import database_url, shown_url

        url = database_url(args.log) if args.log else settings.log_url
        shown = shown_url(url)
        if args.log:
            settings = settings.replace(event_log_url=url)
        worker = open_worker(settings, metrics=metrics, redis=False)
        if worker.zmq is not None:
            note(publishing_line(worker.zmq))
    elif settings.zmq_endpoint is not None:
        raise ValueError("--zmq-endpoint needs the event log (replay serves from it)")
    log = None if worker is None else worker.event_log
    try:
        # the worker's sink counts events in its metrics; without a log, the metrics do
        sinks: list[Callable[[AnyEvent], None]] = [] if worker is None else [worker.sink]
        if metrics is not None:
            if worker is None:
                sinks.append(metrics.observe_event)
            metrics.serve(args.metrics_port)
            note(f"serving kvbm_* metrics on http://127.0.0.1:{args.metrics_port}/metrics")

        def fan_out(event: AnyEvent) -> None:
            for sink in sinks:
                sink(event)

        previous = -1 if worker is None else worker.last_event_id
        lookups_before = -1 if log is None else log.last_event_id(lookup_stream(worker_id))
        clock = engine_clock(args)
        emitter = counter = CountingEmitter(
            fan_out if len(sinks) > 1 else (sinks[0] if sinks else None),
            worker_id=worker_id,
            dp_rank=settings.dp_rank,
            clock=time.time if clock is None else clock,
        )
        cache = build_cache(settings, emitter, metrics)
        if settings.log_lookups and worker is not None:
            cache.lookups = lookup_recorder(worker, settings, emitter.clock)
        if previous >= 0:
            note(
                f"{shown} already holds events of worker {worker_id} "
                f"(up to event {previous}); "
                "this run continues it after a Cleared event per tier (a worker restart), "
                "so replaying the log gives this run's final state. Use --log for a separate log."
            )
        cache.tiered.resume(previous)
        progress = Progress(len(requests), "simulate")
        if metrics is not None:
            pools = cache.tiered.pools
            progress.listeners.append(lambda _done: metrics.refresh(pools))
        sample_every = max(1, len(requests) // TIMELINE_POINTS) if args.plot else 0
        started = time.perf_counter()
        try:
            stats = run_workload(
                cache,
                requests,
                settings,
                clock=clock,
                speedup=args.speedup,
                progress=progress,
                sample_every=sample_every,
            )
        finally:
            progress.close()
        elapsed = time.perf_counter() - started
        if metrics is not None:
            metrics.refresh(cache.tiered.pools)
        if worker is not None:
            worker.flush()
        lookup_records = (
            0 if log is None else log.last_event_id(lookup_stream(worker_id)) - lookups_before
        )
    finally:
        if worker is not None:
            worker.close()  # commits the rest, which reaches the ZMQ publisher

    live = cache.tiered.state()
    replay_ok = log is None or replay_matches(url, worker_id, live, note)
    if args.dump_state:
        from kvledger.events.log.replay import save_state

        save_state(args.dump_state, live)

    summary = stats.summary(cache, counter)
    summary.update(
        lookup_records_written=lookup_records,
        workload=workload,
        engine=args.engine,
        **(
            {
                "timing_model": settings.timing_model,
                "admission_rule": settings.admission_rule,
                "cache_partial_blocks": settings.cache_partial_blocks,
            }
            if args.engine == "on"
            else {}
        ),
        policy=settings.eviction_policy,
        offload_filter=settings.offload_filter,
        block_size=settings.block_size,
        capacity={
            t.name: (cache.tiered.pools[t].capacity if t in cache.tiered.pools else 0)
            for t in TIERS
        },
        log=shown,
        replay_matches=None if log is None else replay_ok,
        state_digest=live.digest(),
        wall_s=round(elapsed, 3),
    )
    if args.plot:
        from kvledger.plots import plot_timeline

        capacities = {k: v for k, v in summary["capacity"].items() if v}
        plot_timeline(
            stats,
            args.plot,
            title=f"kvledger simulate: {workload}",
            subtitle=describe_run(settings, capacities, args.engine, len(requests)),
            capacities=capacities,
            failure=None if replay_ok else "REPLAY MISMATCH: the log does not rebuild this run",
        )
        summary["plot"] = str(args.plot)
    return Outcome(summary, stats, replay_ok)


def describe_run(settings: Settings, capacities: dict[str, int], engine: str, requests: int) -> str:
    """The line under a chart's title: what was run, so a chart read alone says it."""
    tiers = " ".join(f"{tier} {n}" for tier, n in capacities.items())
    return (
        f"{requests} requests; {tiers} blocks of {settings.block_size} tokens; policy "
        f"{settings.eviction_policy}, offload filter {settings.offload_filter}; engine {engine}"
    )


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def print_table(s: dict[str, Any], out: TextIO | None = None) -> None:
    out = sys.stdout if out is None else out  # the stdout of now, not of import
    asked = s["blocks_requested"]
    by_tier = ", ".join(f"{t} {_pct(n, asked)}" for t, n in s["hits_by_tier"].items())
    rows = [
        ("workload", f"{s['workload']}, block size {s['block_size']}"),
        (
            "cache",
            " ".join(f"{t} {n}" for t, n in s["capacity"].items())
            + f" blocks, policy {s['policy']}, offload filter {s['offload_filter']}",
        ),
        ("engine", s["engine"]),
        ("requests", str(s["requests"])),
        ("prefix hit rate", f"{_pct(s['blocks_hit'], asked)} of {asked} blocks ({by_tier})"),
        ("evictions", "  ".join(f"{t} {n}" for t, n in s["evictions"].items())),
        (
            "offloads",
            "  ".join(f"to {t} {n}" for t, n in s["offloaded_blocks"].items() if t != "G1"),
        ),
        (
            "onboards",
            "  ".join(f"from {t} {n}" for t, n in s["onboarded_blocks"].items() if t != "G1"),
        ),
        (
            "written",
            # the words of `kvledger replay` and `inspect`: events, lookup records, rows
            f"{s['events_written']} events and {s['lookup_records_written']} lookup records "
            f"to {s['log']}"
            if s["log"]
            else f"nothing ({s['events_written']} events counted, no log)",
        ),
    ]
    if "ttft_ms_p50" in s:
        rows.append(
            (
                "engine model",
                f"{s['timing_model']} timing, {s['admission_rule']} admission, partial blocks "
                + ("cached" if s["cache_partial_blocks"] else "not cached"),
            )
        )
        rows.append(("TTFT p50 / p99", f"{s['ttft_ms_p50']:.1f} / {s['ttft_ms_p99']:.1f} ms"))
        if "tpot_ms_mean" in s:
            rows.append(("TPOT mean", f"{s['tpot_ms_mean']:.1f} ms"))
        rows.append(
            (
                "simulated",
                f"{s['simulated_s']} s in {s['steps']} steps, {s['preemptions']} preemptions",
            )
        )
    rows.append(("wall time", f"{s['wall_s']:.2f} s"))
    if "plot" in s:
        rows.append(("plot", s["plot"]))
    width = max(len(name) for name, _ in rows) + 2
    for name, value in rows:
        print(f"{name:<{width}}{value}", file=out)
    if s["log"] is not None and s["replay_matches"]:
        from kvledger.events.log.schema import paste_note  # a log was written: loaded

        print(
            f"\n`kvledger replay {shlex.quote(s['log'])}`{paste_note(s['log'])} reproduces the "
            f"final per-tier state (digest {s['state_digest']}).",
            file=out,
        )
    elif s["log"] is not None:
        print(
            f"\nREPLAY MISMATCH: the log at {s['log']} does not rebuild the live state.", file=out
        )


def run(args: argparse.Namespace) -> int:
    def note(message: str) -> None:
        print(f"kvledger simulate: {message}", file=sys.stderr)

    if args.workers:
        from kvledger.commands.cluster import run_command  # only a cluster run pays for it

        settings = settings_from_args(args)
        requests, workload = load_workload(args, settings)
        return run_command(args, settings, requests, workload, note)

    outcome = simulate(args, note)
    if args.json:
        print(json.dumps(outcome.summary, sort_keys=True))
    else:
        print_table(outcome.summary)
    return 0 if outcome.replay_ok else 1
