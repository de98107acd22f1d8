"""What a replica's engine said about its load, how far it is trusted, and when it may be
asked again (internal).

One `ProbeState` per probed replica, shared by every Hedger that reads the same poller (a
``LoadMonitor``'s, or a Hedger's own): its latest
[`LoadReading`][trio_hedge.sources.probes.LoadReading] and when it arrived, the polls and
failures (for statistics), the attempts those Hedgers started there since (the engine could
not count them yet), and ``quiet_until``, before which no poll may start -- moved by a cancel
in any of them. What each Hedger decided from it is counted in its own ``ReplicaState``.

* **Fail open**: a reading is evidence only while it is younger than ``max_age`` and the last
  poll succeeded (a failed poll drops it). Otherwise the Hedger decides from its own view,
  exactly as without probes.
* **Cancellation is not defeated**: llama-server notices a request cancelled during prefill
  only after 1 s in which no result for any request reached it, so a poll in that second keeps
  the cancelled prefill running to its end. After this Hedger cancels an attempt with no first
  token there, no poll starts for ``LoadProbe.quiet`` seconds (`ProbeState.cancelled`,
  `ProbeState.next_poll`); the Hedger's own view (the cancelled attempt counts as lingering)
  covers that gap.
* **Predicted TTFT** (`ProbeState.predicted_wait`): the prompt tokens the engine still has to
  prefill ahead of a new request, in seconds at the replica's prefill rate, plus each waiting
  request the engine gives no token count for, plus the prompts this Hedger sent there since
  the reading (smg's least-load scores queued tokens ÷ throughput the same way); a KV cache at
  ``kv_limit`` is saturated (infinite).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

from ..sources.probes import LoadProbe, LoadReading, ProbeError

__all__ = ["ProbeState"]

#: Attempts remembered as started since the last reading (a memory bound).
_SINCE = 1024


def _busy(reading: LoadReading) -> int:
    """The requests the engine has, as its gauges say, or its HTTP front when it counts more
    (``LoadReading.in_flight``: a request is in the gauges only after a step on it ended)."""
    return max(reading.running + reading.waiting, reading.in_flight or 0)


class ProbeState:
    """One probed replica's engine evidence (internal)."""

    __slots__ = (
        "consecutive_failures",
        "failures",
        "last_error",
        "polls",
        "probe",
        "progress_at",
        "quiet_until",
        "read_at",
        "reading",
        "since",
        "taken_at",
    )

    def __init__(self, probe: LoadProbe) -> None:
        self.probe = probe
        self.reading: LoadReading | None = None
        self.read_at = -math.inf
        self.taken_at = -math.inf  # when the poll that gave ``reading`` started
        self.polls = 0
        self.failures = 0
        self.consecutive_failures = 0
        #: Why the last poll failed: a ``ProbeError``'s own text (the status and the configured
        #: path, written by this library) or the error's class name, never a server's words.
        self.last_error = ""
        self.quiet_until = -math.inf
        #: When a poll last saw the engine idle or its generated-token count move.
        self.progress_at = -math.inf
        #: (started, prompt tokens, request) of attempts started here after the reading was
        #: taken (by any Hedger sharing it); ``request`` tells a request's own attempts apart
        #: (not ahead of itself): a key unique across Hedgers (`RequestPlanner`).
        self.since: deque[tuple[float, int, int]] = deque(maxlen=_SINCE)

    # -- the poller ---------------------------------------------------------------------------

    def next_poll(self, last_start: float) -> float:
        """When the next poll may start: ``interval`` after the last one started, and not
        inside the quiet window after a cancel."""
        return max(last_start + self.probe.interval, self.quiet_until)

    def observed(self, reading: LoadReading, taken_at: float, now: float) -> None:
        """A poll that started at ``taken_at`` read ``reading`` (arriving ``now``)."""
        self.polls += 1
        self.consecutive_failures = 0
        previous = self.reading
        if (
            _busy(reading) == 0
            or reading.generated is None
            or previous is None
            or previous.generated != reading.generated
        ):
            self.progress_at = taken_at  # idle, or a step ended since: no long step seen
        self.reading = reading
        self.read_at = now
        self.taken_at = taken_at
        since = self.since
        while since and since[0][0] <= taken_at:  # the engine counted these
            since.popleft()

    def failed(self, error: BaseException) -> None:
        """A poll failed: the reading is no evidence any more (fail open)."""
        self.polls += 1
        self.failures += 1
        self.consecutive_failures += 1
        self.last_error = str(error) if isinstance(error, ProbeError) else type(error).__name__
        self.reading = None

    # -- the Hedger's own traffic -------------------------------------------------------------

    def started(self, now: float, tokens: int, request: int = 0) -> None:
        self.since.append((now, tokens, request))

    def cancelled(self, now: float) -> None:
        """A Hedger cancelled an attempt here before its first token: its prefill may still
        run, and a poll now could keep it running (llama-server)."""
        quiet = self.probe.quiet
        if quiet > 0:
            self.quiet_until = max(self.quiet_until, now + quiet)

    # -- the evidence -------------------------------------------------------------------------

    def fresh(self, now: float) -> LoadReading | None:
        """The reading, if it is evidence now (younger than ``max_age``); else ``None``."""
        if self.reading is None or now - self.read_at > self.probe.max_age:
            return None
        return self.reading

    def status(self, now: float) -> str:
        """``"fresh"``, ``"stale"``, ``"failing"`` or ``"waiting"`` (no poll answered yet)."""
        if self.fresh(now) is not None:
            return "fresh"
        if self.consecutive_failures:
            return "failing"
        return "stale" if self.reading is not None else "waiting"

    def stalled_for(
        self,
        reading: LoadReading,
        now: float,
        before: float | None = None,
        own: int | None = None,
    ) -> float:
        """Seconds the engine has been inside one step, when longer than a poll interval:
        requests run and the generated-token count has not moved since ``progress_at`` (a
        decode step takes tens of milliseconds; a long one is a prefill). A lower bound of
        what a new request waits, as the age of an attempt still waiting for its first token
        is (`FleetState.predicted`); 0 when the engine gives no such count. On vLLM the
        gauges of a long prefill show ``running = 1``, like a decode, and nothing else
        (``../shared/engine2/README.md``). ``before``, ``own``: for an attempt started then,
        of ``own`` prompt tokens, a stall that began after it was sent may be its own prefill,
        so that prefill (at ``prefill_rate``) is taken off it: a short prompt's is a few
        milliseconds, and another tenant's prefill that began just before it still counts.
        A stall longer than ``LoadProbe.max_stall`` is no evidence: vLLM's gauges freeze
        when every running request was aborted (vllm-project/vllm#22545), and a frozen page
        would keep the replica out for every caller."""
        if reading.generated is None or _busy(reading) == 0:
            return 0.0
        probe = self.probe
        stalled = now - self.progress_at
        if not probe.interval < stalled <= probe.max_stall:
            return 0.0
        if before is not None and self.progress_at >= before - probe.interval:
            stalled = max(0.0, stalled - (own or 0) / probe.prefill_rate)
        return stalled

    def saturated(self, reading: LoadReading) -> bool:
        return reading.kv_usage is not None and reading.kv_usage >= self.probe.kv_limit

    def predicted_wait(
        self,
        reading: LoadReading,
        prefill_seconds: Callable[[int], float | None],
        request: int | None = None,
        before: float | None = None,
        own: int | None = None,
    ) -> float:
        """Seconds a new request waits before its prefill starts, from ``reading``:
        ``prefill_seconds(tokens)`` is the Hedger's prefill model (``None`` or 0 without one:
        ``prefill_rate`` then). ``request``: the asking request's own attempts are not ahead
        of it (a long prompt's own prefill would otherwise make its primary look queued and
        hedge it at once); ``before``: only the attempts started before then count (those
        ahead of a request started then); ``own``: that request's prompt tokens, taken off
        the engine's queued tokens once a reading taken after ``before`` counts them
        (llama-server's ``/slots`` shows a request's own prompt left to prefill). Infinite
        when the KV cache is saturated."""
        if self.saturated(reading):
            return math.inf
        probe = self.probe
        queued = reading.queued_tokens or 0
        if own and before is not None and before <= self.taken_at:
            queued = max(0, queued - own)
        tokens = queued + sum(
            t
            for at, t, by in self.since
            if (request is None or by != request) and (before is None or at < before)
        )
        seconds = reading.waiting * probe.queued_request_seconds
        if tokens:
            model = prefill_seconds(tokens)
            seconds += model if model else tokens / probe.prefill_rate
        return seconds
