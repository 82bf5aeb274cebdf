"""Settings, from the environment (prefix ``KVLEDGER_``) or keyword arguments.

Dynamo's KVBM variables are accepted as aliases so a deployment can switch without renaming:
``DYN_KVBM_CPU_CACHE_GB``, ``DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS``,
``DYN_KVBM_DISK_CACHE_GB`` and ``DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS``. As in Dynamo, a
block-count override wins over a size in GB, a value of 0 means "no such tier", and a disk
cache without a CPU cache makes G1 offload straight to G3.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal, Self

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from kvledger.events.files import private_folder
from kvledger.events.types import Tier

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "uint8": 1}


#: ``KVLEDGER_*`` variables that are not settings: the shared data folder (read by the test
#: suite and benchmarks) and the switch that turns the compiled encoders off (read when
#: ``kvledger.events.codec`` is imported, before any settings exist).
OTHER_VARIABLES = ("KVLEDGER_SHARED_DATA", "KVLEDGER_PYTHON_ENCODERS")
OTHER_PREFIXES = ("KVLEDGER_TEST_",)
_warned: set[str] = set()
_DEVICES = re.compile(r"^[A-Za-z0-9_.:\-]+(,[A-Za-z0-9_.:\-]+)*$")


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


def _env(field: str, *aliases: str) -> Any:
    """Accept the field name (keyword use), its KVLEDGER_ variable and Dynamo's aliases."""
    return AliasChoices(field, f"KVLEDGER_{field.upper()}", *aliases)


# allow_inf_nan=False: a size of inf or nan GB would pass ge=0 (nan compares false) and only
# fail later, as an overflow deep inside a tier. validate_default and arbitrary_types_allowed
# are pydantic-settings' own defaults, so that settings built without the environment
# validate as those built from it.
_CONFIG = ConfigDict(
    extra="forbid",
    populate_by_name=True,
    frozen=True,
    allow_inf_nan=False,
    validate_default=True,
    arbitrary_types_allowed=True,
)


