"""Ready-made ``on_event`` hooks for :class:`trio_hedge.Hedger` (stamina-style: each imports
its library lazily, so the core depends on none of them)::

    hedger = trio_hedge.Hedger(replicas, on_event=[LoggingHook(), PrometheusHook()])
"""

from ._logging import LoggingHook
from ._prometheus import PrometheusHook

__all__ = ["LoggingHook", "PrometheusHook"]
