"""The extra config each engine hands kvledger, checked as ``Settings`` are (``ExtraConfig``).

An engine passes its integration a dict from its command line (vLLM's
``kv_connector_extra_config``, SGLang's ``--hicache-storage-backend-extra-config``). Each key
has one rule here; a key kvledger does not read is refused with the closest one it does (a
misspelt key used to fall back to a default in silence), and a bad value is refused rather
than coerced (``"8e9"``, ``true``, ``1.7``). The engine's own keys in the same dict pass through.
No engine is imported here, so these models are checked without one.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from kvledger.config import SettingsError, check_net_devices
from kvledger.events.shared.keys import KeySpace
from kvledger.settings_model import ExtraConfig

__all__ = ["SglangExtraConfig", "VllmExtraConfig"]

MAX_WORKER_ID = (1 << 32) - 1
RETIRED_SETTINGS = ("g3_blocks", "offload_filter", "data_dir")
"""Keys of the G3 ``KvledgerOffloadingSpec`` once kept below G2: kvledger's G3 for vLLM is a
secondary tier of vLLM's tiering layer now (docs/vllm.md)."""


def _log_url(url: str | None) -> str | None:
    """A SQLAlchemy URL or a SQLite file's path, whose database kvledger can open here."""
    if url is None:
        return url
    # SQLAlchemy only when a log is named
    from kvledger.events.log.schema import check_log_url, database_url

    check_log_url(database_url(url))
    return url


def _folder(path: str | None) -> str | None:
    if path is not None and Path(path).exists() and not Path(path).is_dir():
        raise ValueError(f"{path} is a file, not a folder")
    return path


class VllmExtraConfig(ExtraConfig):
    """``kv_connector_extra_config`` of ``KvledgerOffloadingSpec`` (docs/vllm.md)."""

    where: ClassVar[str] = "kv_connector_extra_config"
    engine_keys: ClassVar[frozenset[str]] = frozenset(
        {
            # the OffloadingConnector's and OffloadingSpec's own
            "spec_name",
            "spec_module_path",
            "block_size",
            "blocks_per_chunk",
            "canonical_layout",
            "sync_load_budget_bytes",
            "self_describing_kv_events",
            "offload_prompt_only",
        }
    )

    cpu_bytes_to_use: int = Field(gt=0, description="G2 size in bytes")
    log_url: str | None = Field(None, description="the durable event log: a URL or a path")
    store_threshold: int = Field(
        0, ge=0, description="store a block in G2 once offered this many times (< 2: always)"
    )
    max_tracker_size: int = Field(64_000, gt=0, description="offers the store filter tracks")
    worker_id: int | None = Field(
        None, ge=0, le=MAX_WORKER_ID, description="kvledger's worker id (default: vLLM's rank)"
    )
    eviction_policy: Literal["lru", "arc", "lineage", "multi_lru"] = Field(
        "lru",
        description="G2's eviction policy: lru (ranked per request, as vLLM's), arc, lineage "
        "(leaves first), multi_lru (TinyLFU-gated)",
    )

    redis_url: str | None = Field(
        None, description="the shared registry G2's blocks are published to (needs log_url)"
    )
    redis_namespace: str | None = Field(None, description="its namespace (default: settings')")

    _url = field_validator("log_url")(_log_url)

    @model_validator(mode="after")
    def _redis_needs_log(self) -> VllmExtraConfig:
        if self.redis_url is not None and self.log_url is None:
            raise ValueError("redis_url needs log_url: the publisher catches up from the log")
        return self

    @model_validator(mode="before")
    @classmethod
    def _retired(cls, given: object) -> object:
        retired = [k for k in RETIRED_SETTINGS if isinstance(given, dict) and k in given]
        if retired:
            raise ValueError(
                f"KvledgerOffloadingSpec no longer keeps a G3 ({', '.join(retired)}): use "
                "vLLM's TieringOffloadingSpec with "
                '{"type": "KvledgerDiskTier", "module_path": '
                '"kvledger.integrations.vllm.disk_tier", "num_blocks": N, "data_dir": ...} '
                "in secondary_tiers (docs/vllm.md)"
            )
        return given

    def chunks(self, bytes_per_chunk: int) -> int:
        """G2's chunk count for chunks of ``bytes_per_chunk``; none is refused by name."""
        if bytes_per_chunk <= 0:
            return 0
        chunks = self.cpu_bytes_to_use // bytes_per_chunk
        if not chunks:
            raise SettingsError(
                f"{self.where} cpu_bytes_to_use {self.cpu_bytes_to_use} holds no chunk: one "
                f"chunk is {bytes_per_chunk} bytes"
            )
        return chunks


class SglangExtraConfig(ExtraConfig):
    """``--hicache-storage-backend-extra-config`` of ``KvledgerHiCacheStorage``
    (docs/sglang.md)."""

    where: ClassVar[str] = "hicache storage backend extra config"
    engine_keys: ClassVar[frozenset[str]] = frozenset(
        {"backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size"}
    )

    data_dir: str | None = Field(None, description="G3 files and default logs (a folder)")
    capacity_pages: int = Field(4096, gt=0, description="G3 slots")
    page_bytes: int | None = Field(None, gt=0, description="default: the host pool's page")
    log_url: str | None = Field(None, description="default: one SQLite file per rank")
    worker_id: int | None = Field(
        None, ge=0, le=MAX_WORKER_ID, description="default tp_rank + tp_size * pp_rank"
    )
    redis_url: str | None = Field(None, description="find other ranks' pages (G4)")
    redis_namespace: str = Field("kvledger-hicache", description="key namespace in Redis")
    g4: Literal["off", "shared_fs", "nixl"] | None = Field(
        None,
        description="how other ranks' pages are read: nixl (this rank's G3 served and theirs "
        "read over NIXL, their G3 files on a shared data_dir as the fallback), shared_fs "
        "(their G3 files only), off; default shared_fs with redis_url, else off",
    )
    g4_interface: str | None = Field(
        None,
        description="network devices NIXL (UCX) listens and reads on (lo, eth0, mlx5_0:1; "
        "comma-separated) or 'all'; default UCX_NET_DEVICES when set, else loopback",
    )
    g4_timeout_s: float = Field(5.0, gt=0, description="longest wait for one NIXL read")
    g4_staging_pages: int = Field(
        16, gt=0, description="host pages NIXL reads other ranks' pages into (registered)"
    )

    _url = field_validator("log_url")(_log_url)
    _dir = field_validator("data_dir")(_folder)
    _devices = field_validator("g4_interface")(check_net_devices)

    @model_validator(mode="after")
    def _g4_needs_redis(self) -> SglangExtraConfig:
        if self.g4 in ("nixl", "shared_fs") and self.redis_url is None:
            raise ValueError(
                f"g4 {self.g4!r} needs redis_url: other ranks' pages are found in the shared "
                "registry"
            )
        return self

    @property
    def g4_mode(self) -> Literal["off", "shared_fs", "nixl"]:
        """``g4`` with its default filled in: shared_fs with redis_url, else off."""
        if self.g4 is not None:
            return self.g4
        return "shared_fs" if self.redis_url is not None else "off"

    @field_validator("redis_namespace")
    @classmethod
    def _namespace(cls, namespace: str) -> str:
        KeySpace(namespace)  # raises ValueError naming what a namespace may hold
        return namespace
