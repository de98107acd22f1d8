"""trio_hedge: first-token hedged requests for streaming LLM calls, on Trio.

Send a request to a primary replica; if no first token arrives within ``hedge_after``
seconds, send it to a backup; the first stream to produce a token wins and is relayed, every
other attempt is cancelled at once.
"""

from ._errors import (
    AllAttemptsFailed,
    AttemptError,
    ErrorKind,
    FatalAttemptError,
    HedgeError,
    RequestFailed,
    StreamInterrupted,
)
from ._events import Delta, FirstToken, ToolCallDelta
from ._plan import Planner, StaticPlanner
from ._policy import HedgePolicy
from ._report import AttemptOutcome, AttemptRecord, Report
from ._stream import HedgedStream, hedged_stream
from .sources import (
    AttemptInfo,
    AttemptStream,
    HeaderNames,
    IteratorSource,
    Replica,
    Source,
    iterator_source,
)

__version__ = "0.1.0"

__all__ = [
    "AllAttemptsFailed",
    "AttemptError",
    "AttemptInfo",
    "AttemptOutcome",
    "AttemptRecord",
    "AttemptStream",
    "Delta",
    "ErrorKind",
    "FatalAttemptError",
    "FirstToken",
    "HeaderNames",
    "HedgeError",
    "HedgePolicy",
    "HedgedStream",
    "IteratorSource",
    "Planner",
    "Replica",
    "Report",
    "RequestFailed",
    "Source",
    "StaticPlanner",
    "StreamInterrupted",
    "ToolCallDelta",
    "__version__",
    "hedged_stream",
    "iterator_source",
]
