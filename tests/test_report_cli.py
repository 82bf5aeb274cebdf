"""``kvledger report``, ``kvledger whatif`` and ``simulate --trace LOG`` on a real recorded log.

One engine-off simulation with G1+G2+G3 is recorded per module; the commands run in-process
through ``kvledger.cli.main``, as the console script calls it.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from kvledger.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SUMMED = ("lookups", "blocks_requested", "blocks_hit", "tokens_requested", "tokens_hit")
PER_KEY = ("hits_by_tier", "rows_by_kind", "evicted_blocks", "offloaded_blocks",
           "onboarded_blocks")  # fmt: skip


@pytest.fixture(scope="module")
def recorded_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("recorded")
    log = folder / "run.db"
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("KVLEDGER_")}
    try:
        status = main(
            ["simulate", "--engine", "off", "--log", str(log), "--requests", "400",
             "--g1-blocks", "192", "--g2-blocks", "384", "--g3-blocks", "768", "--json"]
        )  # fmt: skip
    finally:
        os.environ.update(saved)
    assert status == 0
    return log


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    capsys.readouterr()
    status = main([*argv, "--json"])
    out = capsys.readouterr().out
    assert status == 0, out
    result: dict[str, Any] = json.loads(out)
    return result


def _sum_windows(windows: list[dict[str, Any]]) -> dict[str, Any]:
    total: dict[str, Any] = {key: sum(w[key] for w in windows) for key in SUMMED}
    for key in PER_KEY:
        counts: Counter[str] = Counter()
        for w in windows:
            counts.update(w[key])
        total[key] = {k: n for k, n in counts.items() if n}
    return total


@pytest.mark.parametrize("windows", [1, 7, 20])
def test_report_windows_add_up_to_the_totals(
    recorded_log: Path, capsys: pytest.CaptureFixture[str], windows: int
) -> None:
    out = run_json(capsys, "report", str(recorded_log), "--windows", str(windows))
    assert len(out["windows"]) == windows
    summed = _sum_windows(out["windows"])
    totals = out["totals"]
    for key in SUMMED:
        assert summed[key] == totals[key], key
    for key in PER_KEY:
        assert summed[key] == {k: n for k, n in totals[key].items() if n}, key
    assert totals["lookups"] == 400
    assert totals["rows_by_kind"]["lookup"] == 400 and totals["rows_by_kind"]["release"] == 400
    whatif = run_json(capsys, "whatif", str(recorded_log))
    assert totals["hits_by_tier"] == whatif["recorded"]["hits_by_tier"]


def test_report_range_by_position_and_time(
    recorded_log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    whole = run_json(capsys, "report", str(recorded_log), "--windows", "4")
    last = whole["totals"]["last_position"]
    part = run_json(
        capsys, "report", str(recorded_log), "--since", "100", "--until", str(last - 100)
    )
    assert part["totals"]["first_position"] == 100
    assert part["totals"]["last_position"] == last - 100
    rows = sum(part["totals"]["rows_by_kind"].values())
    assert rows == last - 199
    assert sum(sum(w["rows_by_kind"].values()) for w in part["windows"]) == rows
    import datetime as dt

    middle = (whole["since_ts"] + whole["until_ts"]) / 2
    iso = dt.datetime.fromtimestamp(middle, dt.UTC).isoformat()
    late = run_json(capsys, "report", str(recorded_log), "--since", iso)
    assert 0 < late["totals"]["lookups"] < whole["totals"]["lookups"]


def test_whatif_sweep_and_plots(
    recorded_log: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = run_json(
        capsys, "whatif", str(recorded_log), "--g1-blocks", "96,192,384", "--policy",
        "lru,lineage", "--plot", str(tmp_path / "w.png"),
    )  # fmt: skip
    assert out["baseline_reproduces"] and out["lookups_compared"] == 400
    assert out["runs"][0]["settings"]["g1_blocks"] == 192  # the baseline comes first
    assert len(out["runs"]) == 6  # 3 x 2, the baseline among them once
    assert all(r["hit_rate"] <= out["ceiling"]["hit_rate"] for r in out["runs"])
    assert (tmp_path / "w.png").read_bytes()[:8] == PNG_MAGIC
    report_png = tmp_path / "r.png"
    run_json(capsys, "report", str(recorded_log), "--plot", str(report_png))
    assert report_png.read_bytes()[:8] == PNG_MAGIC


def test_simulate_takes_a_log_as_its_trace(
    recorded_log: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The recorded requests, re-simulated with the recorded settings, hit as recorded."""
    had = run_json(capsys, "whatif", str(recorded_log))["recorded"]
    again = run_json(
        capsys, "simulate", "--engine", "off", "--trace", str(recorded_log), "--log",
        str(tmp_path / "again.db"), "--g1-blocks", "192", "--g2-blocks", "384",
        "--g3-blocks", "768",
    )  # fmt: skip
    assert again["requests"] == 400 and again["block_size"] == 16
    assert again["blocks_requested"] == had["blocks_requested"]
    assert abs(again["hit_rate"] - had["hit_rate"]) < 0.02


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["whatif", "{log}", "--g1-blocks", "0,8"], "must be 1 or more"),
        (["whatif", "{log}", "--policy", "lru,fifo"], "unknown 'fifo'"),
        (["whatif", "{log}", "--g2-blocks", "8,,9"], "comma-separated"),
        (["report", "{log}", "--since", "yesterday"], "event position"),
        (["report", "{log}", "--windows", "0"], "must be 1 or more"),
    ],
)
def test_bad_flags_are_refused_by_name(
    recorded_log: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        main([a.format(log=recorded_log) for a in argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_log_without_lookups_or_range_says_so(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "plain.db"
    monkeypatch.setenv("KVLEDGER_LOG_LOOKUPS", "0")
    assert main(["simulate", "--engine", "off", "--log", str(log), "--requests", "20"]) == 0
    capsys.readouterr()
    assert main(["whatif", str(log)]) == 2
    assert "no lookup records" in capsys.readouterr().err
    assert main(["report", str(log), "--since", "100000"]) == 2
    assert "no events in the range" in capsys.readouterr().err


def test_whatif_lru_g1_alone_never_loses_hits_as_it_grows(
    recorded_log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The recorded stream re-run on G1 alone with LRU: hits only grow with G1."""
    out = run_json(
        capsys, "whatif", str(recorded_log), "--g2-blocks", "0", "--g3-blocks", "0",
        "--policy", "lru", "--g1-blocks", "48,96,160,192,256,512",
    )  # fmt: skip
    points = sorted((r["settings"]["g1_blocks"], r["blocks_hit"]) for r in out["runs"][1:])
    hits = [h for _, h in points]
    assert len(points) == 6 and hits == sorted(hits) and hits[0] < hits[-1]


def test_whatif_since_and_until_pick_the_lookups_that_count(
    recorded_log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    whole = run_json(capsys, "report", str(recorded_log), "--windows", "1")
    last = whole["totals"]["last_position"]
    early = run_json(capsys, "whatif", str(recorded_log), "--until", str(last // 2))
    late = run_json(capsys, "whatif", str(recorded_log), "--since", str(last // 2 + 1))
    assert early["baseline_reproduces"] and late["baseline_reproduces"]
    assert early["recorded"]["lookups"] + late["recorded"]["lookups"] == 400
    assert 0 < early["recorded"]["lookups"] < 400


def test_every_report_series_can_be_told_apart(
    recorded_log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """In each panel every series is a line of its own colour and marker, whose markers fall
    where no other series' do, so two series with the same values (G2's evictions and the
    offloads into it, in a steady state) and one near zero (the G2 hit share) both show; and
    the lower of two coinciding lines is drawn wider, so it shows as an outline."""
    import numpy as np

    from kvledger.plots import report_figure

    out = run_json(capsys, "report", str(recorded_log))
    fig = report_figure(out)
    panels = fig.axes[:3]  # hit rate, rows by kind, blocks moved
    labels = [[line.get_label() for line in ax.get_lines()] for ax in panels]
    assert "served from G2" in labels[0] and "offloaded to G2" in labels[2]
    assert not any(ax.collections for ax in panels)  # no stacked bands hiding a thin one
    for ax in panels:
        lines = ax.get_lines()
        styles = [(line.get_color(), line.get_marker()) for line in lines]
        assert len(set(styles)) == len(styles), styles
        marked: list[set[float]] = []
        for line in lines:
            xs = np.asarray(line.get_xdata(), dtype=float)
            start, step = line.get_markevery()
            marked.append(set(xs[start::step].tolist()))
            assert marked[-1], f"{line.get_label()} shows no marker"
        for i, a in enumerate(lines):
            for j, b in enumerate(lines[i + 1 :], i + 1):
                assert not marked[i] & marked[j], (a.get_label(), b.get_label())
                if np.array_equal(a.get_ydata(), b.get_ydata()):
                    assert a.get_linewidth() > b.get_linewidth()
    png = tmp_path / "report.png"
    assert main(["report", str(recorded_log), "--plot", str(png)]) == 0
    assert png.read_bytes().startswith(PNG_MAGIC)
