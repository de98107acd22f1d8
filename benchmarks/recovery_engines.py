"""Recovery after the commit on real engines: kill or freeze the winner mid-answer, and see
the answer complete on the other replica with the text the engine would have produced
(issue 17).

What it runs. Two replicas of one engine of ``../shared/engine2/`` (llama.cpp's C++
``llama-server`` with ``-np 4``, or vLLM 0.32 on CPU; the tiny random-weight model, model name
``tiny``, the same on both), started with that directory's scripts
(``benchmarks/_engines.py``) on free loopback ports and stopped on exit.
``--engine llama|vllm`` chooses. Every request is ``temperature: 0`` with ``max_tokens`` M
(the tiny model never stops before it: a complete answer has exactly M tokens), a seeded
prompt, a fresh ``Hedger`` (no hedging, ``stall_timeout`` 1 s, ``max_recoveries`` 2) on both
replicas:

* **reference**: the answer of one replica, uninterrupted (both replicas are asked: they
  must agree, else "the text the engine would have produced" means nothing);
* **kill**: once N tokens have reached the caller, the winner's engine (found from the
  stream's report) gets ``SIGKILL`` (llama-server: its process; vLLM: its process group,
  API server and engine core). The killed replica is restarted before the next request;
* **stop**: the same instant, ``SIGSTOP`` (a frozen engine: its socket stays open, nothing
  comes; the stall timeout ends the wait), and ``SIGCONT`` once the answer is over;
* **slow** (issue 28, "slow but alive"): the same instant, the winner starts to crawl
  (``SIGSTOP`` 0.5 s, ``SIGCONT`` 0.01 s, over and over: a few tokens a second where it gave
  hundreds, never a silence as long as the stall timeout); the Hedger has a throughput floor
  (``ThroughputFloor(window=2, ratio=0.1)``, learned from three warm-up answers on the same
  Hedger), which finishes the answer on the other replica;
* **silent** (issue 28, a recovery that never answers): the same instant the winner is
  frozen (``SIGSTOP``; on the fakes, killed), and the first replica the recovery goes to is a
  server that accepts the request and never sends a token (a third, fake replica between the
  two engines, tried first); with ``stall_timeout`` at its default (``None`` would never end:
  the recovery's own first-token deadline and hedge end it), the Hedger hedges the recovery
  to the other engine after ``hedge_after`` (2 s; 0.5 s on the fakes);

each with the replicas declaring their engine's continuation contract
(``continuation="llama.cpp"`` / ``"vllm"``) and without (replay and verify).

``--anchor`` (llama-server only) shows the anchor method on a real engine: a llama-server
started with an instruction-following chat template (ChatML) is asked to continue a cut
answer by anchor; the tiny random model does not follow instructions, so the anchor's repeat
is never found and the recovery is refused (diverged, the cut answer kept, nothing spliced),
while a scripted fake that follows the instruction is accepted, the answer whole.

Printed per engine × method × fault: answers complete / total; identical to the reference
(and for the others, the first differing character); the recovery time (from the signal to
the first token the recovery relayed, P50 / max, seconds); the answers' token counts against
M (an answer presented as complete but shorter than the uninterrupted one -- a proper prefix
of it, or with fewer than M content events when it differs -- is a **hidden truncation**:
must be 0; more than M is an answer past the caller's limit); wasted tokens: from the
engines' own counters (llama-server ``llamacpp:tokens_predicted_total``, vLLM
``vllm:generation_tokens_total``) the tokens
the *surviving* replicas generated beyond what the caller got from them (a killed engine's
counters die with it: its own undelivered tokens are not counted), and the report's
``held_back`` (a replay's regenerated prefix).

Without the engine it prints ``SKIP: …`` and exits 0 (CI builds neither). ``--quick``
(unless ``--engine`` is given) runs the same scenarios on two
``trio_hedge.testing.FakeReplica`` servers that answer like a deterministic engine (both
continuation contracts, ``max_tokens`` honoured):
"kill" closes the winner's server mid-answer (a fresh pair per request), "stop" makes the
primary stall at token N. Hold the engine lock for an engine run:
``flock /tmp/engine.lock python benchmarks/recovery_engines.py --engine llama``.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import random
import re
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import attrs
import httpx
import trio
from rich.console import Console
from rich.table import Table

import trio_hedge as th
from trio_hedge._recovery import ANCHOR_INSTRUCTION
from trio_hedge._verify import anchor_of
from trio_hedge.policy import HedgerConfig, RecoveryPolicy, ThroughputFloor
from trio_hedge.testing import Behaviour, FakeReplica, RequestRecord

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import percentile
from _engines import (
    Engine,
    free_port,
    missing,
    parse_metrics,
    start_replica,
    started,
    stop_replica,
)
from real_engine import WORDS

METHODS = ("continuation", "replay")
FAULTS = ("kill", "stop", "slow", "silent")
#: Warm-up answers on the measured Hedger before a "slow" request: the throughput floor
#: judges a (replica, model) only once it has learned its rate from this many.
WARM_UP = 3
#: The counter of generated tokens each engine's /metrics has.
GENERATED = {"llama": "llamacpp:tokens_predicted_total", "vllm": "vllm:generation_tokens_total"}


@attrs.frozen
class Params:
    requests: int  # per method and fault
    kills: int  # kill requests per method (a vLLM restart takes ~35 s)
    max_tokens: int  # M
    fault_after: int  # N: tokens the caller has when the signal goes
    stall_timeout: float
    seed: int


def prompts(p: Params) -> list[str]:
    rng = random.Random(p.seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))) for _ in range(p.requests)
    ]


def request_body(p: Params, prompt: str) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": p.max_tokens,
        "temperature": 0.0,
    }


# -- the replicas: real engines or fakes ----------------------------------------------------------


class Pair(Protocol):
    """Two replicas and the faults the benchmark can put on one of them (0 or 1)."""

    @property
    def kind(self) -> str: ...
    @property
    def urls(self) -> list[str]: ...

    async def fault(self, index: int, fault: str, nursery: trio.Nursery) -> None: ...
    async def after(self, index: int, fault: str) -> None: ...
    async def generated(self, client: httpx.AsyncClient) -> list[float | None]: ...


@attrs.define
class EnginePair:
    """Two engine replicas: signals to their processes, restarts, their counters."""

    engine: Engine
    console: Console
    leaders: list[int]
    crawling: trio.CancelScope | None = None

    @property
    def kind(self) -> str:
        return self.engine.kind

    @property
    def urls(self) -> list[str]:
        return self.engine.urls

    def _signal(self, index: int, signum: int) -> None:
        leader = self.leaders[index]
        if self.kind == "vllm":  # setsid: API server and engine core, one group of its own
            os.killpg(leader, signum)
        else:  # one process, in the start script's (our) process group: the process only
            os.kill(leader, signum)

    async def fault(self, index: int, fault: str, nursery: trio.Nursery) -> None:
        if fault == "slow":
            self.crawling = trio.CancelScope()
            nursery.start_soon(self._crawl, index, self.crawling)
            return
        self._signal(index, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)

    async def _crawl(self, index: int, scope: trio.CancelScope) -> None:
        """Stop and continue the engine over and over: alive, a few tokens a second."""
        try:
            with scope:
                while True:
                    self._signal(index, signal.SIGSTOP)
                    await trio.sleep(0.5)
                    self._signal(index, signal.SIGCONT)
                    await trio.sleep(0.01)
        finally:
            self._signal(index, signal.SIGCONT)

    async def after(self, index: int, fault: str) -> None:
        if fault == "slow" and self.crawling is not None:
            self.crawling.cancel()  # (the request's end cancelled it already)
            self.crawling = None
            self._signal(index, signal.SIGCONT)
        if fault in ("stop", "silent"):
            self._signal(index, signal.SIGCONT)
        elif fault == "kill":
            port = int(self.urls[index].rsplit(":", 1)[1].split("/")[0])
            await trio.to_thread.run_sync(stop_replica, self.kind, port)  # its pid file
            self.leaders[index] = await trio.to_thread.run_sync(
                start_replica, self.kind, port, self.console
            )
        async with httpx.AsyncClient() as client:
            await self.engine.wait_idle(client, "tiny")

    async def generated(self, client: httpx.AsyncClient) -> list[float | None]:
        out: list[float | None] = []
        for root in self.engine.roots():
            text = (await client.get(root + "/metrics", timeout=30)).text
            out.append(parse_metrics(text).get(GENERATED[self.kind]))
        return out


def fake_tokens(prompt: str, count: int) -> tuple[str, ...]:
    """A deterministic engine's answer to ``prompt`` (the same on every replica)."""
    seed = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big")
    rng = random.Random(seed)
    return tuple(" " + rng.choice(WORDS) for _ in range(count))


