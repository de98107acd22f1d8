"""``trio-hedge serve`` (the gateway) and ``trio-hedge fake`` (a fake replica), called from
``trio_hedge.cli``. Importing this module needs no optional package: ``serve`` imports the
gateway extra's packages when it runs."""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import math
import os
import signal
import sys
from typing import Any

import trio

__all__ = ["add_commands", "run"]

#: The gen-0 threshold `serve` sets: CPython's default (700) runs a collection every 700 net
#: allocations, and the older generations' collections walk every live object.
GC_THRESHOLD = 100_000


def _seconds(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be finite seconds >= 0, not {text!r}")
    return value


def _hedge_after(text: str) -> float | str:
    if text in ("learned", "off"):
        return text
    try:
        return _seconds(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be seconds, 'learned' or 'off', not {text!r}"
        ) from None


def _tool_call(text: str) -> tuple[str, str]:
    name, sep, arguments = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"must be NAME=JSON_ARGUMENTS, not {text!r}")
    return name, arguments


def add_commands(sub: Any) -> None:
    """Add ``serve`` and ``fake`` to the ``trio-hedge`` subcommands."""
    serve = sub.add_parser(
        "serve",
        help="an OpenAI-compatible hedging gateway for any client (extra: gateway)",
        description=(
            "Serve POST /v1/chat/completions, POST /v1/messages (Anthropic Messages: give the "
            "Anthropic SDKs base_url http://HOST:PORT, without /v1) and POST /v1/responses "
            "(OpenAI Responses), racing the replicas with first-token hedging; and GET "
            "/v1/models, /healthz, /readyz, /metrics. Flags override the config file; "
            "--replica replaces its replicas and groups. Durations are in seconds. On SIGTERM "
            "or Ctrl-C it drains (--drain-delay, --drain-timeout); a second signal stops at "
            "once."
        ),
    )
    serve.add_argument(
        "--config", metavar="FILE", help="a TOML file (see docs/gateway.md; default: none)"
    )
    serve.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="URL",
        help="an upstream base URL, e.g. http://10.0.0.1:8000/v1 (repeat; preferred first)",
    )
    serve.add_argument(
        "--api-key-env",
        metavar="VAR",
        help="environment variable holding the key for the --replica URLs (never printed)",
    )
    serve.add_argument("--host", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument(
        "--port", type=int, help="port to listen on; 0: any free port (default: 8080)"
    )
    serve.add_argument(
        "--hedge-after",
        type=_hedge_after,
        metavar="SECONDS|learned|off",
        help="hedge delay: seconds, 'learned' from observed TTFTs or 'off' (default: learned)",
    )
    serve.add_argument(
        "--pick",
        choices=("peak_ewma", "least_loaded", "in_order"),
        help="how each request's primary is chosen: 'peak_ewma', the replica with the lowest "
        "recent TTFT (it learns to avoid a slow one); 'least_loaded', the fewest attempts in "
        "flight; 'in_order', the first eligible --replica, a preferred primary "
        "(default: peak_ewma)",
    )
    serve.add_argument(
        "--first-token-timeout",
        type=_seconds,
        metavar="SECONDS",
        help="fail a request with no first token within SECONDS, over all its attempts "
        "(default: none: only --request-timeout bounds it)",
    )
    serve.add_argument(
        "--stall-timeout",
        type=_seconds,
        metavar="SECONDS",
        help="after the first token, fail a stream that goes quiet for SECONDS "
        "(default: none: only --request-timeout bounds it)",
    )
    serve.add_argument(
        "--max-concurrent",
        type=int,
        metavar="N",
        help="chat requests handled at once; beyond it the answer is 503 (default: 1000)",
    )
    serve.add_argument(
        "--request-timeout",
        type=_seconds,
        metavar="SECONDS",
        help="the deadline of one chat request: 504 before its first token, an in-band error "
        "after (default: 600)",
    )
    serve.add_argument(
        "--drain-delay",
        type=_seconds,
        metavar="SECONDS",
        help="on SIGTERM, how long /readyz answers 503 'draining' while new requests are still "
        "served, before the listener closes: the time your load balancer needs to take this "
        "instance out (default: 0)",
    )
    serve.add_argument(
        "--drain-timeout",
        type=_seconds,
        metavar="SECONDS",
        help="then, how long requests in flight may go on before they are cancelled (default: 30)",
    )
    serve.add_argument(
        "--write-timeout",
        type=_seconds,
        metavar="SECONDS",
        help="close a connection whose write makes no progress for SECONDS (a client that "
        "stopped reading), ending its requests (default: 30)",
    )
    serve.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="gateway processes on the one port, under a supervisor that restarts one that "
        "dies and drains all on SIGTERM (config: [server] workers; default: 1, no supervisor)",
    )
    serve.add_argument("--worker", help=argparse.SUPPRESS)  # a supervisor's worker: its spec
    serve.add_argument(
        "--http1-only",
        action="store_true",
        help="serve HTTP/1.1 only, no h2c (config: [server] http2 = false)",
    )
    serve.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="what the gateway logs to stderr (default: %(default)s)",
    )
    serve.add_argument(
        "--log-format",
        choices=("text", "json"),
        help="stderr as text lines or one JSON object per line (config: [server] log_format; "
        "default: text)",
    )
    serve.add_argument(
        "--gc-threshold",
        type=int,
        default=GC_THRESHOLD,
        metavar="N",
        help="CPython's gen-0 garbage-collection threshold; 0 keeps Python's: with thousands "
        "of streams alive, the default collector's cost per stream grows with their number "
        f"(benchmarks/scale.py; default: {GC_THRESHOLD:,})",
    )

    fake = sub.add_parser(
        "fake",
        help="run a fake OpenAI-compatible replica (trio_hedge.testing.FakeReplica)",
        description=(
            "A fake replica for trying the gateway and for tests: it streams tok0 tok1 … "
            "(or --text) and prints one line per request it answered. Durations in seconds."
        ),
    )
    fake.add_argument(
        "--port", type=int, default=0, help="port to listen on; 0: any free port (default: 0)"
    )
    fake.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: %(default)s)"
    )
    fake.add_argument(
        "--name", default="fake", help="the name its lines are printed with (default: %(default)s)"
    )
    fake.add_argument(
        "--model", default="fake-model", help="the model /v1/models lists (default: %(default)s)"
    )
    fake.add_argument(
        "--ttft",
        type=_seconds,
        default=0.0,
        metavar="SECONDS",
        help="time to first token (default: %(default)s)",
    )
    fake.add_argument(
        "--tpot",
        type=_seconds,
        default=0.02,
        metavar="SECONDS",
        help="time per output token (default: %(default)s)",
    )
    fake.add_argument(
        "--tokens", type=int, default=8, help="tokens to send, tok0 tok1 … (default: %(default)s)"
    )
    fake.add_argument("--text", help="send these words instead of tok0 tok1 …")
    fake.add_argument(
        "--reasoning", type=int, default=0, help="reasoning tokens first (default: %(default)s)"
    )
    fake.add_argument(
        "--tool-call",
        type=_tool_call,
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="stream a tool call after the content (repeat; finish_reason tool_calls)",
    )
    fake.add_argument("--fail-status", type=int, metavar="CODE", help="answer this error status")
    fake.add_argument(
        "--retry-after", type=_seconds, metavar="SECONDS", help="Retry-After on the error"
    )
    fake.add_argument(
        "--error-delay",
        type=_seconds,
        default=0.0,
        metavar="SECONDS",
        help="seconds before the error (default: %(default)s)",
    )
    fake.add_argument("--stall-after", type=int, metavar="N", help="stall after N tokens")
    fake.add_argument("--cut-after", type=int, metavar="N", help="cut the connection after N")
    fake.add_argument("--http2", action="store_true", help="also accept h2c")
    fake.add_argument("--quiet", action="store_true", help="no line per request")


