"""Shared state back ends: what one process, or a fleet of gateways, keeps between requests.

Two contracts, each with an in-process implementation and a Redis one (``coredis``):

* `FleetStore`: the slow, shared part of a fleet's view (ejections and cooldowns per
  (replica, model), the learned hedge delay's TTFT samples). Only the fleet's single writer
  (``policy/_writer.py``) publishes to it and applies what it brings from other processes.
* `KeyLedger`: each gateway key's admission leases (concurrency, request rate, tokens per
  minute): reserve an estimate at admission, settle on the answer's reported usage, release on
  failure, expire when the process holding them dies (litellm-rs's admission leases).
  In-process: `LocalKeyLedger`.

Back ends here: `LocalFleetStore` (shares nothing: one process's view),
`RedisFleetStore` and `RedisKeyLedger` (every process of a fleet through one Redis; they
import ``coredis``, the ``redis`` extra, only when they run).

Fast state (the hedge budget, the retry throttle, in-flight counts, probe readings) stays in
each process: see ``docs/gateway.md``, "Scale-out".
"""

from ._contracts import (
    Cooldown,
    DelaySample,
    Ejection,
    FleetStore,
    KeyLedger,
    Lease,
    Quota,
    Refusal,
    StateChange,
    StoreStatus,
)
from ._local import LocalKeyLedger
from ._nowhere import LocalFleetStore
from ._redis import RedisFleetStore
from ._redis_ledger import RedisKeyLedger

__all__ = [
    "Cooldown",
    "DelaySample",
    "Ejection",
    "FleetStore",
    "KeyLedger",
    "Lease",
    "LocalFleetStore",
    "LocalKeyLedger",
    "Quota",
    "RedisFleetStore",
    "RedisKeyLedger",
    "Refusal",
    "StateChange",
    "StoreStatus",
]
