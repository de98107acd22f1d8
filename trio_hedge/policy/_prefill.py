"""The prefill model: a group's TTFT as a function of prompt size, for classes short of data.

Why: a class of rare long prompts may never collect enough observations of its own to learn
a delay. Its delay then comes from a model of TTFT against prompt tokens fitted on every
class of the group: a line through the censoring-aware medians of runs of observations of
neighbouring prompt sizes (a class gives one or more, so a single learned class already
tells the line's intercept from its slope), times a spread
estimated (Kaplan–Meier) from every observation divided by the line
([`PrefillFit`][trio_hedge.policy.PrefillFit]).

This module is the model's arithmetic only: which observations feed it, and when it is
refitted, is the delay learner's business (``policy/_delay.py``).
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from ._quantiles import km_quantile

__all__ = ["PrefillFit", "fit_line", "fit_prefill", "prefill_spread"]


@attrs.frozen
class PrefillFit:
    """The prefill model of one group: ``TTFT ≈ (intercept + slope · tokens) · E``, where the
    line is fitted on the size classes' censoring-aware medians and ``E`` is the spread, a
    multiplicative noise whose quantiles are estimated (Kaplan–Meier) from every observation
    divided by the line. Beyond the largest prompt size it was fitted on, a line that grows
    continues as fitted, its intercept kept (the fixed part of a TTFT -- queueing, the
    network, the first decode step -- does not grow with the prompt; continuing in proportion
    to tokens instead, through the origin, made a 300-token prompt wait 3.68 s for its backup
    against its own P95 of 0.68 s: issue 16). A flat line (one prompt size seen, or no
    growth) measured no slope: beyond its data it grows in proportion to tokens, the most
    cautious line through its last point, as prefill grows at least linearly with the
    prompt. A line fitted through a negative intercept (superlinear data) goes through the
    origin.

    This is an accelerated-failure-time model (log TTFT = log line + log E) with the
    Kaplan–Meier estimate of the residual distribution, as in Buckley & James, "Linear
    regression with censored data" (Biometrika 1979).

    Attributes:
        group: the group it was fitted on.
        intercept: seconds (``≥ 0``).
        slope: seconds per prompt token (``≥ 0``).
        max_tokens: the largest prompt size the line was fitted on (tokens).
        points: points the line was fitted on: runs of observations of neighbouring prompt
            sizes, at least half ``min_samples`` each (a size class gives one or more).
        observations: observations behind it.
        spread: the ``percentile`` quantile of ``E`` (≥ 1 in practice), or ``None`` when not
            computed (only the line was needed).
    """

    group: str
    intercept: float
    slope: float
    max_tokens: int
    points: int
    observations: int
    spread: float | None = None

    def median(self, tokens: int) -> float:
        """The model's median TTFT, in seconds, of a prompt of ``tokens`` tokens."""
        line = self.intercept + self.slope * tokens
        if tokens <= self.max_tokens or self.slope > 0:
            return line
        # A flat line measured no growth: beyond its data, in proportion to tokens.
        return line * tokens / max(self.max_tokens, 1)

    def quantile(self, tokens: int) -> float | None:
        """The model's ``percentile`` TTFT of a prompt of ``tokens`` tokens (``None`` without
        a spread)."""
        return None if self.spread is None else self.median(tokens) * self.spread


def fit_line(points: list[tuple[int, float, int]]) -> tuple[float, float]:
    """``(intercept, slope)`` of the line through ``(tokens, seconds, weight)`` points by
    weighted least squares, both kept ``≥ 0``. One point (or prompts all of one size) gives
    the flat line through it, which with the proportional continuation above it is the most
    cautious line a single size allows (the longest delay for every larger size)."""
    total = sum(w for _, _, w in points)
    mean_x = sum(x * w for x, _, w in points) / total
    mean_y = sum(y * w for _, y, w in points) / total
    sxx = sum(w * (x - mean_x) ** 2 for x, _, w in points)
    if sxx <= 0:
        return mean_y, 0.0
    slope = sum(w * (x - mean_x) * (y - mean_y) for x, y, w in points) / sxx
    if slope <= 0:
        return mean_y, 0.0  # no growth seen: flat (the proportional continuation still grows)
    intercept = mean_y - slope * mean_x
    if intercept < 0:  # superlinear data: a line through the origin
        slope = sum(w * x * y for x, y, w in points) / sum(w * x * x for x, _, w in points)
        intercept = 0.0
    return intercept, slope


def fit_prefill(group: str, points: list[tuple[int, float, int]]) -> PrefillFit | None:
    """The prefill model (without its spread) of ``group`` through ``(tokens, median
    seconds, observations)`` points, one per size class (``tokens ≥ 1``), or ``None``
    without points."""
    if not points:
        return None
    intercept, slope = fit_line(points)
    return PrefillFit(
        group=group,
        intercept=intercept,
        slope=slope,
        max_tokens=max(x for x, _, _ in points),
        points=len(points),
        observations=sum(n for _, _, n in points),
    )


def prefill_spread(
    fit: PrefillFit, observations: Iterable[tuple[float, bool, int]], q: float
) -> float | None:
    """The ``q`` quantile of the spread ``E`` of ``fit``: the Kaplan–Meier quantile of each
    ``(seconds, observed, prompt tokens)`` observation's TTFT divided by the line at its
    prompt size (a censored TTFT gives a censored ratio), or ``None`` without observations."""
    ratios: list[tuple[float, bool]] = []
    for seconds, observed, tokens in observations:
        line = fit.median(max(tokens, 1))
        if line > 0:
            ratios.append((seconds / line, observed))
    return km_quantile(ratios, q)
