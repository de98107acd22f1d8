"""`hedged_stream()`: one request over a fixed plan (no state shared between requests).

It checks its arguments (before any I/O), binds each replica that needs the request -- a
[`Replica`][trio_hedge.sources.Replica] over an ``httpx.AsyncClient`` (its own, closed when the
stream closes, unless one is given), an [`SDKReplica`][trio_hedge.sources.openai_sdk.SDKReplica]
over its own ``AsyncOpenAI`` client -- to it, and hands a
[`StaticPlanner`][trio_hedge.policy.StaticPlanner] to a [`HedgedStream`][trio_hedge.HedgedStream].
The long-lived [`Hedger`][trio_hedge.Hedger] does the same with a learning planner.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import httpx

from ._source import Source
from ._stream import HedgedStream
from ._validate import check_request_id
from .policy._config import HedgePolicy
from .policy._static import StaticPlanner
from .sources._bindable import BindableReplica, is_bindable
from .sources.iterator import IteratorSource
from .sources.openai._http import HeaderNames, OpenAIChatSource, Replica
from .transport import make_client

__all__ = ["check_replicas", "check_request", "hedged_stream"]


_DEFAULT_POLICY = HedgePolicy()
_KNOWN_SOURCES = frozenset({IteratorSource, OpenAIChatSource})


def check_replicas(replicas: object) -> tuple[Callable[[object], None], ...]:
    """Raise ``TypeError``/``ValueError`` unless ``replicas`` is a non-empty sequence of
    replicas bound to each request ([`Replica`][trio_hedge.sources.Replica],
    [`SDKReplica`][trio_hedge.sources.openai_sdk.SDKReplica]) or
    [`Source`][trio_hedge.sources.Source] objects (checked before any client is created, so a bad
    list leaks nothing).

    Returns the request checks of the kinds of bound replica among them, one per kind
    (empty: every replica is a request-independent source)."""
    if isinstance(replicas, (str, bytes)) or not isinstance(replicas, Sequence):
        raise TypeError("replicas must be a sequence of Replica, SDKReplica or Source objects")
    if not replicas:
        raise ValueError("replicas must not be empty")
    names: set[str] = set()
    checks: dict[type, Callable[[object], None]] = {}
    apis: set[str] = set()
    for r in replicas:
        cls = type(r)
        if is_bindable(r):
            if cls not in checks:
                checks[cls] = cast(BindableReplica, r).check_request
            apis.add(getattr(cls, "api", "chat"))
            if len(apis) > 1:
                # One request body cannot be a chat, a Messages and a Responses body at once.
                raise ValueError(
                    f"replicas must all speak one API, not {' and '.join(sorted(apis))} "
                    "(Replica: chat completions, AnthropicReplica: Messages, "
                    "ResponsesReplica: Responses)"
                )
        # The runtime Protocol check costs microseconds: known classes skip it.
        elif cls not in _KNOWN_SOURCES and not isinstance(r, Source):
            raise TypeError(
                f"replicas must be Replica, SDKReplica or Source objects, not {cls.__name__}"
            )
        if r.name in names:
            # Reports, events and the Hedger's health are per replica name: two with one name
            # (the same URL twice, say) could not be told apart.
            raise ValueError(
                f"replica names must be unique: {r.name!r} appears twice "
                "(give each Replica its own name=)"
            )
        names.add(r.name)
    return tuple(checks.values())


def check_request(
    request: object, checks: tuple[Callable[[object], None], ...]
) -> Mapping[str, Any]:
    """``request``, checked by ``checks`` (from ``check_replicas``: one per kind of
    replica bound to requests). Mixing kinds needs a request every kind accepts: a
    chat-completions body whose fields are also ``create()`` arguments."""
    if request is None:
        raise TypeError(
            "request must be the chat-completions request (a JSON body for Replica, "
            "create() keyword arguments for SDKReplica), not None"
        )
    for check in checks:
        check(request)
    assert isinstance(request, Mapping)
    return request


def hedged_stream(
    request: Mapping[str, Any] | None,
    replicas: Sequence[Replica | BindableReplica | Source],
    policy: HedgePolicy | None = None,
    *,
    client: httpx.AsyncClient | None = None,
    request_id: str | None = None,
    headers: HeaderNames | None = None,
) -> HedgedStream:
    """Open a first-token hedged stream.

    Args:
        request: the chat-completions request: the JSON body (``model``, ``messages``, …)
            for [`Replica`][trio_hedge.sources.Replica]s, ``chat.completions.create()``'s keyword
            arguments for [`SDKReplica`][trio_hedge.sources.openai_sdk.SDKReplica]s (both kinds
            at once: a body whose fields are also ``create()`` arguments); ``stream=True`` is
            set for you. May be ``None`` when every replica is a generic
            [`Source`][trio_hedge.sources.Source].
        replicas: where attempts go, in order: [`Replica`][trio_hedge.sources.Replica] endpoints,
            [`SDKReplica`][trio_hedge.sources.openai_sdk.SDKReplica]s (your ``AsyncOpenAI``
            clients) and/or any [`Source`][trio_hedge.sources.Source] (e.g.
            [`iterator_source`][trio_hedge.sources.iterator_source]).
        policy: a [`HedgePolicy`][trio_hedge.HedgePolicy]; default ``HedgePolicy()`` (hedge after
            1.0 s, one attempt per replica; repeats on one replica back off, and wait for
            its ``Retry-After`` up to 10 s).
        client: an ``httpx.AsyncClient`` for the [`Replica`][trio_hedge.sources.Replica]s, used as
            given (pool, proxies, TLS). Without one, the stream creates its own (only if some
            replica is a ``Replica``) and closes it on exit (share one client when you make
            many requests).
        request_id: the id sent on every attempt; default a fresh UUID4 (servers that
            validate ``X-Request-ID`` as a UUID accept it).
        headers: which headers carry the request id and attempt number
            ([`HeaderNames`][trio_hedge.sources.HeaderNames]); default ``X-Request-ID`` /
            ``X-Hedge-Attempt``.

    Returns:
        The request's stream; use it as ``async with hedged_stream(...) as stream:``.

    Raises:
        TypeError, ValueError: bad arguments (raised here, before any I/O): among them a
            ``request`` that does not encode to strict JSON (``NaN``, ``Infinity``,
            ``bytes``…) for a ``Replica``, one ``create()`` cannot stream for an
            ``SDKReplica`` (see
            [`check_request`][trio_hedge.sources.openai_sdk.SDKReplica.check_request]), and a
            ``request_id`` an HTTP header cannot carry. Messages name the field, never the value.
    """
    policy = _DEFAULT_POLICY if policy is None else policy
    if not isinstance(policy, HedgePolicy):
        raise TypeError(f"policy must be a HedgePolicy, not {type(policy).__name__}")
    checks = check_replicas(replicas)
    check_request_id(request_id)
    if headers is not None and not isinstance(headers, HeaderNames):
        raise TypeError(f"headers must be HeaderNames or None, not {type(headers).__name__}")
    # The id is known before the plan: the back-off's jitter is drawn from it.
    request_id = request_id or str(uuid.uuid4())
    if not checks:  # every replica is a source already
        sources = cast("list[Source]", list(replicas))
        planner = StaticPlanner(sources, policy, request_id=request_id)
        return HedgedStream(planner, policy, request_id=request_id)
    checked = check_request(request, checks)
    bindable = [cast(BindableReplica, r) if is_bindable(r) else None for r in replicas]
    needs_http = any(b is not None and b.needs_http_client for b in bindable)
    if needs_http and client is not None and not isinstance(client, httpx.AsyncClient):
        raise TypeError(f"client must be an httpx.AsyncClient, not {type(client).__name__}")
    owned = None
    if needs_http and client is None:
        owned = client = make_client()
    sources = []
    for r, b in zip(replicas, bindable, strict=True):
        if b is None:
            sources.append(cast(Source, r))
        else:
            http = client if b.needs_http_client else None
            sources.append(b.bind(checked, http, headers=headers))
    return HedgedStream(
        StaticPlanner(sources, policy, request_id=request_id),
        policy,
        request_id=request_id,
        owned_client=owned,
    )
