"""What verifying record checksums costs replay and the writer, measured in one process.

Replay: ``fold_chunk`` over the same rows written as version 3 records (checksummed, the
checksum verified per record) and as version 2 records (the same bytes without the checksum
field), in 10k-row chunks as replay folds them. Encode: ``encode`` (version 3), and the part
of it that computes and appends the checksum (``zlib.crc32`` and one concatenation). The
measures interleave round by round, so the machine's slow spells hit both sides; each figure
is the best round. ``eventlog_bench.py`` gives the end-to-end ratios against raw sqlite3.

    .venv/bin/python bench/checksum_cost.py [--events 200000] [--repeat 7]
"""

from __future__ import annotations

import argparse
import struct
import time
import zlib
from collections.abc import Callable

from eventlog_bench import workload

from kvledger.events.codec import encode
from kvledger.events.log.replay import fold_chunk
from kvledger.registry.state import RegistryState

CHUNK = 10_000
Row = tuple[int, float, bytes]


def unchecked(payload: bytes) -> bytes:
    """The version 2 record of a version 3 one: one array field fewer, no checksum field."""
    return bytes([payload[0] - 1, 2]) + payload[2:-5]


def fold_all(rows: list[Row]) -> None:
    state = RegistryState()
    for start in range(0, len(rows), CHUNK):
        fold_chunk(state, rows[start : start + CHUNK])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    events = workload(args.events)
    v3 = [(i, e.ts, encode(e)) for i, e in enumerate(events, 1)]
    v2 = [(i, ts, unchecked(p)) for i, ts, p in v3]
    unsealed = [p[:-4] for *_, p in v3]
    crc_le = struct.Struct("<I").pack
    measures: dict[str, Callable[[], object]] = {
        "fold v2": lambda: fold_all(v2),
        "fold v3": lambda: fold_all(v3),
        "encode": lambda: [encode(e) for e in events],
        "checksum": lambda: [d + crc_le(zlib.crc32(d)) for d in unsealed],
    }
    best = dict.fromkeys(measures, float("inf"))
    for _ in range(args.repeat):
        for name, run in measures.items():
            t0 = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - t0)
    n = len(events)
    size = sum(len(p) for *_, p in v3) / n
    print(f"events: {n}, mean record {size:.1f} bytes (v3), best of {args.repeat}")
    old, new = best["fold v2"], best["fold v3"]
    print(
        f"replay fold: v2 {old / n * 1e6:.3f} us/event, v3 {new / n * 1e6:.3f} us/event: "
        f"verifying costs +{(new - old) / n * 1e9:.0f} ns, ratio v2/v3 {old / new:.2f}"
    )
    encode_s, check_s = best["encode"], best["checksum"]
    print(
        f"encode:      {encode_s / n * 1e6:.3f} us/event, of which the checksum "
        f"{check_s / n * 1e9:.0f} ns ({check_s / encode_s:.0%})"
    )


if __name__ == "__main__":
    main()
