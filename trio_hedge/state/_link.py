"""What every Redis back end shares: the URL (checked, never shown with its password), one
bounded call, and the status with a log line at each change (``coredis`` is imported only
when a back end runs: the ``redis`` extra)."""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import unquote, urlsplit

import trio

from .._redact import Redactor
from ._contracts import StoreStatus

if TYPE_CHECKING:  # pragma: no cover
    import coredis

__all__ = [
    "DEFAULT_PREFIX",
    "DEFAULT_TIMEOUT",
    "MAX_NAME_CHARS",
    "MAX_TIMEOUT",
    "Link",
    "Unreachable",
    "check_prefix",
    "check_redis_url",
    "check_timeout",
    "redacted_url",
]

logger = logging.getLogger("trio_hedge.state")

#: Every key a back end writes starts with this (``[state] prefix``).
DEFAULT_PREFIX = "trio-hedge"
#: Seconds one Redis call may take before the back end counts Redis as unreachable.
DEFAULT_TIMEOUT = 0.25
#: The longest ``timeout`` accepted (seconds): a call is never allowed to hang a loop longer.
MAX_TIMEOUT = 10.0
#: The longest name (fleet, replica, model, group, key) that reaches a Redis key or value;
#: a longer one is not shared (the gateway refuses longer model names already).
MAX_NAME_CHARS = 256
#: The longest prefix (characters).
MAX_PREFIX_CHARS = 64

_SCHEMES = ("redis", "rediss", "unix")

T = TypeVar("T")