def run(args: argparse.Namespace) -> int:
    """Run ``serve`` or ``fake``; the exit status."""
    if args.command == "fake":
        return trio.run(_fake, args)
    return _serve(args)


def _serve(args: argparse.Namespace) -> int:
    try:
        from . import _serve  # noqa: F401 (fail early: the extra may be missing)
    except ImportError as exc:
        sys.stderr.write(
            f"trio-hedge serve needs the gateway extra ({exc.name} is missing): "
            "pip install 'trio-hedge[gateway]', or from a clone pip install -e '.[gateway]'\n"
        )
        return 2
    from ._config import ConfigError, load_config, with_flags
    from ._log_format import configure_logging
    from ._serve import serve
    from ._server import ListenError, raise_fd_limit

    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            sys.stderr.write(f"trio-hedge: environment variable {args.api_key_env} is not set\n")
            return 2
    hedger: dict[str, Any] = {}
    for flag in ("hedge_after", "pick", "first_token_timeout", "stall_timeout"):
        if getattr(args, flag) is not None:
            hedger[flag] = getattr(args, flag)
    limits: dict[str, Any] = {}
    for flag in (
        "max_concurrent",
        "request_timeout",
        "drain_delay",
        "drain_timeout",
        "write_timeout",
    ):
        if getattr(args, flag) is not None:
            limits[flag] = getattr(args, flag)
    try:
        config = load_config(args.config) if args.config else None
        config = with_flags(
            config,
            replicas=args.replica,
            api_key=api_key,
            host=args.host,
            port=args.port,
            hedger=hedger,
            limits=limits,
            http2=False if args.http1_only else None,
            log_format=args.log_format,
            workers=args.workers,
        )
    except (ConfigError, OSError) as exc:
        sys.stderr.write(f"trio-hedge: {exc}\n")
        return 2
    configure_logging(args.log_level, config.log_format)
    if config.state.redis_url is not None and importlib.util.find_spec("coredis") is None:
        sys.stderr.write(
            "trio-hedge: [state] redis_url needs the redis extra (coredis is missing): "
            "pip install 'trio-hedge[redis]'\n"
        )
        return 2
    if args.gc_threshold:
        _, gen1, gen2 = gc.get_threshold()
        gc.set_threshold(args.gc_threshold, gen1, gen2)
    raise_fd_limit()  # room for max_concurrent streams and their replicas' connections
    if args.worker:
        return _worker(config, args.worker)
    if config.workers > 1:
        from ._workers import supervise

        try:
            return trio.run(supervise, config, getattr(args, "argv", []))
        except ListenError as exc:
            return _cannot_listen(exc.filename, exc)
    try:
        trio.run(lambda: serve(config, handle_signals=True))
    except ListenError as exc:
        return _cannot_listen(exc.filename, exc)
    return 0


