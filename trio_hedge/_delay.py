"""A hedge delay learned from observed times to first token, per prompt-size class.

Why size classes: a single global delay hedges long prompts too early; the backup repeats the
most expensive work (prefill) and drags a second replica into the same long wait, so the tail
gets *worse* (field notes, "Hedging long prompts backfires"). TTFT grows with the prompt, so
the delay is learned per group (model / replica group) and per log-spaced class of prompt
tokens, and each request is hedged at the chosen percentile of *its* class.

Why censoring: when a request commits, its other attempts are cancelled before their first
token. Their TTFT is not unknown but *at least* the time they ran (right-censored). Dropping
them (as tower's hedge does, timing only successes) keeps the fast ones and loses the slow
ones, so the estimate is biased low and the delay shrinks into a hedge storm. The Kaplan–Meier
product-limit estimator (Kaplan & Meier, "Nonparametric estimation from incomplete
observations", JASA 1958) uses both kinds of observation without that bias.

Everything uses Trio's clock (``trio.current_time()``), so virtual time in tests is exact.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from typing import Any

import attrs

__all__ = [
    "LearnedDelay",
    "SizeClasses",
    "TTFTWindow",
    "empirical_quantile",
    "km_quantile",
]


Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def _number(lo: float | None = None, *, open_lo: bool = False) -> Validator:
    """An attrs validator: a finite real number (not a bool), ``>= lo`` (``> lo``)."""

    def check(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{attribute.name} must be a number, not {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{attribute.name} must be a finite number, not {value!r}")
        if lo is not None and (value <= lo if open_lo else value < lo):
            op = ">" if open_lo else ">="
            raise ValueError(f"{attribute.name} must be {op} {lo}, not {value!r}")

    return check


def _int(lo: int) -> Validator:
    """An attrs validator: an int (not a bool) ``>= lo``."""

    def check(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{attribute.name} must be an int, not {value!r}")
        if value < lo:
            raise ValueError(f"{attribute.name} must be >= {lo}, not {value!r}")

    return check


def _fraction(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """An attrs validator: a number strictly between 0 and 1."""
    _number(0.0, open_lo=True)(_inst, attribute, value)
    assert isinstance(value, (int, float))
    if value >= 1.0:
        raise ValueError(f"{attribute.name} must be < 1, not {value!r}")


# -- estimators ----------------------------------------------------------------------------


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
    items = sorted(observations, key=lambda o: (o[0], not o[1]))
    n = len(items)
    if n == 0:
        return None
    survival = 1.0
    i = 0
    while i < n:
        t = items[i][0]
        at_risk = n - i
        deaths = 0
        while i < n and items[i][0] == t:
            deaths += items[i][1]
            i += 1
        if deaths:
            survival *= 1.0 - deaths / at_risk
            if 1.0 - survival >= q - 1e-12:
                return t
    return items[-1][0]


def empirical_quantile(values: Iterable[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile of ``values`` (the smallest value with at least a
    fraction ``q`` of values at or below it), or ``None`` when empty. This is what an
    estimator that ignores censored observations computes."""
    data = sorted(values)
    if not data:
        return None
    rank = max(1, math.ceil(q * len(data) - 1e-9))
    return data[min(rank, len(data)) - 1]


# -- size classes --------------------------------------------------------------------------


@attrs.frozen
class SizeClasses:
    """Log-spaced classes of prompt size (estimated prompt tokens).

    Class 0 holds prompts below ``first`` tokens; class ``k ≥ 1`` holds
    ``[first·base^(k−1), first·base^k)``; the last class (``count − 1``) holds everything
    above. With the defaults: < 256, 256–511, 512–1023, …, ≥ 131,072 tokens.

    Attributes:
        first: the upper bound of class 0, in tokens. Default 256.
        base: the ratio between successive class bounds (> 1). Default 2.0.
        count: how many classes (bounds memory). Default 11.

    Raises:
        TypeError, ValueError: on a bad field.
    """

    first: int = attrs.field(default=256, validator=_int(1))
    base: float = attrs.field(default=2.0, validator=_number(1.0, open_lo=True))
    count: int = attrs.field(default=11, validator=_int(1))

    def of(self, tokens: int) -> int:
        """The class of a prompt of ``tokens`` tokens."""
        if tokens < self.first:
            return 0
        k = int(math.log(tokens / self.first) / math.log(self.base) + 1e-9) + 1
        return min(k, self.count - 1)

    def bounds(self, index: int) -> tuple[int, int | None]:
        """``(low, high)`` token bounds of class ``index`` (``high`` exclusive, ``None`` for
        the open last class)."""
        low = 0 if index == 0 else math.ceil(self.first * self.base ** (index - 1))
        high = None if index >= self.count - 1 else math.ceil(self.first * self.base**index)
        return low, high


