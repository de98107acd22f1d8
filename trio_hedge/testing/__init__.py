"""Fake OpenAI-compatible replicas for tests, benchmarks and demos.

- [`FakeReplica`][trio_hedge.testing.FakeReplica] /
  [`fake_replicas`][trio_hedge.testing.fake_replicas]: real HTTP servers on loopback ports
  (HTTP/1.1, and HTTP/2 with prior knowledge), which record client disconnects.
- [`MockReplicas`][trio_hedge.testing.MockReplicas]: the same answers in-process over
  ``httpx.MockTransport``, for exact virtual-time tests under ``trio.testing.MockClock``.
- [`Behaviour`][trio_hedge.testing.Behaviour]: what a replica does (times in seconds);
  [`RequestRecord`][trio_hedge.testing.RequestRecord]: what it saw and did for one request.
"""

from ._behaviour import Behaviour, BehaviourSource, RequestRecord, render_response, sse_event
from ._mock import MockReplicas
from ._server import FakeReplica, fake_replicas

__all__ = [
    "Behaviour",
    "BehaviourSource",
    "FakeReplica",
    "MockReplicas",
    "RequestRecord",
    "fake_replicas",
    "render_response",
    "sse_event",
]