@attrs.define
class FakeEngine:
    """A fake replica that answers as a deterministic engine at temperature 0: the same
    tokens for the same prompt, ``max_tokens`` of them (``finish_reason="length"``), vLLM's
    and llama.cpp's continuation contracts; the primary stalls at token N when told to."""

    p: Params
    stall_primary: bool = False
    slow_primary: bool = False
    calls: int = 0

    def __call__(self, record: RequestRecord) -> Behaviour:
        self.calls += 1
        body = record.json
        limit = body["max_tokens"]
        messages = body["messages"]
        tokens = fake_tokens(messages[0]["content"], 4 * self.p.max_tokens)
        pace: dict[str, Any] = {"ttft": 0.01, "token_delay": 0.003, "finish_reason": "length"}
        if messages[-1]["role"] == "assistant":
            have = messages[-1]["content"]
            count = next(i for i in range(len(tokens) + 1) if "".join(tokens[:i]) == have)
            after = tokens[count : count + limit]
            if body.get("continue_final_message"):
                return Behaviour(tokens=after, **pace)
            return Behaviour(tokens=tokens[:count] + after, **pace)
        primary = record.headers.get("x-hedge-attempt") == "1"
        stall = self.stall_primary and primary
        # The answer after the warm-ups crawls (one token a second) from token N.
        slow = self.slow_primary and primary and self.calls == WARM_UP + 1
        return Behaviour(
            tokens=tokens[:limit],
            stall_after=self.p.fault_after if stall else None,
            slow_after=self.p.fault_after if slow else None,
            **pace,
        )