# -- the policy ----------------------------------------------------------------------------


@attrs.frozen
class LearnedDelay:
    """A hedge delay learned from observed TTFTs, per group and prompt-size class.

    A request's delay is the ``percentile`` of the TTFT distribution of its (group, size
    class), estimated over the last ``window`` seconds with censoring (Kaplan–Meier), clamped
    to ``[min_delay, max_delay]``. Hedging at the P90 sends a backup for about 10% of the
    requests; at the P95 about 5% ("The Tail at Scale", Dean & Barroso 2013). Finagle's
    ``BackupRequestFilter`` couples the two: ``LearnedDelay.for_extra_load(0.05)`` hedges at
    the percentile ``1 − 0.05``.

    Until a class has ``min_samples`` observations in the window, it borrows the estimate of
    the nearest smaller class that has them, scaled by the ratio of the classes' sizes
    (``base ** k`` for classes ``k`` apart: prefill cost grows about linearly with prompt
    tokens); only when no smaller class has learned anything is its delay ``fallback``. Rare
    long prompts rarely fill their own class, and hedging them at the short prompts' delay, or
    at a fixed fallback, makes the tail worse (field notes; ``benchmarks/tail.py`` showed
    P99 TTFT 11.4 s against 10.1 s without hedging before this rule). With ``monotone``
    (default) a class's delay is also never below that of a smaller class with enough data.

    Attributes:
        percentile: the TTFT quantile to hedge at, in ``(0, 1)``. Default 0.9 (P90).
        window: seconds of observations kept (a sliding window on Trio's clock). Default 300:
            LLM traffic per group is often about one request a second, and a size class
            needs tens of samples for a P90 (with 60 s, ``benchmarks/tail.py`` measured P99
            TTFT 3.9 s against 2.2 s at 300 s).
        min_samples: observations (exact or censored) a class needs before its estimate is
            used. Default 20.
        fallback: the delay in seconds before that. Default 1.0.
        min_delay, max_delay: the clamp, in seconds. Defaults 0.05 and 60.
        refresh: seconds an estimate is cached before it is recomputed (Finagle refreshes
            every 3 s); 0 recomputes whenever new data arrived. Default 1.0.
        max_samples: observations kept per class (memory bound; oldest dropped). Default 2048.
        classes: the :class:`SizeClasses`. Default ``SizeClasses()``.
        censoring: use cancelled attempts as censored observations (Kaplan–Meier). ``False``
            times only attempts that got a first token (tower's behaviour, biased low); it
            exists for comparison. Default ``True``.
        monotone: see above. Default ``True``.

    Raises:
        TypeError, ValueError: on a bad field, or ``min_delay > max_delay``.
    """

    percentile: float = attrs.field(default=0.9, validator=_fraction)
    window: float = attrs.field(default=300.0, validator=_number(0.0, open_lo=True))
    min_samples: int = attrs.field(default=20, validator=_int(1))
    fallback: float = attrs.field(default=1.0, validator=_number(0.0))
    min_delay: float = attrs.field(default=0.05, validator=_number(0.0))
    max_delay: float = attrs.field(default=60.0, validator=_number(0.0))
    refresh: float = attrs.field(default=1.0, validator=_number(0.0))
    max_samples: int = attrs.field(default=2048, validator=_int(1))
    classes: SizeClasses = attrs.field(
        factory=SizeClasses, validator=attrs.validators.instance_of(SizeClasses)
    )
    censoring: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    monotone: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))

    def __attrs_post_init__(self) -> None:
        if self.min_delay > self.max_delay:
            raise ValueError(
                f"min_delay ({self.min_delay}) must be <= max_delay ({self.max_delay})"
            )

    @classmethod
    def for_extra_load(cls, max_extra_load: float, **kwargs: object) -> LearnedDelay:
        """Finagle's coupling: hedge at the percentile ``1 − max_extra_load``, so about
        ``max_extra_load`` of requests send a backup (e.g. 0.05 → P95).

        Raises:
            ValueError: ``max_extra_load`` not in ``(0, 1)``.
        """
        if isinstance(max_extra_load, bool) or not isinstance(max_extra_load, (int, float)):
            raise TypeError(f"max_extra_load must be a number, not {max_extra_load!r}")
        if not 0.0 < max_extra_load < 1.0:
            raise ValueError(f"max_extra_load must be in (0, 1), not {max_extra_load!r}")
        return cls(percentile=1.0 - max_extra_load, **kwargs)  # type: ignore[arg-type]


