"""What the race engine races: the [`Source`][trio_hedge.sources.Source] interface and its
implementations.

- [`Source`][trio_hedge.sources.Source], [`AttemptStream`][trio_hedge.sources.AttemptStream],
  [`AttemptInfo`][trio_hedge.sources.AttemptInfo]: the interface (a source opens one stream per
  attempt; the engine knows nothing else of it).
- [`iterator_source`][trio_hedge.sources.iterator_source] /
  [`IteratorSource`][trio_hedge.sources.IteratorSource]: any async-iterator factory.
- [`Replica`][trio_hedge.sources.Replica], [`HeaderNames`][trio_hedge.sources.HeaderNames],
  [`OpenAIChatSource`][trio_hedge.sources.OpenAIChatSource]: OpenAI-compatible chat completions over
  httpx (the `trio_hedge.sources.openai` package).
- [`trio_hedge.sources.anthropic`][trio_hedge.sources.anthropic] (``AnthropicReplica``: the
  Anthropic Messages API) and
  [`trio_hedge.sources.openai_responses`][trio_hedge.sources.openai_responses]
  (``ResponsesReplica``: the OpenAI Responses API): the same transport, errors and redaction,
  the same [`Delta`][trio_hedge.events.Delta]s.
- [`trio_hedge.sources.openai_sdk`][trio_hedge.sources.openai_sdk]: calls made through your own
  ``openai.AsyncOpenAI`` clients.
"""

from .._source import AttemptInfo, AttemptStream, Source
from .iterator import IteratorSource, iterator_source
from .openai import HeaderNames, OpenAIChatSource, Replica

__all__ = [
    "AttemptInfo",
    "AttemptStream",
    "HeaderNames",
    "IteratorSource",
    "OpenAIChatSource",
    "Replica",
    "Source",
    "iterator_source",
]