class Settings(BaseModel):
    """kvledger's settings. ``Settings.load`` builds them from keyword arguments and the
    environment through pydantic-settings, which is imported only when the environment holds
    a variable that a setting reads (``_from_environment``): importing it cost a third of a
    short ``kvledger simulate`` run's start-up (``python -X importtime``: 51 of 154 ms of
    ``kvledger.config``)."""

    model_config = _CONFIG

    block_size: int = Field(16, gt=0, le=1 << 16, description="tokens per KV block")
    # Model geometry, for bytes per block (turns GB into block counts, sizes tier buffers).
    num_layers: int = Field(32, gt=0)
    # an int in 1..2, not Literal[1, 2]: pydantic matches a literal strictly, so the text "1"
    # of KVLEDGER_OUTER_DIM=1 was refused as "should be 1 or 2"
    outer_dim: int = Field(2, ge=1, le=2, description="2 for separate K and V, 1 for MLA")
    inner_dim: int = Field(1024, gt=0, description="kv heads x head size")
    dtype: Literal["float32", "float16", "bfloat16", "float8_e4m3fn", "uint8"] = "bfloat16"

    g1_blocks: int = Field(4096, gt=0, description="G1 (GPU) pool size in blocks")
    g2_gb: float = Field(0.0, ge=0, validation_alias=_env("g2_gb", "DYN_KVBM_CPU_CACHE_GB"))
    g2_blocks: int = Field(
        0, ge=0, validation_alias=_env("g2_blocks", "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS")
    )
    g3_gb: float = Field(0.0, ge=0, validation_alias=_env("g3_gb", "DYN_KVBM_DISK_CACHE_GB"))
    g3_blocks: int = Field(
        0, ge=0, validation_alias=_env("g3_blocks", "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS")
    )

    eviction_policy: Literal["lru", "arc", "lineage", "multi_lru"] = "lineage"
    offload_filter: Literal["always", "seen_twice", "never"] = Field(
        "seen_twice", description="which blocks go down to G3 (G2 is write-through)"
    )
    # Mock engine: scheduler limits, and copy bandwidths (GB/s, both directions) for its costs.
    max_num_batched_tokens: int = Field(8192, gt=0, description="tokens one engine step computes")
    max_num_seqs: int = Field(256, gt=0, description="sequences one engine step runs")
    watermark: float = Field(0.01, ge=0, lt=1, description="fraction of G1 kept free to admit")
    timing_model: Literal["linear", "dynamo"] = Field(
        "linear", description="mock engine step cost: linear StepCosts or Dynamo's polynomial"
    )
    admission_rule: Literal["watermark", "whole_prompt"] = Field(
        "watermark",
        description="admit while G1 keeps the watermark free, or only when the whole uncached "
        "prompt fits in free or evictable G1 blocks (Dynamo)",
    )
    cache_partial_blocks: bool = Field(
        True, description="cache a prompt's partial last block (False: full blocks only, Dynamo)"
    )
    speedup_ratio: float = Field(
        1.0, gt=0, description="dynamo timing model: pass cost is divided by this"
    )
    g1_g2_gbps: float = Field(25.0, gt=0, description="G1<->G2 bandwidth (PCIe), GB/s")
    g2_g3_gbps: float = Field(6.0, gt=0, description="G2<->G3 bandwidth (NVMe), GB/s")
    g1_g3_gbps: float = Field(6.0, gt=0, description="G1<->G3 bandwidth (GDS), GB/s")
    allocate_wait_s: float = Field(
        10.0,
        ge=0,
        allow_inf_nan=False,
        description="how long allocate waits for copies in flight to free G1 blocks, seconds",
    )
    data_dir: Path = Path("kvledger-data")
    token_ids: Literal["keep", "live_only", "drop"] = Field(
        "keep",
        description="where prompts' token ids go: keep (the log, Redis records, ZMQ and its "
        "replay), live_only (only live ZMQ messages; nothing persisted or replayed holds them), "
        "drop (nowhere). Routers that hash tokens themselves (Dynamo's) skip blocks that come "
        "without them (docs/security.md)",
    )
    log_lookups: bool = Field(
        True,
        description="write each request's lookup, growth and end to the event log (for "
        "`kvledger whatif` and `kvledger report`); about 84 + 8 x blocks bytes per lookup",
    )
    event_log_url: str | None = Field(
        None, description="SQLAlchemy URL of the event log; default: SQLite under data_dir"
    )
    event_log_durability: Literal["batch", "fsync", "none"] = Field(
        "batch",
        description="batch: a committed batch survives the process dying; fsync: also the "
        "machine dying; none: no commit-lag bound (tests, throwaway runs)",
    )
    event_log_max_delay_s: float = Field(
        0.05,
        gt=0,
        le=60,
        allow_inf_nan=False,
        description="longest an appended event waits for its commit; with batch or fsync, "
        "appends wait once the oldest uncommitted event is this old (what a crash can lose)",
    )
    event_log_queue_size: int = Field(
        100_000,
        ge=10_000,
        description="most events appended and not yet committed before appends wait "
        "(at least one writer batch, 10,000)",
    )
    event_log_retry_s: float = Field(
        60.0,
        ge=0,
        le=86_400,
        allow_inf_nan=False,
        description="how long the log's writer keeps trying a database it lost (a dropped "
        "connection, a restarting server, a locked file) before the run stops; appends wait "
        "meanwhile, and nothing is lost or written twice",
    )
    switch_interval_s: float | None = Field(
        None,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="the interpreter's switch interval (sys.setswitchinterval) for a worker "
        "whose log and views share the process with a busy engine thread, seconds; None "
        "leaves the process's own (Python's default is 5 ms; kvledger's CLI uses 0.5 ms)",
    )
    redis_url: str | None = Field(
        None, description="shared registry; every event is also published there when set"
    )
    redis_namespace: str = Field("kvledger", min_length=1, description="key namespace in Redis")
    redis_linger_s: float = Field(
        0.0,
        ge=0,
        lt=60,
        allow_inf_nan=False,
        description="how long a batch of events may wait to fill before it is published to the "
        "shared registry, seconds (each batch costs every shard a script call)",
    )
    redis_lease_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="a worker's lease (and claim of its id) in the shared registry: its entries "
        "are purged, and its id free again, this long after its last heartbeat",
    )
    redis_shards: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="split a new namespace's index over this many shards (Redis Cluster); "
        "default: as the namespace recorded, else 1",
    )
    g4: bool = Field(
        False,
        description="share G2 with the workers of redis_namespace and read theirs over NIXL "
        "(needs G2, redis_url and the remote extra)",
    )
    g4_timeout_s: float = Field(5.0, gt=0, description="longest wait for one remote read")
    g4_interface: str | None = Field(
        None,
        description="the network devices NIXL (UCX) listens and reads on, as UCX names them "
        "(lo, eth0, mlx5_0:1; comma-separated), or 'all'; default: UCX_NET_DEVICES when set, "
        "else loopback (G4 between the workers of one machine)",
    )
    zmq_endpoint: str | None = Field(
        None,
        description="bind a vLLM-compatible ZMQ PUB socket here (e.g. tcp://127.0.0.1:5557) and "
        "publish every event as a KVEventBatch",
    )
    zmq_replay_endpoint: str | None = Field(
        None, description="bind the ZMQ replay (ROUTER) socket here; needs zmq_endpoint"
    )
    zmq_topic: str = Field("", description="topic frame of every ZMQ message")
    zmq_ring_size: int = Field(
        10_000, gt=0, description="newest ZMQ batches replayed from memory (older: from the log)"
    )
    zmq_process: bool = Field(
        False,
        description="run the ZMQ publisher in a child process fed by the log's commits through "
        "a pipe, off the engine's interpreter (kvledger worker and simulate do)",
    )
    zmq_curve_secret_key: Path | None = Field(
        None,
        description="the publisher's CurveZMQ secret certificate (zmq.auth's NAME.key_secret): "
        "the PUB and replay sockets encrypt, and a subscriber must know the public key",
    )
    zmq_curve_client_keys: Path | None = Field(
        None,
        description="a folder of the public certificates (NAME.key) of the subscribers "
        "allowed in; without it any subscriber that knows the publisher's public key is",
    )
    metrics_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="serve this worker's kvbm_* Prometheus metrics on metrics_addr:PORT "
        "(0: a free port, which start-up logs); unset: not served",
    )
    metrics_addr: str = Field(
        "127.0.0.1",
        min_length=1,
        description="the address the metrics port binds: loopback unless the operator says",
    )
    worker_id: int = Field(0, ge=0)
    dp_rank: int = Field(0, ge=0)
    chain_seed: int = Field(1337, ge=0, lt=1 << 64, description="seed of the sequence-hash chain")

    @field_validator("event_log_url")
    @classmethod
    def _log_url(cls, url: str | None) -> str | None:
        if url is None:
            return url
        if "://" not in url:
            raise ValueError(f"must be a URL such as sqlite:///path.db, got {url!r}")
        # here, not at the top: SQLAlchemy only when a log is named (simulate --no-log)
        from kvledger.events.log.schema import check_log_url

        return check_log_url(url)

    @field_validator("g4_interface")
    @classmethod
    def _interface(cls, devices: str | None) -> str | None:
        return check_net_devices(devices)

    @field_validator("zmq_curve_secret_key")
    @classmethod
    def _secret_key(cls, path: Path | None) -> Path | None:
        if path is not None and not path.is_file():
            raise ValueError(f"no such file {path} (a zmq.auth NAME.key_secret certificate)")
        return path

    @field_validator("zmq_curve_client_keys")
    @classmethod
    def _client_keys(cls, path: Path | None) -> Path | None:
        if path is not None and not path.is_dir():
            raise ValueError(f"no such folder {path} (of zmq.auth NAME.key certificates)")
        return path

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.zmq_replay_endpoint is not None and self.zmq_endpoint is None:
            raise ValueError("zmq_replay_endpoint needs zmq_endpoint")
        curve = (self.zmq_curve_secret_key, self.zmq_curve_client_keys)
        if any(key is not None for key in curve) and self.zmq_endpoint is None:
            raise ValueError("zmq_curve_secret_key and zmq_curve_client_keys need zmq_endpoint")
        if self.zmq_curve_client_keys is not None and self.zmq_curve_secret_key is None:
            raise ValueError("zmq_curve_client_keys needs zmq_curve_secret_key")
        if self.g4 and (not self.g2_capacity or self.redis_url is None):
            raise ValueError("g4 needs a G2 (g2_gb or g2_blocks) and redis_url")
        return self

    @classmethod
    def load(cls, **overrides: Any) -> Settings:
        """Build settings, turning pydantic's report into one message per bad setting.

        ``KVLEDGER_*`` variables that no setting reads get a ``SettingsWarning`` naming the
        closest setting: a misspelt variable would otherwise be ignored without a word.
        """
        for message in unknown_variables(os.environ):
            if message not in _warned:  # once per process, not once per load
                _warned.add(message)
                warnings.warn(message, SettingsWarning, stacklevel=2)
        built = _from_environment() if _reads_environment(os.environ) else cls
        try:
            return built(**overrides)
        except ValidationError as exc:
            raise SettingsError(_describe(exc)) from None

    def prepare_log_folder(self) -> None:
        """Create the data folder (0700) when the log is the default SQLite file in it, so a
        first run in an empty folder works. A log given by URL is the operator's: its folder
        must exist (a mistyped path is reported, not created)."""
        if self.event_log_url is None:
            private_folder(self.data_dir)

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

    def event_log_options(self) -> dict[str, Any]:
        """``EventLog``'s keyword arguments for these settings, beside ``log_url``."""
        return {
            "durability": self.event_log_durability,
            "max_delay": self.event_log_max_delay_s,
            "queue_size": self.event_log_queue_size,
            "retry_for": self.event_log_retry_s,
            "token_ids": self.persist_token_ids,
        }

    @property
    def persist_token_ids(self) -> bool:
        """Whether token ids may go where they outlive the moment: the event log, Redis stream
        records, ZMQ replays (the ``token_ids`` setting)."""
        return self.token_ids == "keep"

    def zmq_options(self) -> dict[str, Any]:
        """``open_publisher``'s keyword arguments for these settings, beside the endpoint,
        the log it replays from, the worker id and the metrics registry."""
        return {
            "block_size": self.block_size,
            "replay_endpoint": self.zmq_replay_endpoint,
            "topic": self.zmq_topic,
            "dp_rank": self.dp_rank,
            "ring_size": self.zmq_ring_size,
            "token_ids": self.token_ids,
            "curve_secret_key": self.zmq_curve_secret_key,
            "curve_client_keys": self.zmq_curve_client_keys,
        }

    @property
    def log_url(self) -> str:
        if self.event_log_url:
            return self.event_log_url
        return f"sqlite:///{self.data_dir / 'events.db'}"


