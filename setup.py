"""The one C extension, which pyproject.toml cannot declare without an experimental table.

``kvledger.events._speedups`` (events/_speedups.c) encodes the log's hot record kinds. It is
optional: where it does not build (no C compiler, no zlib headers) the install goes on and
``kvledger.events.codec`` uses its Python encoders, which write the same bytes.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvledger.events._speedups",
            sources=["events/_speedups.c"],
            libraries=["z"],
            optional=True,
        )
    ]
)
