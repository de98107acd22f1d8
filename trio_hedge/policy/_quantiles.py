"""Quantile estimators: pure functions over observed and right-censored times.

A cancelled attempt's TTFT is not unknown but *at least* the time it ran (right-censored).
An estimator that drops those observations keeps the fast attempts and loses the slow ones,
so its quantiles are biased low; the Kaplan–Meier product-limit estimator (Kaplan & Meier,
"Nonparametric estimation from incomplete observations", JASA 1958) uses both kinds without
that bias. [`empirical_quantile`][trio_hedge.policy.empirical_quantile] is the plain
nearest-rank estimator: right for values with no censoring (the TTFTs of committed
requests), and what an estimator that ignores censoring computes (tower's hedge).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["empirical_quantile", "km_quantile", "km_quantiles"]


def km_quantile(observations: Iterable[tuple[float, bool]], q: float) -> float | None:
    """The ``q`` quantile of the Kaplan–Meier (product-limit) estimate of a distribution.

    Args:
        observations: ``(time, observed)`` pairs: ``observed=True`` is an exact time (an
            attempt got its first token after ``time`` seconds), ``False`` a right-censored
            one (it was cancelled after ``time`` seconds without one: the TTFT is at least
            ``time``).
        q: the quantile, in ``(0, 1)``.

    Returns:
        the smallest observed time ``t`` with ``1 − S(t) ≥ q``; when censoring leaves the
        estimate short of ``q`` (the tail is unknown), the largest time seen (a lower bound);
        ``None`` without observations. At tied times events count before censorings
        (Kaplan & Meier 1958).
    """
    return km_quantiles(observations, (q,))[0]


def km_quantiles(
    observations: Iterable[tuple[float, bool]], qs: tuple[float, ...]
) -> tuple[float | None, ...]:
    """[`km_quantile`][trio_hedge.policy.km_quantile] for several increasing quantiles in
    one pass."""
    items = sorted(observations, key=lambda o: (o[0], not o[1]))
    n = len(items)
    if n == 0:
        return tuple(None for _ in qs)
    out: list[float] = []
    survival = 1.0
    i = 0
    while i < n and len(out) < len(qs):
        t = items[i][0]
        at_risk = n - i
        deaths = 0
        while i < n and items[i][0] == t:
            deaths += items[i][1]
            i += 1
        if deaths:
            survival *= 1.0 - deaths / at_risk
            while len(out) < len(qs) and 1.0 - survival >= qs[len(out)] - 1e-12:
                out.append(t)
    while len(out) < len(qs):
        out.append(items[-1][0])
    return tuple(out)


def empirical_quantile(values: Iterable[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile of ``values`` (the smallest value with at least a
    fraction ``q`` of values at or below it), or ``None`` when empty. This is what an
    estimator that ignores censored observations computes."""
    data = sorted(values)
    if not data:
        return None
    rank = max(1, math.ceil(q * len(data) - 1e-9))
    return data[min(rank, len(data)) - 1]
