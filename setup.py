"""The C extensions, which pyproject.toml cannot declare without an experimental table.

``kvledger.events._speedups`` (events/_speedups.c) encodes the log's hot record kinds;
``kvledger.registry._records`` (registry/_records.c) builds event records from positional
values; ``kvledger.events.log._sqlite`` (events/log/_sqlite.c) commits the SQLite log's
batches and reads replay's chunks with the GIL released, through the SQLite that Python's
sqlite3 module runs (found when it is imported: nothing of SQLite is linked, no SQLite headers
are needed); ``kvledger.events.log._gather`` (events/log/_gather.c) is an append buffer's
queue, which encodes each event into its row as it comes and takes no lock;
``kvledger.registry._pool`` (registry/_pool.c) runs the block pool's per-block loops (match,
register, release, eviction) over the pool's own lists and dicts; ``kvledger.registry._index``
(registry/_index.c) folds a router index's usual events; ``kvledger.registry._chain``
(registry/_chain.c) hashes block chains; ``kvledger.mocker._trace``
(kvledger/mocker/_trace.c) reads a plain Mooncake trace in one pass. Each is optional: where
one does not build (no C compiler) the install goes on, and the records' dataclass constructors,
the codec's Python encoders, the log's Python writer, reader and buffer, the pool's and the
index's Python loops, xxhash and the trace's ``json`` reader do the same work. Nothing is
linked but Python itself (and libdl): the record's CRC-32 is events/crc32.h's.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvledger.events._speedups",
            sources=["events/_speedups.c"],
            depends=["events/crc32.h", "events/records.h", "registry/fields.h"],
            optional=True,
        ),
        Extension(
            "kvledger.registry._records",
            sources=["registry/_records.c"],
            depends=["registry/fields.h"],
            optional=True,
        ),
        Extension(
            "kvledger.events.log._sqlite",
            sources=["events/log/_sqlite.c"],
            depends=["events/crc32.h", "events/log/rowblock.h"],
            libraries=["dl"],
            optional=True,
        ),
        Extension(
            "kvledger.events.log._gather",
            sources=["events/log/_gather.c"],
            depends=["events/records.h", "events/log/rowblock.h"],
            optional=True,
        ),
        Extension(
            "kvledger.registry._pool",
            sources=["registry/_pool.c"],
            optional=True,
        ),
        Extension(
            "kvledger.registry._index",
            sources=["registry/_index.c"],
            depends=["registry/fields.h"],
            optional=True,
        ),
        Extension(
            "kvledger.registry._chain",
            sources=["registry/_chain.c"],
            optional=True,
        ),
        Extension(
            "kvledger.mocker._trace",
            sources=["kvledger/mocker/_trace.c"],
            optional=True,
        ),
    ]
)
