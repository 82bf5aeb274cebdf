"""PNG charts for ``kvledger simulate --plot`` and ``kvledger sweep --plot``.

matplotlib is an optional dependency (the ``plot`` extra); it is imported only when a chart
is asked for, with the Agg backend so no display is needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvledger.events.files import open_private
from kvledger.mocker.rerun import CacheSettings
from kvledger.mocker.stats import SimStats
from kvledger.report import percent


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'kvledger[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> None:
    """Write the PNG readable by its owner only, as every file kvledger makes."""
    with open_private(path) as file:
        fig.savefig(file, dpi=100, format="png")


def _check_png(path: str | Path) -> Path:
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"--plot writes a PNG; give a file name ending in .png, got {path}")
    if not path.parent.is_dir():
        raise ValueError(f"--plot: folder {path.parent} does not exist")
    return path


def plot_timeline(
    stats: SimStats,
    path: str | Path,
    *,
    title: str,
    capacities: dict[str, int],
    subtitle: str = "",
    failure: str | None = None,
) -> Path:
    """Cumulative prefix-hit rate and blocks held per tier against requests finished; with
    the mock engine, time to first token of each request too."""
    path = _check_png(path)
    if not stats.timeline:
        raise ValueError("--plot: the run recorded no samples (no request finished)")
    plt = _pyplot()
    x = [point[0] for point in stats.timeline]
    panels = 3 if stats.ttft_ms else 2
    fig, axes = plt.subplots(panels, 1, figsize=(9, 3 * panels + 1))
    ax_hit, ax_occ = axes[0], axes[1]
    rates = [100 * point[1] for point in stats.timeline]
    ax_hit.plot(x, rates, color="tab:blue")
    ax_hit.annotate(
        f"{rates[-1]:.1f}%",
        (x[-1], rates[-1]),
        xytext=(-4, 6),
        textcoords="offset points",
        ha="right",
        color="tab:blue",
        weight="bold",
    )
    ax_hit.set_ylabel("cumulative prefix hit rate\n(% of blocks asked so far)")
    ax_hit.set_ylim(*fitted_range(rates))
    ax_hit.grid(alpha=0.3)
    for tier in sorted(capacities):
        held = [point[2].get(tier, 0) for point in stats.timeline]
        ax_occ.plot(
            x,
            [100 * h / capacities[tier] for h in held],
            label=f"{tier} ({capacities[tier]} blocks)",
        )
    ax_occ.set_ylabel("tier occupancy\n(% of its blocks)")
    ax_occ.set_ylim(0, 105)
    ax_occ.set_xlabel("requests finished")
    ax_hit.sharex(ax_occ)
    ax_occ.legend(loc="lower right", fontsize=8)
    ax_occ.grid(alpha=0.3)
    if stats.ttft_ms:
        ax_ttft = axes[2]
        ttft = [t / 1000 for t in stats.ttft_ms]
        order = range(1, len(ttft) + 1)
        ax_ttft.plot(order, ttft, ".", ms=2, alpha=0.3, color="tab:red", label="each request")
        span = max(1, len(ttft) // 50)
        rolling = [
            sorted(ttft[max(0, i - span) : i + 1])[min(i, span) // 2] for i in range(len(ttft))
        ]
        ax_ttft.plot(order, rolling, color="darkred", label=f"median of the last {span + 1}")
        ordered = sorted(ttft)
        p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
        ax_ttft.set_ylim(0, p99 * 1.2 if p99 > 0 else 1)
        ax_ttft.set_ylabel("time to first token (s)")
        ax_ttft.set_xlabel(
            "requests, in the order of their first token (simulated time runs left to right)"
        )
        ax_ttft.legend(loc="upper left", fontsize=8)
        ax_ttft.grid(alpha=0.3)
    _title(fig, title, subtitle)
    _stamp_failure(fig, failure)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    _save(fig, path)
    plt.close(fig)
    return path


# -- shared pieces -------------------------------------------------------------------------


def fitted_range(
    values: Sequence[float], *, floor: float = 0.0, ceil: float = 100.0
) -> tuple[float, float]:
    """An axis range that fits ``values`` with a margin, within [floor, ceil]: a hit rate that
    moves between 61% and 64% should not be drawn as a flat line on a 0-100 axis."""
    finite = [v for v in values if v == v]
    if not finite:
        return floor, ceil
    lo, hi = min(finite), max(finite)
    pad = max((hi - lo) * 0.15, 0.5)
    return max(floor, lo - pad), min(ceil, hi + pad)


def _stamp_failure(fig: Any, message: str | None) -> None:
    """A run whose check failed says so on the chart itself, not only in the terminal."""
    if message:
        fig.text(
            0.5,
            0.5,
            message,
            ha="center",
            va="center",
            fontsize=15,
            color="red",
            alpha=0.8,
            rotation=20,
            weight="bold",
            bbox={"facecolor": "white", "alpha": 0.7, "edgecolor": "red"},
        )


def _title(fig: Any, title: str, subtitle: str) -> None:
    fig.suptitle(title, fontsize=12, weight="bold", y=0.995)
    fig.text(0.5, 0.945, subtitle, ha="center", va="top", fontsize=8.5, color="dimgray")


def _label_points(ax: Any, xs: Sequence[float], ys: Sequence[float], color: str) -> None:
    """The value at each point, under it (a dashed token line runs just above)."""
    for x, y in zip(xs, ys, strict=True):
        ax.annotate(f"{y:.1f}", (x, y), textcoords="offset points", xytext=(0, -8), ha="center",
                    va="top", fontsize=8, color=color, weight="bold")  # fmt: skip


def plot_hit_rate_lines(
    series: dict[str, list[tuple[int, float, float | None]]],
    path: str | Path,
    *,
    title: str,
    subtitle: str,
    ceiling: float | None = None,
    marker: tuple[int, float, str] | None = None,
    failure: str | None = None,
) -> Path:
    """Hit rate (%) against G1 capacity, one colour per series (a policy): block hit rate
    solid, token hit rate dashed, the value at each point, the infinite-cache ceiling dotted,
    and ``marker`` (x, y, label) as a star (what a recorded run had)."""
    path = _check_png(path)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    shown: list[float] = []
    drawn: dict[tuple[tuple[int, float, float | None], ...], str] = {}
    for i, (name, points) in enumerate(series.items()):
        color = f"C{i}"
        same = drawn.setdefault(tuple(points), name)
        if same != name:  # identical results: one line, named for both
            ax.plot([], [], color=color, marker="o", label=f"{name}: same as {same}")
            continue
        xs = [p[0] for p in points]
        blocks = [100 * p[1] for p in points]
        ax.plot(xs, blocks, marker="o", color=color, label=f"{name}: block hit rate")
        _label_points(ax, xs, blocks, color)
        shown += blocks
        tokens = [(p[0], 100 * p[2]) for p in points if p[2] is not None]
        if tokens:
            ax.plot(
                *zip(*tokens, strict=True),
                marker=".",
                ls="--",
                color=color,
                alpha=0.6,
                label=f"{name}: token hit rate (last {tokens[-1][1]:.1f})",
            )
            shown += [t[1] for t in tokens]
    if ceiling is not None:
        ax.axhline(100 * ceiling, color="gray", ls=":", lw=1.5)
        ax.annotate(
            f"infinite cache {100 * ceiling:.1f}%",
            (0.01, 100 * ceiling),
            xycoords=("axes fraction", "data"),
            va="bottom",
            fontsize=8,
            color="gray",
        )
        shown.append(100 * ceiling)
    if marker is not None:
        ax.plot(
            [marker[0]], [100 * marker[1]], marker="*", ms=16, color="black", ls="", label=marker[2]
        )
        shown.append(100 * marker[1])
    xs_all = sorted({p[0] for points in series.values() for p in points})
    if len(xs_all) > 1 and xs_all[-1] / max(xs_all[0], 1) >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks(xs_all, [str(x) for x in xs_all])
    ax.set_ylim(*fitted_range(shown))
    ax.set_xlabel("G1 capacity (blocks)")
    ax.set_ylabel("prefix hit rate (% of blocks / tokens asked)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="best")
    _title(fig, title, subtitle)
    _stamp_failure(fig, failure)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    _save(fig, path)
    plt.close(fig)
    return path


def plot_whatif(out: dict[str, Any], path: str | Path) -> Path:
    """``kvledger whatif --plot``: what the run had against each re-run."""
    rec = out["recorded"]
    base = CacheSettings(**rec["settings"])
    subtitle = (
        f"{out['log']}, worker {out['worker']}, {rec['lookups']} lookups, block size "
        f"{out['block_size']}; the run had {base.label()}"
    )
    failure = (
        None
        if out["baseline_reproduces"]
        else (
            f"BASELINE DIFFERS: {out['runs'][0]['lookups_differing']} of "
            f"{out['lookups_compared']} lookups"
        )
    )
    runs = out["runs"]
    g1_values = {r["settings"]["g1_blocks"] for r in runs}
    if len(g1_values) > 1:
        series: dict[str, list[tuple[int, float, float | None]]] = {}
        for r in runs:
            s = dict(r["settings"])
            g1 = s.pop("g1_blocks")
            rest = CacheSettings(0, **s).label().split(", ", 1)[1]
            tiers = f"G2 {s['g2_blocks']} G3 {s['g3_blocks']}"
            name = (
                rest
                if s["g2_blocks"] == base.g2_blocks and s["g3_blocks"] == base.g3_blocks
                else f"{tiers}, {rest}"
            )
            series.setdefault(name, []).append((g1, r["hit_rate"], r["token_hit_rate"]))
        for points in series.values():
            points.sort()
        return plot_hit_rate_lines(
            series,
            path,
            title="What if: hit rate of the recorded lookups by G1 capacity",
            subtitle=subtitle,
            ceiling=out["ceiling"]["hit_rate"],
            marker=(base.g1_blocks, rec["hit_rate"], f"the run had {100 * rec['hit_rate']:.1f}%"),
            failure=failure,
        )
    path = _check_png(path)
    plt = _pyplot()
    rows = [("the run had", rec)] + [
        (("baseline: " if i == 0 else "") + CacheSettings(**r["settings"]).label(), r)
        for i, r in enumerate(runs)
    ]
    fig, ax = plt.subplots(figsize=(9, 2.2 + 0.55 * len(rows)))
    ys = list(range(len(rows)))[::-1]
    colors = {"G1": "tab:green", "G2": "tab:orange", "G3": "tab:purple"}
    for y, (_name, r) in zip(ys, rows, strict=True):
        left = 0.0
        for tier in ("G1", "G2", "G3"):
            width = 100 * r["hit_rate_by_tier"][tier]
            ax.barh(y, width, left=left, color=colors[tier], label=tier if y == ys[0] else None)
            left += width
        ax.annotate(
            f"{100 * r['hit_rate']:.2f}%",
            (left, y),
            xytext=(4, 0),
            textcoords="offset points",
            va="center",
            fontsize=8,
        )
    ceiling_rate = 100 * out["ceiling"]["hit_rate"]
    ax.axvline(ceiling_rate, color="gray", ls=":", label=f"infinite cache {ceiling_rate:.1f}%")
    ax.set_yticks(ys, [name for name, _ in rows], fontsize=8)
    ax.set_xlabel("prefix hit rate (% of blocks asked), by the tier that served it")
    ax.set_xlim(0, min(100, max(ceiling_rate, *(100 * r["hit_rate"] for _, r in rows)) * 1.15 + 1))
    ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=4, frameon=False)
    ax.grid(alpha=0.3, axis="x")
    _title(fig, "What if: hit rate of the recorded lookups", subtitle)
    _stamp_failure(fig, failure)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    _save(fig, path)
    plt.close(fig)
    return path


def plot_report(out: dict[str, Any], path: str | Path) -> Path:
    """``kvledger report --plot``: ``report_figure`` as a PNG."""
    path = _check_png(path)
    plt = _pyplot()
    fig = report_figure(out)
    _save(fig, path)
    plt.close(fig)
    return path


_TIER_STYLE = {"G1": ("tab:green", "o"), "G2": ("tab:orange", "s"), "G3": ("tab:purple", "^")}
_SERIES_COLORS = (
    "tab:blue",
    "tab:orange",
    "tab:green",
    "tab:red",
    "tab:purple",
    "tab:brown",
    "tab:pink",
    "tab:olive",
    "tab:cyan",
    "black",
)
_SERIES_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "<", ">", "*")


def _series(ax: Any, x: list[float], series: list[tuple[str, list[float], Any]]) -> None:
    """Lines that stay distinguishable when their values coincide (evictions from G2 and
    offloads into it, in a steady state, are the same numbers): each its own colour, marker
    and dash, markers placed in turn (series ``i`` marks points ``i``, ``i + n``, ...) so that
    every series shows its own even on top of another, and earlier lines drawn wider, so one
    laid on another still shows as an outline."""
    n = len(series)
    for i, (label, values, style) in enumerate(series):
        color, marker, dash = style or (
            _SERIES_COLORS[i % len(_SERIES_COLORS)],
            _SERIES_MARKERS[i % len(_SERIES_MARKERS)],
            "-",
        )
        ax.plot(
            x,
            values,
            color=color,
            marker=marker,
            ls=dash,
            lw=1.0 + 3.0 * (n - 1 - i) / max(n - 1, 1),
            ms=6,
            markevery=(i % max(min(n, len(x)), 1), max(min(n, len(x)), 1)),
            label=label,
            zorder=2 + i,
        )


def report_figure(out: dict[str, Any]) -> Any:
    """Aligned panels over time, one x axis (seconds from the start of the range): hit rate
    per tier, rows per kind, blocks moved, requests in flight. Every series is a line of its
    own colour and marker (``_series``), so none hides another, however small or equal."""
    plt = _pyplot()
    windows = out["windows"]
    t0 = out["since_ts"]
    mid = [(w["start_ts"] + w["end_ts"]) / 2 - t0 for w in windows]
    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    ax_hit, ax_rows, ax_moved, ax_flight = axes
    total = [100 * w["hit_rate"] if w["hit_rate"] is not None else float("nan") for w in windows]
    hits: list[tuple[str, list[float], Any]] = [("hit rate, all tiers", total, ("black", "*", "-"))]
    for tier, (color, marker) in _TIER_STYLE.items():
        values = [100 * (w["hit_rate_by_tier"][tier] or 0.0) for w in windows]
        if any(values):
            hits.append((f"served from {tier}", values, (color, marker, "--")))
    _series(ax_hit, mid, hits)
    ax_hit.set_ylim(0, min(100, max([v for v in total if v == v] or [1]) * 1.3 + 1))
    ax_hit.set_ylabel("prefix hit rate\n(% of blocks asked)")
    ax_hit.legend(fontsize=8, loc="upper left", ncol=4)
    kinds = sorted({k for w in windows for k in w["rows_by_kind"]})
    _series(
        ax_rows,
        mid,
        [(kind, [w["rows_by_kind"].get(kind, 0) for w in windows], None) for kind in kinds],
    )
    ax_rows.set_ylabel("rows per window\nby kind")
    peak_rows = max((v for w in windows for v in w["rows_by_kind"].values()), default=0)
    ax_rows.set_ylim(0, max(1, peak_rows) * 1.45)  # headroom: the legend sits above the lines
    ax_rows.legend(fontsize=7, ncol=4, loc="upper right")
    moved: list[tuple[str, list[float], Any]] = []
    for label, key in (
        ("evicted from", "evicted_blocks"),
        ("offloaded to", "offloaded_blocks"),
        ("onboarded from", "onboarded_blocks"),
    ):
        for tier in ("G1", "G2", "G3"):
            values = [w[key][tier] for w in windows]
            if any(values):
                moved.append((f"{label} {tier}", values, None))
    _series(ax_moved, mid, moved)
    ax_moved.set_ylabel("blocks per window")
    peak_moved = max((v for _, values, _ in moved for v in values), default=0)
    ax_moved.set_ylim(0, max(1, peak_moved) * 1.45)
    ax_moved.legend(fontsize=7, ncol=3, loc="upper right")
    in_flight = [w["requests_in_flight"] for w in windows]
    ax_flight.step(mid, in_flight, where="mid", color="tab:blue")
    ax_flight.set_ylabel("requests holding\nblocks (window end)")
    ax_flight.set_ylim(0, max(1, *in_flight) * 1.15)
    ax_flight.yaxis.get_major_locator().set_params(integer=True)
    ax_flight.set_xlabel(
        f"seconds from the start of the range ({out['window_s']:.3g} s per window)"
    )
    for ax in axes:
        ax.grid(alpha=0.3)
    totals = out["totals"]
    runs = out["runs"]
    settings = (
        f"G1 {runs[-1]['g1_blocks']} G2 {runs[-1]['g2_blocks']} G3 {runs[-1]['g3_blocks']} "
        f"blocks of {runs[-1]['block_size']} tokens, policy {runs[-1]['policy']}, offload "
        f"filter {runs[-1]['offload_filter']}"
        if runs
        else "settings not recorded"
    )
    hit = totals["hit_rate"]
    _title(
        fig,
        f"kvledger report: {out['log']}",
        f"positions {totals['first_position']}..{totals['last_position']}, {totals['lookups']} "
        f"lookups, hit rate {percent(hit)} overall; {settings}",
    )
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    return fig


def _series_label(run: dict[str, Any]) -> str:
    """A cluster run's line: its router, and its tiers and G4 when they are not G1 alone."""
    c = run["cluster"]
    label = str(c["router"])
    tiers = [f"{t} {n}" for t, n in run.get("capacity", {}).items() if n and t != "G1"]
    if tiers:
        label += " + " + " ".join(tiers)
    if c.get("g4"):
        label += " + G4"
    if c.get("feed") and c.get("feed") != "memory":
        label += f", {c['feed']} feed"
    if c.get("feed_delay_ms"):
        label += f" +{c['feed_delay_ms']:g} ms"
    return label


