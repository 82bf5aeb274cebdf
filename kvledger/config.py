"""Settings, from the environment (prefix ``KVLEDGER_``) or keyword arguments.

Dynamo's KVBM variables are accepted as aliases so a deployment can switch without renaming:
``DYN_KVBM_CPU_CACHE_GB``, ``DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS``,
``DYN_KVBM_DISK_CACHE_GB`` and ``DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS``. As in Dynamo, a
block-count override wins over a size in GB, a value of 0 means "no such tier", and a disk
cache without a CPU cache makes G1 offload straight to G3.
"""

from __future__ import annotations

import difflib
import os
import warnings
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

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


def _env(field: str, *aliases: str) -> Any:
    """Accept the field name (keyword use), its KVLEDGER_ variable and Dynamo's aliases."""
    return AliasChoices(field, f"KVLEDGER_{field.upper()}", *aliases)


class Settings(BaseSettings):
    # allow_inf_nan=False: a size of inf or nan GB would pass ge=0 (nan compares false) and
    # only fail later, as an overflow deep inside a tier.
    model_config = SettingsConfigDict(
        env_prefix="KVLEDGER_",
        extra="forbid",
        populate_by_name=True,
        frozen=True,
        allow_inf_nan=False,
    )

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

    eviction_policy: Literal["lru", "lineage", "multi_lru"] = "lineage"
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
    g4: bool = Field(
        False,
        description="share G2 with the workers of redis_namespace and read theirs over NIXL "
        "(needs G2, redis_url and the remote extra)",
    )
    g4_timeout_s: float = Field(5.0, gt=0, description="longest wait for one remote read")
    zmq_endpoint: str | None = Field(
        None,
        description="bind a vLLM-compatible ZMQ PUB socket here (e.g. tcp://*:5557) and publish "
        "every event as a KVEventBatch",
    )
    zmq_replay_endpoint: str | None = Field(
        None, description="bind the ZMQ replay (ROUTER) socket here; needs zmq_endpoint"
    )
    zmq_topic: str = Field("", description="topic frame of every ZMQ message")
    zmq_ring_size: int = Field(
        10_000, gt=0, description="newest ZMQ batches replayed from memory (older: from the log)"
    )
    worker_id: int = Field(0, ge=0)
    dp_rank: int = Field(0, ge=0)
    chain_seed: int = Field(1337, ge=0, lt=1 << 64, description="seed of the sequence-hash chain")

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.event_log_url is not None and "://" not in self.event_log_url:
            raise ValueError(
                f"event_log_url must be a URL such as sqlite:///path.db, got {self.event_log_url!r}"
            )
        if self.zmq_replay_endpoint is not None and self.zmq_endpoint is None:
            raise ValueError("zmq_replay_endpoint needs zmq_endpoint")
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
        try:
            return cls(**overrides)
        except ValidationError as exc:
            raise SettingsError(_describe(exc)) from None

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
        }

    def zmq_options(self) -> dict[str, Any]:
        """``open_publisher``'s keyword arguments for these settings, beside the endpoint,
        the log it replays from, the worker id and the metrics registry."""
        return {
            "block_size": self.block_size,
            "replay_endpoint": self.zmq_replay_endpoint,
            "topic": self.zmq_topic,
            "dp_rank": self.dp_rank,
            "ring_size": self.zmq_ring_size,
        }

    @property
    def log_url(self) -> str:
        if self.event_log_url:
            return self.event_log_url
        return f"sqlite:///{self.data_dir / 'events.db'}"


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


def ensure_log_folder(url: str) -> None:
    """Create the folder of a SQLite log file, so a first run in an empty folder works."""
    import sqlalchemy as sa

    parsed = sa.make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)


def _env_names(field: str) -> str:
    info = Settings.model_fields.get(field)
    names = [f"KVLEDGER_{field.upper()}"]
    alias = info.validation_alias if info is not None else None
    if isinstance(alias, AliasChoices):
        names += [c for c in alias.choices if isinstance(c, str) and c.startswith("DYN_")]
    return " / ".join(names)


def _describe(exc: ValidationError) -> str:
    lines = ["invalid kvledger settings:"]
    for err in exc.errors():
        loc = [str(part) for part in err["loc"]]
        field = loc[0] if loc else "settings"
        for name, info in Settings.model_fields.items():
            alias = info.validation_alias
            if isinstance(alias, AliasChoices) and field in alias.choices:
                field = name
        field = field.removeprefix("KVLEDGER_").lower() if field.isupper() else field
        shown = f"{field} ({_env_names(field)})" if field in Settings.model_fields else field
        value = err.get("input")
        got = "" if isinstance(value, dict) else f", got {value!r}"
        lines.append(f"  {shown}: {err['msg']}{got}")
    return "\n".join(lines)
