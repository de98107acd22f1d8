"""Load probes: what an inference engine says about its own queue.

A [`Hedger`][trio_hedge.Hedger] sees only its own traffic. An engine shared with other tenants
publishes what it is doing for all of them; a [`LoadProbe`][trio_hedge.sources.probes.LoadProbe]
reads it (one poller per replica per Hedger, or per
[`LoadMonitor`][trio_hedge.hedger.LoadMonitor] for many Hedgers; never one per request) into a
[`LoadReading`][trio_hedge.sources.probes.LoadReading]:

* **vLLM** -- ``GET /metrics``: ``vllm:num_requests_waiting``, ``vllm:num_requests_running``,
  ``vllm:kv_cache_usage_perc`` (``vllm:gpu_cache_usage_perc`` before 0.10). It does not say how
  many prompt tokens a running prefill has left: a replica prefilling another tenant's long
  prompt shows ``running = 1``, like one decoding (``../shared/engine2/README.md``).
* **llama.cpp** (``llama-server``) -- ``GET /slots`` (on by default): per slot
  ``is_processing``, ``n_prompt_tokens`` and ``n_prompt_tokens_processed``, so the prompt
  tokens still to prefill; or ``GET /metrics`` (``--metrics``): ``llamacpp:requests_processing``,
  ``llamacpp:requests_deferred``.
* **SGLang** -- ``GET /metrics`` (``--enable-metrics``): ``num_running_reqs``,
  ``num_queue_reqs``, ``token_usage`` under the ``sglang:`` or the ``sglang_`` prefix; or
  ``GET /v1/loads`` (``path="/v1/loads"``), its JSON load report, one object per
  data-parallel rank (``num_running_reqs``, ``num_waiting_reqs``, ``token_usage``, and in
  newer versions ``num_waiting_uncached_tokens``: the prompt tokens waiting for prefill;
  ``python/sglang/srt/entrypoints/v1_loads.py`` in sgl-project/sglang).
* **TGI** -- ``GET /metrics``: ``tgi_queue_size``, ``tgi_batch_current_size``.

Prometheus text is parsed by ``prometheus_client``'s parser (the ``probes`` extra), after the
lines of the wanted metrics are picked out: vLLM's page is tens of kilobytes of histograms, and
the parser took ~49 ms for a 58 KB page of them against ~1 ms for the picked lines (shared
2-core machine), every poll, for three numbers. The body is read
at most ``max_body`` bytes; anything else (a status other than 200, a timeout, a body too
large, text that does not parse, a page without the metrics) is a failed poll, and a failed or
stale probe is never evidence: the Hedger falls back to what it sees itself (fail open).
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Literal

import attrs
import httpx

from .._validate import integer, number

__all__ = [
    "ENGINES",
    "LoadProbe",
    "LoadReading",
    "ProbeError",
    "parse_llama_slots",
    "parse_metrics",
    "parse_server_load",
    "parse_sglang_loads",
    "read_load",
]

#: The engines a probe knows, and the path each is read at by default.
ENGINES: dict[str, str] = {
    "vllm": "/metrics",
    "llama.cpp": "/slots",
    "sglang": "/metrics",
    "tgi": "/metrics",
}
Engine = Literal["vllm", "llama.cpp", "sglang", "tgi"]

#: Seconds after this Hedger cancelled an attempt still without a first token during which a
#: llama-server is not polled: it notices a cancelled request during prefill only after 1 s in
#: which no result for any request reached the server, and a poll every 0.25 s kept a
#: cancelled 7,800-token prefill running to its end (11.6 s instead of 2.0 s;
#: ``../shared/engine2/README.md``). 1 s plus a margin for the poll in flight at the cancel.
LLAMA_CPP_CANCEL_QUIET = 1.2


class ProbeError(Exception):
    """A poll that gave no reading: a bad status, a body too large, text that does not parse
    or lacks the engine's metrics. The message names what, never a header or key."""


