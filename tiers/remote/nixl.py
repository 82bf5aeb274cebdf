"""Loading NIXL, which is optional: nothing in this package imports it at module import time.

NIXL ships one wheel per CUDA major (``nixl-cu12``, ``nixl-cu13``: the ``remote-cu12`` and
``remote-cu13`` extras) and a meta package ``nixl`` (the ``remote`` extra) that installs both and
loads the one matching torch's CUDA. Only one flavour may be loaded per process, so everything
here goes through ``nixl_api()``: the meta package's ``nixl._api`` where it is installed, else the
``_api`` of the flavour for torch's CUDA major (the first one installed when torch has no CUDA).
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Any

import torch

FLAVOURS = ("nixl_cu13", "nixl_cu12")


def _absent(exc: ModuleNotFoundError, package: str) -> bool:
    """Whether ``exc`` says that ``package`` (not something it imports) is not installed."""
    return exc.name in (package, f"{package}._api")


def _import_api() -> ModuleType:
    try:
        return importlib.import_module("nixl._api")
    except ModuleNotFoundError as exc:
        if not _absent(exc, "nixl"):  # there, but broken: say so
            raise
    major = (torch.version.cuda or "").split(".")[0]
    if major:  # torch is built for one CUDA: only that flavour can work beside it
        try:
            return importlib.import_module(f"nixl_cu{major}._api")
        except ModuleNotFoundError as exc:
            if not _absent(exc, f"nixl_cu{major}"):
                raise
            raise ModuleNotFoundError(
                f"torch is built for CUDA {torch.version.cuda} but neither nixl-cu{major} nor "
                f"the nixl meta package is installed; pip install 'kvledger[remote-cu{major}]'"
            ) from exc
    for flavour in FLAVOURS:
        try:
            return importlib.import_module(f"{flavour}._api")
        except ModuleNotFoundError as exc:
            if not _absent(exc, flavour):
                raise
    raise ModuleNotFoundError(f"none of nixl, {', '.join(FLAVOURS)} is installed")


@functools.cache
def _load() -> ModuleType | str:
    try:
        return _import_api()
    except Exception as exc:  # ImportError, or OSError from its native libraries
        return (
            f"nixl cannot be imported ({type(exc).__name__}: {exc}); pip install "
            "'kvledger[remote-cu13]' (or remote-cu12, for torch's CUDA major)"
        )


def nixl_unavailable_reason() -> str | None:
    """Why NIXL cannot be used in this process, or None when it can."""
    loaded = _load()
    return loaded if isinstance(loaded, str) else None


def nixl_api() -> Any:
    """NIXL's ``_api`` module; raises RuntimeError naming the cause when it is missing."""
    loaded = _load()
    if isinstance(loaded, str):
        raise RuntimeError(loaded)
    return loaded


def nixl_flavour() -> str | None:
    """The NIXL wheel this process loaded (``nixl_cu13``, ...), or None when none could be."""
    loaded = _load()
    return None if isinstance(loaded, str) else loaded.__name__.split(".")[0]
