"""The recovery phase's policy: [`RecoveryPolicy`][trio_hedge.policy.RecoveryPolicy] (a
recovery's first-token deadline and its hedge) and
[`ThroughputFloor`][trio_hedge.policy.ThroughputFloor] (a winner far slower than its replica's
learned rate is finished elsewhere).

Why a recovery needs its own clock. After the commit the winner can break; a recovery attempt
then goes on with the answer on another replica (``_recovery.py``). Without a deadline of its
own, a recovery on a replica that never answers waited as long as the caller's own scope
(the default ``stall_timeout`` is ``None``), while a healthy third replica was never tried; and
holding it to ``stall_timeout`` from its start called a healthy replica's prefill a stall
(issue 28). The deadline here is the recovery's first-token timeout, as the race's hedge delay
is the primary's: derived from what the fleet learned of the TTFT of that replica, model and
prompt size (a continuation's prompt is the original plus the answer so far), a few times
over (``first_token_ratio``), never below ``min_first_token`` nor above ``max_first_token``.
``stall_timeout`` keeps its meaning: silence after a first token.

Why a floor on throughput. A stream can stay alive and crawl: Bifrost users report streams at
0.8-1.6 tokens/s where healthy ones give 143-269 (maximhq/bifrost#6472). Off by default; on,
a winner whose tokens come far below what the fleet learned for its replica and model, timed
on the producer side as the stall clock is (the caller's own pauses are not the upstream's),
is finished elsewhere by the recovery machinery, bounded by ``max_recoveries``.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque

import attrs

from .._validate import fraction, integer, number, optional_instance_of

__all__ = ["RecoveryPolicy", "ThroughputFloor", "TokenRates"]


@attrs.frozen
class ThroughputFloor:
    """When a winner streaming far below its replica's learned rate is finished elsewhere.

    After the commit, the stream times its winner on the producer side (the seconds the
    caller waits on it; its own pauses excluded, as the stall clock is). When, over the last
    ``window`` seconds of that time, fewer tokens came than ``ratio`` times the rate the fleet
    learned for the winner's replica and model would give, the winner is closed and the answer
    goes on on another replica by the recovery machinery ([`ErrorKind.SLOW_STREAM`]
    [trio_hedge.errors.ErrorKind.SLOW_STREAM]; one of ``max_recoveries``). The rate of a
    (replica, model) is the median of its last winners' rates (each a whole stream after its
    commit, of at least ``min_tokens`` tokens, never one the floor cut); until it has
    ``min_samples`` of them, nothing is judged (no evidence is never a reason to cut).

    Attributes:
        window: seconds of producer-side time the rate is measured over. Default 5. A crawl
            is found within ``window`` seconds of its start (the test: a stream that slows to
            1 token/s after 10 tokens completes elsewhere, identical, within ``2 × window``).
        ratio: slow below this fraction of the learned rate. Default 0.1 (ten times slower).
        min_samples: winners' rates a (replica, model) needs before it is judged. Default 5.
        min_tokens: a winner's stream counts as a sample only with at least this many tokens
            after its commit. Default 16.

    Raises:
        TypeError, ValueError: on a bad field.
    """

    window: float = attrs.field(default=5.0, validator=number(0.0, open_lo=True))
    ratio: float = attrs.field(default=0.1, validator=fraction)
    min_samples: int = attrs.field(default=5, validator=integer(1))
    min_tokens: int = attrs.field(default=16, validator=integer(2))

    def tokens_needed(self, learned_rate: float) -> int:
        """Tokens a healthy stream gives in one ``window`` at the floor (at least 1)."""
        # (Less a hair: a rate learned as 20.00000000000007 tokens/s asks 4 tokens, not 5.)
        return max(1, math.ceil(self.ratio * learned_rate * self.window - 1e-9))


@attrs.frozen
class RecoveryPolicy:
    """How the recovery phase after the commit runs (``docs/recovery.md``). Seconds.

    Attributes:
        first_token_ratio: a recovery attempt that has given no output (content, reasoning
            or a tool-call fragment: the prefix it reproduces counts) this many times the
            TTFT the fleet expects of it is abandoned (``ErrorKind.TIMEOUT``) and the next
            recovery goes, to another replica, within ``max_recoveries``. The expected TTFT
            is the larger of the learned hedge delay (the percentile of its group's TTFTs)
            for the recovery's prompt size (the original prompt, plus the answer so far for
            a continuation) and the replica's own peak-EWMA latency over that prompt's
            predicted prefill; with a fixed ``hedge_after``, that delay. Default 3.
        min_first_token: the deadline's floor. Default 2.
        max_first_token: the deadline's ceiling, and the deadline when nothing is known
            (no learned or fixed delay, no latency seen). Default 30.
        hedge: when a recovery has no output after the hedge delay for its prompt size (the
            learned or fixed delay, the request's own ``hedge_after`` if it has one), a
            second recovery goes to another replica while the first goes on, within
            ``max_recoveries``, the hedge budget and the throttle; the first with new text
            wins. Never for a request that may not be hedged (``hedge=False``, side effects
            without an idempotency key, ``hedge_after=None``). Default ``True``.
        throughput_floor: a [`ThroughputFloor`][trio_hedge.policy.ThroughputFloor], or
            ``None`` (default: off, and the token path pays nothing for it).

    Raises:
        TypeError, ValueError: on a bad field, or ``min_first_token > max_first_token``.
    """

    first_token_ratio: float = attrs.field(default=3.0, validator=number(1.0))
    min_first_token: float = attrs.field(default=2.0, validator=number(0.0, open_lo=True))
    max_first_token: float = attrs.field(default=30.0, validator=number(0.0, open_lo=True))
    hedge: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    throughput_floor: ThroughputFloor | None = attrs.field(
        default=None, validator=optional_instance_of(ThroughputFloor)
    )

    def __attrs_post_init__(self) -> None:
        if self.min_first_token > self.max_first_token:
            raise ValueError(
                f"min_first_token ({self.min_first_token}) must be <= max_first_token "
                f"({self.max_first_token})"
            )

    def deadline(self, expected: float | None) -> float:
        """The first-token deadline of a recovery whose expected TTFT is ``expected``
        seconds (``None``: unknown, the ceiling)."""
        if expected is None or not expected > 0:
            return self.max_first_token
        return min(
            max(self.first_token_ratio * expected, self.min_first_token), self.max_first_token
        )


#: (replica, model) entries `TokenRates` keeps (a client chooses the model: bounded), and
#: rates per entry.
RATE_ENTRIES = 1024
RATES_KEPT = 32


class TokenRates:
    """The streaming rate (tokens/s, producer side) each (replica index, model) gave its last
    winners: at most `RATES_KEPT` rates per entry and `RATE_ENTRIES` entries, least recently
    written dropped first (internal; the throughput floor's reference)."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: OrderedDict[tuple[int, str], deque[float]] = OrderedDict()

    def observe(self, index: int, model: str, rate: float) -> None:
        key = (index, model)
        rates = self._entries.get(key)
        if rates is None:
            rates = self._entries[key] = deque(maxlen=RATES_KEPT)
            if len(self._entries) > RATE_ENTRIES:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(key)
        rates.append(rate)

    def rate(self, index: int, model: str, min_samples: int) -> float | None:
        """The median of the entry's rates, or ``None`` with fewer than ``min_samples``."""
        rates = self._entries.get((index, model))
        if rates is None or len(rates) < min_samples:
            return None
        ordered = sorted(rates)
        n = len(ordered)
        middle = n // 2
        return ordered[middle] if n % 2 else (ordered[middle - 1] + ordered[middle]) / 2
