"""Settings, from the environment (prefix ``KVLEDGER_``) or keyword arguments.

Dynamo's KVBM variables are accepted as aliases so a deployment can switch without renaming:
``DYN_KVBM_CPU_CACHE_GB``, ``DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS``,
``DYN_KVBM_DISK_CACHE_GB`` and ``DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS``. As in Dynamo, a
block-count override wins over a size in GB, a value of 0 means "no such tier", and a disk
cache without a CPU cache makes G1 offload straight to G3.

Settings are a frozen dataclass checked by a rule per field (its type, allowed values and
bounds), not a pydantic model: every CLI run builds them, and importing pydantic and
pydantic-settings took longer than a short simulation's whole replay.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from kvledger.events.types import Tier

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "uint8": 1}


#: ``KVLEDGER_*`` variables that are not settings (read by the test suite and benchmarks).
OTHER_VARIABLES = ("KVLEDGER_SHARED_DATA",)
OTHER_PREFIXES = ("KVLEDGER_TEST_",)
_warned: set[str] = set()


class SettingsError(ValueError):
    """One or more settings are invalid; the message names each and what is allowed."""


class SettingsWarning(UserWarning):
    """A ``KVLEDGER_*`` variable that no setting reads (most likely a misspelling)."""


@dataclass(frozen=True, slots=True)
class Rule:
    """What one setting accepts: its type, its allowed values or bounds, and the environment
    variables besides ``KVLEDGER_<NAME>`` that set it."""

    kind: type  # int, float, bool, str or Path
    optional: bool = False  # None allowed
    choices: tuple[object, ...] = ()
    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    min_length: int = 0
    aliases: tuple[str, ...] = ()
    doc: str = ""


def setting(default: Any, kind: type, doc: str = "", **rule: Any) -> Any:
    """A settings field: its default and its ``Rule``."""
    return field(default=default, metadata={"rule": Rule(kind, doc=doc, **rule)})


class _Invalid(ValueError):
    """One value breaks its rule; the message says what the rule wants."""


_TRUE = frozenset(("1", "true", "t", "yes", "y", "on"))
_FALSE = frozenset(("0", "false", "f", "no", "n", "off"))


def _convert(rule: Rule, value: Any) -> Any:
    """``value`` (a keyword's value, or a variable's text) as the setting's type, checked."""
    kind = rule.kind
    if value is None and rule.optional:
        return None
    out: Any
    if kind is bool:
        text = value.strip().lower() if isinstance(value, str) else None
        if isinstance(value, bool) or (type(value) is int and value in (0, 1)):
            out = bool(value)
        elif text in _TRUE or text in _FALSE:
            out = text in _TRUE
        else:
            raise _Invalid("Input should be a valid boolean, unable to interpret input")
    elif kind is int:
        if type(value) is int:
            out = value
        elif type(value) is float and value.is_integer():
            out = int(value)
        elif type(value) is float:
            raise _Invalid("Input should be a valid integer, got a number with a fractional part")
        elif isinstance(value, str):
            try:
                out = int(value.strip())
            except ValueError:
                raise _Invalid(
                    "Input should be a valid integer, unable to parse string as an integer"
                ) from None
        else:
            raise _Invalid("Input should be a valid integer")
    elif kind is float:
        if type(value) in (int, float):
            out = float(value)
        elif isinstance(value, str):
            try:
                out = float(value.strip())
            except ValueError:
                raise _Invalid(
                    "Input should be a valid number, unable to parse string as a number"
                ) from None
        else:
            raise _Invalid("Input should be a valid number")
        # a size of inf or nan GB would pass ge=0 (nan compares false) and only fail later,
        # as an overflow deep inside a tier
        if not math.isfinite(out):
            raise _Invalid("Input should be a finite number")
    elif kind is Path:
        if not isinstance(value, str | os.PathLike):
            raise _Invalid("Input should be a path")
        out = Path(value)
    else:
        if not isinstance(value, str):
            raise _Invalid("Input should be a valid string")
        if len(value) < rule.min_length:
            raise _Invalid(f"String should have at least {rule.min_length} character")
        out = value
    if rule.choices and out not in rule.choices:
        shown = [repr(c) for c in rule.choices]
        raise _Invalid(f"Input should be {', '.join(shown[:-1])} or {shown[-1]}")
    if rule.gt is not None and not out > rule.gt:
        raise _Invalid(f"Input should be greater than {rule.gt}")
    if rule.ge is not None and not out >= rule.ge:
        raise _Invalid(f"Input should be greater than or equal to {rule.ge}")
    if rule.lt is not None and not out < rule.lt:
        raise _Invalid(f"Input should be less than {rule.lt}")
    if rule.le is not None and not out <= rule.le:
        raise _Invalid(f"Input should be less than or equal to {rule.le}")
    return out


