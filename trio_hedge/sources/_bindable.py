"""The seam between the front doors and the replicas they bind to each request.

A *bindable replica* is a replica that becomes a [`Source`][trio_hedge.sources.Source] only
once it knows the request: [`Replica`][trio_hedge.sources.Replica] (an HTTP endpoint: the request
is the JSON body) and [`SDKReplica`][trio_hedge.sources.openai_sdk.SDKReplica] (your
``AsyncOpenAI`` client: the request is ``create()``'s keyword arguments). The front doors
([`hedged_stream`][trio_hedge.hedged_stream], [`Hedger`][trio_hedge.Hedger]) check each request with
every kind's ``check_request`` before any I/O, and ``bind`` a replica when the planner first
sends an attempt to it; anything else is a request-independent ``Source``, used as given.
The protocol is private: the two implementations are the library's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Protocol

import httpx

from .._source import Source
from .openai._http import HeaderNames

__all__ = ["BindableReplica", "is_bindable"]


class BindableReplica(Protocol):
    """A replica a front door binds to each request."""

    #: Whether ``bind`` needs the front door's ``httpx.AsyncClient`` (the front door creates
    #: one only if some replica does; otherwise it passes ``None``).
    needs_http_client: ClassVar[bool]

    @property
    def name(self) -> str: ...

    def check_request(self, request: object) -> None:
        """Raise ``TypeError``/``ValueError`` unless this kind of replica can send
        ``request`` (called once per request and kind, before any I/O; it must not depend on
        the instance)."""
        ...

    def bind(
        self,
        request: Mapping[str, Any],
        client: httpx.AsyncClient | None,
        *,
        headers: HeaderNames | None = None,
        extra_headers: Mapping[str, str] | None = None,
    ) -> Source:
        """This replica as a source for one (checked) request."""
        ...


_MEMBERS = ("needs_http_client", "check_request", "bind")
_KINDS: dict[type, bool] = {}


def is_bindable(replica: object) -> bool:
    """Whether ``replica`` is a ``BindableReplica`` (its class has the members; the
    answer is cached per class: the front doors ask for every request)."""
    cls = type(replica)
    known = _KINDS.get(cls)
    if known is None:
        known = _KINDS[cls] = all(hasattr(cls, member) for member in _MEMBERS)
    return known
