"""PNG charts for ``kvledger simulate --plot`` and ``kvledger sweep --plot``.

matplotlib is an optional dependency (the ``plot`` extra); it is imported only when a chart
is asked for, with the Agg backend so no display is needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvledger.mocker.stats import SimStats


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'kvledger[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _check_png(path: str | Path) -> Path:
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"--plot writes a PNG; give a file name ending in .png, got {path}")
    if not path.parent.is_dir():
        raise ValueError(f"--plot: folder {path.parent} does not exist")
    return path


def plot_timeline(
    stats: SimStats, path: str | Path, *, title: str, capacities: dict[str, int]
) -> Path:
    """Cumulative prefix-hit rate and blocks held per tier, against requests finished."""
    path = _check_png(path)
    if not stats.timeline:
        raise ValueError("--plot: the run recorded no samples (no request finished)")
    plt = _pyplot()
    x = [point[0] for point in stats.timeline]
    fig, (ax_hit, ax_occ) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax_hit.plot(x, [100 * point[1] for point in stats.timeline], color="tab:blue")
    ax_hit.set_ylabel("prefix hit rate (%)")
    ax_hit.set_ylim(0, 100)
    ax_hit.grid(alpha=0.3)
    for tier in sorted(capacities):
        held = [point[2].get(tier, 0) for point in stats.timeline]
        ax_occ.plot(x, [100 * h / capacities[tier] for h in held], label=tier)
    ax_occ.set_ylabel("tier occupancy (% of blocks)")
    ax_occ.set_ylim(0, 105)
    ax_occ.set_xlabel("requests finished")
    ax_occ.legend(loc="lower right")
    ax_occ.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_sweep(
    capacities: Sequence[int], hit_rates: Sequence[float], path: str | Path, *, title: str
) -> Path:
    """Prefix-hit rate against G1 capacity."""
    path = _check_png(path)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(capacities, [100 * h for h in hit_rates], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("G1 capacity (blocks)")
    ax.set_ylabel("prefix hit rate (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3, which="both")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
