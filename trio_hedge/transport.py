"""httpx clients for many concurrent streams: [`make_client`][trio_hedge.transport.make_client] (a
shared ``httpx.AsyncClient``), [`ShardedTransport`][trio_hedge.transport.ShardedTransport] (its
transport), [`cancel_safe_transport`][trio_hedge.transport.cancel_safe_transport] (HTTP/2 safe to
cancel, see ``_cancel_safe.py``) and [`shared_ssl_context`][trio_hedge.transport.shared_ssl_context]
(one SSL context for every client the library makes).

Why: httpcore 1.0.9's connection pool does work proportional to the number of connections it
holds on every request it starts or finishes (``AsyncConnectionPool.
_assign_requests_to_connections`` rescans every connection: ``is_closed()``,
``has_expired()`` -- a ``poll`` syscall per idle connection -- and, for each idle connection,
counts all connections again; then, for each queued request, filters every connection by
origin twice). Opening *n* concurrent streams through one pool therefore costs O(n²):
``benchmarks/scale.py`` measured 1,000 concurrent hedged streams through one
``httpx.AsyncClient`` (unlimited pool) at 2.5-3x the time of 1,000 raw Trio sockets doing the
same requests, growing ~2.2x per doubling of *n* (see ``docs/benchmarks.md``). httpx's default
``Limits(max_connections=100)`` is worse for streaming: a stream holds its connection while the
caller reads it, so the 101st concurrent stream waits for the pool (forever, with the
library's ``pool=None`` timeout).

The workaround: [`ShardedTransport`][trio_hedge.transport.ShardedTransport] spreads requests over
independent pools, each given at most ``per_shard`` (default 4) open responses, adding pools as
concurrency grows, so every pool's scans stay short and opening *n* streams costs O(n). A request
goes to the oldest pool with room (at low load, always the first: its connections are reused),
and a pool idle for ``keepalive_expiry`` is removed. No pool has a connection limit. All pools
share one SSL context (building one costs ~16-50 ms). Round-robin over a fixed number of pools
was not enough: with 16 pools, a second wave of 1,000 streams (reusing 1,000 idle keep-alive
connections) took 5.7 s against 0.9 s raw, as a pool's cost per event is quadratic in its
*idle* connections (the ``len([... for connection in self._connections])`` inside the loop
over connections); with at most 16 open responses per pool, 2.4 s; with 4, 1.7-1.8 s (wave 1:
1.7-1.8 s).

With HTTP/2, every pool is hardened against cancelled requests (``trio_hedge/_cancel_safe.py``):
a cancelled attempt can neither cut a write in half, corrupting a connection other streams
share, nor leave a connection open outside its pool.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import itertools
import ssl
from collections.abc import AsyncIterator
from typing import Any, cast

import httpcore
import httpx
import trio

from ._cancel_safe import WrappingBackend, cancel_safe_transport, harden

__all__ = [
    "DEFAULT_LIMITS",
    "DEFAULT_PER_SHARD",
    "ShardedTransport",
    "cancel_safe_transport",
    "http2_connections",
    "make_client",
    "shared_ssl_context",
]

DEFAULT_PER_SHARD = 4
"""Connections per pool before [`ShardedTransport`][trio_hedge.transport.ShardedTransport] adds
another pool."""
DEFAULT_LIMITS = httpx.Limits(
    max_connections=None, max_keepalive_connections=None, keepalive_expiry=5.0
)
"""Per-pool limits: no cap on connections (a stream holds one while it is read; a cap would
make extra concurrent streams wait for the pool), idle connections kept 5 s."""

# Connect fast (a dead replica must fail over quickly); never time out a read: TTFT and
# inter-token gaps are the hedge delay's and the stall timeout's business.
DEFAULT_TIMEOUT = httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None)


@functools.cache
def shared_ssl_context() -> ssl.SSLContext:
    """One SSL context for every client the library creates: building one costs ~50 ms."""
    return httpx.create_ssl_context()


class ShardedTransport(httpx.AsyncBaseTransport):
    """An ``httpx`` transport that spreads requests over independent
    ``httpx.AsyncHTTPTransport`` pools, each kept to about ``per_shard`` connections.

    Each request goes to the *first* pool (the oldest) with fewer than ``per_shard`` open
    responses; when none has room, a new pool is added. So however many streams are open,
    each pool scans at most ~``per_shard`` connections per request event, and opening *n*
    streams costs O(n), not O(n²) (see the module docstring). At low load every request goes
    to the first pool and reuses its keep-alive connections; at high load the pools fill in
    order. A pool that holds no open response for ``keepalive_expiry`` seconds (every
    connection it keeps has expired) is closed and removed, newest first, as the next
    request arrives; the first pool stays.

    Why not a rotation: with requests handed to pools in turn, after a burst a request at low
    load went to a different pool each time, whose connections had expired or been closed:
    15 sequential requests after a burst of 400 streams opened 15 connections (issue 16,
    ``tests/test_client.py``, ``benchmarks/pool_reuse.py``); and pools were never removed.

    Args:
        per_shard: connections per pool before another pool is added (>= 1).
        verify: an ``ssl.SSLContext`` shared by every pool, or ``True``/``False``; default
            the library's shared context.
        network_backend: the httpcore network backend every pool connects through (default
            httpcore's own). With ``http2=True`` the pools are made safe to cancel (see
            [`cancel_safe_transport`][trio_hedge.transport.cancel_safe_transport]); HTTP/1.1-only
            pools are left as httpx builds them.
        **kwargs: passed to each ``httpx.AsyncHTTPTransport`` (``http1``, ``http2``,
            ``limits``, ``retries``, ``local_address``, ``socket_options``…); ``limits``
            defaults to [`DEFAULT_LIMITS`][trio_hedge.transport.DEFAULT_LIMITS] (per pool);
            its ``keepalive_expiry`` (seconds; ``None``: never) is also how long a pool may
            stay idle before it is removed.
    """

    def __init__(
        self,
        per_shard: int = DEFAULT_PER_SHARD,
        *,
        verify: ssl.SSLContext | bool | None = None,
        network_backend: httpcore.AsyncNetworkBackend | None = None,
        **kwargs: Any,
    ) -> None:
        if isinstance(per_shard, bool) or not isinstance(per_shard, int) or per_shard < 1:
            raise ValueError(f"per_shard must be a positive int, not {per_shard!r}")
        if verify is None or verify is True:
            verify = shared_ssl_context()
        kwargs.setdefault("limits", DEFAULT_LIMITS)
        self._per_shard = per_shard
        self._verify = verify
        self._kwargs = kwargs
        self._network_backend = network_backend
        self._http2 = bool(kwargs.get("http2", False))
        limits = kwargs["limits"]
        self._expiry: float | None = getattr(limits, "keepalive_expiry", None)
        self._shards: list[_Shard] = []
        # Shards with room, by age (a heap of (position, tiebreak, shard)): the first has
        # the lowest position. A shard is listed at most once (``_Shard.listed``).
        self._room: list[tuple[int, int, _Shard]] = []
        self._tiebreak = itertools.count()
        self._closed = False

    @property
    def shards(self) -> int:
        """How many pools exist now."""
        return len(self._shards)

    @property
    def in_flight(self) -> int:
        """Requests sent whose response is not closed yet."""
        return sum(shard.in_flight for shard in self._shards)

    def pools(self) -> list[httpx.AsyncHTTPTransport]:
        """The shards' httpx transports (connection pools), oldest first: what
        [`http2_connections`][trio_hedge.transport.http2_connections] inspects to reset HTTP/2
        streams a cancel orphaned."""
        return [shard.transport for shard in self._shards]

    def _list(self, shard: _Shard) -> None:
        heapq.heappush(self._room, (shard.position, next(self._tiebreak), shard))
        shard.listed = True

    def _pick(self) -> _Shard:
        # O(log pools): the oldest shard with room, else a new shard.
        room, per_shard = self._room, self._per_shard
        while room:
            shard = room[0][2]
            if not shard.retired and shard.in_flight < per_shard:
                break
            heapq.heappop(room)  # retired (or full): not a candidate
            shard.listed = False
        else:
            shard = _Shard(self._new_pool(), self, len(self._shards))
            self._shards.append(shard)
            self._list(shard)
        shard.in_flight += 1
        if shard.in_flight >= per_shard:
            heapq.heappop(room)  # it is room[0]
            shard.listed = False
        return shard

    def _new_pool(self) -> httpx.AsyncHTTPTransport:
        transport = httpx.AsyncHTTPTransport(verify=self._verify, **self._kwargs)
        if self._http2 or self._network_backend is not None:
            harden(transport, self._network_backend, http2=self._http2)
        return transport

    def _release(self, shard: _Shard) -> None:
        shard.in_flight -= 1
        if shard.in_flight == 0:
            shard.idle_since = trio.current_time()
        if not shard.listed and not shard.retired:  # it was full: it has room again
            self._list(shard)

    async def _retire_idle(self) -> None:
        """Close and remove the newest pools while they have been idle for
        ``keepalive_expiry`` seconds (their connections have all expired), keeping one."""
        expiry, shards = self._expiry, self._shards
        if expiry is None:
            return
        now = trio.current_time()
        while len(shards) > 1:
            last = shards[-1]
            if last.in_flight or now - last.idle_since < expiry:
                return
            shards.pop()
            last.retired = True
            # Its connections are idle: closing them is quick, and must not be cut short.
            with (
                trio.CancelScope(shield=True, deadline=now + 1.0),
                contextlib.suppress(Exception),
            ):
                await last.transport.aclose()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._closed:
            raise RuntimeError("the transport is closed")
        shards = self._shards
        if len(shards) > 1 and not shards[-1].in_flight:
            await self._retire_idle()
        shard = self._pick()
        try:
            response = await shard.transport.handle_async_request(request)
        except BaseException:
            self._release(shard)
            raise
        assert isinstance(response.stream, httpx.AsyncByteStream)
        response.stream = _CountedStream(response.stream, shard)
        return response

    async def aclose(self) -> None:
        self._closed = True
        shards, self._shards = self._shards, []
        self._room.clear()
        for shard in shards:
            shard.retired = True
            await shard.transport.aclose()


class _Shard:
    __slots__ = ("idle_since", "in_flight", "listed", "owner", "position", "retired", "transport")

    def __init__(
        self, transport: httpx.AsyncHTTPTransport, owner: ShardedTransport, position: int
    ) -> None:
        self.transport = transport
        self.owner = owner
        self.position = position  # its index in the owner's list: lower is older
        self.in_flight = 0
        self.idle_since = trio.current_time()
        self.listed = False  # in the owner's heap of shards with room
        self.retired = False  # closed and removed


class _CountedStream(httpx.AsyncByteStream):
    """The pool's response stream, counting the shard's open responses down on close.

    Iteration is the inner stream's own (no extra generator per chunk). ``_httpcore_stream``
    mirrors httpx's ``AsyncResponseStream`` so the HTTP/2 reset in ``sources.openai_http``
    (``response.stream._stream._httpcore_stream._stream``) finds the h2 stream.
    """

    def __init__(self, inner: httpx.AsyncByteStream, shard: _Shard) -> None:
        self._inner = inner
        self._shard: _Shard | None = shard
        self._httpcore_stream = getattr(inner, "_httpcore_stream", None)

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._inner.__aiter__()

    async def aclose(self) -> None:
        shard, self._shard = self._shard, None
        if shard is not None:
            shard.owner._release(shard)
        await self._inner.aclose()


class _LeanStream(httpcore.AsyncNetworkStream):
    """httpcore's Trio stream, with a read that has no timeout (the library's: ``read=None``)
    going straight to ``receive_some``, and (``hold_heads``: an HTTP/1.1-only client) a
    request's head written with its body.

    Why: httpcore 1.0.9's ``TrioStream.read`` enters ``trio.fail_after(inf)`` and an
    exception-mapping context manager on every read, i.e. on every token of a stream: 7.5 µs
    per read here (two ``contextlib`` generators and a cancel scope), about a tenth of the
    gateway's CPU per relayed token (``benchmarks/gateway.py``, issue 20: 105 -> 93 µs per
    paced token). The errors are httpcore's own (``ReadError`` from the same trio errors);
    a read with a timeout, writes and TLS are the inner stream's.

    The head: httpcore 1.0.9's HTTP/1.1 connection writes a request's head, then its body,
    in two writes: two segments and two wake-ups of the server before it can answer (TTFT).
    Here a head (a write that ends in a blank line, the first since a read) waits for the
    next write or read: one write of head and body. As httpcore does for the head's own
    write, a failed write then leaves the answer to the read (a server that refused the
    request may have answered). Not for HTTP/2, whose writes and reads are shared by
    streams.
    """

    def __init__(self, inner: httpcore.AsyncNetworkStream, *, hold_heads: bool = False) -> None:
        self._inner = inner
        self._hold_heads = hold_heads
        self._head: bytes | None = None  # a request head not written yet
        self._head_timeout: float | None = None
        self._read_since_write = True
        # httpcore's TrioStream keeps its trio stream as ``_stream``; any other shape (a
        # different httpcore) reads through the inner stream, unchanged.
        stream = getattr(inner, "_stream", None)
        self._trio_stream = stream if isinstance(stream, trio.abc.ReceiveStream) else None

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        if self._head is not None:
            head, self._head = self._head, None
            with contextlib.suppress(httpcore.WriteError):  # httpcore's own rule for a head
                await self._inner.write(head, self._head_timeout)
        self._read_since_write = True
        stream = self._trio_stream
        if timeout is not None or stream is None:
            return await self._inner.read(max_bytes, timeout)
        try:
            data = await stream.receive_some(max_bytes)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise httpcore.ReadError(exc) from exc
        return cast("bytes", data)  # trio's socket streams give bytes (h11 takes either)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        head = self._head
        if head is not None:
            self._head = None
            buffer = head + buffer
        elif self._hold_heads and self._read_since_write and buffer.endswith(b"\r\n\r\n"):
            self._head, self._head_timeout = buffer, timeout
            self._read_since_write = False
            return
        self._read_since_write = False
        await self._inner.write(buffer, timeout)

    async def aclose(self) -> None:
        self._head = None
        await self._inner.aclose()

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> httpcore.AsyncNetworkStream:
        tls = await self._inner.start_tls(ssl_context, server_hostname, timeout)
        return _LeanStream(tls, hold_heads=self._hold_heads)

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


def _lean_http1(inner: httpcore.AsyncNetworkStream) -> _LeanStream:
    return _LeanStream(inner, hold_heads=True)


def make_client(
    *,
    per_shard: int = DEFAULT_PER_SHARD,
    http1: bool = True,
    http2: bool = False,
    limits: httpx.Limits = DEFAULT_LIMITS,
    timeout: httpx.Timeout | float | None = DEFAULT_TIMEOUT,
    **client_kwargs: Any,
) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` for many concurrent hedged streams (share one per process).

    It sends requests through a [`ShardedTransport`][trio_hedge.transport.ShardedTransport] (pools
    of about ``per_shard`` open responses each, added as needed, no connection cap), with the
    library's timeouts (connect 5 s, no read timeout, no pool timeout), over httpcore's Trio
    backend with reads that skip its per-read timeout scope when there is no read timeout
    (the token path: one read per token) and, HTTP/1.1 only, each request's head and body
    in one write (one wake-up of the server, not two, before it can answer). Use it as
    ``async with make_client() as client:`` and pass ``client=client`` to
    [`hedged_stream`][trio_hedge.hedged_stream].

    Args:
        per_shard: connections per pool before another pool is added (see the module
            docstring for why).
        http1: speak HTTP/1.1. Default ``True``. With ``http1=False`` and ``http2=True`` it
            speaks HTTP/2 with prior knowledge to ``http://`` URLs.
        http2: speak HTTP/2 (needs the ``h2`` package). Default ``False``. With
            ``http2=True`` the pools are made safe to cancel, as by
            [`cancel_safe_transport`][trio_hedge.transport.cancel_safe_transport].
        limits: per-shard ``httpx.Limits``.
        timeout: the client's timeout.
        **client_kwargs: passed to ``httpx.AsyncClient`` (``headers``, ``base_url``,
            ``event_hooks``…; not ``transport``).
    """
    if "transport" in client_kwargs or "verify" in client_kwargs:
        raise TypeError(
            "make_client builds its own transport; pass TLS options to ShardedTransport"
        )
    transport = ShardedTransport(
        per_shard,
        http1=http1,
        http2=http2,
        limits=limits,
        network_backend=WrappingBackend(wrap=_lean_http1 if not http2 else _LeanStream),
    )
    return httpx.AsyncClient(transport=transport, timeout=timeout, **client_kwargs)


def http2_connections(client: httpx.AsyncClient) -> list[tuple[Any, Any]]:
    """The live HTTP/2 connections in ``client``'s pools (httpx's default transport, or
    [`ShardedTransport`][trio_hedge.transport.ShardedTransport]), as
    ``(pool connection, HTTP/2 connection)`` pairs; ``[]`` for any other transport."""
    transport = getattr(client, "_transport", None)
    if isinstance(transport, ShardedTransport):
        transports: list[Any] = transport.pools()
    else:
        transports = [transport]
    found = []
    for each in transports:
        pool = getattr(each, "_pool", None)
        if not getattr(pool, "_http2", False):
            continue  # HTTP/1.1 only: a cancel closes the socket, the server sees it
        for connection in getattr(pool, "connections", ()):
            inner = getattr(connection, "_connection", None)
            if hasattr(inner, "_h2_state") and hasattr(inner, "_events"):
                found.append((connection, inner))
    return found