def check_redis_url(url: object) -> str:
    """``url`` if it is a ``redis://``, ``rediss://`` or ``unix://`` URL with a host (or a
    socket path).

    Raises:
        TypeError, ValueError: naming what is wrong, never quoting the URL (it may hold a
            password).
    """
    if not isinstance(url, str):
        raise TypeError(f"redis_url must be a string, not {type(url).__name__}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise ValueError("redis_url is not a valid URL (its port?)") from None
    if parts.scheme not in _SCHEMES:
        raise ValueError("redis_url must start with redis://, rediss:// or unix://")
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError("redis_url (unix://) names no socket path")
    elif not parts.hostname:
        raise ValueError("redis_url names no host")
    if port is not None and port == 0:
        raise ValueError("redis_url's port must be in 1..65535")
    return url


def redacted_url(url: str) -> str:
    """``url`` as logs and reprs show it: user and password replaced by ``***``, the query
    dropped (it may carry a password too)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    where = host if parts.port is None else f"{host}:{parts.port}"
    auth = "***@" if parts.username or parts.password else ""
    return f"{parts.scheme}://{auth}{where}{parts.path}"


def _secrets(url: str) -> list[str]:
    parts = urlsplit(url)
    found = [s for s in (parts.password, parts.username) if s]
    found += [unquote(s) for s in found]
    for pair in parts.query.split("&"):
        name, _, value = pair.partition("=")
        if name.lower() in ("password", "username", "user") and value:
            found += [value, unquote(value)]
    return found


def check_timeout(value: object, name: str = "timeout") -> float:
    """``value`` as seconds in ``(0, MAX_TIMEOUT]``.

    Raises:
        TypeError, ValueError: not a number, or out of range.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be seconds (a number), not {value!r}")
    if not math.isfinite(value) or not 0 < value <= MAX_TIMEOUT:
        raise ValueError(f"{name} must be seconds in (0, {MAX_TIMEOUT:g}], not {value!r}")
    return float(value)


def check_prefix(value: object) -> str:
    """``value`` if it is a non-empty string of printable characters without braces (a
    Redis Cluster hash tag is built around it), at most ``MAX_PREFIX_CHARS`` long.

    Raises:
        TypeError, ValueError: what is wrong.
    """
    if not isinstance(value, str):
        raise TypeError(f"prefix must be a string, not {type(value).__name__}")
    if not value or len(value) > MAX_PREFIX_CHARS:
        raise ValueError(f"prefix must have 1 to {MAX_PREFIX_CHARS} characters")
    if not value.isprintable() or "{" in value or "}" in value or " " in value:
        raise ValueError("prefix must be printable, without spaces or braces")
    return value


class Unreachable(Exception):
    """A Redis call failed or gave no answer in time (the message says which; never the
    URL's password)."""


class Link:
    """One back end's way to Redis: its bounded calls and its status.

    ``status`` is ``"degraded"`` until the first call succeeds, ``"ok"`` after a success,
    ``"degraded"`` after a failure; each change is logged once (a warning when Redis is
    lost, with the reason; an info line when it is back).
    """

    def __init__(self, url: str, timeout: float, what: str) -> None:
        self.url = check_redis_url(url)
        self.timeout = check_timeout(timeout)
        self.where = redacted_url(url)
        self.what = what
        self.status: StoreStatus = "degraded"
        #: Times Redis was lost (went from reachable, or from the start, to unreachable).
        self.losses = 0
        self._redact = Redactor(_secrets(url))
        self._told_lost = False
        self._ever_ok = False
        self._scripts: dict[str, Any] = {}  # Lua source -> its script on the current client

    def client(self) -> coredis.Redis[str]:
        """A new client (not connected yet: ``async with`` it), its own timeouts at
        ``timeout``."""
        import coredis

        return coredis.Redis.from_url(
            self.url,
            stream_timeout=self.timeout,
            connect_timeout=self.timeout,
            decode_responses=True,
            max_connections=8,
        )

    def script(self, client: coredis.Redis[str], lua: str) -> Any:
        """``lua`` registered on ``client`` once (``EVALSHA``, loaded again if Redis forgot
        it); registered anew on a new client."""
        script = self._scripts.get(lua)
        if script is None or script.registered_client is not client:
            script = self._scripts[lua] = client.register_script(lua)
        return script

    def describe(self, exc: BaseException) -> str:
        """``Type: message``, the message masked of the URL's secrets and cut short."""
        text = str(exc)
        if self._redact:
            text = self._redact(text)
        text = text if len(text) <= 200 else text[:200] + "…"
        return f"{type(exc).__name__}: {text}" if text else type(exc).__name__

    async def call(self, make: Callable[[], Awaitable[T]]) -> T:
        """``await make()``, bounded by ``timeout``; a success makes the status ``"ok"``.

        Raises:
            Unreachable: it failed or did not answer in time (the status is not changed
                here: the caller decides with `lost`).
        """
        with trio.move_on_after(self.timeout):
            try:
                result = await make()
            except Unreachable:
                raise
            except Exception as exc:  # coredis' errors, OSError: Redis is not there for us
                raise Unreachable(self.describe(exc)) from None
            self.reached()
            return result
        raise Unreachable(f"no answer within {self.timeout:g} s")

    def reached(self) -> None:
        """A call succeeded."""
        if self.status == "ok":
            return
        self.status = "ok"
        if self._told_lost:
            logger.info("%s: Redis at %s is reachable again: catching up", self.what, self.where)
        elif not self._ever_ok:
            logger.info("%s: shared through Redis at %s", self.what, self.where)
        self._told_lost = False
        self._ever_ok = True

    def lost(self, reason: str) -> None:
        """A call failed: ``"degraded"``, logged once until Redis is reached again."""
        if not self._told_lost:
            self.losses += 1
            logger.warning(
                "%s: Redis at %s is unreachable (%s): running on this process's own state",
                self.what,
                self.where,
                reason,
            )
            self._told_lost = True
        self.status = "degraded"

    def __repr__(self) -> str:
        return f"Link({self.where!r}, status={self.status!r})"


def as_str(value: Any) -> str:
    """A Redis reply's string (bytes decoded)."""
    return value.decode() if isinstance(value, bytes) else str(value)
