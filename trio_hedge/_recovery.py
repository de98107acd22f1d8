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
* **anchor**: for targets without assistant prefill (hosted APIs that answer 400 to it, the
  Messages and Responses APIs), declared ``"anchor"``: the text so far as an assistant turn,
  then a user turn telling the model to go on from where it stopped, repeating the answer's
  last ~40 characters first (the dario gateway's v6.1 resumes this way). The repeat is found
  and trimmed (`AnchorGate`); none, or two, is a divergence. Only when nothing but content
  reached the caller;
* **replay and verify**: the original request again; its output is held back until it has
  reproduced what the caller has, exactly (`Gate`), and only what follows is relayed. If it
  diverges, the recovery fails (`ErrorKind.DIVERGED`). The only method once tool-call
  fragments (or reasoning) reached the caller, and for a request under guided decoding (its
  source declares no continuation: a continuation restarts a JSON schema or grammar at its
  root, as NVIDIA Dynamo's migration knows).

The recovery phase is a race of its own, beside the race and the relay, over the same planner
(budget, throttle, ejection, ``max_attempts``: a failover's rules) and nursery, at most the
request's remaining ``max_recoveries`` attempts. Each has a first-token deadline of its own
(the planner's ``recovery_deadline``: from what the fleet learned for that replica, model and
prompt size): a recovery on a replica that never answers is abandoned and the next one tried,
and a prefill is never called a stall; a second recovery may go as a hedge when the first has
no output after the planner's ``recovery_hedge_delay`` (within the hedge budget). Each is an
attempt like any other (``trigger="recovery"``, with a `RecoveryRecord` saying what the
planner's judge needs: the deadline, whether it was hedged, when its first output came). A
recovery that fails leaves the caller where the failure left it: the `StreamInterrupted` names
the *original* failure, never the recovery's (a prefill 400 must not mask a cut).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import trio

from ._plan import Planner
from ._race import Committed, Resume, ResumePlan, race
from ._source import Source
from ._verify import AnchorGate, Gate, anchor_of, tool_transcript
from .errors import HedgeError
from .events import Delta, FirstToken
from .report import RecoveryRecord, _Recorder

__all__ = ["ANCHOR_INSTRUCTION", "recover"]

#: The user turn of an anchor continuation (``{anchor}``: the answer's last characters).
ANCHOR_INSTRUCTION = (
    "Your previous reply was cut off. Continue it from exactly where it stopped. Begin your "
    "reply by repeating, word for word, the last characters of your previous reply, which "
    "are between <<< and >>> here: <<<{anchor}>>>, then go on with the rest of the reply. "
    "Write nothing before them and repeat nothing else."
)
#: Characters per token for the prompt tokens a recovery's request adds (an estimate, as the
#: Hedger's own: ``HedgerConfig.chars_per_token``'s default).
_CHARS_PER_TOKEN = 4.0


def _resume_plan(
    replaces: int, text: str, tokens: int, others: Sequence[Delta], reason: str | None
) -> Resume:
    """How each recovery attempt goes on from ``text`` (``others``: the deltas with reasoning
    or tool calls the caller had): by continuation or anchor when its source declares how and
    only content was delivered, else by replay."""
    reasoning = "".join(d.reasoning for d in others)
    tools = tool_transcript(f for d in others for f in d.tool_calls)

    def record(method: str, added: int) -> RecoveryRecord:
        return RecoveryRecord(
            replaces, len(text), tokens, method, reason=reason, prompt_added=added
        )

    def plan(source: Source) -> ResumePlan:
        how = getattr(source, "continues", None)
        if how in ("appends", "repeats") and not others and text:
            # An "appends" engine answers only what follows; a "repeats" one repeats it first.
            gate = Gate() if how == "appends" else Gate(text)
            return ResumePlan(text, None, gate, record("continuation", tokens))
        if how == "anchor" and not others and text:
            anchor = anchor_of(text)
            instruction = ANCHOR_INSTRUCTION.format(anchor=anchor)
            added = tokens + math.ceil(len(instruction) / _CHARS_PER_TOKEN)
            anchored = AnchorGate(anchor, ends_with_space=text[-1:].isspace())
            return ResumePlan(text, instruction, anchored, record("anchor", added))
        return ResumePlan(None, None, Gate(text, reasoning, tools), record("replay", 0))

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
    reason: str | None = None,
) -> Committed | None:
    """Race up to ``limit`` recovery attempts for the answer attempt ``replaces`` broke off
    (``reason``: the kind of its failure, for the records).

    Returns the new winner (its relayed deltas pending, its stream owned by the caller), or
    ``None`` when no recovery got past the answer so far: no replica left, refused by the
    throttle, failed, diverged. What the recoveries raised stays in their records."""
    text = "".join(recorder.chunks)
    resume = _resume_plan(replaces, text, recorder.token_count, others, reason)
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
