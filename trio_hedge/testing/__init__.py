"""Fake OpenAI-compatible replicas for tests, benchmarks and demos.

- :class:`FakeReplica` / :func:`fake_replicas`: real HTTP servers on loopback ports
  (HTTP/1.1, and HTTP/2 with prior knowledge), which record client disconnects.
- :class:`MockReplicas`: the same answers in-process over ``httpx.MockTransport``, for exact
  virtual-time tests under ``trio.testing.MockClock``.
- :class:`Behaviour`: what a replica does (times in seconds); :class:`RequestRecord`: what it
  saw and did for one request.
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