@functools.cache
def _setting_variables() -> frozenset[str]:
    """Every environment variable that pydantic-settings reads for a setting, upper-cased (it
    matches them case-insensitively): ``KVLEDGER_<NAME>``, or each name of a field's alias
    choices (which hold the field's own name and Dynamo's variables)."""
    names: set[str] = set()
    for name, info in Settings.model_fields.items():
        alias = info.validation_alias
        if isinstance(alias, AliasChoices):
            names.update(c.upper() for c in alias.choices if isinstance(c, str))
        else:
            names.add(f"KVLEDGER_{name.upper()}")
    return frozenset(names)


def _reads_environment(environ: Mapping[str, str]) -> bool:
    """Whether building settings from ``environ`` would read any of it."""
    known = _setting_variables()
    return any(name.upper() in known for name in environ)


@functools.cache
def _from_environment() -> type[Settings]:
    """``Settings`` as a pydantic-settings ``BaseSettings``: what reads the environment (prefix
    ``KVLEDGER_``, the alias choices for Dynamo's names), with every field and validator of
    ``Settings``, whose subclass it is. Imported and built on first use: pydantic-settings is
    the settings library, loaded only when settings are built from the environment."""
    from pydantic_settings import BaseSettings, SettingsConfigDict  # lazy: see Settings

    class EnvironmentSettings(BaseSettings, Settings):
        model_config = SettingsConfigDict(env_prefix="KVLEDGER_", **_CONFIG)  # type: ignore[typeddict-item]

    EnvironmentSettings.__name__ = EnvironmentSettings.__qualname__ = "Settings"
    return EnvironmentSettings