@attrs.frozen
class LoadReading:
    """What one poll of an engine said (counts of requests, tokens; no times).

    Attributes:
        engine: the engine it was read from (``"vllm"``, ``"llama.cpp"``, ``"sglang"``,
            ``"tgi"``, or your own reader's name).
        waiting: requests the engine holds but has not started (vLLM's waiting, llama.cpp's
            deferred, SGLang's queue, TGI's queue size).
        running: requests it is processing (prefill or decode).
        queued_tokens: prompt tokens still to prefill before a new request's prefill starts,
            when the engine says (llama.cpp's slots); ``None`` when it does not.
        kv_usage: the KV cache's used fraction (0 to 1), when the engine says; ``None``
            otherwise.
        slots: the engine's parallel slots (llama.cpp), when known.
        generated: the output tokens the engine has generated since it started (a counter:
            vLLM's ``vllm:generation_tokens_total``), when it says. vLLM refreshes its gauges
            only after each engine step, and a decode step takes tens of milliseconds: a
            count that has not moved between two polls while requests run says the engine
            is inside one long step, a prefill (`ProbeState.stalled_for`).
        in_flight: the requests the server's HTTP front holds, counted as they arrive (vLLM's
            ``GET /load`` with ``--enable-server-load-tracking``: ``LoadProbe.load_path``),
            when read. The engine's gauges show a request only once a step on it has ended,
            so during the first step of another tenant's long prefill only this count shows
            it.

    Raises:
        TypeError, ValueError: a count that is not an int >= 0, a ``kv_usage`` outside 0..1.
    """

    engine: str = attrs.field(validator=attrs.validators.instance_of(str))
    waiting: int = attrs.field(default=0, validator=integer(0))
    running: int = attrs.field(default=0, validator=integer(0))
    queued_tokens: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(integer(0))
    )
    kv_usage: float | None = attrs.field(
        default=None, validator=attrs.validators.optional(number(0.0))
    )
    slots: int | None = attrs.field(default=None, validator=attrs.validators.optional(integer(1)))
    generated: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(integer(0))
    )
    in_flight: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(integer(0))
    )

    def __attrs_post_init__(self) -> None:
        if self.kv_usage is not None and self.kv_usage > 1.0:
            raise ValueError("kv_usage must be <= 1")


Reader = Callable[[], Awaitable[LoadReading]]


