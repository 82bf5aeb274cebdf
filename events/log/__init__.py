"""The durable event log, by job: ``core`` (the backlog, id checks, counters and errors both
logs share, no I/O), ``rows`` (a row's columns and the INSERTs that write them), ``database``
(SQLAlchemy engine setup), ``schema`` (the tables), ``reader`` (the one chunked reader),
``checkpoints``, the threaded ``event_log`` and the asyncio ``async_log``, ``buffer`` (batches
for a producer of a few events at a time); ``replay`` folds a log into registry state and
``check`` verifies its records.

The names users need are importable from here.
"""

from kvledger.events.log.async_log import AsyncEventLog
from kvledger.events.log.buffer import AppendBuffer
from kvledger.events.log.checkpoints import Checkpoint
from kvledger.events.log.core import EventLogError
from kvledger.events.log.database import DURABILITY_MODES, Durability
from kvledger.events.log.event_log import Committed, EventLog
from kvledger.events.log.reader import LogSummary
from kvledger.events.log.schema import DEFAULT_URL, SchemaError

__all__ = [
    "DEFAULT_URL",
    "DURABILITY_MODES",
    "AppendBuffer",
    "AsyncEventLog",
    "Checkpoint",
    "Committed",
    "Durability",
    "EventLog",
    "EventLogError",
    "LogSummary",
    "SchemaError",
]
