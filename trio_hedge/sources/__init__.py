"""What the race engine races: the :class:`Source` interface and its implementations.

- :class:`Source`, :class:`AttemptStream`, :class:`AttemptInfo`: the interface (a source
  opens one stream per attempt; the engine knows nothing else of it).
- :func:`iterator_source` / :class:`IteratorSource`: any async-iterator factory.
- :class:`Replica`, :class:`HeaderNames`, :class:`OpenAIChatSource`: OpenAI-compatible chat
  completions over httpx (the :mod:`trio_hedge.sources.openai` package).
- :mod:`trio_hedge.sources.openai_sdk`: calls made through your own ``openai.AsyncOpenAI``
  clients.
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