@dataclass(frozen=True)
class Settings:
    """kvledger's settings; build them with ``Settings.load`` (the environment under keywords)."""

    block_size: int = setting(16, int, "tokens per KV block", gt=0, le=1 << 16)
    # Model geometry, for bytes per block (turns GB into block counts, sizes tier buffers).
    num_layers: int = setting(32, int, gt=0)
    outer_dim: Literal[1, 2] = setting(2, int, "2 for separate K and V, 1 for MLA", choices=(1, 2))
    inner_dim: int = setting(1024, int, "kv heads x head size", gt=0)
    dtype: Literal["float32", "float16", "bfloat16", "float8_e4m3fn", "uint8"] = setting(
        "bfloat16", str, choices=("float32", "float16", "bfloat16", "float8_e4m3fn", "uint8")
    )

    g1_blocks: int = setting(4096, int, "G1 (GPU) pool size in blocks", gt=0)
    g2_gb: float = setting(0.0, float, ge=0, aliases=("DYN_KVBM_CPU_CACHE_GB",))
    g2_blocks: int = setting(0, int, ge=0, aliases=("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS",))
    g3_gb: float = setting(0.0, float, ge=0, aliases=("DYN_KVBM_DISK_CACHE_GB",))
    g3_blocks: int = setting(0, int, ge=0, aliases=("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS",))

    eviction_policy: Literal["lru", "lineage", "multi_lru"] = setting(
        "lineage", str, choices=("lru", "lineage", "multi_lru")
    )
    offload_filter: Literal["always", "seen_twice", "never"] = setting(
        "seen_twice",
        str,
        "which blocks go down to G3 (G2 is write-through)",
        choices=("always", "seen_twice", "never"),
    )
    # Mock engine: scheduler limits, and copy bandwidths (GB/s, both directions) for its costs.
    max_num_batched_tokens: int = setting(8192, int, "tokens one engine step computes", gt=0)
    max_num_seqs: int = setting(256, int, "sequences one engine step runs", gt=0)
    watermark: float = setting(0.01, float, "fraction of G1 kept free to admit", ge=0, lt=1)
    timing_model: Literal["linear", "dynamo"] = setting(
        "linear",
        str,
        "mock engine step cost: linear StepCosts or Dynamo's polynomial",
        choices=("linear", "dynamo"),
    )
    admission_rule: Literal["watermark", "whole_prompt"] = setting(
        "watermark",
        str,
        "admit while G1 keeps the watermark free, or only when the whole uncached prompt fits "
        "in free or evictable G1 blocks (Dynamo)",
        choices=("watermark", "whole_prompt"),
    )
    cache_partial_blocks: bool = setting(
        True, bool, "cache a prompt's partial last block (False: full blocks only, Dynamo)"
    )
    speedup_ratio: float = setting(
        1.0, float, "dynamo timing model: pass cost is divided by this", gt=0
    )
    g1_g2_gbps: float = setting(25.0, float, "G1<->G2 bandwidth (PCIe), GB/s", gt=0)
    g2_g3_gbps: float = setting(6.0, float, "G2<->G3 bandwidth (NVMe), GB/s", gt=0)
    g1_g3_gbps: float = setting(6.0, float, "G1<->G3 bandwidth (GDS), GB/s", gt=0)
    allocate_wait_s: float = setting(
        10.0,
        float,
        "how long allocate waits for copies in flight to free G1 blocks, seconds",
        ge=0,
    )
    data_dir: Path = setting("kvledger-data", Path)  # noqa: RUF009 (a field, made once)
    log_lookups: bool = setting(
        True,
        bool,
        "write each request's lookup, growth and end to the event log (for `kvledger whatif` "
        "and `kvledger report`); about 84 + 8 x blocks bytes per lookup",
    )
    event_log_url: str | None = setting(
        None, str, "SQLAlchemy URL of the event log; default: SQLite under data_dir", optional=True
    )
    redis_url: str | None = setting(
        None, str, "shared registry; every event is also published there when set", optional=True
    )
    redis_namespace: str = setting("kvledger", str, "key namespace in Redis", min_length=1)
    redis_linger_s: float = setting(
        0.0,
        float,
        "how long a batch of events may wait to fill before it is published to the shared "
        "registry, seconds (each batch costs every shard a script call)",
        ge=0,
        lt=60,
    )
    g4: bool = setting(
        False,
        bool,
        "share G2 with the workers of redis_namespace and read theirs over NIXL (needs G2, "
        "redis_url and the remote extra)",
    )
    g4_timeout_s: float = setting(5.0, float, "longest wait for one remote read", gt=0)
    zmq_endpoint: str | None = setting(
        None,
        str,
        "bind a vLLM-compatible ZMQ PUB socket here (e.g. tcp://*:5557) and publish every "
        "event as a KVEventBatch",
        optional=True,
    )
    zmq_replay_endpoint: str | None = setting(
        None, str, "bind the ZMQ replay (ROUTER) socket here; needs zmq_endpoint", optional=True
    )
    zmq_topic: str = setting("", str, "topic frame of every ZMQ message")
    zmq_ring_size: int = setting(
        10_000, int, "newest ZMQ batches replayed from memory (older: from the log)", gt=0
    )
    worker_id: int = setting(0, int, ge=0)
    dp_rank: int = setting(0, int, ge=0)
    chain_seed: int = setting(1337, int, "seed of the sequence-hash chain", ge=0, lt=1 << 64)
    #: the settings given (keywords or variables) rather than defaulted
    fields_set: frozenset[str] = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        errors = []
        for name, rule in RULES.items():
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, _convert(rule, value))
            except _Invalid as exc:
                errors.append(f"{shown_name(name)}: {exc}, got {value!r}")
        if not errors:
            errors = [f"settings: {problem}" for problem in self._conflicts()]
        if errors:
            raise SettingsError("\n  ".join(["invalid kvledger settings:", *errors]))

    def _conflicts(self) -> list[str]:
        """Settings that are each valid but do not go together."""
        out = []
        if self.event_log_url is not None and "://" not in self.event_log_url:
            out.append(
                f"event_log_url must be a URL such as sqlite:///path.db, got {self.event_log_url!r}"
            )
        if self.zmq_replay_endpoint is not None and self.zmq_endpoint is None:
            out.append("zmq_replay_endpoint needs zmq_endpoint")
        if self.g4 and (not self.g2_capacity or self.redis_url is None):
            out.append("g4 needs a G2 (g2_gb or g2_blocks) and redis_url")
        return out

    @classmethod
    def load(cls, **overrides: Any) -> Settings:
        """Build settings from ``KVLEDGER_*`` (and Dynamo's) variables with ``overrides`` on
        top; a ``SettingsError`` names each bad setting, its variables and what it allows.

        ``KVLEDGER_*`` variables that no setting reads get a ``SettingsWarning`` naming the
        closest setting: a misspelt variable would otherwise be ignored without a word.
        """
        for message in unknown_variables(os.environ):
            if message not in _warned:  # once per process, not once per load
                _warned.add(message)
                warnings.warn(message, SettingsWarning, stacklevel=2)
        unknown = [name for name in overrides if name not in RULES]
        if unknown:
            raise SettingsError(
                "\n  ".join(
                    ["invalid kvledger settings:"]
                    + [
                        f"{name}: not a setting{_hint(name)}, got {overrides[name]!r}"
                        for name in unknown
                    ]
                )
            )
        values = from_environment(os.environ)
        values.update(overrides)
        settings = cls(**values)
        object.__setattr__(settings, "fields_set", frozenset(values))
        return settings

    # -- derived -------------------------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        return (
            self.num_layers
            * self.outer_dim
            * self.block_size
            * self.inner_dim
            * DTYPE_BYTES[self.dtype]
        )

    def _blocks(self, override: int, gb: float) -> int:
        return override if override else int(gb * GIB) // self.bytes_per_block

    @property
    def g2_capacity(self) -> int:
        """G2 blocks: the override if set, else the size in GB; 0 means no G2."""
        return self._blocks(self.g2_blocks, self.g2_gb)

    @property
    def g3_capacity(self) -> int:
        return self._blocks(self.g3_blocks, self.g3_gb)

    @property
    def offload_path(self) -> tuple[Tier, ...]:
        """The tiers a block goes through on its way down, starting at G1.

        A disk cache with no CPU cache means G1 -> G3 directly (Dynamo's bypass rule).
        """
        path = [Tier.G1]
        if self.g2_capacity:
            path.append(Tier.G2)
        if self.g3_capacity:
            path.append(Tier.G3)
        return tuple(path)

    @property
    def log_url(self) -> str:
        if self.event_log_url:
            return self.event_log_url
        return f"sqlite:///{self.data_dir / 'events.db'}"


