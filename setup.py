"""The C extensions, which pyproject.toml cannot declare without an experimental table.

``kvledger.events._speedups`` (events/_speedups.c) encodes the log's hot record kinds;
``kvledger.events.log._sqlite_writer`` (events/log/_sqlite_writer.c) commits the SQLite log's
batches with the GIL released, through the SQLite that Python's sqlite3 module runs (found when
it is imported: nothing is linked, no SQLite headers are needed). Both are optional: where one
does not build (no C compiler, no zlib headers) the install goes on, and the codec's Python
encoders and the log's Python writer do the same work.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvledger.events._speedups",
            sources=["events/_speedups.c"],
            libraries=["z"],
            optional=True,
        ),
        Extension(
            "kvledger.events.log._sqlite_writer",
            sources=["events/log/_sqlite_writer.c"],
            libraries=["dl"],
            optional=True,
        ),
    ]
)
