"""trio_hedge: first-token hedged requests for streaming LLM calls, on Trio.

Send a request to a primary replica; if no first token arrives within ``hedge_after``
seconds, send it to a backup; the first stream to produce a token wins and is relayed, every
other attempt is cancelled at once.
"""

from ._budget import Backoff, HedgeBudget, RetryThrottle
from ._cancel_safe import cancel_safe_transport
from ._client import ShardedTransport, make_client
from ._delay import LearnedDelay, PrefillFit, SizeClasses, empirical_quantile, km_quantile
from ._errors import (
    AllAttemptsFailed,
    AttemptError,
    ErrorKind,
    FatalAttemptError,
    HedgeError,
    ReplicasCooling,
    RequestFailed,
    StreamInterrupted,
)
from ._events import Delta, FirstToken, ToolCallDelta
from ._health import OutlierDetection
from ._hooks import EventKind, HedgeEvent
from ._plan import Planner, StaticPlanner
from ._policy import HedgePolicy
from ._report import AttemptOutcome, AttemptRecord, Report
from ._sizing import estimate_prompt_tokens
from ._stats import DelayStatistics, HedgerStatistics, ReplicaStatistics
from ._stream import HedgedStream, hedged_stream
from .hedger import Hedger, HedgerConfig
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
    "Backoff",
    "DelayStatistics",
    "Delta",
    "ErrorKind",
    "EventKind",
    "FatalAttemptError",
    "FirstToken",
    "HeaderNames",
    "HedgeBudget",
    "HedgeError",
    "HedgeEvent",
    "HedgePolicy",
    "HedgedStream",
    "Hedger",
    "HedgerConfig",
    "HedgerStatistics",
    "IteratorSource",
    "LearnedDelay",
    "OutlierDetection",
    "Planner",
    "PrefillFit",
    "Replica",
    "ReplicaStatistics",
    "ReplicasCooling",
    "Report",
    "RequestFailed",
    "RetryThrottle",
    "ShardedTransport",
    "SizeClasses",
    "Source",
    "StaticPlanner",
    "StreamInterrupted",
    "ToolCallDelta",
    "__version__",
    "cancel_safe_transport",
    "empirical_quantile",
    "estimate_prompt_tokens",
    "hedged_stream",
    "iterator_source",
    "km_quantile",
    "make_client",
]