def _engine(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value not in ENGINES:
        raise ValueError(f"{attribute.name} must be one of {sorted(ENGINES)}")


def _path(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        raise TypeError(f"{attribute.name} must be a str or None")
    if not value.startswith("/") or any(not "!" <= c <= "~" for c in value):
        raise ValueError(f"{attribute.name} must be a URL path starting with '/'")


def _reader(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"{attribute.name} must be an async callable or None")


@attrs.frozen
class LoadProbe:
    """How a replica's engine is read, how often, and how far a reading is trusted. Durations
    in seconds.

    Give it as ``Replica(..., probe="vllm")`` (or a ``LoadProbe``), or for any replica or
    [`Source`][trio_hedge.sources.Source] by name: ``Hedger(..., probes={"a": LoadProbe(...)})``.
    Probes run only inside ``async with Hedger(...)`` (the Hedger's own nursery, one poller
    per replica), or ``async with LoadMonitor(...)`` for the Hedgers given it; a Hedger used
    without either decides from its own view, as without probes.

    Attributes:
        engine: ``"vllm"``, ``"llama.cpp"``, ``"sglang"`` or ``"tgi"`` (what the page says, and
            the default ``path`` and ``cancel_quiet``).
        path: the path read, under the server's root (the replica's ``base_url`` without a
            trailing ``/v1``). Default by engine: ``/slots`` for llama.cpp (``/metrics`` also
            works, with ``--metrics``), ``/metrics`` for the others (SGLang's JSON
            ``/v1/loads`` also works). A path ending in ``/slots`` is read as llama-server's
            slots, one ending in ``/v1/loads`` as SGLang's load report, any other as a
            Prometheus page of ``engine``.
        interval: the least time between two polls' starts. Default 0.25 (llm-d's endpoint
            picker scrapes every 0.05).
        max_age: a reading older than this is stale and not used (the Hedger's own view is).
            Default 1.0.
        timeout: one poll's limit; beyond it the poll failed. Default 0.5.
        max_body: the most bytes of a page read; a larger page is a failed poll (a bounded
            read: a misbehaving endpoint cannot make the Hedger hold more). Default 1 MiB.
        cancel_quiet: after this Hedger cancelled an attempt on the replica that had no first
            token (its prefill may still run), no poll starts for this long. ``None`` (the
            default): 1.2 for llama.cpp (see ``LLAMA_CPP_CANCEL_QUIET``), 0 for the others
            (vLLM notices a cancel at its next engine step whatever is polled).
        prefill_rate: prompt tokens per second the engine prefills, used for queued tokens
            until the Hedger has fitted its own prefill model (``HedgerConfig``'s learned
            delay). Default 1000 (llama-server on 2 CPU cores: ~1,350 falling to ~650).
        queued_request_seconds: what each waiting request adds to a new one's predicted TTFT
            when the engine gives no token counts. Default 0.25.
        kv_limit: a replica whose KV cache is at least this full is saturated: no backup goes
            to it, and none goes at all when every probed replica is. Default 0.95.
        load_path: a second path read at each poll for ``LoadReading.in_flight``, when the
            server has one: ``"/load"`` on vLLM started with ``--enable-server-load-tracking``
            (its ``{"server_load": N}``); a poll fails if it fails. Default ``None``.
        max_stall: the longest engine step believed (``LoadReading.generated`` standing
            still while requests run); a longer stall is no evidence (vLLM's gauges freeze
            when every running request was aborted, vllm-project/vllm#22545). Default 10.
        reader: an async callable returning a [`LoadReading`][trio_hedge.sources.probes.LoadReading]
            instead of the HTTP read (a Source that is not a ``Replica``, a simulation, a
            test); ``engine`` still sets the defaults. Default ``None``.

    Raises:
        TypeError, ValueError: a bad field (the message names it).
    """

    engine: Engine = attrs.field(validator=_engine)
    path: str | None = attrs.field(default=None, validator=_path, kw_only=True)
    interval: float = attrs.field(default=0.25, validator=number(0.0, open_lo=True), kw_only=True)
    max_age: float = attrs.field(default=1.0, validator=number(0.0, open_lo=True), kw_only=True)
    timeout: float = attrs.field(default=0.5, validator=number(0.0, open_lo=True), kw_only=True)
    max_body: int = attrs.field(default=1 << 20, validator=integer(1), kw_only=True)
    cancel_quiet: float | None = attrs.field(
        default=None, validator=attrs.validators.optional(number(0.0)), kw_only=True
    )
    prefill_rate: float = attrs.field(
        default=1000.0, validator=number(0.0, open_lo=True), kw_only=True
    )
    queued_request_seconds: float = attrs.field(default=0.25, validator=number(0.0), kw_only=True)
    kv_limit: float = attrs.field(default=0.95, validator=number(0.0, open_lo=True), kw_only=True)
    max_stall: float = attrs.field(default=10.0, validator=number(0.0, open_lo=True), kw_only=True)
    load_path: str | None = attrs.field(default=None, validator=_path, kw_only=True)
    reader: Reader | None = attrs.field(
        default=None, validator=_reader, kw_only=True, eq=False, repr=False
    )

    @property
    def probe_path(self) -> str:
        """The path read: ``path``, else the engine's default."""
        return self.path or ENGINES[self.engine]

    @property
    def quiet(self) -> float:
        """``cancel_quiet``, else the engine's default."""
        if self.cancel_quiet is not None:
            return self.cancel_quiet
        return LLAMA_CPP_CANCEL_QUIET if self.engine == "llama.cpp" else 0.0


def as_probe(value: object, field: str) -> LoadProbe | None:
    """``value`` as a `LoadProbe`: an engine name makes one with its defaults."""
    if value is None or isinstance(value, LoadProbe):
        return value
    if isinstance(value, str):
        if value not in ENGINES:
            raise ValueError(f"{field} must be one of {sorted(ENGINES)}, a LoadProbe or None")
        return LoadProbe(value)  # type: ignore[arg-type]
    raise TypeError(f"{field} must be an engine name, a LoadProbe or None")


# -- parsing -------------------------------------------------------------------------------------

#: The metrics read per engine: (waiting, running, KV usage) names, first found wins.
_METRICS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "vllm": (
        ("vllm:num_requests_waiting",),
        ("vllm:num_requests_running",),
        ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    ),
    "llama.cpp": (("llamacpp:requests_deferred",), ("llamacpp:requests_processing",), ()),
    "sglang": (
        ("sglang:num_queue_reqs", "sglang_num_queue_reqs"),
        ("sglang:num_running_reqs", "sglang_num_running_reqs"),
        ("sglang:token_usage", "sglang_token_usage"),
    ),
    "tgi": (("tgi_queue_size",), ("tgi_batch_current_size",), ()),
}
#: The generated-tokens counter per engine, where it has one (``LoadReading.generated``).
_GENERATED: dict[str, str] = {"vllm": "vllm:generation_tokens_total"}


def _wanted_lines(text: str, names: frozenset[str]) -> str:
    """The sample lines of ``names`` only (comments and every other metric dropped): the
    parser then reads a few lines, not a page of histograms."""
    kept = []
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        end = len(line)
        for sep in ("{", " "):
            at = line.find(sep)
            if 0 <= at < end:
                end = at
        if line[:end] in names:
            kept.append(line)
    return "\n".join(kept) + "\n"


def parse_metrics(engine: str, text: str) -> LoadReading:
    """A reading from a Prometheus text page (``/metrics``) of ``engine``: each count summed
    over its label sets (one per model or engine core), the KV usage their maximum.

    Raises:
        ProbeError: the page does not parse, or has none of the engine's request counts.
        ValueError: an engine without a Prometheus page here.
    """
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError as exc:  # pragma: no cover - the extra is installed in the tests
        raise ProbeError("reading /metrics needs prometheus-client (trio-hedge[probes])") from exc
    if engine not in _METRICS:
        raise ValueError(f"engine must be one of {sorted(_METRICS)}")
    waiting_names, running_names, kv_names = _METRICS[engine]
    generated_name = _GENERATED.get(engine, "")
    names = frozenset((*waiting_names, *running_names, *kv_names, generated_name)) - {""}
    values: dict[str, float] = {}
    kv: float | None = None
    try:
        for family in text_string_to_metric_families(_wanted_lines(text, names)):
            for sample in family.samples:
                if sample.name not in names or not math.isfinite(sample.value):
                    continue
                if sample.name in kv_names:
                    kv = sample.value if kv is None else max(kv, sample.value)
                else:
                    values[sample.name] = values.get(sample.name, 0.0) + sample.value
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise ProbeError(f"the {engine} metrics page does not parse") from exc

    def first(candidates: Iterable[str]) -> float | None:
        for name in candidates:
            if name in values:
                return values[name]
        return None

    waiting, running = first(waiting_names), first(running_names)
    if waiting is None and running is None:
        raise ProbeError(f"the page has none of {engine}'s request counts")
    if kv is not None:
        kv = min(max(kv, 0.0), 1.0)
    generated = values.get(generated_name)
    return LoadReading(
        engine=engine,
        waiting=max(0, round(waiting or 0.0)),
        running=max(0, round(running or 0.0)),
        kv_usage=kv,
        generated=None if generated is None else max(0, round(generated)),
    )


def _count(slot: dict[str, Any], key: str) -> int:
    value = slot.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int):
        return 0
    return max(value, 0)


