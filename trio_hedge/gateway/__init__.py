"""``trio-hedge serve``: an OpenAI-compatible gateway that hedges with first-token commit.

Any client (the official ``openai`` SDKs, LangChain, curl) points its ``base_url`` here; the
gateway races the upstream replicas through the library's public [`Hedger`][trio_hedge.Hedger]
and relays the winner's events as they arrive. Needs the ``gateway`` extra (hypercorn,
prometheus-client). See ``docs/gateway.md``.

The configuration names import without the extra; [`serve`][trio_hedge.gateway.serve] and
[`GatewayApp`][trio_hedge.gateway.GatewayApp] import it when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._config import (
    ConfigError,
    GatewayConfig,
    GatewayKey,
    Group,
    Limits,
    StateConfig,
    load_config,
    parse_config,
)

if TYPE_CHECKING:
    from ._app import GatewayApp
    from ._serve import serve

__all__ = [
    "ConfigError",
    "GatewayApp",
    "GatewayConfig",
    "GatewayKey",
    "Group",
    "Limits",
    "StateConfig",
    "load_config",
    "parse_config",
    "serve",
]


def __getattr__(name: str) -> Any:
    if name == "serve":
        from ._serve import serve

        return serve
    if name == "GatewayApp":
        from ._app import GatewayApp

        return GatewayApp
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
