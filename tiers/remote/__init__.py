"""G4: other workers' host blocks, read over NIXL and found through the shared registry.

Importing this package never imports NIXL; ``RemoteAgent`` does, when one is made (the
``remote`` extra installs it). ``nixl_unavailable_reason()`` says why it cannot be used.
"""

from kvledger.tiers.remote.agent import ReadOutcome, RemoteAgent
from kvledger.tiers.remote.directory import AgentCard, BlockEntry, Region, RemoteDirectory
from kvledger.tiers.remote.export import BlockExporter, block_checksum
from kvledger.tiers.remote.fetch import FetchPlan, FetchResult, FetchStats, RemoteFetcher
from kvledger.tiers.remote.nixl import nixl_unavailable_reason

__all__ = [
    "AgentCard",
    "BlockEntry",
    "BlockExporter",
    "FetchPlan",
    "FetchResult",
    "FetchStats",
    "ReadOutcome",
    "Region",
    "RemoteAgent",
    "RemoteDirectory",
    "RemoteFetcher",
    "block_checksum",
    "nixl_unavailable_reason",
]