def _worker(config: Any, spec: str) -> int:
    """One of a supervisor's workers: the gateway on the sockets it was handed."""
    from ._serve import serve
    from ._workers import parse_worker, watch_supervisor, worker_listeners

    index, supervisor, fds = parse_worker(spec)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_supervisor, supervisor)
            listeners = worker_listeners(fds)
            await serve(config, handle_signals=True, listeners=listeners, worker=index)
            nursery.cancel_scope.cancel()

    trio.run(main)
    return 0


def _cannot_listen(where: str, exc: OSError) -> int:
    """One line naming the address, the reason and the flag; the exit status (2)."""
    reason = (exc.strerror or str(exc)).lower()
    sys.stderr.write(
        f"trio-hedge: cannot listen on {where}: {reason} (choose another port with --port)\n"
    )
    return 2


async def _fake(args: argparse.Namespace) -> int:
    from ..testing import Behaviour, FakeReplica

    behaviour = Behaviour(
        ttft=args.ttft,
        token_delay=args.tpot,
        tokens=args.text if args.text is not None else args.tokens,
        status=args.fail_status or 200,
        retry_after=args.retry_after,
        error_delay=args.error_delay,
        stall_after=args.stall_after,
        cut_after=args.cut_after,
        reasoning=args.reasoning,
        tool_calls=args.tool_call,
        finish_reason="tool_calls" if args.tool_call else "stop",
    )
    out = sys.stdout
    fake = FakeReplica(
        behaviour,
        name=args.name,
        http2=args.http2,
        model=args.model,
        host=args.host,
        port=args.port,
    )
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with contextlib.AsyncExitStack() as stack:
            try:
                replica = await stack.enter_async_context(fake)
            except OSError as exc:  # the port taken: one line, not a traceback
                return _cannot_listen(f"{args.host}:{args.port}", exc)
            out.write(f"fake replica {args.name!r} listening on {replica.url}\n")
            out.flush()
            async with trio.open_nursery() as nursery:

                async def report() -> None:
                    index = 0
                    while True:
                        record = await replica.wait_finished(index)
                        index += 1
                        if record.path.split("?")[0] != "/v1/chat/completions":
                            continue
                        ended = (
                            "client disconnected"
                            if record.disconnected_at is not None
                            else "completed"
                            if record.completed
                            else "ended"
                        )
                        took = (record.finished_at or record.received_at) - record.received_at
                        out.write(
                            f"request {index}: status {record.status}, {record.tokens_sent} "
                            f"tokens sent, {ended} after {took:.3f} s\n"
                        )
                        out.flush()

                if not args.quiet:
                    nursery.start_soon(report)
                async for _ in signals:
                    break
                nursery.cancel_scope.cancel()
    return 0
