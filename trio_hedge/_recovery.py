"""Recovery after the commit: when the winner breaks mid-answer, the answer goes on elsewhere.

The problem. Hedging protects the wait for the first token; after the commit a replica that
dies, stalls, sends a malformed event or an in-band error used to end the caller's answer with
`StreamInterrupted`. Honest, but a fleet can do better: another replica can finish the answer,
*if* the caller gets no gap, no duplicated text and no splice of two different answers. Gateways
that try get it wrong in known ways (LiteLLM's mid-stream fallback repeats or corrupts tool
calls and masks the real error when the fallback rejects assistant prefill: LiteLLM #27967,
#31067, #40404); NVIDIA Dynamo migrates a request token-exactly, but only inside its own stack.

Two methods, chosen per replica from what its source *declares* (``Source.continues``), never
by guessing:

* **continuation**: the request again, with the text delivered so far as a final assistant
  message, by the engine's own contract. ``"appends"`` (vLLM: ``continue_final_message``,
  ``add_generation_prompt: false``) answers only what follows; ``"repeats"`` (llama.cpp's
  server) repeats the prefix first, which is verified and stripped like a replay. Only when
  nothing but content reached the caller: a prefill cannot carry reasoning or tool calls;
* **replay and verify**: the original request again; its output is held back until it has
  reproduced what the caller has, exactly (`Gate`), and only what follows is relayed. If it
  diverges, the recovery fails (`ErrorKind.DIVERGED`). The only method once tool-call
  fragments (or reasoning) reached the caller.

A recovery is an attempt like any other (``trigger="recovery"``, with a `RecoveryRecord`): a
race of its own over the same planner (budget, throttle, ejection, ``max_attempts``; a
failover's rules) and nursery, one attempt at a time, at most the request's remaining
``max_recoveries``. A recovery that fails leaves the caller where the failure left it: the
`StreamInterrupted` names the *original* failure, never the recovery's (a prefill 400 must not
mask a cut).
"""

from __future__ import annotations

from collections.abc import Sequence

import trio

from ._plan import Planner
from ._race import Committed, Resume, race
from ._source import Source
from ._verify import Gate, tool_transcript
from .errors import HedgeError
from .events import Delta, FirstToken
from .report import RecoveryRecord, _Recorder

__all__ = ["recover"]


def _resume_plan(replaces: int, text: str, tokens: int, others: Sequence[Delta]) -> Resume:
    """How each recovery attempt goes on from ``text`` (``others``: the deltas with reasoning
    or tool calls the caller had): by continuation when its source declares how and only
    content was delivered, else by replay."""
    reasoning = "".join(d.reasoning for d in others)
    tools = tool_transcript(f for d in others for f in d.tool_calls)

    def plan(source: Source) -> tuple[str | None, Gate, RecoveryRecord]:
        how = getattr(source, "continues", None)
        if how in ("appends", "repeats") and not others:
            # An "appends" engine answers only what follows; a "repeats" one repeats it first.
            gate = Gate() if how == "appends" else Gate(text)
            return text, gate, RecoveryRecord(replaces, len(text), tokens, "continuation")
        return (
            None,
            Gate(text, reasoning, tools),
            RecoveryRecord(replaces, len(text), tokens, "replay"),
        )

    return plan


async def recover(
    planner: Planner,
    recorder: _Recorder,
    nursery: trio.Nursery,
    *,
    replaces: int,
    others: Sequence[Delta],
    limit: int,
    first_token: FirstToken,
    close_timeout: float,
    stall_timeout: float | None,
) -> Committed | None:
    """Race up to ``limit`` recovery attempts for the answer attempt ``replaces`` broke off.

    Returns the new winner (its relayed deltas pending, its stream owned by the caller), or
    ``None`` when no recovery got past the answer so far: no replica left, refused by the
    throttle, failed, diverged. What the recoveries raised stays in their records."""
    text = "".join(recorder.chunks)
    resume = _resume_plan(replaces, text, recorder.token_count, others)
    try:
        return await race(
            planner,
            recorder,
            nursery,
            first_token=first_token,
            close_timeout=close_timeout,
            resume=resume,
            stall_timeout=stall_timeout,
            limit=limit,
        )
    except HedgeError:
        return None
