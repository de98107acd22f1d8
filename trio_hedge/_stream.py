"""`hedged_stream`: the async context manager and its token iterator.

Entering races the attempts until one commits (the race's nursery lives and dies inside
``__aenter__``); iterating then reads the winner's stream in the caller's own task, so after
commit a token pays no task switch and no channel hop. Leaving, by any path, closes the winner.
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Coroutine, Mapping, Sequence
from types import TracebackType
from typing import Any, NoReturn

import httpx
import trio

from ._client import make_client
from ._errors import AllAttemptsFailed, AttemptError, ErrorKind, HedgeError, StreamInterrupted
from ._events import Delta
from ._plan import Planner, StaticPlanner
from ._policy import HedgePolicy
from ._race import Committed, classify_exception, close_quietly, race
from ._report import Report, _Recorder
from .sources._base import AttemptStream, Source
from .sources.iterator import IteratorSource
from .sources.openai_http import HeaderNames, OpenAIChatSource, Replica

__all__ = ["HedgedStream", "hedged_stream"]


class HedgedStream:
    """One hedged request: ``async with`` races to the first token, ``async for`` yields
    ``str`` tokens from the winner, :meth:`events` yields richer :class:`~trio_hedge.Delta`
    events, and :attr:`report` says what happened. Use each stream once.

    Raises (from ``async with``):
        FatalAttemptError: a non-retryable error (400, 401, 403, 404, 413, 422, quota…).
        AllAttemptsFailed: every allowed attempt failed, or ``first_token_timeout`` passed.
    Raises (while iterating):
        StreamInterrupted: the winner failed after its first token; ``.text`` keeps the
            partial answer.
    """

    def __init__(
        self,
        planner: Planner,
        policy: HedgePolicy,
        *,
        request_id: str | None = None,
        owned_client: httpx.AsyncClient | None = None,
        prompt_tokens: int | None = None,
        idempotency_key: str | None = None,
    ) -> None:
        self._planner = planner
        self._policy = policy
        self._owned_client = owned_client
        self._recorder = _Recorder(
            request_id=request_id or str(uuid.uuid4()),
            prompt_tokens=prompt_tokens,
            idempotency_key=idempotency_key,
        )
        self._planner_told = False
        self._winner: AttemptStream | None = None
        self._winner_number = 0
        self._pending: deque[Delta] = deque()
        self._tokens: deque[str] = deque()
        self._ended = False
        self._entered = False
        self._events_mode = False
        # The winner, when __anext__ may read it directly (no stall timeout to enforce).
        self._direct: AttemptStream | None = None

    @property
    def request_id(self) -> str:
        """The id every attempt of this request carries."""
        return self._recorder.request_id

    @property
    def started_at(self) -> float:
        """The Trio clock time (seconds) the request started; report times are offsets
        from it."""
        return self._recorder.origin

    @property
    def report(self) -> Report:
        """A frozen snapshot of what happened so far (see :class:`~trio_hedge.Report`)."""
        return self._recorder.snapshot()

    @property
    def text(self) -> str:
        """The text relayed to the caller so far."""
        return "".join(self._recorder.chunks)

    # -- entering: the race ----------------------------------------------------------------

    async def __aenter__(self) -> HedgedStream:
        if self._entered:
            raise RuntimeError("a HedgedStream can be entered only once")
        self._entered = True
        rec = self._recorder
        rec.origin = trio.current_time()
        try:
            committed = await self._race()
        except BaseException as exc:
            rec.ended_at = trio.current_time()
            if isinstance(exc, HedgeError):
                rec.error = exc
                exc.report = rec.snapshot()
            self._tell_planner()
            await self._close_client()
            raise
        self._winner = committed.stream
        if self._policy.stall_timeout is None:
            self._direct = committed.stream
        self._winner_number = committed.number
        self._ended = committed.ended
        # Kept for events(); the str iterator reads only the queued tokens.
        self._pending.extend(committed.pending)
        # The race already counted these in the winner's tokens_received.
        self._take(committed.pending, trio.current_time(), count_for_attempt=False)
        return self

    async def _race(self) -> Committed:
        policy = self._policy
        racing = race(
            self._planner,
            self._recorder,
            first_token=policy.first_token,
            close_timeout=policy.close_timeout,
        )
        timeout = policy.first_token_timeout
        if timeout is None:  # no cancel scope to pay for
            return await racing
        with trio.move_on_after(timeout) as scope:
            return await racing
        assert scope.cancelled_caught
        error = AttemptError(
            ErrorKind.TIMEOUT, f"no first token within first_token_timeout={timeout} s"
        )
        errors = tuple(a.error for a in self._recorder.attempts if a.error is not None)
        raise AllAttemptsFailed(str(error), (*errors, error))

    # -- leaving: close the winner ----------------------------------------------------------

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        rec = self._recorder
        if rec.ended_at is None:
            rec.ended_at = trio.current_time()
        winner, self._winner = self._winner, None
        self._direct = None
        if winner is not None:
            state = rec.attempt(self._winner_number)
            state.ended_at = rec.ended_at
            if exc is not None and not isinstance(exc, HedgeError) and rec.error is None:
                rec.error = exc
            await close_quietly(winner, self._policy.close_timeout)
        self._tell_planner()
        await self._close_client()

    def _tell_planner(self) -> None:
        if not self._planner_told:
            self._planner_told = True
            self._planner.request_finished(self._recorder.snapshot())

    async def _close_client(self) -> None:
        client, self._owned_client = self._owned_client, None
        if client is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(self._policy.close_timeout):
                await client.aclose()

    # -- iterating: the hot path -------------------------------------------------------------

    def _take(self, batch: Sequence[Delta], now: float, *, count_for_attempt: bool = True) -> None:
        """Account one batch of the winner's deltas; queue content tokens (``str`` mode)."""
        rec = self._recorder
        tokens = self._tokens
        keep = not self._events_mode
        count = 0
        for delta in batch:
            content = delta.content
            if content:
                if keep:
                    tokens.append(content)
                rec.chunks.append(content)
                count += 1
        if count:
            last = rec.last_token_time
            if last is None:
                rec.first_token_time = now
            else:
                gap = now - last
                if rec.max_gap is None or gap > rec.max_gap:
                    rec.max_gap = gap
            rec.last_token_time = now
            rec.token_count += count
            if count_for_attempt:
                rec.attempt(self._winner_number).tokens_received += count

    async def _receive(self) -> Sequence[Delta] | None:
        """The winner's next batch, under the stall timeout; errors become typed."""
        winner = self._winner
        if winner is None:
            raise RuntimeError("iterate a HedgedStream inside its 'async with' block")
        stall = self._policy.stall_timeout
        try:
            if stall is None:
                return await winner.receive()
            # Only content resets the stall clock: role-only deltas, usage and keep-alive
            # comments do not (the caller loops back here until content arrives).
            rec = self._recorder
            last = rec.last_token_time if rec.last_token_time is not None else rec.committed_at
            assert last is not None
            with trio.move_on_at(last + stall):
                return await winner.receive()
            raise AttemptError(
                ErrorKind.STALL, f"no content for stall_timeout={stall} s after commit"
            )
        except Exception as exc:
            self._fail(classify_exception(exc))

    def _fail(self, error: AttemptError) -> NoReturn:
        rec = self._recorder
        state = rec.attempt(self._winner_number)
        if error.replica is None:
            error.replica = state.replica
        state.error = error
        rec.ended_at = state.ended_at = trio.current_time()
        interrupted = StreamInterrupted(error, self.text)
        rec.error = interrupted
        self._ended = True
        interrupted.report = rec.snapshot()
        raise interrupted

    def __aiter__(self) -> HedgedStream:
        return self

    async def __anext__(self) -> str:
        tokens = self._tokens
        while not tokens:
            if self._ended:
                self._finish()
                raise StopAsyncIteration
            direct = self._direct
            if direct is not None:
                # Hot path (no stall timeout): the winner itself, one coroutine per batch.
                try:
                    batch = await direct.receive()
                except Exception as exc:
                    self._fail(classify_exception(exc))
            else:
                batch = await self._receive()
            if batch is None:
                self._ended = True
            else:
                self._take(batch, trio.current_time())
        return tokens.popleft()

    def events(self) -> _EventIterator:
        """An async iterator of every :class:`~trio_hedge.Delta` of the winner (content,
        reasoning, tool-call fragments, usage, finish reason), starting with those read
        before the commit. An alternative to iterating the stream for ``str`` tokens; do not
        mix the two. It holds nothing between items, so leaving it early is safe."""
        self._events_mode = True
        self._tokens.clear()
        return _EventIterator(self)

    async def _next_event(self) -> Delta:
        pending = self._pending
        while not pending:
            if self._ended:
                self._finish()
                raise StopAsyncIteration
            batch = await self._receive()
            if batch is None:
                self._ended = True
            else:
                self._take(batch, trio.current_time())
                pending.extend(batch)
        return pending.popleft()

    def _finish(self) -> None:
        """The winner's stream ended normally."""
        rec = self._recorder
        rec.completed = rec.error is None
        if rec.ended_at is None:
            rec.ended_at = trio.current_time()
            if self._winner_number:
                rec.attempt(self._winner_number).ended_at = rec.ended_at