@attrs.define
class FakePair:
    """Two fakes, each served by a task of its own, so either can go at any time."""

    kind: str
    fakes: list[FakeReplica]
    scopes: list[trio.CancelScope]
    gone: list[trio.Event]

    @property
    def urls(self) -> list[str]:
        return [f.url for f in self.fakes]

    async def fault(self, index: int, fault: str, nursery: trio.Nursery) -> None:
        if fault in ("kill", "silent"):  # the server goes: its connections close mid-answer
            self.scopes[index].cancel()
            await self.gone[index].wait()
        # "stop", "slow": the primary's behaviour stalls or crawls at token N by itself

    async def after(self, index: int, fault: str) -> None:
        pass

    async def generated(self, client: httpx.AsyncClient) -> list[float | None]:
        return [float(sum(r.tokens_sent for r in f.requests)) for f in self.fakes]


async def _serve(
    fake: FakeReplica,
    scope: trio.CancelScope,
    gone: trio.Event,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    try:
        with scope:
            async with fake:
                task_status.started()
                await trio.sleep_forever()
    finally:
        gone.set()


@asynccontextmanager
async def fake_pair(p: Params, fault: str) -> AsyncIterator[FakePair]:
    """A fresh pair per request (a killed fake is gone)."""
    fakes = [
        FakeReplica(
            FakeEngine(p, stall_primary=fault == "stop", slow_primary=fault == "slow"),
            name=f"r{i}",
        )
        for i in (0, 1)
    ]
    pair = FakePair(
        "fake", fakes, [trio.CancelScope(), trio.CancelScope()], [trio.Event(), trio.Event()]
    )
    async with trio.open_nursery() as nursery:
        for fake, scope, gone in zip(fakes, pair.scopes, pair.gone, strict=True):
            await nursery.start(_serve, fake, scope, gone)
        yield pair
        nursery.cancel_scope.cancel()


# -- one request ----------------------------------------------------------------------------------


@attrs.frozen
class Outcome:
    completed: bool
    text: str
    tokens: int
    finish: str | None
    recovery_time: float | None  # from the signal to the recovery's first relayed token
    wasted: float | None  # surviving engines' tokens the caller did not get from them
    held_back: int
    error: str | None
    methods: tuple[str, ...] = ()  # each recovery's method, in order


def config_for(p: Params, fault: str | None) -> HedgerConfig:
    """The Hedger of one request: no hedging before the commit, the stall timeout; for
    "slow" a throughput floor, for "silent" a 2 s hedge delay (the recovery's own hedge)."""
    config = HedgerConfig(
        hedge_after=None,
        stall_timeout=p.stall_timeout,
        outlier_detection=None,
        pick="in_order",
    )
    if fault == "slow":
        window = 0.5 if p.stall_timeout < 1 else 2.0  # the fakes' pace is 333 tokens/s
        floor = ThroughputFloor(window=window, ratio=0.1, min_samples=WARM_UP, min_tokens=8)
        config = attrs.evolve(config, recovery=RecoveryPolicy(throughput_floor=floor))
    elif fault == "silent":  # (the fakes' answers take 0.1 s: a shorter delay there)
        config = attrs.evolve(config, hedge_after=0.5 if p.stall_timeout < 1 else 2.0)
    return config


async def one(
    pair: Pair,
    p: Params,
    prompt: str,
    method: str,
    fault: str | None,
    hole: str | None = None,
) -> Outcome:
    """One request over a fresh Hedger; ``fault`` on its winner once N tokens arrived
    (``hole``: a replica that never answers, tried first by the recovery)."""
    declared = {"llama": "llama.cpp", "vllm": "vllm", "fake": "vllm"}[pair.kind]
    continuation: Any = declared if method == "continuation" else None
    replicas = [
        th.Replica(url, name=f"r{i}", continuation=continuation) for i, url in enumerate(pair.urls)
    ]
    if fault == "silent" and hole is not None:
        replicas.insert(1, th.Replica(hole, name="hole", continuation=continuation))
    config = config_for(p, fault)
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=5.0)) as client:
        text, tokens, finish, error = "", 0, None, None
        faulted: int | None = None
        fault_at = next_at = None
        async with th.Hedger(replicas, config, client=client) as hedger:
            if fault == "slow":  # the floor learns each replica's rate first
                for _ in range(WARM_UP):
                    async with hedger.stream(request_body(p, prompt)) as warm:
                        [t async for t in warm]
            before = await pair.generated(client)
            try:
                with trio.fail_after(120):
                    async with trio.open_nursery() as nursery:
                        try:
                            async with hedger.stream(request_body(p, prompt)) as stream:
                                async for delta in stream.events():
                                    if delta.finish_reason:
                                        finish = delta.finish_reason
                                    if not delta.content:
                                        continue
                                    text += delta.content
                                    tokens += 1
                                    now = trio.current_time()
                                    recovering = fault_at is not None and next_at is None
                                    if recovering and stream.recovered:
                                        next_at = now
                                    if fault is None or faulted is not None:
                                        continue
                                    if tokens == p.fault_after:
                                        report = stream.report
                                        assert report.winner is not None
                                        name = report.attempts[report.winner - 1].replica
                                        faulted = int(name[1:])
                                        fault_at = trio.current_time()
                                        await pair.fault(faulted, fault, nursery)
                        finally:
                            nursery.cancel_scope.cancel()  # a crawl ends with the answer
            except th.StreamInterrupted as exc:
                error = f"{exc.error.kind.value} at {exc.error.replica}"
            report = stream.report
        if faulted is not None:
            await pair.after(faulted, fault or "")
        after = await pair.generated(client)
    got: dict[str, int] = {}
    for a in report.attempts:
        held = a.recovery.held_back if a.recovery is not None else 0  # received, not relayed
        got[a.replica] = got.get(a.replica, 0) + a.tokens_received - held
    wasted: float | None = 0.0
    for i, (b, e) in enumerate(zip(before, after, strict=True)):
        if i == faulted and fault == "kill" and pair.kind != "fake":
            continue  # restarted: its counters began again
        if b is None or e is None or wasted is None:
            wasted = None
            continue
        wasted += e - b - got.get(f"r{i}", 0)
    held = sum(a.recovery.held_back for a in report.attempts if a.recovery is not None)
    recovery = None if fault_at is None or next_at is None else next_at - fault_at
    methods = tuple(a.recovery.method for a in report.attempts if a.recovery is not None)
    return Outcome(report.completed, text, tokens, finish, recovery, wasted, held, error, methods)