def parse_llama_slots(body: bytes | str) -> LoadReading:
    """A reading from llama-server's ``GET /slots`` (a JSON list, one object per slot):
    ``running`` the slots processing, ``queued_tokens`` their prompt tokens not yet processed.

    Raises:
        ProbeError: not a JSON list of slot objects.
    """
    try:
        slots = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProbeError("the /slots page is not JSON") from exc
    if not isinstance(slots, list) or not slots or not all(isinstance(s, dict) for s in slots):
        raise ProbeError("the /slots page is not a list of slots")
    running = queued = 0
    for slot in slots:
        busy = slot.get("is_processing")
        if busy is None:  # older llama-server: "state" 0 is idle
            busy = slot.get("state", 0) != 0
        if busy is not True and busy is not False:
            busy = bool(busy)
        if busy:
            running += 1
            left = _count(slot, "n_prompt_tokens") - _count(slot, "n_prompt_tokens_processed")
            queued += max(left, 0)
    return LoadReading(engine="llama.cpp", running=running, queued_tokens=queued, slots=len(slots))


def _sglang_count(rank: dict[str, Any], key: str) -> int | None:
    """A rank's count: ``None`` when absent, else an int >= 0 (anything else is no reading)."""
    if key not in rank or rank[key] is None:
        return None
    value = rank[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ProbeError(f"the /v1/loads page has a bad {key}")
    return value


def parse_sglang_loads(body: bytes | str) -> LoadReading:
    """A reading from SGLang's ``GET /v1/loads`` (a JSON object whose ``"loads"`` list has one
    object per data-parallel rank): ``running`` and ``waiting`` their ``num_running_reqs`` and
    ``num_waiting_reqs`` summed, ``queued_tokens`` their ``num_waiting_uncached_tokens``
    summed when every rank gives it (newer SGLang; ``None`` otherwise), ``kv_usage`` the
    fullest rank's ``token_usage`` (clamped to 0..1). Other fields are ignored.

    Raises:
        ProbeError: not JSON, no non-empty ``"loads"`` list of objects, a rank with neither
            request count, a count that is not an int >= 0 or a ``token_usage`` that is not a
            finite number: anything unexpected is no reading (fail open).
    """
    try:
        page = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProbeError("the /v1/loads page is not JSON") from exc
    ranks = page.get("loads") if isinstance(page, dict) else None
    if not isinstance(ranks, list) or not ranks or not all(isinstance(r, dict) for r in ranks):
        raise ProbeError("the /v1/loads page has no list of loads")
    running = waiting = 0
    queued: int | None = 0
    kv: float | None = None
    for rank in ranks:
        ran = _sglang_count(rank, "num_running_reqs")
        wait = _sglang_count(rank, "num_waiting_reqs")
        if ran is None and wait is None:
            raise ProbeError("a rank of the /v1/loads page has no request counts")
        running += ran or 0
        waiting += wait or 0
        tokens = _sglang_count(rank, "num_waiting_uncached_tokens")
        queued = None if tokens is None or queued is None else queued + tokens
        usage = rank.get("token_usage")
        if usage is not None:
            if isinstance(usage, bool) or not isinstance(usage, (int, float)):
                raise ProbeError("the /v1/loads page has a bad token_usage")
            if not math.isfinite(usage):
                raise ProbeError("the /v1/loads page has a bad token_usage")
            usage = min(max(float(usage), 0.0), 1.0)
            kv = usage if kv is None else max(kv, usage)
    return LoadReading(
        engine="sglang", waiting=waiting, running=running, queued_tokens=queued, kv_usage=kv
    )


def probe_root(base_url: str) -> str:
    """The server's root a probe path is under: ``base_url`` without a trailing ``/v1``."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


async def read_load(
    client: httpx.AsyncClient,
    probe: LoadProbe,
    base_url: str,
    headers: dict[str, str] | None = None,
) -> LoadReading:
    """One poll over HTTP: ``GET`` the probe's path under ``base_url``'s root, at most
    ``max_body`` bytes, parsed for its engine. Not time-bounded here (the poller bounds it by
    ``timeout``).

    Raises:
        ProbeError: a status other than 200, a body over ``max_body``, a page that does not
            parse.
        httpx.HTTPError: the request failed.
    """
    path = probe.probe_path
    body = await _get(client, probe, probe_root(base_url), path, headers)
    reading = _parse(probe, path, body)
    if probe.load_path is not None:
        load = await _get(client, probe, probe_root(base_url), probe.load_path, headers)
        reading = attrs.evolve(reading, in_flight=parse_server_load(load))
    return reading


async def _get(
    client: httpx.AsyncClient,
    probe: LoadProbe,
    root: str,
    path: str,
    headers: dict[str, str] | None,
) -> bytes:
    """``GET root + path``: its body, at most ``max_body`` bytes."""
    async with client.stream("GET", root + path, headers=headers) as response:
        if response.status_code != 200:
            raise ProbeError(f"HTTP {response.status_code} from GET {path}")
        body = bytearray()
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > probe.max_body:
                raise ProbeError(f"GET {path}: page larger than {probe.max_body} bytes")
    return bytes(body)


def parse_server_load(body: bytes | str) -> int:
    """vLLM's ``GET /load`` (``{"server_load": N}``, with ``--enable-server-load-tracking``):
    the requests its HTTP front holds.

    Raises:
        ProbeError: not that JSON object, or a count that is not an int >= 0.
    """
    try:
        page = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProbeError("the /load page is not JSON") from exc
    count = page.get("server_load") if isinstance(page, dict) else None
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ProbeError("the /load page has no server_load count")
    return count


def _parse(probe: LoadProbe, path: str, body: bytes) -> LoadReading:
    bare = path.split("?", 1)[0]
    if bare.endswith("/slots"):
        return parse_llama_slots(body)
    if bare.endswith("/v1/loads"):
        return parse_sglang_loads(body)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProbeError(f"GET {path}: not UTF-8 text") from exc
    return parse_metrics(probe.engine, text)
