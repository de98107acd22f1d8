"""What a fake replica's engine says about its load: the pages a
[`LoadProbe`][trio_hedge.sources.probes.LoadProbe] reads (``/metrics``, ``/slots``), settable
at any time, and misbehaving ones (garbage, huge, stalled) for tests."""

from __future__ import annotations

import json
from collections.abc import Sequence

import attrs

from ._behaviour import Chunk, Head, Stall, Step, Wait

__all__ = ["EnginePage", "llama_slots_page", "vllm_metrics_page"]

#: Prometheus' text exposition format.
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


@attrs.frozen
class EnginePage:
    """One ``GET`` page of a fake engine: ``FakeReplica.pages["/metrics"] = EnginePage(...)``.

    Attributes:
        body: the page's bytes (``str`` is encoded as UTF-8).
        status: the HTTP status. Default 200.
        content_type: default Prometheus text.
        delay: seconds before the answer (a slow endpoint). Default 0.
        stall: send the headers and then nothing, forever (a hung endpoint). Default ``False``.
    """

    body: bytes = attrs.field(default=b"", converter=_bytes)
    status: int = 200
    content_type: str = PROMETHEUS_TEXT
    delay: float = 0.0
    stall: bool = False

    def steps(self) -> list[Step]:
        """The answer, as the fake servers' steps."""
        steps: list[Step] = [Wait(self.delay)] if self.delay else []
        headers: tuple[tuple[str, str], ...] = (("content-type", self.content_type),)
        if self.stall:
            return [*steps, Head(self.status, headers), Stall(None)]
        headers += (("content-length", str(len(self.body))),)
        return [*steps, Head(self.status, headers), Chunk(self.body)]


def vllm_metrics_page(
    waiting: int = 0,
    running: int = 0,
    kv_usage: float = 0.0,
    *,
    model: str = "tiny",
    generated: int | None = None,
) -> EnginePage:
    """A vLLM ``/metrics`` page (with the help, type and histogram lines vLLM writes around
    the three gauges a probe reads); ``generated``: with the ``vllm:generation_tokens_total``
    counter at that value."""
    labels = f'engine="0",model_name="{model}"'
    counter = () if generated is None else (
        "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
        "# TYPE vllm:generation_tokens_total counter",
        f"vllm:generation_tokens_total{{{labels}}} {float(generated)}",
        f"vllm:generation_tokens_created{{{labels}}} 1.7e9",
    )  # fmt: skip
    text = "\n".join(
        (
            *counter,
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {float(running)}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} {float(waiting)}",
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{labels}}} {float(kv_usage)}",
            "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.",
            "# TYPE vllm:time_to_first_token_seconds histogram",
            f'vllm:time_to_first_token_seconds_bucket{{{labels},le="0.001"}} 0.0',
            f'vllm:time_to_first_token_seconds_bucket{{{labels},le="+Inf"}} 3.0',
            f"vllm:time_to_first_token_seconds_count{{{labels}}} 3.0",
            f"vllm:time_to_first_token_seconds_sum{{{labels}}} 0.12",
            "",
        )
    )
    return EnginePage(text)


def llama_slots_page(slots: Sequence[tuple[int, int] | None]) -> EnginePage:
    """A llama-server ``/slots`` page: per slot ``None`` (idle) or ``(n_prompt_tokens,
    n_prompt_tokens_processed)`` (processing)."""
    out = []
    for i, slot in enumerate(slots):
        prompt, processed = slot if slot is not None else (0, 0)
        out.append(
            {
                "id": i,
                "n_ctx": 8192,
                "is_processing": slot is not None,
                "n_prompt_tokens": prompt,
                "n_prompt_tokens_processed": processed,
                "next_token": [{"has_next_token": slot is not None, "n_decoded": 0}],
            }
        )
    return EnginePage(json.dumps(out), content_type="application/json; charset=utf-8")
