"""The hedge delay learned from observed times to first token, per group and prompt-size class:
[`LearnedDelay`][trio_hedge.LearnedDelay] (the configuration) and the learner behind it
(``DelayModel``: a sliding window of observations per class, the estimates cached).

Why size classes: a single global delay hedges long prompts too early; the backup repeats the
most expensive work (prefill) and drags a second replica into the same long wait, so the tail
gets *worse* (field notes, "Hedging long prompts backfires"). TTFT grows with the prompt, so
the delay is learned per group (model / replica group) and per log-spaced class of prompt
tokens ([`SizeClasses`][trio_hedge.policy.SizeClasses]), and each request is hedged at the
chosen percentile of *its* class.

Why censoring: when a request commits, its other attempts are cancelled before their first
token. Their TTFT is not unknown but *at least* the time they ran (right-censored). Dropping
them (as tower's hedge does, timing only successes) keeps the fast ones and loses the slow
ones, so the estimate is biased low and the delay shrinks into a hedge storm. The Kaplan–Meier
product-limit estimator (Kaplan & Meier, "Nonparametric estimation from incomplete
observations", JASA 1958; ``policy/_quantiles.py``) uses both kinds of observation without
that bias.

Why a prefill model: a class of rare long prompts may never collect enough observations of its
own. Its delay then comes from a model of TTFT against prompt tokens fitted on every class of
the group ([`PrefillFit`][trio_hedge.policy.PrefillFit], ``policy/_prefill.py``); this module
chooses the observations it is fitted on and caches it.

Everything uses Trio's clock (``trio.current_time()``), so virtual time in tests is exact.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from typing import Any

import attrs

from .._validate import fraction, integer, number
from ._prefill import PrefillFit, fit_prefill, prefill_spread
from ._quantiles import km_quantile, km_quantiles
from ._sizing import SizeClasses

__all__ = ["DelayModel", "LearnedDelay", "TTFTWindow"]


@attrs.frozen
class LearnedDelay:
    """A hedge delay learned from observed TTFTs, per group and prompt-size class.

    A request's delay is the ``percentile`` of the TTFT distribution of its (group, size
    class), estimated over the last ``window`` seconds with censoring (Kaplan–Meier), clamped
    to ``[min_delay, max_delay]``. Hedging at the P90 sends a backup for about 10% of the
    requests; at the P95 about 5% ("The Tail at Scale", Dean & Barroso 2013). Finagle's
    ``BackupRequestFilter`` couples the two: ``LearnedDelay.for_extra_load(0.05)`` hedges at
    the percentile ``1 − 0.05``.

    Until a class has ``min_samples`` observations in the window, its delay comes from the
    group's *prefill model* ([`PrefillFit`][trio_hedge.policy.PrefillFit]):
    ``TTFT ≈ (a + b·tokens) · E``, a line fitted on the censoring-aware medians of the
    classes that have at least half ``min_samples`` observations (``min_samples`` in all;
    a class gives a point per run of that many observations of neighbouring prompt sizes),
    with a spread ``E`` estimated (Kaplan–Meier) from every observation divided by the
    line, evaluated at the request's own prompt size. Beyond the largest size it was fitted
    on the line goes on with its intercept (a flat one, which measured no growth, in
    proportion to tokens), and the delay is never below the nearest smaller learned class's
    delay scaled by the line's growth between the two prompt sizes: the delay grows as
    prefill does. Rare long prompts rarely fill
    their own class; a delay that grows slower than their prefill hedges them, and each such
    backup repeats the whole prefill on a second replica (on llama.cpp, which aborts a
    prefill only when it ends, both stay busy): the tail gets worse (field notes; issue 9:
    borrowing a short class's P90 × the class ratio, 16, for prompts 40× longer hedged 5 of
    9 long prompts, none of whose backups won). With ``monotone`` (default) a class's delay
    is also never below that of a smaller class with enough data.

    A group that is cold (no class learned, too few observations for the prefill model) does
    not wait for ``min_samples`` observations: from ``cold_samples`` observations of any
    class on, its delay is ``cold_ratio`` times their median TTFT (Kaplan–Meier: censored
    ones count), grown in proportion to the request's prompt when it is longer than their
    median prompt, and never above ``fallback``. The median of three TTFTs is a fair guess
    where a P95 of three is none, and a P95 is a few times the median in the distributions
    engines show (2.3× for a lognormal of σ = 0.5, 5.2× for σ = 1). A request whose hedge
    delay came from this rule (or from the fallback) is looked at again every 50 ms while
    it waits: when the observations that arrived since give a delay it has already waited,
    its backup goes then. Only a group with fewer than ``cold_samples`` observations waits
    for ``fallback`` (1 s): on two llama-server replicas under another tenant's prompts the
    first requests' fallback made a cold P99 of 1.04 s against 0.24–0.29 s once warm
    (issue 29; ``benchmarks/cold_start.py`` measures the rule).

    Attributes:
        percentile: the TTFT quantile to hedge at, in ``(0, 1)``. Default 0.95 (P95, as
            "The Tail at Scale" defers its hedges): on two llama.cpp replicas it gave a lower
            P99 TTFT than the P90 for about half the hedges (``benchmarks/real_engine.py``);
            in the tail simulation the same P99 with a lone client and 6% higher with other
            tenants' load (``benchmarks/tail.py``). 0.9 hedges sooner, for about twice the
            hedges.
        window: seconds of observations kept (a sliding window on Trio's clock). Default 300:
            LLM traffic per group is often about one request a second, and a size class
            needs tens of samples for a P90 (with 60 s, ``benchmarks/tail.py`` measured P99
            TTFT 3.9 s against 2.2 s at 300 s).
        min_samples: observations (exact or censored) a class needs before its estimate is
            used. Default 20.
        fallback: the delay in seconds while the group has no data. Default 1.0.
        min_delay: the clamp's lower bound, in seconds. Default 0.05.
        max_delay: the clamp's upper bound, in seconds. Default 60.
        refresh: seconds an estimate (and the prefill model) is cached before it is
            recomputed, when new data arrived or old data expired (Finagle refreshes every
            3 s), and at once when a class reaches the observations its estimate
            (``min_samples``) or the prefill model's points need; 0 recomputes at the first
            lookup after a change, never on a lookup alone. Default 1.0.
        max_samples: observations kept per class (memory bound; oldest dropped). Default 2048.
        classes: the [`SizeClasses`][trio_hedge.policy.SizeClasses]. Default ``SizeClasses()``.
        censoring: use cancelled attempts as censored observations (Kaplan–Meier). ``False``
            times only attempts that got a first token (tower's behaviour, biased low); it
            exists for comparison. Default ``True``.
        monotone: see above. Default ``True``.
        cold_samples: observations (any class, exact or censored) a cold group needs before
            its delay is ``cold_ratio`` × their median instead of ``fallback``; ``None``:
            the fallback until the group learns (the rule before). Default 3.
        cold_ratio: the cold rule's multiple of the median TTFT, ``>= 1``. Default 3.
        stuck_ratio: the delay is at most this many times the class's median TTFT
            (Kaplan–Meier), and the prefill model's spread at most this factor; ``None``: no
            cap. A percentile that far above the median is not the distribution's own tail
            but a stuck mode (requests queued behind someone's long prefill), and a delay
            there rescues none of them; worse, it feeds itself: unhedged, the stuck requests
            become exact slow samples that keep the percentile up. On two llama.cpp replicas
            with other tenants' long prompts the P95 climbed from 0.09 s to 2.25 s (the
            stuck requests' own TTFT) and stopped hedging (``benchmarks/real_engine.py
            --seed 3``). Default 10: the P99 of a lognormal TTFT with σ = 1, heavier than
            a replica's own tail usually is.

    Raises:
        TypeError, ValueError: on a bad field, or ``min_delay > max_delay``.
    """

    percentile: float = attrs.field(default=0.95, validator=fraction)
    window: float = attrs.field(default=300.0, validator=number(0.0, open_lo=True))
    min_samples: int = attrs.field(default=20, validator=integer(1))
    fallback: float = attrs.field(default=1.0, validator=number(0.0))
    min_delay: float = attrs.field(default=0.05, validator=number(0.0))
    max_delay: float = attrs.field(default=60.0, validator=number(0.0))
    refresh: float = attrs.field(default=1.0, validator=number(0.0))
    max_samples: int = attrs.field(default=2048, validator=integer(1))
    classes: SizeClasses = attrs.field(
        factory=SizeClasses, validator=attrs.validators.instance_of(SizeClasses)
    )
    censoring: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    monotone: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    stuck_ratio: float | None = attrs.field(default=10.0)
    cold_samples: int | None = attrs.field(default=3)
    cold_ratio: float = attrs.field(default=3.0, validator=number(1.0))

    @cold_samples.validator
    def _check_cold_samples(self, attribute: attrs.Attribute[Any], value: object) -> None:
        if value is not None:
            integer(1)(self, attribute, value)

    @stuck_ratio.validator
    def _check_stuck_ratio(self, attribute: attrs.Attribute[Any], value: object) -> None:
        if value is not None:
            number(1.0, open_lo=True)(self, attribute, value)

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


#: One observation: (when, seconds, got a first token, prompt tokens, replica or None,
#: attempt number).
Sample = tuple[float, float, bool, int, "str | None", int]


class TTFTWindow:
    """The observations of one (group, size class) over a sliding window, and the cached
    estimates made from them: the class's percentile (once it has ``min_samples``
    observations) and its median with the median prompt size (once it has enough for the
    prefill model, ``_fit_samples``). Memory: at most ``max_samples`` entries."""

    __slots__ = (
        "_cached",
        "_cached_at",
        "_config",
        "_dirty",
        "_median",
        "_points",
        "_samples",
        "_tokens",
        "version",
    )

    def __init__(self, config: LearnedDelay) -> None:
        self._config = config
        self._samples: deque[Sample] = deque(maxlen=config.max_samples)
        self._cached: float | None = None
        self._median: float | None = None
        self._tokens = 0
        self._points: list[tuple[int, float, int]] = []
        self._cached_at = -math.inf
        self._dirty = False
        #: How many times the estimates were recomputed (each time the observations changed
        #: and ``refresh`` had passed): the group's prefill model is refitted when it moves.
        self.version = 0

    def add(
        self,
        now: float,
        seconds: float,
        observed: bool,
        tokens: int,
        replica: str | None = None,
        attempt: int = 1,
    ) -> None:
        """Record one attempt that ran ``seconds`` and got (``observed``) or did not get
        (censored) its first token, for a prompt of ``tokens`` tokens."""
        if not observed and not self._config.censoring:
            return
        self._samples.append((now, seconds, observed, tokens, replica, attempt))
        self._dirty = True

    def _expire(self, now: float) -> None:
        horizon = now - self._config.window
        samples = self._samples
        while samples and samples[0][0] < horizon:
            samples.popleft()
            self._dirty = True

    def size(self, now: float) -> int:
        """Observations in the window (without counting the censored ones: cheap)."""
        self._expire(now)
        return len(self._samples)

    def count(self, now: float) -> tuple[int, int]:
        """``(observations, censored)`` in the window."""
        self._expire(now)
        censored = sum(1 for s in self._samples if not s[2])
        return len(self._samples), censored

    def samples(self, now: float) -> tuple[Sample, ...]:
        """The observations in the window, oldest first."""
        self._expire(now)
        return tuple(self._samples)

    def _update(self, now: float) -> None:
        self._expire(now)
        config = self._config
        if not self._dirty:
            return
        samples = self._samples
        n = len(samples)
        if now - self._cached_at < config.refresh and not (
            # A threshold crossed since the last computation: the estimate (or the prefill
            # model's points) exists from this observation on, not up to ``refresh`` later
            # (a class that had just begun learned nothing for a second, and each of its
            # requests took the cold rule over every sample: +40 µs a request here).
            (self._cached is None and n >= config.min_samples)
            or (self._median is None and n >= _fit_samples(config))
        ):
            return
        self._cached = self._median = None
        self._points = []
        if n >= _fit_samples(config):
            observations = [(s[1], s[2]) for s in samples]
            self._median, percentile = km_quantiles(observations, (0.5, config.percentile))
            if n >= config.min_samples:
                ratio = config.stuck_ratio
                if ratio is not None and percentile is not None and self._median is not None:
                    percentile = min(percentile, ratio * self._median)  # not a stuck mode
                self._cached = percentile
            self._tokens = _median_int([s[3] for s in samples])
            self._points = _size_points(samples, _fit_samples(config))
        self._cached_at = now
        self._dirty = False
        self.version += 1

    def estimate(self, now: float) -> float | None:
        """The percentile (unclamped), or ``None`` below ``min_samples`` observations."""
        self._update(now)
        return self._cached if len(self._samples) >= self._config.min_samples else None

    def summary(self, now: float) -> tuple[float, int, int] | None:
        """``(median TTFT, median prompt tokens, observations)`` for the prefill model, or
        ``None`` with too few observations."""
        self._update(now)
        if self._median is None or len(self._samples) < _fit_samples(self._config):
            return None
        return self._median, self._tokens, len(self._samples)

    def points(self, now: float) -> list[tuple[int, float, int]]:
        """The class's points of the prefill model: ``(median prompt tokens, median TTFT,
        observations)`` of each run of neighbouring prompt sizes (empty with too few)."""
        self._update(now)
        return self._points


def _size_points(samples: Iterable[Sample], need: int) -> list[tuple[int, float, int]]:
    """The observations sorted by prompt size and cut into runs of at least ``need``: each
    run's median prompt size (``≥ 1``), censoring-aware median TTFT and count (a run too
    censored for a median is left out). Why not one point per class: a class spans a factor
    ``base`` of prompt sizes, and the TTFT's growth across it is what tells the line's
    intercept from its slope when a group has a single learned class (issue 16: one point
    gives no slope, and the proportional continuation through the origin hedged a 300-token
    prompt at 3.68 s against its own P95 of 0.68 s)."""
    ordered = sorted(samples, key=lambda sample: sample[3])
    parts = len(ordered) // need
    points = []
    for k in range(parts):
        run = ordered[k * len(ordered) // parts : (k + 1) * len(ordered) // parts]
        median = km_quantile([(sample[1], sample[2]) for sample in run], 0.5)
        if median is not None:
            tokens = _median_int([sample[3] for sample in run])
            points.append((max(tokens, 1), median, len(run)))
    return points


def _fit_samples(config: LearnedDelay) -> int:
    """Observations a class needs to be a point of the prefill model: half ``min_samples``
    (a median is steadier than a P90), at least 2."""
    return max(2, (config.min_samples + 1) // 2)


def _median_int(values: list[int]) -> int:
    values.sort()
    return values[(len(values) - 1) // 2]


class _Group:
    """The windows of one group and its cached prefill model."""

    __slots__ = ("fit", "fit_at", "fit_version", "spread_version", "windows")

    def __init__(self, count: int) -> None:
        self.windows: list[TTFTWindow | None] = [None] * count
        self.fit: PrefillFit | None = None
        self.fit_at = -math.inf
        self.fit_version = -1  # the windows' version the fit was made from
        self.spread_version = -1  # ... and its spread

    def version(self, now: float) -> int:
        """A number that changes whenever a window's estimates are recomputed (its
        observations changed and its ``refresh`` passed): each window's version only grows,
        so their sum changes when any does."""
        total = 0
        for window in self.windows:
            if window is not None:
                window._update(now)
                total += window.version
        return total


class DelayModel:
    """Per-group, per-class windows of one [`LearnedDelay`][trio_hedge.LearnedDelay]
    (internal to the Hedger), and each group's prefill model
    ([`PrefillFit`][trio_hedge.policy.PrefillFit]).

    Groups are kept in least-recently-used order and capped at ``max_groups``; at the cap a
    group that has learned nothing goes first (``_evict``)."""

    def __init__(self, config: LearnedDelay, *, max_groups: int = 256) -> None:
        self.config = config
        self._max_groups = max_groups
        self._groups: OrderedDict[str, _Group] = OrderedDict()

    def _group(self, group: str, now: float) -> _Group:
        entry = self._groups.get(group)
        if entry is None:
            entry = self._groups[group] = _Group(self.config.classes.count)
            if len(self._groups) > self._max_groups:
                self._evict(now)
        else:
            self._groups.move_to_end(group)
        return entry

    def _evict(self, now: float) -> None:
        """Forget the least recently used group that has learned nothing (no class with
        ``min_samples`` observations in the window), else the least recently used: the group
        is a client-chosen string (the model), and a flood of new names must not push out
        what the fleet learned for the models it serves (then the newest, with one
        observation, is the one forgotten)."""
        need = self.config.min_samples
        for name, entry in self._groups.items():  # least recently used first
            if not any(w is not None and w.size(now) >= need for w in entry.windows):
                del self._groups[name]
                return
        self._groups.popitem(last=False)  # pragma: no cover - the newest has learned nothing

    def tokens_of(self, size_class: int) -> int:
        """The prompt size assumed for an observation or request of unknown size: the
        class's lower bound (``first / base`` for class 0)."""
        classes = self.config.classes
        if size_class == 0:
            return max(1, round(classes.first / classes.base))
        return classes.bounds(size_class)[0]

    def observe(
        self,
        group: str,
        size_class: int,
        now: float,
        seconds: float,
        observed: bool,
        tokens: int | None = None,
        replica: str | None = None,
        attempt: int = 1,
    ) -> None:
        windows = self._group(group, now).windows
        window = windows[size_class]
        if window is None:
            window = windows[size_class] = TTFTWindow(self.config)
        window.add(
            now,
            seconds,
            observed,
            self.tokens_of(size_class) if tokens is None else tokens,
            replica,
            attempt,
        )

    def raw(self, group: str, size_class: int, now: float) -> float | None:
        """The class's own estimate (unclamped), or ``None`` without enough data."""
        entry = self._groups.get(group)
        if entry is None:
            return None
        window = entry.windows[size_class]
        return None if window is None else window.estimate(now)

    def fit(self, group: str, now: float, *, spread: bool = False) -> PrefillFit | None:
        """The group's prefill model, or ``None`` while no class has enough observations.
        It is refitted when ``refresh`` seconds have passed *and* the group's observations
        changed since (with ``refresh=0``: whenever they changed, never on a lookup alone).
        ``spread``: also estimate the spread (a pass over every observation of the group;
        only needed for a delay of an unlearned class)."""
        entry = self._groups.get(group)
        if entry is None:
            return None
        if now - entry.fit_at >= self.config.refresh:
            version = entry.version(now)
            if version != entry.fit_version:
                entry.fit = self._fit_line(group, entry, now)
                entry.fit_at = now
                entry.fit_version = version
        fit = entry.fit
        if spread and fit is not None and entry.spread_version != entry.fit_version:
            fit = entry.fit = attrs.evolve(fit, spread=self._spread(entry, fit, now))
            entry.spread_version = entry.fit_version
        return fit

    def _fit_line(self, group: str, entry: _Group, now: float) -> PrefillFit | None:
        points: list[tuple[int, float, int]] = []
        for window in entry.windows:
            if window is not None:
                points += window.points(now)
        return fit_prefill(group, points)

    def _spread(self, entry: _Group, fit: PrefillFit, now: float) -> float | None:
        spread = self._raw_spread(entry, fit, now)
        ratio = self.config.stuck_ratio
        return spread if spread is None or ratio is None else min(spread, ratio)

    def _raw_spread(self, entry: _Group, fit: PrefillFit, now: float) -> float | None:
        return prefill_spread(fit, self._pooled(entry, now), self.config.percentile)

    def _pooled(self, entry: _Group, now: float) -> Iterator[tuple[float, bool, int]]:
        """``(seconds, observed, prompt tokens)`` of every observation of the group's classes
        with enough observations to be points of the prefill model."""
        need = _fit_samples(self.config)
        for window in entry.windows:
            if window is None:
                continue
            samples = window.samples(now)
            if len(samples) < need:
                continue
            for _, seconds, observed, tokens, _, _ in samples:
                yield seconds, observed, tokens

    def delay(self, group: str, size_class: int, now: float, tokens: int | None = None) -> float:
        """The hedge delay in seconds for a request of this group and class, of ``tokens``
        prompt tokens (``None``: unknown, the class's lower bound is assumed)."""
        return self.estimate(group, size_class, now, tokens)[0]

    def estimate(
        self, group: str, size_class: int, now: float, tokens: int | None = None
    ) -> tuple[float, bool]:
        """``(delay, cold)``: `delay`, and whether it came from the cold rule or the
        fallback (the group has learned nothing that applies: a delay worth looking at
        again as observations arrive)."""
        config = self.config
        entry = self._groups.get(group)
        own: float | None = None
        floor = 0.0
        if entry is not None:
            windows = entry.windows
            window = windows[size_class]
            own = None if window is None else window.estimate(now)
            if config.monotone:
                for smaller in windows[:size_class]:
                    if smaller is not None:
                        estimate = smaller.estimate(now)
                        if estimate is not None and estimate > floor:
                            floor = estimate
        cold = False
        if own is None:
            x = self.tokens_of(size_class) if tokens is None else max(tokens, 1)
            estimate = None if entry is None else self._unlearned(group, entry, size_class, now, x)
            if estimate is None:
                cold = True
                guess = None if entry is None else self._cold(entry, now, x)
                value = config.fallback if guess is None else min(guess, config.fallback)
            else:
                value = estimate
        else:
            value = own
        value = max(value, floor)
        return min(max(value, config.min_delay), config.max_delay), cold

    def _cold(self, entry: _Group, now: float, tokens: int) -> float | None:
        """The cold rule (see `LearnedDelay`): ``cold_ratio`` × the median TTFT of every
        observation of the group, × the request's prompt over their median prompt when
        longer; ``None`` below ``cold_samples`` observations (or no median: all censored
        early)."""
        need = self.config.cold_samples
        if need is None:
            return None
        observations: list[tuple[float, bool]] = []
        sizes: list[int] = []
        for window in entry.windows:
            if window is not None:
                for _, seconds, observed, size, _, _ in window.samples(now):
                    observations.append((seconds, observed))
                    sizes.append(size)
        if len(observations) < need:
            return None
        median = km_quantile(observations, 0.5)
        if median is None:
            return None
        typical = max(_median_int(sizes), 1)
        return self.config.cold_ratio * median * max(1.0, tokens / typical)

    def _unlearned(
        self, group: str, entry: _Group, size_class: int, now: float, tokens: int
    ) -> float | None:
        """The delay of a class short of data: the prefill model's percentile at ``tokens``,
        and never below the nearest smaller learned class's delay scaled by the model's
        growth from that class's median prompt to ``tokens`` (its intercept kept: the fixed
        part of a TTFT does not grow with the prompt; a flat model, which measured no
        growth, scales in proportion to the prompt sizes)."""
        estimate: float | None = None
        fit = self.fit(group, now, spread=True)
        for smaller in range(size_class - 1, -1, -1):
            window = entry.windows[smaller]
            learned = None if window is None else window.estimate(now)
            if learned is not None:
                assert window is not None
                summary = window.summary(now)
                assert summary is not None  # learned implies enough for a summary
                base = max(summary[1], 1)
                at_base = 0.0 if fit is None else fit.median(base)
                growth = fit.median(tokens) / at_base if fit and at_base > 0 else tokens / base
                estimate = learned * growth
                break
        # Pooled over classes, the model needs as many observations as a class needs alone.
        enough = fit is not None and fit.observations >= self.config.min_samples
        modelled = fit.quantile(tokens) if fit is not None and enough else None
        if modelled is not None and (estimate is None or modelled > estimate):
            estimate = modelled
        return estimate

    def samples(self, now: float) -> list[tuple[str, Sample]]:
        """``(group, sample)`` for every observation in the windows, oldest first."""
        rows = [
            (group, sample)
            for group, entry in self._groups.items()
            for window in entry.windows
            if window is not None
            for sample in window.samples(now)
        ]
        rows.sort(key=lambda row: row[1][0])
        return rows

    def describe(self, now: float) -> list[tuple[str, int, int, int, float, bool]]:
        """``(group, class, observations, censored, delay, learned)`` for every class with
        data."""
        rows = []
        for group, entry in self._groups.items():
            for index, window in enumerate(entry.windows):
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

    def fits(self, now: float) -> list[PrefillFit]:
        """The prefill model of every group that has one."""
        out = []
        for group in list(self._groups):
            fit = self.fit(group, now, spread=True)
            if fit is not None:
                out.append(fit)
        return out