def unknown_variables(environ: Any) -> list[str]:
    """A warning for each ``KVLEDGER_*`` name in ``environ`` that is not a setting."""
    known = [name.upper() for name in Settings.model_fields]
    out = []
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith("KVLEDGER_") or upper in OTHER_VARIABLES:
            continue
        if upper.startswith(OTHER_PREFIXES) or upper.removeprefix("KVLEDGER_") in known:
            continue
        close = difflib.get_close_matches(upper.removeprefix("KVLEDGER_"), known, n=1)
        hint = f"did you mean KVLEDGER_{close[0]}?" if close else "see the Settings table"
        out.append(f"{name} is not a kvledger setting and is ignored; {hint}")
    return out


def _env_names(field: str) -> str:
    info = Settings.model_fields.get(field)
    names = [f"KVLEDGER_{field.upper()}"]
    alias = info.validation_alias if info is not None else None
    if isinstance(alias, AliasChoices):
        names += [c for c in alias.choices if isinstance(c, str) and c.startswith("DYN_")]
    return " / ".join(names)


def _describe(exc: ValidationError) -> str:
    """One line per bad setting, naming it and its variables."""
    lines = []
    for err in exc.errors():
        loc = [str(part) for part in err["loc"]]
        field = loc[0] if loc else ""
        for name, info in Settings.model_fields.items():
            alias = info.validation_alias
            if isinstance(alias, AliasChoices) and field in alias.choices:
                field = name
        field = field.removeprefix("KVLEDGER_").lower() if field.isupper() else field
        shown = f"{field} ({_env_names(field)})" if field in Settings.model_fields else field
        value = err.get("input")
        # a validator of ours says what it got (and never a URL's password)
        got = "" if isinstance(value, dict) or err["type"] == "value_error" else f", got {value!r}"
        what = f"invalid kvledger setting {shown}" if shown else "invalid kvledger settings"
        lines.append(f"{what}: {_message(err)}{got}")
    return "\n".join(lines)


