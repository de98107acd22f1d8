"""What the race engine races: the :class:`Source` interface and its implementations."""

from ._base import AttemptInfo, AttemptStream, Source
from .iterator import IteratorSource, iterator_source
from .openai_http import HeaderNames, OpenAIChatSource, Replica

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