class TTFTWindow:
    """The observations of one (group, size class) over a sliding window, and the cached
    estimate of their percentile. Memory: at most ``max_samples`` entries."""

    __slots__ = ("_cached", "_cached_at", "_config", "_dirty", "_samples")

    def __init__(self, config: LearnedDelay) -> None:
        self._config = config
        self._samples: deque[tuple[float, float, bool]] = deque(maxlen=config.max_samples)
        self._cached: float | None = None
        self._cached_at = -math.inf
        self._dirty = False

    def add(self, now: float, seconds: float, observed: bool) -> None:
        """Record one attempt that ran ``seconds`` and got (``observed``) or did not get
        (censored) its first token."""
        if not observed and not self._config.censoring:
            return
        self._samples.append((now, seconds, observed))
        self._dirty = True

    def _expire(self, now: float) -> None:
        horizon = now - self._config.window
        samples = self._samples
        while samples and samples[0][0] < horizon:
            samples.popleft()
            self._dirty = True

    def count(self, now: float) -> tuple[int, int]:
        """``(observations, censored)`` in the window."""
        self._expire(now)
        censored = sum(1 for s in self._samples if not s[2])
        return len(self._samples), censored

    def estimate(self, now: float) -> float | None:
        """The percentile (unclamped), or ``None`` below ``min_samples`` observations."""
        self._expire(now)
        config = self._config
        if len(self._samples) < config.min_samples:
            return None
        if self._dirty and now - self._cached_at >= config.refresh:
            self._cached = km_quantile(((s[1], s[2]) for s in self._samples), config.percentile)
            self._cached_at = now
            self._dirty = False
        return self._cached


class DelayModel:
    """Per-group, per-class windows of one :class:`LearnedDelay` (internal to the Hedger).

    Groups are kept in least-recently-used order and capped at ``max_groups``."""

    def __init__(self, config: LearnedDelay, *, max_groups: int = 256) -> None:
        self.config = config
        self._max_groups = max_groups
        self._groups: OrderedDict[str, list[TTFTWindow | None]] = OrderedDict()

    def _windows(self, group: str) -> list[TTFTWindow | None]:
        windows = self._groups.get(group)
        if windows is None:
            windows = [None] * self.config.classes.count
            self._groups[group] = windows
            if len(self._groups) > self._max_groups:
                self._groups.popitem(last=False)
        else:
            self._groups.move_to_end(group)
        return windows

    def observe(
        self, group: str, size_class: int, now: float, seconds: float, observed: bool
    ) -> None:
        windows = self._windows(group)
        window = windows[size_class]
        if window is None:
            window = windows[size_class] = TTFTWindow(self.config)
        window.add(now, seconds, observed)

    def raw(self, group: str, size_class: int, now: float) -> float | None:
        """The class's own estimate (unclamped), or ``None`` without enough data."""
        windows = self._groups.get(group)
        if windows is None:
            return None
        window = windows[size_class]
        return None if window is None else window.estimate(now)

    def delay(self, group: str, size_class: int, now: float) -> float:
        """The hedge delay in seconds for a request of this group and class."""
        config = self.config
        windows = self._groups.get(group)
        own: float | None = None
        floor = 0.0
        if windows is not None:
            window = windows[size_class]
            own = None if window is None else window.estimate(now)
            if config.monotone:
                for smaller in windows[:size_class]:
                    if smaller is not None:
                        estimate = smaller.estimate(now)
                        if estimate is not None and estimate > floor:
                            floor = estimate
        if own is None:
            borrowed = None if windows is None else self._extrapolate(windows, size_class, now)
            value = config.fallback if borrowed is None else borrowed
        else:
            value = own
        value = max(value, floor)
        return min(max(value, config.min_delay), config.max_delay)

    def _extrapolate(
        self, windows: list[TTFTWindow | None], size_class: int, now: float
    ) -> float | None:
        """The nearest smaller learned class's estimate, scaled up to ``size_class``."""
        base = self.config.classes.base
        for smaller in range(size_class - 1, -1, -1):
            window = windows[smaller]
            estimate = None if window is None else window.estimate(now)
            if estimate is not None:
                return float(estimate * base ** (size_class - smaller))
        return None

    def describe(self, now: float) -> list[tuple[str, int, int, int, float, bool]]:
        """``(group, class, observations, censored, delay, learned)`` for every class with
        data."""
        rows = []
        for group, windows in self._groups.items():
            for index, window in enumerate(windows):
                if window is None:
                    continue
                observations, censored = window.count(now)
                if observations == 0:
                    continue
                learned = window.estimate(now) is not None
                rows.append(
                    (group, index, observations, censored, self.delay(group, index, now), learned)
                )
        return rows