_MESSAGES = {
    "int_type": "must be a whole number (a JSON integer)",
    "string_type": "must be a string",
    "bool_type": "must be true or false",
    "extra_forbidden": "is not a key kvledger reads",
}


def _message(err: Any) -> str:
    """pydantic's message, in the words of a setting (a model validator's "Value error, "
    prefix dropped: the message is ours)."""
    value = err.get("input")
    if err["type"] == "int_type" and isinstance(value, float) and value.is_integer():
        return f"must be a whole number written as one ({int(value)})"
    if err["type"] == "missing":
        return "is required"
    return _MESSAGES.get(err["type"]) or str(err["msg"]).removeprefix("Value error, ")


class ExtraConfig(BaseModel):
    """An engine's extra config for a kvledger integration (vLLM's
    ``kv_connector_extra_config``, SGLang's storage backend extra config), checked the way
    ``Settings`` are: one rule per key, a key kvledger does not read refused (with the closest
    one it does), and a bad value refused rather than coerced (``"8e9"``, ``true`` or ``1.7``
    where a whole number belongs). Keys the engine itself reads (``engine_keys``) pass through.
    Subclasses declare the keys; ``load`` raises ``SettingsError`` with one line per bad key.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    where: ClassVar[str] = "extra config"
    """How the engine names this config, for messages (``kv_connector_extra_config``)."""
    engine_keys: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def load(cls, config: Mapping[str, Any] | None) -> Self:
        values = {k: v for k, v in (config or {}).items() if k not in cls.engine_keys}
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            raise SettingsError(cls._describe(exc)) from None

    @classmethod
    def _describe(cls, exc: ValidationError) -> str:
        known = sorted([*cls.model_fields, *cls.engine_keys])
        lines = []
        for err in exc.errors():
            key = ".".join(str(part) for part in err["loc"])
            message = _message(err)
            if err["type"] == "extra_forbidden":
                close = difflib.get_close_matches(key, known, n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"known: {', '.join(known)}"
                lines.append(f"{cls.where} {key!r} {message}; {hint}")
                continue
            value = err.get("input")
            got = (
                ""
                if isinstance(value, dict) or err["type"] == "value_error"
                else f", got {value!r}"
            )
            named = f"{cls.where} {key}" if key else cls.where
            lines.append(f"{named}: {message}{got}")
        return "\n".join(lines)
