"""Ready-made ``on_event`` hooks for [`trio_hedge.Hedger`][trio_hedge.Hedger] (stamina-style: each
imports its library lazily, so the core depends on none of them):

```python
hedger = trio_hedge.Hedger(replicas, on_event=[LoggingHook(), PrometheusHook()])
```

A hook may return a context manager that wraps what the event began (an attempt, for
``attempt_started``): [`OpenTelemetryHook`][trio_hedge.instrumentation.OpenTelemetryHook] wraps each
attempt in a span that way.
"""

from ._logging import LoggingHook
from ._otel import OpenTelemetryHook
from ._prometheus import PrometheusHook

__all__ = ["LoggingHook", "OpenTelemetryHook", "PrometheusHook"]
