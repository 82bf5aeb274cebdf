"""G4: other workers' blocks (their host tier, or a G3 file mapped into memory), read over
NIXL and found through the shared registry.

Importing this package never imports NIXL; ``RemoteAgent`` does, when one is made (the
``remote`` extra installs it). ``nixl_unavailable_reason()`` says why it cannot be used.
"""

from kvledger.tiers.remote.agent import ReadOutcome, RemoteAgent
from kvledger.tiers.remote.directory import AgentCard, BlockEntry, Region, RemoteDirectory
from kvledger.tiers.remote.export import BlockExporter, ExportedSlots, HostSlots, block_checksum
from kvledger.tiers.remote.fetch import (
    Fetched,
    FetchPlan,
    FetchResult,
    FetchStats,
    RemoteFetcher,
    fetch_blocks,
)
from kvledger.tiers.remote.mapped import MappedG3
from kvledger.tiers.remote.nixl import nixl_unavailable_reason

__all__ = [
    "AgentCard",
    "BlockEntry",
    "BlockExporter",
    "ExportedSlots",
    "FetchPlan",
    "FetchResult",
    "FetchStats",
    "Fetched",
    "HostSlots",
    "MappedG3",
    "ReadOutcome",
    "Region",
    "RemoteAgent",
    "RemoteDirectory",
    "RemoteFetcher",
    "block_checksum",
    "fetch_blocks",
    "nixl_unavailable_reason",
]