def _seconds(value: float) -> str:
    if value >= 10:
        return f"{value:.0f} s"
    return f"{value:.1f} s" if value >= 1 else f"{value:.2f} s"


def plot_cluster(runs: list[dict[str, Any]], path: str | Path, *, title: str) -> Path:
    """``simulate --workers ... --plot`` and ``whatif FOLDER --plot``: TTFT (p50 solid, p99
    dashed) and prefix hit rate against the number of workers, one colour per router (and
    tier set); with a single run, requests and hit rate per worker instead of lines."""
    path = _check_png(path)
    plt = _pyplot()
    first = runs[0]
    tiers = " ".join(f"{t} {n}" for t, n in first.get("capacity", {}).items() if n)
    if first["cluster"].get("g4"):
        tiers += " + G4 (peers' G2)"
    subtitle = (
        f"{first.get('workload', '')}; per worker {tiers} blocks of {first['block_size']} "
        f"tokens; {first.get('engine_model', '')}"
    ).strip("; ")
    if len(runs) == 1:
        return _plot_one_cluster(plt, first, path, title=title, subtitle=subtitle)
    series: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        series.setdefault(_series_label(run), []).append(run["cluster"])
    fig, (ax_ttft, ax_hit) = plt.subplots(1, 2, figsize=(12, 5.2))
    workers = sorted({c["workers"] for points in series.values() for c in points})
    for i, (name, points) in enumerate(series.items()):
        color = f"C{i}"
        points.sort(key=lambda c: c["workers"])
        xs = [c["workers"] for c in points]
        p50 = [c.get("ttft_ms_p50", float("nan")) / 1e3 for c in points]
        p99 = [c.get("ttft_ms_p99", float("nan")) / 1e3 for c in points]
        ax_ttft.plot(xs, p50, marker="o", color=color, label=f"{name}: p50")
        ax_ttft.plot(xs, p99, marker="^", ls="--", color=color, alpha=0.7, label=f"{name}: p99")
        below = -11 if i % 2 == 0 else 5  # alternate sides: lines that meet stay readable
        for x, y in zip(xs, p50, strict=True):
            ax_ttft.annotate(_seconds(y), (x, y), textcoords="offset points", xytext=(6, below),
                             ha="left", fontsize=8, color=color, weight="bold")  # fmt: skip
        hits = [100 * c["hit_rate"] for c in points]
        ax_hit.plot(xs, hits, marker="o", color=color, label=name)
        _label_points(ax_hit, xs, hits, color)
    ax_ttft.set_yscale("log")
    ax_ttft.set_ylabel("time to first token (s, log scale)")
    ax_hit.set_ylabel("prefix hit rate (% of prompt blocks, all tiers)")
    ax_hit.set_ylim(*fitted_range([100 * c["hit_rate"] for p in series.values() for c in p]))
    for ax in (ax_ttft, ax_hit):
        ax.set_xticks(workers, [str(w) for w in workers])
        ax.set_xlabel("workers")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="best")
    _title(fig, title, subtitle)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    _save(fig, path)
    plt.close(fig)
    return path