class _EventIterator:
    __slots__ = ("_stream",)

    def __init__(self, stream: HedgedStream) -> None:
        self._stream = stream

    def __aiter__(self) -> _EventIterator:
        return self

    def __anext__(self) -> Coroutine[Any, Any, Delta]:
        return self._stream._next_event()


_DEFAULT_POLICY = HedgePolicy()
_KNOWN_SOURCES = frozenset({Replica, IteratorSource, OpenAIChatSource})


def check_replicas(replicas: object) -> None:
    """Raise ``TypeError``/``ValueError`` unless ``replicas`` is a non-empty sequence of
    :class:`~trio_hedge.Replica` or :class:`~trio_hedge.Source` objects (checked before any
    client is created, so a bad list leaks nothing)."""
    if isinstance(replicas, (str, bytes)) or not isinstance(replicas, Sequence):
        raise TypeError("replicas must be a sequence of Replica or Source objects")
    if not replicas:
        raise ValueError("replicas must not be empty")
    for r in replicas:
        # The runtime Protocol check costs microseconds: known classes skip it.
        if type(r) not in _KNOWN_SOURCES and not isinstance(r, (Replica, Source)):
            raise TypeError(f"replicas must be Replica or Source objects, not {type(r).__name__}")


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
            generic :class:`~trio_hedge.Source`.
        replicas: where attempts go, in order: :class:`~trio_hedge.Replica` endpoints and/or
            any :class:`~trio_hedge.Source` (e.g. :func:`~trio_hedge.iterator_source`).
        policy: a :class:`~trio_hedge.HedgePolicy`; default ``HedgePolicy()`` (hedge after
            1.0 s, one attempt per replica).
        client: an ``httpx.AsyncClient`` used as given (pool, proxies, TLS). Without one, the
            stream creates its own and closes it on exit (share one client when you make many
            requests).
        request_id: the id sent on every attempt; default a fresh UUID4 (servers that
            validate ``X-Request-ID`` as a UUID accept it).
        headers: which headers carry the request id and attempt number
            (:class:`~trio_hedge.HeaderNames`); default ``X-Request-ID`` / ``X-Hedge-Attempt``.

    Returns:
        a :class:`HedgedStream`; use it as ``async with hedged_stream(...) as stream:``.

    Raises:
        TypeError, ValueError: bad arguments (raised here, before any I/O).
    """
    policy = _DEFAULT_POLICY if policy is None else policy
    if not isinstance(policy, HedgePolicy):
        raise TypeError(f"policy must be a HedgePolicy, not {type(policy).__name__}")
    check_replicas(replicas)
    needs_http = any(isinstance(r, Replica) for r in replicas)
    if needs_http:
        if request is None or not isinstance(request, Mapping):
            raise TypeError("request must be the chat-completions JSON body (a mapping)")
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