#: each setting's rule, by name (the names are also the keywords of ``Settings.load``)
RULES: dict[str, Rule] = {f.name: f.metadata["rule"] for f in fields(Settings) if f.init}


def variables(name: str) -> tuple[str, ...]:
    """The environment variables that set ``name``, the first found winning."""
    return (f"KVLEDGER_{name.upper()}", *RULES[name].aliases)


def shown_name(name: str) -> str:
    """``name`` with its variables, as error messages show it."""
    return f"{name} ({' / '.join(variables(name))})"


def from_environment(environ: Any) -> dict[str, Any]:
    """The settings that ``environ`` sets, as text (names compared without case, as a shell
    user would expect of ``kvledger_block_size``)."""
    upper = {name.upper(): value for name, value in environ.items()}
    out: dict[str, Any] = {}
    for name in RULES:
        for variable in variables(name):
            if variable in upper:
                out[name] = upper[variable]
                break
    return out


def _hint(name: str) -> str:
    import difflib

    close = difflib.get_close_matches(name, list(RULES), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def unknown_variables(environ: Any) -> list[str]:
    """A warning for each ``KVLEDGER_*`` name in ``environ`` that is not a setting."""
    known = [name.upper() for name in RULES]
    out = []
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith("KVLEDGER_") or upper in OTHER_VARIABLES:
            continue
        if upper.startswith(OTHER_PREFIXES) or upper.removeprefix("KVLEDGER_") in known:
            continue
        import difflib

        close = difflib.get_close_matches(upper.removeprefix("KVLEDGER_"), known, n=1)
        hint = f"did you mean KVLEDGER_{close[0]}?" if close else "see the Settings table"
        out.append(f"{name} is not a kvledger setting and is ignored; {hint}")
    return out


def ensure_log_folder(url: str) -> None:
    """Create the folder of a SQLite log file, so a first run in an empty folder works."""
    import sqlalchemy as sa

    parsed = sa.make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
