"""The policy: when to hedge, whether a hedge or failover may go, where an attempt goes.

Configuration (values, validated at construction):

- [`HedgePolicy`][trio_hedge.HedgePolicy]: one request's fixed plan for
  [`hedged_stream`][trio_hedge.hedged_stream].
- [`HedgerConfig`][trio_hedge.HedgerConfig]: how a [`Hedger`][trio_hedge.Hedger] hedges; the fields
  the two share are declared once.
- [`LearnedDelay`][trio_hedge.LearnedDelay] (with [`SizeClasses`][trio_hedge.policy.SizeClasses],
  [`PrefillFit`][trio_hedge.policy.PrefillFit]): the hedge delay learned from observed TTFTs;
  [`HedgeBudget`][trio_hedge.policy.HedgeBudget],
  [`RetryThrottle`][trio_hedge.policy.RetryThrottle], [`Backoff`][trio_hedge.policy.Backoff]: the
  brakes on extra requests; [`OutlierDetection`][trio_hedge.policy.OutlierDetection]: when a replica
  is ejected; [`Attribution`][trio_hedge.policy.Attribution]: whose fault each kind of error is;
  [`RecoveryPolicy`][trio_hedge.policy.RecoveryPolicy] (with
  [`ThroughputFloor`][trio_hedge.policy.ThroughputFloor]): the recovery phase after the commit.

The race's advisor: [`Planner`][trio_hedge.policy.Planner] (the protocol the race consults at each
decision) and [`StaticPlanner`][trio_hedge.policy.StaticPlanner] (a fixed, ordered list and delay).
A [`Hedger`][trio_hedge.Hedger]'s planner is private: it reads the fleet state every request shares.

Statistics (frozen snapshots): [`HedgerStatistics`][trio_hedge.policy.HedgerStatistics],
[`ReplicaStatistics`][trio_hedge.policy.ReplicaStatistics] (with its
[`HealthVerdict`][trio_hedge.policy.HealthVerdict]s),
[`DelayStatistics`][trio_hedge.policy.DelayStatistics]. Helpers:
[`estimate_prompt_tokens`][trio_hedge.policy.estimate_prompt_tokens],
[`empirical_quantile`][trio_hedge.policy.empirical_quantile],
[`km_quantile`][trio_hedge.policy.km_quantile] (Kaplan-Meier, for censored samples).

Inside, one job per module: ``_config`` (the two config classes), ``_delay`` (the delay
learner), ``_quantiles`` (the estimators), ``_prefill`` (the prefill model), ``_budget``
(the hedge budget), ``_throttle`` (the retry throttle), ``_backoff`` (the back-off),
``_blame`` (whose fault an attempt's outcome is: every consumer asks it), ``_health``
(replica health and ejection), ``_sizing`` (prompt size and size classes),
``_recovering`` (the recovery phase's deadline, hedge and throughput floor, and the
streaming rates it compares with), ``_stats`` (snapshots), ``_static`` (the static
planner), ``_fleet`` (the state shared by every request of a Hedger), ``_planner`` (one
request's decisions over that state).
"""

from .._plan import Planner
from ._backoff import Backoff
from ._blame import Attribution
from ._budget import HedgeBudget
from ._config import HedgePolicy, HedgerConfig
from ._delay import LearnedDelay
from ._health import OutlierDetection
from ._prefill import PrefillFit
from ._quantiles import empirical_quantile, km_quantile
from ._recovering import RecoveryPolicy, ThroughputFloor
from ._sizing import SizeClasses, estimate_prompt_tokens
from ._static import StaticPlanner
from ._stats import DelayStatistics, HealthVerdict, HedgerStatistics, ReplicaStatistics
from ._throttle import RetryThrottle

__all__ = [
    "Attribution",
    "Backoff",
    "DelayStatistics",
    "HealthVerdict",
    "HedgeBudget",
    "HedgePolicy",
    "HedgerConfig",
    "HedgerStatistics",
    "LearnedDelay",
    "OutlierDetection",
    "Planner",
    "PrefillFit",
    "RecoveryPolicy",
    "ReplicaStatistics",
    "RetryThrottle",
    "SizeClasses",
    "StaticPlanner",
    "ThroughputFloor",
    "empirical_quantile",
    "estimate_prompt_tokens",
    "km_quantile",
]