async def reference(pair: Pair, p: Params, prompt: str) -> tuple[str, bool]:
    """The uninterrupted answer of replica 0, and whether replica 1 gives the same."""
    answers = []
    async with httpx.AsyncClient(timeout=60.0) as client:
        for url in pair.urls:
            body = {**request_body(p, prompt), "stream": False}
            answer = (await client.post(url + "/chat/completions", json=body)).json()
            answers.append(answer["choices"][0]["message"]["content"])
    return answers[0], answers[0] == answers[1]


async def _generated_ids(
    client: httpx.AsyncClient, kind: str, url: str, p: Params, prompt: str
) -> tuple[list[int], list[int]]:
    """The prompt's tokens and the tokens the engine generates for it (temperature 0)."""
    root = url.removesuffix("/v1")
    user = [{"role": "user", "content": prompt}]
    if kind == "vllm":
        body = {**request_body(p, prompt), "logprobs": True, "return_tokens_as_token_ids": True}
        answer = (await client.post(url + "/chat/completions", json=body)).json()
        ids = [int(t["token"].split(":")[1]) for t in answer["choices"][0]["logprobs"]["content"]]
        ask = {"model": "tiny", "messages": user, "add_generation_prompt": True}
        return (await client.post(root + "/tokenize", json=ask)).json()["tokens"], ids
    text = (await client.post(root + "/apply-template", json={"messages": user})).json()["prompt"]
    ask = {"prompt": text, "n_predict": p.max_tokens, "temperature": 0, "n_probs": 1}
    answer = (await client.post(root + "/completion", json=ask)).json()
    return [], [t["id"] for t in answer["completion_probabilities"]]