def _plot_one_cluster(
    plt: Any, run: dict[str, Any], path: Path, *, title: str, subtitle: str
) -> Path:
    """One cluster run: requests and TTFT per worker, and each worker's hit rate by tier."""
    c = run["cluster"]
    workers = run["per_worker"]
    names = [str(w["worker_id"]) for w in workers]
    fig, (ax_load, ax_hit) = plt.subplots(1, 2, figsize=(12, 5.2))
    xs = list(range(len(workers)))
    ax_load.bar(xs, [w["requests"] for w in workers], color="C0", alpha=0.75, label="requests")
    ax_load.set_ylabel("requests routed", color="C0")
    ax_ttft = ax_load.twinx()
    ax_ttft.plot(xs, [w.get("ttft_ms_p50", 0) / 1e3 for w in workers], "o-", color="C3",
                 label="TTFT p50")  # fmt: skip
    ax_ttft.plot(xs, [w.get("ttft_ms_p99", 0) / 1e3 for w in workers], "^--", color="C3",
                 alpha=0.7, label="TTFT p99")  # fmt: skip
    ax_ttft.set_ylabel("time to first token (s)", color="C3")
    ax_ttft.legend(fontsize=8, loc="upper right")
    ax_load.set_title(
        f"{c['router']} router: load imbalance {c['load_imbalance']:.2f} (busiest / mean)",
        fontsize=10,
    )
    bottom = [0.0] * len(workers)
    for i, tier in enumerate(("G1", "G2", "G3", "G4")):
        shares = [
            100 * w["hits_by_tier"].get(tier, 0) / max(w["blocks_requested"], 1) for w in workers
        ]
        if any(shares):
            ax_hit.bar(xs, shares, bottom=bottom, color=f"C{i}", label=f"{tier} hits")
            bottom = [b + s for b, s in zip(bottom, shares, strict=True)]
    for x, total in zip(xs, bottom, strict=True):
        ax_hit.annotate(f"{total:.1f}%", (x, total), textcoords="offset points", xytext=(0, 3),
                        ha="center", fontsize=8, weight="bold")  # fmt: skip
    ax_hit.set_ylabel("prefix hit rate (% of the worker's prompt blocks)")
    ax_hit.set_title(
        f"cluster: TTFT p50 {c.get('ttft_ms_p50', 0) / 1e3:.2f} s, p99 "
        f"{c.get('ttft_ms_p99', 0) / 1e3:.2f} s, hit rate {100 * c['hit_rate']:.1f}%",
        fontsize=10,
    )
    ax_hit.legend(fontsize=8, loc="lower right")
    ax_hit.set_ylim(0, max([*bottom, 1.0]) * 1.15)
    for ax in (ax_load, ax_hit):
        ax.set_xticks(xs, names)
        ax.set_xlabel("worker")
        ax.grid(alpha=0.3, axis="y")
    _title(fig, title, subtitle)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    _save(fig, path)
    plt.close(fig)
    return path
