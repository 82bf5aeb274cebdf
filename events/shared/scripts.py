"""The Lua scripts of the shared registry, read from the ``lua/`` files of this package.

Each script is one atomic step in Redis: ``APPLY`` edits the index for a reduced run of one
worker's events and moves its applied id, ``PURGE`` drops workers whose lease lapsed (or one
that leaves), ``WHO_HAS`` answers a prefix in one round trip, ``SWEEP`` removes entries that
a Cleared or a purge made stale; ``CLAIM``, ``FENCE`` and ``BEAT`` keep one owner per worker
id (a claim with a fencing token, the fence every shard checks, the heartbeat). The index
scripts share ``generations.lua`` (reading a worker's current generations and masking stale
bits) and ``common.lua`` (writing blocks back and the sweep), which are prepended to them
here. The key layout they keep is in ``keys.py``.

The files are package data (loaded with ``importlib.resources``), so they are edited, linted
and diffed as Lua rather than as Python strings.
"""

from __future__ import annotations

from importlib.resources import files


def _read(name: str) -> str:
    return files(__package__).joinpath("lua", name).read_text(encoding="utf-8")


GENERATIONS = _read("generations.lua")
COMMON = GENERATIONS + _read("common.lua")
APPLY = COMMON + _read("apply.lua")
PURGE = COMMON + _read("purge.lua")
WHO_HAS = GENERATIONS + _read("who_has.lua")
SWEEP = COMMON + _read("sweep.lua")
CLAIM = _read("claim.lua")
UNCLAIM = _read("unclaim.lua")
FENCE = _read("fence.lua")
BEAT = _read("beat.lua")