async def round_trips(pair: EnginePair, p: Params) -> tuple[int, int]:
    """Of the generated prefixes (1 to M-1 tokens of each prompt's answer), how many an
    engine reads back as the tokens it generated when given their text, as a continuation
    gives it: vLLM's ``/tokenize`` of the continuation's messages, llama-server's
    ``/tokenize`` of the ``/detokenize``d text (its SentencePiece-style leading space
    aside). A prefix that does not round-trip is continued from other tokens."""
    same = total = 0
    url = pair.urls[0]
    root = url.removesuffix("/v1")
    async with httpx.AsyncClient(timeout=60.0) as client:
        for prompt in prompts(p):
            base, ids = await _generated_ids(client, pair.kind, url, p, prompt)
            for k in range(1, len(ids)):
                if pair.kind == "vllm":
                    pieces = {"model": "tiny", "tokens": ids[:k]}
                    text = (await client.post(root + "/detokenize", json=pieces)).json()["prompt"]
                    messages = [
                        {"role": "user", "content": prompt},
                        {"role": "assistant", "content": text},
                    ]
                    ask = {"model": "tiny", "messages": messages, "add_generation_prompt": False,
                           "continue_final_message": True}  # fmt: skip
                    back = (await client.post(root + "/tokenize", json=ask)).json()["tokens"]
                    ok = back == base + ids[:k]
                else:
                    pieces = {"tokens": ids[:k]}
                    text = (await client.post(root + "/detokenize", json=pieces)).json()["content"]
                    ask = {"content": text, "add_special": False}
                    back = (await client.post(root + "/tokenize", json=ask)).json()["tokens"]
                    ok = back == ids[:k] or back[1:] == ids[:k]
                same += ok
                total += 1
    return same, total


