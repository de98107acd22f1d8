"""trio_hedge: first-token hedged requests for streaming LLM calls, on Trio.

Send a request to a primary replica; if no first token arrives within ``hedge_after``
seconds, send it to a backup; the first stream to produce a token wins and is relayed, every
other attempt is cancelled at once.

The names most programs need are here; the rest live in documented submodules:
`trio_hedge.errors`, `trio_hedge.events`, `trio_hedge.report`,
`trio_hedge.policy`, `trio_hedge.sources`, `trio_hedge.transport`,
[`trio_hedge.instrumentation`][trio_hedge.instrumentation],
[`trio_hedge.testing`][trio_hedge.testing], [`trio_hedge.aio`][trio_hedge.aio] and
[`trio_hedge.gateway`][trio_hedge.gateway]. ``docs/layout.md`` shows how the code is laid out.
"""

from . import errors, events, policy, report, sources, transport  # noqa: F401 (public submodules)
from ._deprecated import moved_attributes
from ._oneshot import hedged_stream
from ._stream import HedgedStream
from .errors import (
    AllAttemptsFailed,
    AttemptError,
    FatalAttemptError,
    HedgeError,
    ReplicasCooling,
    RequestFailed,
    StreamInterrupted,
)
from .hedger import Hedger
from .policy import HedgePolicy, HedgerConfig, LearnedDelay
from .report import Report
from .sources import Replica, iterator_source

__version__ = "0.1.0"

__all__ = [
    "AllAttemptsFailed",
    "AttemptError",
    "FatalAttemptError",
    "HedgeError",
    "HedgePolicy",
    "HedgedStream",
    "Hedger",
    "HedgerConfig",
    "LearnedDelay",
    "Replica",
    "ReplicasCooling",
    "Report",
    "RequestFailed",
    "StreamInterrupted",
    "__version__",
    "hedged_stream",
    "iterator_source",
]

#: Names that were top-level before 0.2, and the module that holds each now. They keep
#: working for one release, with a DeprecationWarning naming the new home.
_MOVED = {
    **dict.fromkeys(
        ("AttemptInfo", "AttemptStream", "HeaderNames", "IteratorSource", "Source"),
        "trio_hedge.sources",
    ),
    **dict.fromkeys(("AttemptOutcome", "AttemptRecord"), "trio_hedge.report"),
    **dict.fromkeys(
        (
            "Backoff",
            "DelayStatistics",
            "HedgeBudget",
            "HedgerStatistics",
            "OutlierDetection",
            "Planner",
            "PrefillFit",
            "ReplicaStatistics",
            "RetryThrottle",
            "SizeClasses",
            "StaticPlanner",
            "empirical_quantile",
            "estimate_prompt_tokens",
            "km_quantile",
        ),
        "trio_hedge.policy",
    ),
    **dict.fromkeys(
        ("Delta", "EventKind", "FirstToken", "HedgeEvent", "ToolCallDelta"), "trio_hedge.events"
    ),
    "ErrorKind": "trio_hedge.errors",
    **dict.fromkeys(
        ("ShardedTransport", "cancel_safe_transport", "make_client"), "trio_hedge.transport"
    ),
}

__getattr__ = moved_attributes(__name__, _MOVED)

del moved_attributes
