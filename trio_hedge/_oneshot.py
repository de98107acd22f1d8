"""`hedged_stream()`: one request over a fixed plan (no state shared between requests).

It checks its arguments (before any I/O), binds each :class:`~trio_hedge.Replica` to the
request over an ``httpx.AsyncClient`` (its own, closed when the stream closes, unless one is
given), and hands a :class:`~trio_hedge.policy.StaticPlanner` to a
:class:`~trio_hedge.HedgedStream`. The long-lived :class:`~trio_hedge.Hedger` does the same
with a learning planner.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from ._source import Source
from ._stream import HedgedStream
from ._validate import check_json_body, check_request_id
from .policy._config import HedgePolicy
from .policy._static import StaticPlanner
from .sources.iterator import IteratorSource
from .sources.openai._http import HeaderNames, OpenAIChatSource, Replica
from .transport import make_client

__all__ = ["check_replicas", "hedged_stream"]


_DEFAULT_POLICY = HedgePolicy()
_KNOWN_SOURCES = frozenset({Replica, IteratorSource, OpenAIChatSource})


def check_replicas(replicas: object) -> None:
    """Raise ``TypeError``/``ValueError`` unless ``replicas`` is a non-empty sequence of
    :class:`~trio_hedge.Replica` or :class:`~trio_hedge.sources.Source` objects (checked before any
    client is created, so a bad list leaks nothing)."""
    if isinstance(replicas, (str, bytes)) or not isinstance(replicas, Sequence):
        raise TypeError("replicas must be a sequence of Replica or Source objects")
    if not replicas:
        raise ValueError("replicas must not be empty")
    names: set[str] = set()
    for r in replicas:
        # The runtime Protocol check costs microseconds: known classes skip it.
        if type(r) not in _KNOWN_SOURCES and not isinstance(r, (Replica, Source)):
            raise TypeError(f"replicas must be Replica or Source objects, not {type(r).__name__}")
        if r.name in names:
            # Reports, events and the Hedger's health are per replica name: two with one name
            # (the same URL twice, say) could not be told apart.
            raise ValueError(
                f"replica names must be unique: {r.name!r} appears twice "
                "(give each Replica its own name=)"
            )
        names.add(r.name)


def hedged_stream(
    request: Mapping[str, Any] | None,
    replicas: Sequence[Replica | Source],
    policy: HedgePolicy | None = None,
    *,
    client: httpx.AsyncClient | None = None,
    request_id: str | None = None,
    headers: HeaderNames | None = None,
) -> HedgedStream:
    """Open a first-token hedged stream.

    Args:
        request: the OpenAI chat-completions JSON body (``model``, ``messages``, …);
            ``"stream": true`` is set for you. May be ``None`` when every replica is a
            generic :class:`~trio_hedge.sources.Source`.
        replicas: where attempts go, in order: :class:`~trio_hedge.Replica` endpoints and/or
            any :class:`~trio_hedge.sources.Source` (e.g. :func:`~trio_hedge.iterator_source`).
        policy: a :class:`~trio_hedge.HedgePolicy`; default ``HedgePolicy()`` (hedge after
            1.0 s, one attempt per replica).
        client: an ``httpx.AsyncClient`` used as given (pool, proxies, TLS). Without one, the
            stream creates its own and closes it on exit (share one client when you make many
            requests).
        request_id: the id sent on every attempt; default a fresh UUID4 (servers that
            validate ``X-Request-ID`` as a UUID accept it).
        headers: which headers carry the request id and attempt number
            (:class:`~trio_hedge.sources.HeaderNames`); default ``X-Request-ID`` /
            ``X-Hedge-Attempt``.

    Returns:
        The request's stream; use it as ``async with hedged_stream(...) as stream:``.

    Raises:
        TypeError, ValueError: bad arguments (raised here, before any I/O): among them a
            ``request`` that does not encode to strict JSON (``NaN``, ``Infinity``,
            ``bytes``…) and a ``request_id`` an HTTP header cannot carry. Messages name the
            field, never the value.
    """
    policy = _DEFAULT_POLICY if policy is None else policy
    if not isinstance(policy, HedgePolicy):
        raise TypeError(f"policy must be a HedgePolicy, not {type(policy).__name__}")
    check_replicas(replicas)
    check_request_id(request_id)
    if headers is not None and not isinstance(headers, HeaderNames):
        raise TypeError(f"headers must be HeaderNames or None, not {type(headers).__name__}")
    needs_http = any(isinstance(r, Replica) for r in replicas)
    if needs_http:
        if request is None or not isinstance(request, Mapping):
            raise TypeError("request must be the chat-completions JSON body (a mapping)")
        check_json_body(request, "request")
        if client is not None and not isinstance(client, httpx.AsyncClient):
            raise TypeError(f"client must be an httpx.AsyncClient, not {type(client).__name__}")
    owned = None
    if needs_http and client is None:
        owned = client = make_client()
    sources: list[Source] = []
    for r in replicas:
        if isinstance(r, Replica):
            assert client is not None and request is not None
            sources.append(r.bind(request, client, headers=headers))
        else:
            sources.append(r)
    return HedgedStream(
        StaticPlanner(sources, policy), policy, request_id=request_id, owned_client=owned
    )
