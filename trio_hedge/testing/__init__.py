"""Fake OpenAI-compatible replicas for tests, benchmarks and demos.

- [`FakeReplica`][trio_hedge.testing.FakeReplica] /
  [`fake_replicas`][trio_hedge.testing.fake_replicas]: real HTTP servers on loopback ports
  (HTTP/1.1, and HTTP/2 with prior knowledge), which record client disconnects.
- [`MockReplicas`][trio_hedge.testing.MockReplicas]: the same answers in-process over
  ``httpx.MockTransport``, for exact virtual-time tests under ``trio.testing.MockClock``.
- [`EnginePage`][trio_hedge.testing.EnginePage],
  [`vllm_metrics_page`][trio_hedge.testing.vllm_metrics_page],
  [`llama_slots_page`][trio_hedge.testing.llama_slots_page]: an engine's load pages for a
  ``FakeReplica`` (what a load probe reads).
- [`Behaviour`][trio_hedge.testing.Behaviour]: what a replica does (times in seconds);
  [`RequestRecord`][trio_hedge.testing.RequestRecord]: what it saw and did for one request.
"""

from ._behaviour import Behaviour, BehaviourSource, RequestRecord, render_response, sse_event
from ._engine import EnginePage, llama_slots_page, vllm_metrics_page
from ._mock import MockReplicas
from ._server import FakeReplica, fake_replicas

__all__ = [
    "Behaviour",
    "BehaviourSource",
    "EnginePage",
    "FakeReplica",
    "MockReplicas",
    "RequestRecord",
    "fake_replicas",
    "llama_slots_page",
    "render_response",
    "sse_event",
    "vllm_metrics_page",
]
