"""Files kvledger creates are its owner's alone, whatever the umask: the log (and its -wal and
-shm), G3, the data folder, state dumps and plots; looser files it finds are reported, and a
mistyped log folder is refused rather than created.

Each run happens in a child process started under umask 022 (the usual one), so the modes
checked are the ones a deployment gets.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from kvledger.cli import main
from kvledger.events.files import LooseFileWarning
from kvledger.events.log import EventLog

pytestmark = pytest.mark.usefixtures("clean_env")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def under_umask_022(code: str, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVLEDGER_", "DYN_KVBM_"))}
    return subprocess.run(
        [sys.executable, "-c", "import os; os.umask(0o022)\n" + textwrap.dedent(code), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def kvledger_022(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return under_umask_022("from kvledger.cli import main; raise SystemExit(main())", cwd, *args)


MANAGER_RUN = """
import random, sys
from kvledger import BlockManager, Settings

settings = Settings.load(
    block_size=4, num_layers=2, inner_dim=8, dtype="float32",
    g1_blocks=8, g2_blocks=8, g3_blocks=32, offload_filter="always",
    data_dir=sys.argv[1],
)
manager = BlockManager(settings)
rng = random.Random(0)
for _ in range(40):
    seq = manager.sequence([rng.randrange(50) for _ in range(16)])
    held = manager.onboard(seq)
    held += manager.register(manager.allocate(len(seq) - len(held)), seq, start=len(held))
    manager.release(held)
manager.wait_idle()
manager.event_log.save_checkpoint(manager.event_log.last_position(), manager.state(), 0.0)
print(manager.settings.log_url)
manager.close()
"""


def test_a_manager_under_umask_022_makes_its_folders_0700_and_its_files_0600(
    tmp_path: Path,
) -> None:
    data = tmp_path / "new" / "data"  # two folders that do not exist yet
    proc = under_umask_022(MANAGER_RUN, tmp_path, str(data))
    assert proc.returncode == 0, proc.stderr
    assert "Warning" not in proc.stderr, proc.stderr
    assert mode(tmp_path / "new") == 0o700 and mode(data) == 0o700
    made = sorted(p.name for p in data.iterdir())
    assert {"events.db", "g3-slots.bin", "g3-slots.bin.idx", "g3-slots.bin.lock"} <= set(made)
    for name in made:
        assert mode(data / name) == 0o600, f"{name} is {mode(data / name):04o}"
    # SQLite gives -wal and -shm the database file's mode: seen while a writer holds them
    log = EventLog(f"sqlite:///{data / 'events.db'}")
    try:
        assert log.latest_checkpoint() is not None  # checkpoints live in the private file
        for suffix in ("-wal", "-shm"):
            assert mode(data / f"events.db{suffix}") == 0o600
    finally:
        log.close()


def test_an_event_log_under_umask_022_is_0600_with_its_wal_and_shm(tmp_path: Path) -> None:
    proc = under_umask_022(
        """
        import json, os, sys, time
        from kvledger.events.log import EventLog
        from kvledger.events.types import Cleared, Tier
        log = EventLog("sqlite:///" + sys.argv[1])
        log.append(Cleared(event_id=0, worker_id=0, dp_rank=0, tier=Tier.G1, ts=time.time()))
        log.flush()
        print(json.dumps(sorted(os.listdir(os.path.dirname(sys.argv[1])))))
        log.close()
        """,
        tmp_path,
        str(tmp_path / "run.db"),
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip())
    assert {"run.db", "run.db-wal", "run.db-shm"} <= set(seen)
    for name in ("run.db", "run.db-wal", "run.db-shm"):
        if (tmp_path / name).exists():  # -wal and -shm go when the last connection closes
            assert mode(tmp_path / name) == 0o600


def test_exports_under_umask_022_are_0600(tmp_path: Path) -> None:
    out = kvledger_022(
        tmp_path,
        "simulate", "--requests", "40", "--g2-blocks", "64",
        "--dump-state", "live.state", "--plot", "run.png",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    for args in (
        ("replay", "kvledger-data/events.db", "--dump", "replayed.state"),
        ("report", "kvledger-data/events.db", "--plot", "report.png"),
        ("db", "upgrade", "--url", "sqlite:///migrated.db"),
    ):
        done = kvledger_022(tmp_path, *args)
        assert done.returncode == 0, done.stderr
    assert mode(tmp_path / "kvledger-data") == 0o700
    for name in ("kvledger-data/events.db", "live.state", "run.png", "replayed.state"):
        assert mode(tmp_path / name) == 0o600, name
    assert mode(tmp_path / "report.png") == 0o600
    assert mode(tmp_path / "migrated.db") == 0o600


def test_a_looser_log_or_g3_file_found_is_reported_and_left_as_it_is(tmp_path: Path) -> None:
    log = tmp_path / "events.db"
    EventLog(f"sqlite:///{log}").close()
    log.chmod(0o644)
    with pytest.warns(LooseFileWarning, match=rf"{log} is readable by other users \(mode 0644\)"):
        EventLog(f"sqlite:///{log}").close()
    assert mode(log) == 0o644  # the operator's to change: the warning says how
    proc = kvledger_022(tmp_path, "simulate", "--requests", "5", "--log", str(log))
    assert proc.returncode == 0, proc.stderr
    warned = [line for line in proc.stderr.splitlines() if "readable by other users" in line]
    assert len(warned) == 1 and f"chmod 600 {log}" in warned[0], proc.stderr

    from kvledger.tiers import BlockShape, DiskTier

    shape = BlockShape(1, 1, 4, 8, __import__("torch").float32)
    DiskTier(tmp_path / "g3", shape, 4).close()
    (tmp_path / "g3" / "g3-slots.bin").chmod(0o640)
    with pytest.warns(LooseFileWarning, match="g3-slots.bin is readable by other users"):
        DiskTier(tmp_path / "g3", shape, 4).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (tmp_path / "g3" / "g3-slots.bin").chmod(0o600)
        DiskTier(tmp_path / "g3", shape, 4).close()  # 0600 again: nothing to say


def test_a_log_in_a_missing_folder_is_refused_and_the_folder_not_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nonexistent" / "dir"
    for argv in (
        ["simulate", "--requests", "5", "--log", f"sqlite:///{missing}/x.db"],
        ["db", "upgrade", "--url", f"{missing}/x.db"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "Traceback" not in err, err
        assert f"folder {missing} does not exist" in err, err
    assert not (tmp_path / "nonexistent").exists()
