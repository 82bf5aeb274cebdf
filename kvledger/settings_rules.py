"""What a setting allows, and the errors settings raise: shared by ``kvledger.config`` (the
settings, checked without pydantic where the values are plain) and ``kvledger.settings_model``
(pydantic's side, which ``config`` loads only when needed and which needs nothing of it)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import TypeVar

_DEVICES = re.compile(r"^[A-Za-z0-9_.:\-]+(,[A-Za-z0-9_.:\-]+)*$")
T = TypeVar("T")


def check_net_devices(devices: str | None) -> str | None:
    """``devices`` when it names network devices as UCX does (G4's NIXL interface setting,
    for ``Settings`` and the SGLang backend alike); ValueError saying what is wrong."""
    if devices is not None and not _DEVICES.match(devices):
        raise ValueError(
            "must name network devices as UCX does (lo, eth0, mlx5_0:1; comma-separated) "
            f"or be 'all', got {devices!r}"
        )
    return devices


class SettingsError(ValueError):
    """One or more settings are invalid; the message names each and what is allowed."""


class SettingsWarning(UserWarning):
    """A ``KVLEDGER_*`` variable that no setting reads (most likely a misspelling)."""


@dataclass(frozen=True, slots=True)
class Rule:
    """What a setting allows beyond its type: bounds, a shortest length, the Dynamo variables
    it is also read from, and what it is for. ``kvledger.settings_model`` turns each into
    pydantic's ``Field``; ``Settings`` checks plain values against it directly."""

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    min_length: int | None = None
    aliases: tuple[str, ...] = ()
    description: str = ""

    def allows(self, value: float | str) -> bool:
        """Whether a value of the setting's type keeps within the bounds."""
        if isinstance(value, str):
            return self.min_length is None or len(value) >= self.min_length
        return (
            (self.gt is None or value > self.gt)
            and (self.ge is None or value >= self.ge)
            and (self.lt is None or value < self.lt)
            and (self.le is None or value <= self.le)
        )


def setting(
    default: T,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    min_length: int | None = None,
    aliases: tuple[str, ...] = (),
    description: str = "",
) -> T:
    """A field of ``Settings``: its default and its ``Rule``."""
    rule = Rule(gt, ge, lt, le, min_length, aliases, description)
    return dataclasses.field(default=default, metadata={"rule": rule})


def variable_names(field: str, rule: Rule) -> tuple[str, ...]:
    """The environment variables a setting is read from: ``KVLEDGER_<NAME>``, then Dynamo's."""
    return (f"KVLEDGER_{field.upper()}", *rule.aliases)


def env_names(field: str, rule: Rule) -> str:
    """A setting's variables, for messages: ``KVLEDGER_G2_GB / DYN_KVBM_CPU_CACHE_GB``."""
    return " / ".join(variable_names(field, rule))
