"""The gateway's configuration: a TOML file (read with the standard library's ``tomllib``;
``tomli`` on Python 3.10) and command-line flags over it.

Everything is validated when the file is loaded, before a socket is opened: a bad field
raises [`ConfigError`][trio_hedge.gateway.ConfigError] naming it (``replicas[1].base_url: ...``).
Secrets never sit in the file: keys are read from the environment variables it names, and never
appear in a repr, a log line or an error.
"""

from __future__ import annotations

import fnmatch
import math
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from .. import HedgerConfig, LearnedDelay, Replica
from .._validate import MAX_PRIORITY
from ..events import FirstToken
from ..policy import Attribution
from ..sources.probes import ENGINES, LoadProbe
from ..state._link import (
    DEFAULT_PREFIX,
    DEFAULT_TIMEOUT,
    check_prefix,
    check_redis_url,
    check_timeout,
    redacted_url,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "DEFAULT_HEDGER",
    "ConfigError",
    "GatewayConfig",
    "GatewayKey",
    "Group",
    "Limits",
    "StateConfig",
    "hedger_config",
    "load_config",
    "parse_config",
]

#: A gateway relays every event, so the first one a client would see commits the race:
#: content, reasoning or a tool-call fragment (the library's default counts content only).
#: Recovery after the commit as the library's (``max_recoveries=2``): the chunks after a
#: recovery are rewritten as one completion (``_recovered.py``; docs/gateway.md, Streaming).
DEFAULT_HEDGER = HedgerConfig(first_token=FirstToken.ANY_OUTPUT)
#: Whose fault errors are when clients' own keys are forwarded (``forward_client_key``): a key,
#: quota or rate-limit error is the key's; so is a "not found", which a provider answers for a
#: model the key may not use (OpenAI: "does not exist or you do not have access to it") -- a
#: replica with a key of its own serving it is no evidence against the other.
FORWARDED_KEYS = Attribution(caller={"auth", "quota_exceeded", "rate_limit", "not_found"})
#: The most worker processes ``[server] workers`` may start.
MAX_WORKERS = 64


class ConfigError(ValueError):
    """A configuration file or flag is wrong; the message names the field (never a key)."""


