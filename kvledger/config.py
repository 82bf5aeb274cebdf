"""Settings, from the environment (prefix ``KVLEDGER_``) or keyword arguments.

Dynamo's KVBM variables are accepted as aliases so a deployment can switch without renaming:
``DYN_KVBM_CPU_CACHE_GB``, ``DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS``,
``DYN_KVBM_DISK_CACHE_GB`` and ``DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS``. As in Dynamo, a
block-count override wins over a size in GB, a value of 0 means "no such tier", and a disk
cache without a CPU cache makes G1 offload straight to G3.

pydantic and pydantic-settings are the settings library, loaded only where they have work to
do (``kvledger.settings_model``): when the environment holds a variable a setting reads, and
when a value is not already of its setting's type and within its bounds (text to parse, a
value to refuse with pydantic's report). Settings given as plain values by keyword, as the CLI
and the engine integrations give them, are checked here against the same rules: importing
pydantic cost a short ``kvledger simulate`` run 90 of its 190 ms of start-up
(``python -X importtime``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvledger.events.files import private_folder
from kvledger.events.types import Tier
from kvledger.settings_rules import (
    Rule,
    SettingsError,
    SettingsWarning,
    check_net_devices,
    env_names,
    setting,
    variable_names,
)

__all__ = ["Rule", "Settings", "SettingsError", "SettingsWarning", "check_net_devices"]

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "uint8": 1}


#: ``KVLEDGER_*`` variables that are not settings: the shared data folder (read by the test
#: suite and benchmarks) and the switches that turn the compiled encoders, the compiled
#: SQLite writer, the append buffer's compiled queue, the block pool's compiled loops, the
#: router index's compiled fold, the compiled chain hashes, the compiled trace reader and the
#: compiled record makers off (read by ``kvledger.events``, ``kvledger.registry`` and
#: ``kvledger.mocker.traces``, below any settings).
OTHER_VARIABLES = (
    "KVLEDGER_SHARED_DATA",
    "KVLEDGER_PYTHON_ENCODERS",
    "KVLEDGER_PYTHON_SQLITE",
    "KVLEDGER_PYTHON_POOL",
    "KVLEDGER_PYTHON_BUFFER",
    "KVLEDGER_PYTHON_INDEX",
    "KVLEDGER_PYTHON_CHAIN",
    "KVLEDGER_PYTHON_TRACE",
    "KVLEDGER_PYTHON_RECORDS",
)
OTHER_PREFIXES = ("KVLEDGER_TEST_",)
_warned: set[str] = set()


@dataclass(frozen=True)
class Settings:
    """kvledger's settings. Build them with ``Settings.load``: keyword arguments on top of the
    environment, every value checked, one message per bad setting (``SettingsError``).

    Frozen: ``replace`` gives a copy with some settings changed (checked again)."""

    block_size: int = setting(16, gt=0, le=1 << 16, description="tokens per KV block")
    # Model geometry, for bytes per block (turns GB into block counts, sizes tier buffers).
    num_layers: int = setting(32, gt=0)
    # an int in 1..2, not Literal[1, 2]: pydantic matches a literal strictly, so the text "1"
    # of KVLEDGER_OUTER_DIM=1 was refused as "should be 1 or 2"
    outer_dim: int = setting(2, ge=1, le=2, description="2 for separate K and V, 1 for MLA")
    inner_dim: int = setting(1024, gt=0, description="kv heads x head size")
    dtype: Literal["float32", "float16", "bfloat16", "float8_e4m3fn", "uint8"] = setting("bfloat16")

    g1_blocks: int = setting(4096, gt=0, description="G1 (GPU) pool size in blocks")
    g2_gb: float = setting(0.0, ge=0, aliases=("DYN_KVBM_CPU_CACHE_GB",))
    g2_blocks: int = setting(0, ge=0, aliases=("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS",))
    g3_gb: float = setting(0.0, ge=0, aliases=("DYN_KVBM_DISK_CACHE_GB",))
    g3_blocks: int = setting(0, ge=0, aliases=("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS",))

    eviction_policy: Literal["lru", "arc", "lineage", "multi_lru"] = setting("lineage")
    offload_filter: Literal["always", "seen_twice", "never"] = setting(
        "seen_twice", description="which blocks go down to G3 (G2 is write-through)"
    )
    # Mock engine: scheduler limits, and copy bandwidths (GB/s, both directions) for its costs.
    max_num_batched_tokens: int = setting(8192, gt=0, description="tokens one engine step computes")
    max_num_seqs: int = setting(256, gt=0, description="sequences one engine step runs")
    watermark: float = setting(0.01, ge=0, lt=1, description="fraction of G1 kept free to admit")
    timing_model: Literal["linear", "dynamo"] = setting(
        "linear", description="mock engine step cost: linear StepCosts or Dynamo's polynomial"
    )
    admission_rule: Literal["watermark", "whole_prompt"] = setting(
        "watermark",
        description="admit while G1 keeps the watermark free, or only when the whole uncached "
        "prompt fits in free or evictable G1 blocks (Dynamo)",
    )
    cache_partial_blocks: bool = setting(
        True, description="cache a prompt's partial last block (False: full blocks only, Dynamo)"
    )
    speedup_ratio: float = setting(
        1.0, gt=0, description="dynamo timing model: pass cost is divided by this"
    )
    g1_g2_gbps: float = setting(25.0, gt=0, description="G1<->G2 bandwidth (PCIe), GB/s")
    g2_g3_gbps: float = setting(6.0, gt=0, description="G2<->G3 bandwidth (NVMe), GB/s")
    g1_g3_gbps: float = setting(6.0, gt=0, description="G1<->G3 bandwidth (GDS), GB/s")
    allocate_wait_s: float = setting(
        10.0,
        ge=0,
        description="how long allocate waits for copies in flight to free G1 blocks, seconds",
    )
    data_dir: Path = setting(Path("kvledger-data"))
    token_ids: Literal["keep", "live_only", "drop"] = setting(
        "keep",
        description="where prompts' token ids go: keep (the log, Redis records, ZMQ and its "
        "replay), live_only (only live ZMQ messages; nothing persisted or replayed holds them), "
        "drop (nowhere). Routers that hash tokens themselves (Dynamo's) skip blocks that come "
        "without them (docs/security.md)",
    )
    log_lookups: bool = setting(
        True,
        description="write each request's lookup, growth and end to the event log (for "
        "`kvledger whatif` and `kvledger report`); about 84 + 8 x blocks bytes per lookup",
    )
    event_log_url: str | None = setting(
        None, description="SQLAlchemy URL of the event log; default: SQLite under data_dir"
    )
    event_log_durability: Literal["batch", "fsync", "none"] = setting(
        "batch",
        description="batch: a committed batch survives the process dying; fsync: also the "
        "machine dying; none: no commit-lag bound (tests, throwaway runs)",
    )
    event_log_max_delay_s: float = setting(
        0.05,
        gt=0,
        le=60,
        description="longest an appended event waits for its commit; with batch or fsync, "
        "appends wait once the oldest uncommitted event is this old (what a crash can lose)",
    )
    event_log_queue_size: int = setting(
        100_000,
        ge=10_000,
        description="most events appended and not yet committed before appends wait "
        "(at least one writer batch, 10,000)",
    )
    event_log_retry_s: float = setting(
        60.0,
        ge=0,
        le=86_400,
        description="how long the log's writer keeps trying a database it lost (a dropped "
        "connection, a restarting server, a locked file) before the run stops; appends wait "
        "meanwhile, and nothing is lost or written twice",
    )
    switch_interval_s: float | None = setting(
        None,
        gt=0,
        le=1,
        description="the interpreter's switch interval (sys.setswitchinterval) for a worker "
        "whose log and views share the process with a busy engine thread, seconds; None "
        "leaves the process's own (Python's default is 5 ms; kvledger's CLI uses 0.5 ms)",
    )
    redis_url: str | None = setting(
        None, description="shared registry; every event is also published there when set"
    )
    redis_namespace: str = setting("kvledger", min_length=1, description="key namespace in Redis")
    redis_linger_s: float = setting(
        0.0,
        ge=0,
        lt=60,
        description="how long a batch of events may wait to fill before it is published to the "
        "shared registry, seconds (each batch costs every shard a script call)",
    )
    redis_lease_s: float = setting(
        10.0,
        gt=0,
        le=3600,
        description="a worker's lease (and claim of its id) in the shared registry: its entries "
        "are purged, and its id free again, this long after its last heartbeat",
    )
    redis_shards: int | None = setting(
        None,
        ge=1,
        le=1024,
        description="split a new namespace's index over this many shards (Redis Cluster); "
        "default: as the namespace recorded, else 1",
    )
    g4: bool = setting(
        False,
        description="share G2 with the workers of redis_namespace and read theirs over NIXL "
        "(needs G2, redis_url and the remote extra)",
    )
    g4_timeout_s: float = setting(5.0, gt=0, description="longest wait for one remote read")
    g4_interface: str | None = setting(
        None,
        description="the network devices NIXL (UCX) listens and reads on, as UCX names them "
        "(lo, eth0, mlx5_0:1; comma-separated), or 'all'; default: UCX_NET_DEVICES when set, "
        "else loopback (G4 between the workers of one machine)",
    )
    zmq_endpoint: str | None = setting(
        None,
        description="bind a vLLM-compatible ZMQ PUB socket here (e.g. tcp://127.0.0.1:5557) and "
        "publish every event as a KVEventBatch",
    )
    zmq_replay_endpoint: str | None = setting(
        None, description="bind the ZMQ replay (ROUTER) socket here; needs zmq_endpoint"
    )
    zmq_topic: str = setting("", description="topic frame of every ZMQ message")
    zmq_ring_size: int = setting(
        10_000, gt=0, description="newest ZMQ batches replayed from memory (older: from the log)"
    )
    zmq_process: bool = setting(
        False,
        description="run the ZMQ publisher in a child process fed by the log's commits through "
        "a pipe, off the engine's interpreter (kvledger worker and simulate do)",
    )
    zmq_curve_secret_key: Path | None = setting(
        None,
        description="the publisher's CurveZMQ secret certificate (zmq.auth's NAME.key_secret): "
        "the PUB and replay sockets encrypt, and a subscriber must know the public key",
    )
    zmq_curve_client_keys: Path | None = setting(
        None,
        description="a folder of the public certificates (NAME.key) of the subscribers "
        "allowed in; without it any subscriber that knows the publisher's public key is",
    )
    metrics_port: int | None = setting(
        None,
        ge=0,
        le=65535,
        description="serve this worker's kvbm_* Prometheus metrics on metrics_addr:PORT "
        "(0: a free port, which start-up logs); unset: not served",
    )
    metrics_addr: str = setting(
        "127.0.0.1",
        min_length=1,
        description="the address the metrics port binds: loopback unless the operator says",
    )
    worker_id: int = setting(0, ge=0)
    dp_rank: int = setting(0, ge=0)
    chain_seed: int = setting(1337, ge=0, lt=1 << 64, description="seed of the sequence-hash chain")

    fields_set: frozenset[str] = dataclasses.field(
        default=frozenset(), init=False, compare=False, repr=False
    )
    """The settings given (by keyword or by a variable) rather than left at their default
    (``load`` and ``replace`` know; for settings built directly, those not at their default)."""

    def __post_init__(self) -> None:
        """Check every value against its type and ``Rule``. Plain values in bounds (what the
        CLI and the integrations pass) are checked here; anything else (text to parse, a
        value to refuse) goes through pydantic (``kvledger.settings_model``), which takes or
        refuses it as it takes or refuses the same value from the environment."""
        values = {name: getattr(self, name) for name in FIELD_NAMES}
        plain = _plain(values)
        if plain is None:
            from kvledger import settings_model  # pydantic only for what needs it: see module

            plain, _given = settings_model.validate(Settings, values, environment=False)
        for name, value in plain.items():
            if value is not values[name]:
                object.__setattr__(self, name, value)
        _check_fields(self)
        if not self.fields_set:
            given = {f.name for f in _FIELDS if getattr(self, f.name) != f.default}
            object.__setattr__(self, "fields_set", frozenset(given))

    @classmethod
    def load(cls, **overrides: Any) -> Settings:
        """Build settings from ``overrides`` on top of the environment.

        ``KVLEDGER_*`` variables that no setting reads get a ``SettingsWarning`` naming the
        closest setting: a misspelt variable would otherwise be ignored without a word.
        """
        for message in unknown_variables(os.environ):
            if message not in _warned:  # once per process, not once per load
                _warned.add(message)
                warnings.warn(message, SettingsWarning, stacklevel=2)
        environment = _reads_environment(os.environ)
        if environment or not overrides.keys() <= FIELD_NAMES:
            from kvledger import settings_model  # pydantic(-settings): see the module

            values, given = settings_model.validate(cls, overrides, environment=environment)
        else:
            values, given = overrides, frozenset(overrides)
        built = cls(**values)
        object.__setattr__(built, "fields_set", given)
        return built

    def replace(self, **changes: Any) -> Settings:
        """A copy with ``changes`` (checked as ``load`` checks them); they count as given."""
        if not changes.keys() <= FIELD_NAMES:
            from kvledger import settings_model

            settings_model.validate(Settings, changes, environment=False)  # raises: names it
        built = dataclasses.replace(self, **changes)
        object.__setattr__(built, "fields_set", self.fields_set | changes.keys())
        return built

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


_FIELDS = tuple(f for f in dataclasses.fields(Settings) if f.init)
FIELD_NAMES = frozenset(f.name for f in _FIELDS)
RULES: dict[str, Rule] = {f.name: f.metadata["rule"] for f in _FIELDS}


def _kind(annotation: Any) -> tuple[type, bool, tuple[str, ...]]:
    """(the type a plain value has, whether None is allowed, the choices of a Literal)."""
    optional = False
    if isinstance(annotation, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional, annotation = True, args[0]
    if typing.get_origin(annotation) is Literal:
        return str, optional, typing.get_args(annotation)
    return annotation, optional, ()


_KINDS = {
    name: _kind(hint)
    for name, hint in typing.get_type_hints(Settings).items()
    if name in FIELD_NAMES
}


def _plain(values: Mapping[str, Any]) -> dict[str, Any] | None:
    """``values`` (every setting's) when each is a plain value of its setting's type within
    its rule, ints given for floats made floats; None when any is not, for pydantic to parse
    or refuse. Never takes what pydantic would refuse."""
    out = dict(values)
    for name, value in values.items():
        kind, optional, choices = _KINDS[name]
        if value is None:
            if not optional:
                return None
            continue
        if kind is float:
            if type(value) is int and abs(value) < 1 << 53:
                value = out[name] = float(value)
            if type(value) is not float or not math.isfinite(value):
                return None
        elif kind is Path:
            if not isinstance(value, Path):
                return None
            continue
        elif type(value) is not kind:  # exact: a bool is not an int here
            return None
        if choices and value not in choices:
            return None
        if not isinstance(value, bool) and not RULES[name].allows(value):
            return None
    return out


def _check_fields(s: Settings) -> None:
    """The rules that tie a value to the machine or to other settings, with the message that
    names the setting."""
    for name, check in _FIELD_CHECKS.items():
        try:
            value = check(getattr(s, name))
        except ValueError as exc:
            raise SettingsError(
                f"invalid kvledger setting {name} ({env_names(name, RULES[name])}): {exc}"
            ) from None
        object.__setattr__(s, name, value)
    problem = _cross_check(s)
    if problem:
        raise SettingsError(f"invalid kvledger settings: {problem}")


def _log_url(url: str | None) -> str | None:
    if url is None:
        return url
    if "://" not in url:
        raise ValueError(f"must be a URL such as sqlite:///path.db, got {url!r}")
    # here, not at the top: SQLAlchemy only when a log is named (simulate --no-log)
    from kvledger.events.log.schema import check_log_url

    return check_log_url(url)


def _secret_key(path: Path | None) -> Path | None:
    if path is not None and not path.is_file():
        raise ValueError(f"no such file {path} (a zmq.auth NAME.key_secret certificate)")
    return path


def _client_keys(path: Path | None) -> Path | None:
    if path is not None and not path.is_dir():
        raise ValueError(f"no such folder {path} (of zmq.auth NAME.key certificates)")
    return path


_FIELD_CHECKS: dict[str, Callable[[Any], Any]] = {
    "event_log_url": _log_url,
    "g4_interface": check_net_devices,
    "zmq_curve_secret_key": _secret_key,
    "zmq_curve_client_keys": _client_keys,
}


def _cross_check(s: Settings) -> str | None:
    """What is wrong with a combination of settings, or None."""
    if s.zmq_replay_endpoint is not None and s.zmq_endpoint is None:
        return "zmq_replay_endpoint needs zmq_endpoint"
    curve = (s.zmq_curve_secret_key, s.zmq_curve_client_keys)
    if any(key is not None for key in curve) and s.zmq_endpoint is None:
        return "zmq_curve_secret_key and zmq_curve_client_keys need zmq_endpoint"
    if s.zmq_curve_client_keys is not None and s.zmq_curve_secret_key is None:
        return "zmq_curve_client_keys needs zmq_curve_secret_key"
    if s.g4 and (not s.g2_capacity or s.redis_url is None):
        return "g4 needs a G2 (g2_gb or g2_blocks) and redis_url"
    return None


_SETTING_VARIABLES = frozenset(
    n.upper() for name, rule in RULES.items() for n in variable_names(name, rule)
)
"""Every environment variable that pydantic-settings reads for a setting, upper-cased (it
matches them case-insensitively)."""


def _reads_environment(environ: Mapping[str, str]) -> bool:
    """Whether building settings from ``environ`` would read any of it."""
    return any(name.upper() in _SETTING_VARIABLES for name in environ)


def unknown_variables(environ: Any) -> list[str]:
    """A warning for each ``KVLEDGER_*`` name in ``environ`` that is not a setting."""
    known = [name.upper() for name in FIELD_NAMES]
    out = []
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith("KVLEDGER_") or upper in OTHER_VARIABLES:
            continue
        if upper.startswith(OTHER_PREFIXES) or upper.removeprefix("KVLEDGER_") in known:
            continue
        import difflib  # here: only a misspelt variable needs it, and it costs every start

        close = difflib.get_close_matches(upper.removeprefix("KVLEDGER_"), known, n=1)
        hint = f"did you mean KVLEDGER_{close[0]}?" if close else "see the Settings table"
        out.append(f"{name} is not a kvledger setting and is ignored; {hint}")
    return out