# -- the scenarios -------------------------------------------------------------------------------


@attrs.frozen
class Row:
    method: str
    fault: str
    outcomes: tuple[Outcome, ...]
    references: tuple[str, ...]


def divergence(a: str, b: str) -> int:
    """The first character where ``a`` and ``b`` differ."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


async def run_all(p: Params, engine: EnginePair | None, console: Console) -> tuple[list[Row], int]:
    texts = prompts(p)
    refs: list[str] = []
    agree = 0
    rows: list[Row] = []

    @asynccontextmanager
    async def pair_for(fault: str) -> AsyncIterator[Pair]:
        if engine is not None:
            yield engine
        else:
            async with fake_pair(p, fault) as pair:
                yield pair

    for prompt in texts:
        async with pair_for("none") as pair:
            ref, same = await reference(pair, p, prompt)
        refs.append(ref)
        agree += same
    async with pair_for("none") as pair:
        plain = [await one(pair, p, prompt, "replay", None) for prompt in texts]
    rows.append(Row("-", "none (reference)", tuple(plain), tuple(refs)))
    # The replica that never answers (headers at once, no token for an hour): a recovery
    # sent to it is the "silent" fault's.
    async with FakeReplica(Behaviour(ttft=3600.0), name="hole") as hole:
        for method in METHODS:
            for fault in FAULTS:
                count = p.kills if fault == "kill" else p.requests
                outcomes = []
                for prompt in texts[:count]:
                    async with pair_for(fault) as pair:
                        outcomes.append(await one(pair, p, prompt, method, fault, hole.url))
                rows.append(Row(method, fault, tuple(outcomes), tuple(refs[:count])))
                console.print(f"  {method} × {fault}: done")
    return rows, agree


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def _methods(outs: Sequence[Outcome]) -> str:
    """How many recoveries, by method (``"5 continuation"``)."""
    counts: dict[str, int] = {}
    for o in outs:
        for m in o.methods:
            counts[m] = counts.get(m, 0) + 1
    return ", ".join(f"{n} {m}" for m, n in counts.items()) or "0"


def print_table(console: Console, rows: Sequence[Row], p: Params, label: str, agree: int) -> None:
    table = Table(
        title=f"recovery after the commit on {label}: fault after {p.fault_after} of "
        f"{p.max_tokens} tokens, stall_timeout {p.stall_timeout} s"
    )
    for column in (
        "method",
        "fault",
        "complete",
        "recoveries",
        "= reference",
        "first divergence (chars)",
        "recovery P50 s",
        "recovery max s",
        "tokens = M / < M / > M",
        "hidden truncations",
        "wasted (engines)",
        "held back (report)",
        "errors",
    ):
        table.add_column(column)
    for row in rows:
        outs = row.outcomes
        same = [o.text == r for o, r in zip(outs, row.references, strict=True)]
        diverged = [
            str(divergence(o.text, r))
            for o, r, s in zip(outs, row.references, same, strict=True)
            if not s
        ]
        times = [o.recovery_time for o in outs if o.recovery_time is not None]
        hidden = sum(truncated(o, r, p) for o, r in zip(outs, row.references, strict=True))
        wasted = [o.wasted for o in outs]
        errors = sorted({o.error for o in outs if o.error})
        table.add_row(
            row.method,
            row.fault,
            f"{sum(o.completed for o in outs)}/{len(outs)}",
            _methods(outs),
            f"{sum(same)}/{len(outs)}",
            ", ".join(diverged) or "-",
            _num(percentile(times, 50)) if times else "-",
            _num(max(times)) if times else "-",
            f"{sum(o.tokens == p.max_tokens for o in outs)} / "
            f"{sum(o.tokens < p.max_tokens for o in outs)} / "
            f"{sum(o.tokens > p.max_tokens for o in outs)}",
            str(hidden),
            "-" if None in wasted else _num(sum(w or 0.0 for w in wasted), 0),
            str(sum(o.held_back for o in outs)),
            "; ".join(e for e in errors if e) or "-",
        )
    console.print(table)
    console.print(f"both replicas gave the same reference answer: {agree}/{len(rows[0].outcomes)}")


def truncated(o: Outcome, reference: str, p: Params) -> bool:
    """Whether ``o`` is a hidden truncation: presented as complete, and shorter than the
    answer. An answer identical to the reference is whole, however many content events
    carried it (vLLM packs several tokens into one event when its front falls behind: fewer
    events than M is then no truncation); a proper prefix of the reference is one; an answer
    that differs (a continuation of re-tokenized text) is one when it has fewer than M."""
    if not o.completed or o.text == reference:
        return False
    return reference.startswith(o.text) or o.tokens < p.max_tokens


def check(console: Console, rows: Sequence[Row], p: Params, strict: bool) -> bool:
    """No hidden truncation ever; on the fakes also every answer complete and identical."""
    hidden = sum(
        truncated(o, ref, p) for r in rows for o, ref in zip(r.outcomes, r.references, strict=True)
    )
    if hidden:
        console.print(f"FAIL: {hidden} hidden truncation(s)")
        return False
    if strict:
        for row in rows:
            for o, ref in zip(row.outcomes, row.references, strict=True):
                if not o.completed or o.text != ref or o.finish != "length":
                    console.print(f"FAIL: {row.method} × {row.fault}: {o}")
                    return False
    return True


# -- the anchor method on a real engine ------------------------------------------------------

#: The answer the anchor demo's primary gives (and a scripted fake continues), word by word.
STORY = (
    'The keeper climbed the stairs at dusk, as he had every evening for thirty years. "One '
    'more night," he said to the gulls, and lit the lamp. Far out, a small boat was turning '
    "toward the rocks, and he reached for the horn before the light had finished its first "
    "sweep across the water."
)


async def anchor_demo(engine_url: str | None, console: Console) -> bool:
    """A winner cut after 20 words, recovered by the anchor method on (1) a llama-server with
    an instruction-following chat template, whose tiny random model does not follow the
    instruction (its repeat is never found: refused, the cut answer kept), and (2) a scripted
    fake that does (accepted, the answer whole). True when both behave so."""
    words = re.findall(r"\S+\s*", STORY)
    cut = Behaviour(tokens=words, cut_after=20, token_delay=0.001)
    scripted = Behaviour(tokens=words, continuation="anchor", token_delay=0.001)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story."}]}
    body["max_tokens"] = 96
    body["temperature"] = 0.0
    table = Table(title="the anchor method: a recovery by instruction, verified")
    for column in ("recovery target", "outcome", "recovery", "verified", "text the caller has"):
        table.add_column(column)
    ok = True
    async with FakeReplica(cut, name="primary") as primary, FakeReplica(scripted) as fake:
        targets = [("scripted fake (follows it)", fake.url)]
        if engine_url is not None:
            targets.insert(0, ("llama-server, ChatML template, tiny random model", engine_url))
        for label, url in targets:
            replicas = [
                th.Replica(primary.url, name="primary"),
                th.Replica(url, name="target", continuation="anchor"),
            ]
            config = HedgerConfig(hedge_after=None, outlier_detection=None, pick="in_order")
            error = None
            async with th.Hedger(replicas, config) as hedger:
                try:
                    with trio.fail_after(120):
                        async with hedger.stream(body) as stream:
                            [t async for t in stream]
                except th.StreamInterrupted as exc:
                    error = exc
            report = stream.report
            (attempt,) = [a for a in report.attempts if a.recovery is not None]
            assert attempt.recovery is not None
            kind = attempt.error.kind.value if attempt.error else attempt.outcome.value
            table.add_row(
                label,
                "complete"
                if report.completed
                else f"interrupted ({error and error.error.kind.value})",
                f"{attempt.recovery.method}: {kind}",
                str(attempt.recovery.verified),
                repr(report.text[-60:]),
            )
            if url == fake.url:
                ok = ok and report.completed and report.text == STORY
            else:
                ok = ok and not report.completed and report.text == "".join(words[:20])
                ok = ok and attempt.error is not None and attempt.error.kind.value == "diverged"
        if engine_url is not None:
            # What the engine answered the same instruction (asked directly): not a repeat.
            text = "".join(words[:20])
            ask = dict(body)
            ask["messages"] = [
                *body["messages"],
                {"role": "assistant", "content": text},
                {"role": "user", "content": ANCHOR_INSTRUCTION.format(anchor=anchor_of(text))},
            ]
            async with httpx.AsyncClient(timeout=60.0) as client:
                answer = await client.post(engine_url + "/chat/completions", json=ask)
            said = answer.json()["choices"][0]["message"]["content"]
            console.print(f"the engine's answer to the instruction: {said[:120]!r}")
    console.print(table)
    return ok


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--engine",
        choices=("llama", "vllm", "fake"),
        default=None,
        help="default: llama; with --quick, the fakes (CI runs it: no engine, no engine lock)",
    )
    parser.add_argument("--requests", type=int, default=5, help="per method and fault")
    parser.add_argument(
        "--kills", type=int, default=None, help="kill requests per method (default: --requests)"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--fault-after", type=int, default=24)
    parser.add_argument("--stall-timeout", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run (on the fakes unless --engine is given)"
    )
    parser.add_argument(
        "--anchor",
        action="store_true",
        help="only the anchor method's demo: llama-server with a ChatML template (and a "
        "scripted fake; with --quick, the fake alone)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the engines
    console = Console(width=220)
    kind = args.engine or ("fake" if args.quick else "llama")
    requests = 3 if args.quick else args.requests
    p = Params(
        requests=requests,
        kills=min(requests, args.kills if args.kills is not None else requests),
        max_tokens=24 if args.quick else args.max_tokens,
        fault_after=8 if args.quick else args.fault_after,
        stall_timeout=0.2 if kind == "fake" else args.stall_timeout,
        seed=args.seed,
    )
    console.print(
        f"parameters: {attrs.asdict(p)}; load average {os.getloadavg()}, nproc {os.cpu_count()}"
    )
    if args.anchor or args.quick:
        anchored = run_anchor(kind if args.anchor else "fake", console)
        if args.anchor:
            return 0 if anchored else 1
        if not anchored:
            return 1
    if kind == "fake":
        console.print("no engine: two trio_hedge.testing fakes that answer like one (--quick)")
        rows, agree = trio.run(partial(run_all, p, None, console))
        label = "fakes"
    else:
        why = missing(kind)
        if why is not None:
            console.print(f"SKIP: {why}: nothing to measure.")
            return 0
        with started(kind, console) as engine:
            pair = EnginePair(engine, console, list(engine.leaders))
            rows, agree = trio.run(partial(run_all, p, pair, console))
            trips = trio.run(round_trips, pair, p)
        label = {"llama": "llama-server (-np 4)", "vllm": "vLLM CPU"}[kind]
    print_table(console, rows, p, label, agree)
    if kind != "fake":
        console.print(
            "generated prefixes whose text the engine reads back as the same tokens "
            f"(a continuation goes on from exactly the engine's own state): {trips[0]}/{trips[1]}"
        )
    console.print(f"load average after: {os.getloadavg()}")
    return 0 if check(console, rows, p, strict=kind == "fake") else 1


def run_anchor(kind: str, console: Console) -> bool:
    """The anchor demo on a llama-server started with ``--chat-template chatml`` (``kind``
    ``"llama"``), or on the scripted fake alone."""
    if kind != "llama":
        return trio.run(anchor_demo, None, console)
    why = missing("llama")
    if why is not None:
        console.print(f"SKIP: {why}: the anchor demo on the fake alone.")
        return trio.run(anchor_demo, None, console)
    port = free_port()
    os.environ["EXTRA_ARGS"] = "--chat-template chatml"
    try:
        start_replica("llama", port, console)
        return trio.run(anchor_demo, f"http://127.0.0.1:{port}/v1", console)
    finally:
        os.environ.pop("EXTRA_ARGS", None)
        stop_replica("llama", port)


if __name__ == "__main__":
    sys.exit(main())