def _non_negative_seconds(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{attribute.name} must be seconds (a number), not {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{attribute.name} must be finite seconds >= 0, not {value!r}")


def _positive_seconds_or_none(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    _non_negative_seconds(inst, attribute, value)
    assert isinstance(value, (int, float))
    if value == 0:
        raise ValueError(f"{attribute.name} must be > 0 seconds, not {value!r}")


def _positive_int(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{attribute.name} must be an int, not {value!r}")
    if value < 1:
        raise ValueError(f"{attribute.name} must be >= 1, not {value!r}")


def _positive_int_or_none(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        _positive_int(inst, attribute, value)


def _non_negative_int(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{attribute.name} must be an int, not {value!r}")
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, not {value!r}")


def _priority(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{attribute.name} must be an int, not {value!r}")
    if not 0 <= value <= MAX_PRIORITY:
        raise ValueError(f"{attribute.name} must be from 0 to {MAX_PRIORITY}, not {value!r}")


def _priority_or_none(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        _priority(inst, attribute, value)


def _positive_rate_or_none(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{attribute.name} must be requests per second (a number)")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{attribute.name} must be finite requests per second > 0")


@attrs.frozen
class Limits:
    """What protects the fleet. Durations in seconds.

    Attributes:
        max_concurrent: chat requests (every API's) running at once; beyond it a request
            waits in the admission queue (``max_queue``, ``queue_wait``). Default 1000.
        max_queue: chat requests that may wait for a slot besides the ones running: at
            most ``max_concurrent + max_queue`` are in the gateway at once (running,
            waiting, or reading their body), which bounds the memory requests hold. Beyond
            it, 503 ``queue_full`` with a ``Retry-After`` from the queue's drain rate (or,
            when the arrival's key has fewer requests in the gateway than the key with the
            most, that key's newest waiting request gets it instead: no key can take every
            place). 0: no queue, 503 at once. Default 256.
        queue_wait: the longest a request waits in the queue for a slot (gateway, group and
            key), in seconds; then 503 ``queue_timeout`` with a ``Retry-After`` from the
            drain rate. 0: no waiting. Default 10.
        completion_weight: what one completion token weighs against a prompt token in the
            token-fair order (VTC: the waiting request of the key that received the fewest
            weighted tokens recently goes first; Sheng et al., OSDI 2024, weigh output 2:1).
            In ``(0, 100]``. Default 2.0.
        fairness_horizon: how recent the tokens counted in that order are, in seconds: each
            key's count decays exponentially with this time constant (``_queue.py`` says why
            rather than VTC's counter lift). ``None`` (``false`` in TOML): every token
            counted, with VTC's lift (a key back from idle gets no head start, but a key
            sending below its share waits behind the flood for every other request of its
            bursts). Default 2.
        completion_reserve: the completion tokens a request that sets no ``max_tokens``
            (``max_completion_tokens``, ``max_output_tokens``) reserves of its key's
            ``tokens_per_minute``; its reported usage is charged when it ends. Default
            1024.
        priority: the priority class (0, the default and lowest, to 9) of requests whose
            key has none of its own (and of every request without gateway keys).
            Default 0.
        max_priority: the highest class a request may ask for with ``X-Priority`` when
            ``priority_header`` is on (each key's own ``max_priority`` over it); ``None``:
            ``priority`` (the header cannot raise it). Default ``None``.
        priority_header: read ``X-Priority: <int>`` from clients, clamped to their key's
            range ``[priority, max_priority]`` (never below the key's default). Default
            ``False``: the header is ignored.
        max_body_bytes: the largest request body; beyond it 413. Default 4 MiB.
        request_timeout: the overall deadline of one chat request, first token to last;
            before the first token it answers 504, after it ends the stream with an in-band
            error. ``None``: no deadline. Default 600.
        drain_timeout: after the listener closes, how long in-flight requests may go on
            before they are cancelled (their upstream attempts closed). Default 30.
        retry_after: the ``Retry-After`` of the gateway's own 503 answers when it has no
            better estimate (draining; the queue before any request has finished) and of
            upstream 503s that gave none. Default 1.
        hedge_after_min: the least a client's ``X-Hedge-After`` is clamped to. Default 0.
        hedge_after_max: the most a client's ``X-Hedge-After`` is clamped to. Default 10.
        key_max_concurrent: chat requests one gateway key may have in flight at once (the
            default of every [`GatewayKey`][trio_hedge.gateway.GatewayKey]); beyond it 429
            with ``Retry-After``. ``None``: no limit. Default ``None``.
        key_rate: requests per second one gateway key may make on ``/v1/*``, on average
            (a token bucket); beyond it 429 with ``Retry-After`` until the next is allowed.
            ``None``: no limit. Default ``None``.
        key_burst: requests a key may make at once beyond ``key_rate`` (the bucket's size).
            ``None``: ``key_rate`` rounded up (at least 1). Default ``None``.
        key_tokens_per_minute: tokens (prompt plus completion) one gateway key may use per
            sliding minute: each request reserves its estimate at admission (prompt plus
            its ``max_tokens``, else ``completion_reserve``) and is charged the usage its
            answer reports, so requests running together cannot overrun it; beyond it 429
            ``tokens_limit_exceeded`` with ``Retry-After``. ``None``: no limit. Default
            ``None``.
        write_timeout: seconds a write to a client may make no progress (a client that
            stopped reading) before its connection is closed, ending its requests (their
            upstream attempts closed, their slots freed); over HTTP/2, also how long a
            stream's shut flow-control window may hold a request. ``None``: no limit.
            Default 30.
        body_timeout: seconds a request's body may take to arrive, from its headers;
            beyond it 408 and the connection closed (a client trickling its body would
            hold a concurrency slot for nothing). ``None``: only ``request_timeout``
            bounds it. Default 30.
        max_connections: client connections open at once; one more is closed as soon as
            it is accepted. ``None``: half the process's file-descriptor limit (the soft
            ``RLIMIT_NOFILE`` when ``serve`` starts; ``trio-hedge serve`` raises it to the
            hard limit first), so that idle connections cannot take the descriptors the
            gateway needs to reach its replicas. Default ``None``.
        drain_delay: on SIGTERM, how long the gateway goes on serving new requests, its
            listener open, while ``/readyz`` answers 503 ``draining``: the time a load
            balancer or Kubernetes needs to see it and stop sending (a health check's
            interval × the failures it needs, plus the time its routing takes to update).
            Then the listener closes and the drain (``drain_timeout``) begins. A second
            signal skips it. Default 0: the listener closes at once (Traefik's
            ``requestAcceptGraceTimeout``, also 0 by default; Kubernetes users often get the
            same with a ``preStop`` sleep).
    """

    max_concurrent: int = attrs.field(default=1000, validator=_positive_int)
    max_body_bytes: int = attrs.field(default=4 * 1024 * 1024, validator=_positive_int)
    request_timeout: float | None = attrs.field(default=600.0, validator=_positive_seconds_or_none)
    drain_timeout: float = attrs.field(default=30.0, validator=_non_negative_seconds)
    retry_after: float = attrs.field(default=1.0, validator=_non_negative_seconds)
    hedge_after_min: float = attrs.field(default=0.0, validator=_non_negative_seconds)
    hedge_after_max: float = attrs.field(default=10.0, validator=_non_negative_seconds)
    key_max_concurrent: int | None = attrs.field(default=None, validator=_positive_int_or_none)
    key_rate: float | None = attrs.field(default=None, validator=_positive_rate_or_none)
    key_burst: int | None = attrs.field(default=None, validator=_positive_int_or_none)
    write_timeout: float | None = attrs.field(default=30.0, validator=_positive_seconds_or_none)
    body_timeout: float | None = attrs.field(default=30.0, validator=_positive_seconds_or_none)
    max_connections: int | None = attrs.field(default=None, validator=_positive_int_or_none)
    drain_delay: float = attrs.field(default=0.0, validator=_non_negative_seconds)
    # The admission queue: after the fields above, so Limits(...) by position still works.
    key_tokens_per_minute: int | None = attrs.field(default=None, validator=_positive_int_or_none)
    max_queue: int = attrs.field(default=256, validator=_non_negative_int)
    queue_wait: float = attrs.field(default=10.0, validator=_non_negative_seconds)
    completion_weight: float = attrs.field(default=2.0)
    fairness_horizon: float | None = attrs.field(default=2.0, validator=_positive_seconds_or_none)
    completion_reserve: int = attrs.field(default=1024, validator=_positive_int)
    priority: int = attrs.field(default=0, validator=_priority)
    max_priority: int | None = attrs.field(default=None, validator=_priority_or_none)
    priority_header: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    @completion_weight.validator
    def _check_weight(self, attribute: attrs.Attribute[float], value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"completion_weight must be a number, not {value!r}")
        if not (math.isfinite(value) and 0 < value <= 100):
            raise ValueError(f"completion_weight must be in (0, 100], not {value!r}")

    def __attrs_post_init__(self) -> None:
        if self.hedge_after_min > self.hedge_after_max:
            raise ValueError(
                f"hedge_after_min ({self.hedge_after_min}) must be <= hedge_after_max "
                f"({self.hedge_after_max})"
            )
        if self.max_priority is not None and self.max_priority < self.priority:
            raise ValueError(
                f"max_priority ({self.max_priority}) must be >= priority ({self.priority})"
            )


def _redis_url(_inst: object, _attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        check_redis_url(value)


def _url_repr(value: str | None) -> str:
    return "None" if value is None else repr(redacted_url(value))


@attrs.frozen
class StateConfig:
    """Where a fleet of gateway processes shares its slow state (``[state]``): ejections and
    cooldowns per (replica, model), the learned delay's TTFT samples, and (with the
    admission ledger) each key's leases; see ``docs/gateway.md``, "Scale-out". Without
    ``redis_url`` each process keeps its own (the default: nothing changes).

    Attributes:
        redis_url: ``redis://[[user]:password@]host[:port][/db]``, ``rediss://…`` (TLS) or
            ``unix://…``; ``None``: nothing is shared. Shown without its user and password
            in reprs, logs and errors; in a file, name an environment variable that holds
            it instead (``redis_url_env``) when it carries a password. Default ``None``.
        prefix: what every Redis key starts with (one Redis for several fleets: one prefix
            each). Default ``"trio-hedge"``.
        fail_closed: while Redis is unreachable, refuse the requests of keys with limits
            (503) instead of counting them in this process alone (the default, fail open).
            Default ``False``.
        timeout: seconds one Redis call may take before Redis counts as unreachable, in
            ``(0, 10]``. Default 0.25.

    Raises:
        TypeError, ValueError: a bad field (never quoting the URL).
    """

    redis_url: str | None = attrs.field(default=None, validator=_redis_url, repr=_url_repr)
    prefix: str = attrs.field(default=DEFAULT_PREFIX)
    fail_closed: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    timeout: float = attrs.field(default=DEFAULT_TIMEOUT)

    @prefix.validator
    def _check_prefix(self, _attribute: attrs.Attribute[str], value: object) -> None:
        check_prefix(value)

    @timeout.validator
    def _check_timeout(self, _attribute: attrs.Attribute[float], value: object) -> None:
        check_timeout(value)


def _names(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


def _replicas(value: Iterable[Replica]) -> tuple[Replica, ...]:
    return tuple(value)


def _groups(value: Iterable[Group]) -> tuple[Group, ...]:
    return tuple(value)


def _patterns(value: Iterable[str]) -> tuple[str, ...]:
    if isinstance(value, str):
        raise TypeError("models must be a list of model names or patterns, not a string")
    return tuple(value)


@attrs.frozen
class Group:
    """A replica group: the requests whose ``model`` matches one of ``models`` race its
    ``replicas`` under one [`Hedger`][trio_hedge.Hedger] with config ``hedger``.

    Attributes:
        name: the group's name (in logs and metrics).
        replicas: replica names, primary preference first.
        models: ``fnmatch`` patterns of the request's ``model`` (``"*"`` matches any, and a
            request without a model). The first group that matches takes the request.
        hedger: the [`HedgerConfig`][trio_hedge.HedgerConfig] of the group's Hedger.
        side_effects: the group's requests act besides generating text: hedged on time only
            when the client sends an ``Idempotency-Key``. Default ``False``.
        max_concurrent: the group's requests running at once (every API's); beyond it they
            wait in the admission queue. ``None``: only the gateway's ``max_concurrent``.
            Default ``None``.
    """

    name: str = attrs.field(validator=attrs.validators.instance_of(str))
    replicas: tuple[str, ...] = attrs.field(converter=_names)
    models: tuple[str, ...] = attrs.field(default=("*",), converter=_patterns)
    hedger: HedgerConfig = attrs.field(
        default=DEFAULT_HEDGER, validator=attrs.validators.instance_of(HedgerConfig)
    )
    side_effects: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    max_concurrent: int | None = attrs.field(default=None, validator=_positive_int_or_none)

    def matches(self, model: str | None) -> bool:
        """Whether a request for ``model`` belongs here."""
        if model is None:
            return "*" in self.models
        return any(fnmatch.fnmatchcase(model, pattern) for pattern in self.models)


@attrs.frozen
class GatewayKey:
    """A key clients send (``Authorization: Bearer …``), with the name it goes by in
    metrics and the access log (never the key) and its own limits.

    Attributes:
        key: the key. Hidden in the repr.
        name: what metrics (``key`` label) and the access log call this key's requests.
        max_concurrent: its chat requests in flight at once; ``None``: the
            [`Limits`][trio_hedge.gateway.Limits]' ``key_max_concurrent``. Default ``None``.
        rate: its requests per second on ``/v1/*``; ``None``: ``Limits.key_rate``.
            Default ``None``.
        burst: its requests at once beyond ``rate``; ``None``: ``Limits.key_burst``.
            Default ``None``.
        tokens_per_minute: its tokens per sliding minute; ``None``:
            ``Limits.key_tokens_per_minute``. Default ``None``.
        priority: its requests' priority class (0 to 9, higher first, in the admission
            queue and for the hedge budget); ``None``: ``Limits.priority``. Default ``None``.
        max_priority: the highest class its requests may ask for with ``X-Priority`` (when
            ``Limits.priority_header`` is on); ``None``: ``Limits.max_priority``, else its
            ``priority``. Default ``None``.

    Raises:
        TypeError, ValueError: a field of the wrong type or out of range (named, never the
            key).
    """

    key: str = attrs.field(repr=False)
    name: str = attrs.field()
    max_concurrent: int | None = attrs.field(default=None, validator=_positive_int_or_none)
    rate: float | None = attrs.field(default=None, validator=_positive_rate_or_none)
    burst: int | None = attrs.field(default=None, validator=_positive_int_or_none)
    tokens_per_minute: int | None = attrs.field(default=None, validator=_positive_int_or_none)
    priority: int | None = attrs.field(default=None, validator=_priority_or_none)
    max_priority: int | None = attrs.field(default=None, validator=_priority_or_none)

    @key.validator
    def _check_key(self, _attribute: attrs.Attribute[str], value: object) -> None:
        if not isinstance(value, str) or not value:
            raise ValueError("gateway keys must be non-empty strings")

    @name.validator
    def _check_name(self, _attribute: attrs.Attribute[str], value: object) -> None:
        if not isinstance(value, str) or not value:
            raise ValueError("a gateway key's name must be a non-empty string")


def _gateway_keys(value: Iterable[str | GatewayKey]) -> tuple[GatewayKey, ...]:
    """Keys given as strings are named ``key0``, ``key1``… by position."""
    keys = []
    for i, key in enumerate(value):
        keys.append(key if isinstance(key, GatewayKey) else GatewayKey(key, f"key{i}"))
    return tuple(keys)


def _keys_repr(keys: tuple[GatewayKey, ...]) -> str:
    return f"<{len(keys)} keys>"


@attrs.frozen
class GatewayConfig:
    """The whole gateway.

    Attributes:
        replicas: the upstream [`Replica`][trio_hedge.sources.Replica] endpoints (unique names).
        groups: the [`Group`][trio_hedge.gateway.Group]s, matched in order; default one group
            ``"default"`` with every replica, for every model.
        host: the address to listen on (HTTP/1.1 and h2c on one port). Default
            ``127.0.0.1``.
        port: the port to listen on. Default 8080.
        keys: the [`GatewayKey`][trio_hedge.gateway.GatewayKey]s clients must send
            (``Authorization: Bearer …``; a plain string is a key named by its position,
            ``key0``…); empty: no authentication. Compared in constant time. Hidden in the
            repr.
        forward_client_key: send a client's own ``Authorization`` upstream, to replicas
            that have no key of their own. Default ``False``. Not with ``keys``.
        limits: the [`Limits`][trio_hedge.gateway.Limits].
        http2: serve h2c (HTTP/2 without TLS, prior knowledge or ``Upgrade``) besides
            HTTP/1.1 on the same port. ``False``: HTTP/1.1 only (a client's HTTP/2 preface
            is answered 505; an ``Upgrade: h2c`` is ignored). Default ``True``.
        log_format: how ``trio-hedge serve`` writes its logs to stderr: ``"text"`` or
            ``"json"`` (one JSON object per line). Default ``"text"``.
        workers: gateway processes serving the one port (``trio-hedge serve``: a
            supervisor hands them its listening socket, restarts one that dies, and drains
            all on SIGTERM), 1 to 64. Limits such as ``max_concurrent`` are per process.
            Default 1: one process, no supervisor.
        state: the [`StateConfig`][trio_hedge.gateway.StateConfig]: what the processes
            share, and where. Default: nothing shared.
    """

    replicas: tuple[Replica, ...] = attrs.field(converter=_replicas)
    groups: tuple[Group, ...] = attrs.field(converter=_groups, default=())
    host: str = "127.0.0.1"
    port: int = attrs.field(default=8080)
    keys: tuple[GatewayKey, ...] = attrs.field(default=(), converter=_gateway_keys, repr=_keys_repr)
    forward_client_key: bool = False
    limits: Limits = attrs.field(factory=Limits)
    http2: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    log_format: str = attrs.field(default="text", validator=attrs.validators.in_(("text", "json")))
    workers: int = attrs.field(default=1)
    state: StateConfig = attrs.field(
        factory=StateConfig, validator=attrs.validators.instance_of(StateConfig)
    )

    @workers.validator
    def _check_workers(self, _attribute: attrs.Attribute[int], value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_WORKERS:
            raise ValueError(f"workers must be an int in 1..{MAX_WORKERS}, not {value!r}")

    @port.validator
    def _check_port(self, _attribute: attrs.Attribute[int], value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
            raise ValueError(f"port must be an int in 0..65535, not {value!r}")

    def __attrs_post_init__(self) -> None:
        if not self.replicas:
            raise ValueError("at least one replica is needed")
        for replica in self.replicas:
            if not isinstance(replica, Replica):
                raise TypeError(f"replicas must be Replica objects, not {type(replica).__name__}")
        names = [r.name for r in self.replicas]
        if len(set(names)) != len(names):
            raise ValueError(f"replica names must be unique, got {names!r}")
        if not self.groups:
            default = Group("default", names)
            object.__setattr__(self, "groups", (default,))
        seen: set[str] = set()
        for group in self.groups:
            if group.name in seen:
                raise ValueError(f"group names must be unique: {group.name!r} twice")
            seen.add(group.name)
            if not group.replicas:
                raise ValueError(f"group {group.name!r} has no replicas")
            for name in group.replicas:
                if name not in names:
                    raise ValueError(f"group {group.name!r} names unknown replica {name!r}")
        key_names = [k.name for k in self.keys]
        if len(set(key_names)) != len(key_names):
            raise ValueError(f"gateway key names must be unique, got {key_names!r}")
        if len({k.key for k in self.keys}) != len(self.keys):
            raise ValueError("two gateway keys are the same key")
        limits = self.limits
        per_key = (
            limits.key_max_concurrent,
            limits.key_rate,
            limits.key_burst,
            limits.key_tokens_per_minute,
        )
        if not self.keys and any(v is not None for v in per_key):
            raise ValueError("per-key limits (limits.key_*) need gateway keys (auth)")
        for key in self.keys:
            low, high = self.priorities(key)
            if high < low:
                raise ValueError(
                    f"gateway key {key.name!r}: max_priority ({high}) must be >= its "
                    f"priority ({low})"
                )
        if self.keys and self.forward_client_key:
            raise ValueError(
                "forward_client_key cannot be used with gateway keys: clients send the "
                "gateway's key, not their own"
            )

    def priorities(self, key: GatewayKey | None) -> tuple[int, int]:
        """``(default, highest)`` priority class of ``key``'s requests (``None``: requests
        without a gateway key): its own, else the ``limits``'."""
        limits = self.limits
        low = limits.priority if key is None or key.priority is None else key.priority
        if key is not None and key.max_priority is not None:
            high = key.max_priority  # checked: not below its own default
        elif limits.max_priority is not None:
            high = max(limits.max_priority, low)
        else:
            high = low
        return low, high

    def replica(self, name: str) -> Replica:
        """The replica called ``name``."""
        for replica in self.replicas:
            if replica.name == name:
                return replica
        raise KeyError(name)

    def group_for(self, model: str | None) -> Group | None:
        """The first group serving ``model``, or ``None``."""
        for group in self.groups:
            if group.matches(model):
                return group
        return None


# -- TOML --------------------------------------------------------------------------------------


def _table(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be a table, not {type(value).__name__}")
    return value


def _known(table: Mapping[str, Any], allowed: Iterable[str], where: str) -> None:
    allowed = tuple(allowed)
    for key in table:
        if key not in allowed:
            raise ConfigError(f"{where}: unknown field {key!r} (known: {', '.join(allowed)})")


def _env(name: object, where: str, environ: Mapping[str, str]) -> str:
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where} must name an environment variable")
    value = environ.get(name)
    if not value:
        raise ConfigError(f"{where}: environment variable {name} is not set")
    return value


def _none_for_false(value: object, default: object) -> object:
    """TOML has no null: ``false`` stands for ``None`` in a field that is not a bool."""
    return None if value is False and not isinstance(default, bool) else value


def _build(cls: type[Any], table: Mapping[str, Any], where: str) -> Any:
    """An attrs class from a TOML table: nested attrs fields from sub-tables, lists as tuples,
    ``false`` for ``None``."""
    fields = attrs.fields_dict(cls)
    _known(table, fields, where)
    defaults = cls()
    kwargs: dict[str, Any] = {}
    for key, value in table.items():
        default = getattr(defaults, key)
        value = _none_for_false(value, default)
        if isinstance(value, Mapping) and attrs.has(type(default)):
            value = _build(type(default), value, f"{where}.{key}")
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _hedge_after(value: object, where: str) -> Any:
    if value is False or value == "off":
        return None
    if value == "learned":
        return LearnedDelay()
    if isinstance(value, Mapping):
        return _build(LearnedDelay, value, where)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(
            f'{where} must be seconds, "learned", "off" or a LearnedDelay table, not {value!r}'
        )
    return float(value)


def hedger_config(table: Mapping[str, Any], base: HedgerConfig, where: str) -> HedgerConfig:
    """``base`` with the fields of ``table`` (a ``[hedger]`` TOML table): every
    [`HedgerConfig`][trio_hedge.HedgerConfig] field by name. Policy objects (``budget``,
    ``throttle``, ``outlier_detection``) take a table of their fields, ``false`` for none or
    ``true`` for the defaults; ``hedge_after`` takes seconds, ``"learned"``, ``"off"`` or a
    [`LearnedDelay`][trio_hedge.LearnedDelay] table; ``false`` stands for ``None`` elsewhere
    (``first_token_timeout = false``).

    Raises:
        ConfigError: an unknown field or a bad value, named by its path.
    """
    fields = attrs.fields_dict(HedgerConfig)
    _known(table, fields, where)
    changes: dict[str, Any] = {}
    for key, value in table.items():
        here = f"{where}.{key}"
        if key == "hedge_after":
            changes[key] = _hedge_after(value, here)
            continue
        default = getattr(HedgerConfig(), key)
        if attrs.has(type(default)):
            if value is False:
                value = None
            elif value is True:
                value = type(default)()
            elif isinstance(value, Mapping):
                value = _build(type(default), value, here)
            else:
                raise ConfigError(f"{here} must be a table, true or false, not {value!r}")
        changes[key] = _none_for_false(value, default)
    try:
        return attrs.evolve(base, **changes)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _str_map(value: object, where: str) -> dict[str, str]:
    table = _table(value, where)
    for key, item in table.items():
        if not isinstance(item, str):
            raise ConfigError(f"{where}.{key} must be a string")
    return dict(table)


#: A probe's fields a TOML table may set (``reader`` is code, not configuration).
_PROBE_FIELDS = tuple(f for f in attrs.fields_dict(LoadProbe) if f != "reader")
#: A replica's fields given as they are (the Replica validates them, naming the field).
_REPLICA_FIELDS = ("name", "path", "continuation", "context_window", "fallback", "backup_priority")
#: Of those, the ones whose "none" is written ``false`` (TOML has no null).
_NONE_FOR_FALSE = ("continuation", "context_window", "backup_priority")


def _probe(value: object, where: str) -> LoadProbe | None:
    """A replica's ``probe``: an engine name, a table of
    [`LoadProbe`][trio_hedge.sources.probes.LoadProbe] fields, or ``false`` (none)."""
    if value is False:
        return None
    if isinstance(value, str):
        if value not in ENGINES:
            raise ConfigError(f"{where} must be one of {sorted(ENGINES)}, a table or false")
        return LoadProbe(value)  # type: ignore[arg-type]
    table = _table(value, where)
    _known(table, _PROBE_FIELDS, where)
    if "engine" not in table:
        raise ConfigError(f"{where}.engine is required")
    kwargs: dict[str, Any] = {
        k: None if v is False and k in ("path", "cancel_quiet") else v for k, v in table.items()
    }
    try:
        return LoadProbe(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _replica(table: Mapping[str, Any], where: str, environ: Mapping[str, str]) -> Replica:
    _known(
        table,
        (
            "base_url",
            "api_key_env",
            "overrides",
            "headers",
            "headers_env",
            "probe",
            *_REPLICA_FIELDS,
        ),
        where,
    )
    if "base_url" not in table:
        raise ConfigError(f"{where}.base_url is required")
    headers = _str_map(table.get("headers", {}), f"{where}.headers")
    for header, var in _str_map(table.get("headers_env", {}), f"{where}.headers_env").items():
        headers[header] = _env(var, f"{where}.headers_env.{header}", environ)
    kwargs: dict[str, Any] = {
        "overrides": _table(table.get("overrides", {}), f"{where}.overrides"),
        "headers": headers,
    }
    if "api_key_env" in table:
        kwargs["api_key"] = _env(table["api_key_env"], f"{where}.api_key_env", environ)
    for field in _REPLICA_FIELDS:
        if field in table:
            value = table[field]
            # TOML has no null: false is "none" for the fields that are not booleans.
            kwargs[field] = None if value is False and field in _NONE_FOR_FALSE else value
    if kwargs.get("continuation") not in (None, "vllm", "llama.cpp", "anchor"):
        raise ConfigError(f'{where}.continuation must be "vllm", "llama.cpp", "anchor" or false')
    if not isinstance(kwargs.get("fallback", False), bool):
        raise ConfigError(f"{where}.fallback must be true or false")
    if "probe" in table:
        kwargs["probe"] = _probe(table["probe"], f"{where}.probe")
    try:
        return Replica(table["base_url"], **kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


#: A ``[[auth.keys]]`` table's limits (the `GatewayKey` fields of the same names).
_KEY_FIELDS = ("max_concurrent", "rate", "burst", "tokens_per_minute", "priority", "max_priority")


def _key(table: Mapping[str, Any], where: str, environ: Mapping[str, str]) -> GatewayKey:
    fields = _KEY_FIELDS
    _known(table, ("name", "key_env", *fields), where)
    if "key_env" not in table:
        raise ConfigError(f"{where}.key_env is required")
    key = _env(table["key_env"], f"{where}.key_env", environ)
    limits: dict[str, Any] = {n: _none_for_false(table[n], None) for n in fields if n in table}
    try:
        return GatewayKey(key, table.get("name", table["key_env"]), **limits)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def parse_config(
    document: Mapping[str, Any], *, environ: Mapping[str, str] | None = None
) -> GatewayConfig:
    """A [`GatewayConfig`][trio_hedge.gateway.GatewayConfig] from a parsed TOML document (see
    ``docs/gateway.md``).

    Raises:
        ConfigError: a missing, unknown or bad field, or an environment variable it names
            that is not set.
    """
    environ = os.environ if environ is None else environ
    _known(
        document, ("server", "auth", "limits", "hedger", "replicas", "groups", "state"), "config"
    )
    server = _table(document.get("server", {}), "server")
    _known(server, ("host", "port", "http2", "log_format", "workers"), "server")
    state = _state(_table(document.get("state", {}), "state"), environ)
    auth = _table(document.get("auth", {}), "auth")
    _known(auth, ("keys_env", "keys", "forward_client_key"), "auth")
    keys_env = auth.get("keys_env", [])
    if isinstance(keys_env, str) or not isinstance(keys_env, list):
        raise ConfigError("auth.keys_env must be a list of environment variable names")
    keys = [
        GatewayKey(_env(var, f"auth.keys_env[{i}]", environ), var) for i, var in enumerate(keys_env)
    ]
    named = auth.get("keys", [])
    if not isinstance(named, list):
        raise ConfigError("auth.keys must be [[auth.keys]] tables")
    keys += [
        _key(_table(k, f"auth.keys[{i}]"), f"auth.keys[{i}]", environ) for i, k in enumerate(named)
    ]
    limits = _build(Limits, _table(document.get("limits", {}), "limits"), "limits")
    hedger_table = _table(document.get("hedger", {}), "hedger")
    base = DEFAULT_HEDGER
    if auth.get("forward_client_key") is True:
        # The client's own key goes upstream: its 401, quota, rate limit and 404 (a model
        # the key may not use) are the client's.
        base = attrs.evolve(base, attribution=FORWARDED_KEYS)
    base = hedger_config(hedger_table, base, "hedger")
    raw_replicas = document.get("replicas", [])
    if not isinstance(raw_replicas, list) or not raw_replicas:
        raise ConfigError("replicas: at least one [[replicas]] table is needed")
    replicas = [
        _replica(_table(r, f"replicas[{i}]"), f"replicas[{i}]", environ)
        for i, r in enumerate(raw_replicas)
    ]
    groups: list[Group] = []
    raw_groups = document.get("groups", [])
    if not isinstance(raw_groups, list):
        raise ConfigError("groups must be [[groups]] tables")
    for i, raw in enumerate(raw_groups):
        where = f"groups[{i}]"
        table = _table(raw, where)
        _known(
            table, ("name", "replicas", "models", "hedger", "side_effects", "max_concurrent"), where
        )
        hedger = hedger_config(_table(table.get("hedger", {}), f"{where}.hedger"), base, where)
        try:
            groups.append(
                Group(
                    table.get("name", f"group{i}"),
                    table.get("replicas", [r.name for r in replicas]),
                    models=table.get("models", ["*"]),
                    hedger=hedger,
                    side_effects=table.get("side_effects", False),
                    max_concurrent=_none_for_false(table.get("max_concurrent"), None),  # type: ignore[arg-type]
                )
            )
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: {exc}") from None
    if not groups:
        groups.append(Group("default", [r.name for r in replicas], hedger=base))
    try:
        return GatewayConfig(
            replicas,
            groups,
            host=server.get("host", "127.0.0.1"),
            port=server.get("port", 8080),
            keys=keys,
            forward_client_key=auth.get("forward_client_key", False),
            limits=limits,
            http2=server.get("http2", True),
            log_format=server.get("log_format", "text"),
            workers=server.get("workers", 1),
            state=state,
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"config: {exc}") from None


def _state(table: Mapping[str, Any], environ: Mapping[str, str]) -> StateConfig:
    """``[state]``: `StateConfig`'s fields, and ``redis_url_env`` (an environment variable
    holding the URL, for one with a password) in place of ``redis_url``."""
    _known(table, ("redis_url", "redis_url_env", "prefix", "fail_closed", "timeout"), "state")
    fields = {k: v for k, v in table.items() if k != "redis_url_env"}
    if "redis_url_env" in table:
        if "redis_url" in table:
            raise ConfigError("state: give redis_url or redis_url_env, not both")
        fields["redis_url"] = _env(table["redis_url_env"], "state.redis_url_env", environ)
    if fields.get("redis_url") is False:
        fields["redis_url"] = None
    try:
        return StateConfig(**fields)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"state: {exc}") from None


def load_config(
    path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None
) -> GatewayConfig:
    """Read and validate a TOML file (see [`parse_config`][trio_hedge.gateway.parse_config]).

    Raises:
        ConfigError: the file is not valid TOML, or a field is wrong.
        OSError: the file cannot be read.
    """
    data = Path(path).read_bytes()
    try:
        document = tomllib.loads(data.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{os.fspath(path)}: not valid TOML: {exc}") from None
    return parse_config(document, environ=environ)


def with_flags(
    config: GatewayConfig | None,
    *,
    replicas: Sequence[str] = (),
    api_key: str | None = None,
    host: str | None = None,
    port: int | None = None,
    hedger: Mapping[str, Any] | None = None,
    limits: Mapping[str, Any] | None = None,
    http2: bool | None = None,
    log_format: str | None = None,
    workers: int | None = None,
) -> GatewayConfig:
    """``config`` (or none) with command-line flags over it: ``replicas`` (URLs) replace the
    file's replicas and groups; ``hedger`` fields apply to every group; ``limits`` fields
    replace the file's.

    Raises:
        ConfigError: no replica at all, or a bad value.
    """
    try:
        if replicas:
            made = [Replica(url, api_key=api_key) for url in replicas]
            names = [r.name for r in made]
            if len(set(names)) != len(names):  # the same host:port twice: number them
                made = [attrs.evolve(r, name=f"r{i}") for i, r in enumerate(made)]
            base = DEFAULT_HEDGER if config is None else config.groups[0].hedger
            group = Group("default", [r.name for r in made], hedger=base)
            config = (
                GatewayConfig(made, [group])
                if config is None
                else attrs.evolve(config, replicas=made, groups=[group])
            )
        if config is None:
            raise ConfigError("give --replica URL (one or more) or --config FILE")
        changes: dict[str, Any] = {}
        if host is not None:
            changes["host"] = host
        if port is not None:
            changes["port"] = port
        if http2 is not None:
            changes["http2"] = http2
        if log_format is not None:
            changes["log_format"] = log_format
        if workers is not None:
            changes["workers"] = workers
        if limits:
            changes["limits"] = attrs.evolve(config.limits, **limits)
        if hedger:
            changes["groups"] = [
                attrs.evolve(g, hedger=hedger_config(hedger, g.hedger, "flags"))
                for g in config.groups
            ]
        return attrs.evolve(config, **changes) if changes else config
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
