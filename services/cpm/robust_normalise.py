"""Median/MAD reward normalisation over a window of recent rewards (our choice beyond the
paper; ``CpmSettings.reward_normaliser = "robust"``).

The paper z-scores rewards with the running mean and standard deviation of every reward
(:mod:`.normalise`). Both statistics have a breakdown point of 0 %: one student's report
at the service's magnitude bound moves them without limit, and a member that files a share
of the rewards can push them report by report (docs/security.md, "Extreme rewards against
the CPM's normaliser"). This normaliser replaces them with the **median** (centre) and
``1.4826 * MAD`` (scale: the median absolute deviation from the median, scaled so that it
estimates the standard deviation of Gaussian rewards), both over the last ``window``
accepted raw rewards. Both have a breakdown point of 50 %: while hostile reports are fewer
than half the window, they can move the centre and the scale only as far as the honest
rewards' own spread reaches, whatever their magnitude.

Choices:

* **The new reward is folded in before it is normalised**, as in :mod:`.normalise`: the
  first reward normalises to 0, the second to +-0.6745 (median and MAD of two rewards).
* **The raw reward is kept** (no winsorising before it enters the window): median and MAD
  need none, and the window then holds exactly what the students reported.
* **Window** (``DEFAULT_REWARD_WINDOW`` = 256): the last W rewards. A window, not the
  whole history, because rewards are not stationary (loss reductions shrink as the
  adapters train; the running z-score of the paper weighs a round-1 reward like the
  latest) and because median and MAD need the values themselves. 256: the scale of 256
  Gaussian rewards is known to about +-7 % (the MAD's asymptotic efficiency is 37 %, so
  its relative standard error is ``sqrt(1 / (2 * 0.37 * 256))``), a window spans several
  rounds of any federation up to a few hundred agents, the snapshot grows by 2 KiB, and
  one reward costs three O(W) numpy passes (tens of microseconds, beside the bandit's
  Sherman-Morrison step). A hostile member must hold half the *window*, i.e. file half of
  the last 256 rewards, to move the statistics without bound.
* **When the MAD is 0** (more than half the window ties at the median, e.g. refused
  exchanges, which all report ``refusal_reward``, or the first rewards), the scale falls
  back to the interquartile range / 1.349, then to the mean absolute deviation from the
  median * sqrt(pi / 2) (both Gaussian-consistent), and when that is 0 too (every reward
  in the window equal, so the new one equals the centre) the z-score is 0. The fallbacks
  are less robust than the MAD (the IQR breaks down at 25 %, the mean deviation at 0 %),
  but only ever take over when more than half the window ties.
* **Bounded**: ``z = (r - median) / (scale + EPS)`` (the paper's ``eps``), then clipped to
  ``+-clip_sigmas`` and to ``+-sqrt(n - 1)`` for a window of ``n`` rewards (the largest
  |z| a running z-score over n rewards can give, so the first rewards are bounded as the
  paper's normaliser bounds them). A scale that is tiny but not 0 therefore gives at most
  ``clip_sigmas``, never a huge z. ``clip_sigmas = None``: only the ``sqrt(n - 1)`` bound.
* Non-finite or absurd rewards are refused (:func:`.normalise.check_reward`) with the state
  unchanged.

Written with numpy's ``median``/``percentile`` (``scipy.stats.median_abs_deviation`` is the
same one line, and would add scipy.stats's import time to the CPM's start).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

import numpy as np
from numpy.typing import NDArray

from .normalise import EPS, check_reward

__all__ = [
    "DEFAULT_REWARD_WINDOW",
    "MAD_TO_SIGMA",
    "MAX_REWARD_WINDOW",
    "MIN_REWARD_WINDOW",
    "RobustRewardNormaliser",
    "robust_scale",
]

#: Rewards the robust normaliser keeps (module docstring, "Window").
DEFAULT_REWARD_WINDOW = 256
#: Below this a window's median and MAD mean little (and one member filing half of a
#: handful of rewards is easy).
MIN_REWARD_WINDOW = 16
#: Bounds the snapshot (8 bytes a reward) and the O(W) work per reward.
MAX_REWARD_WINDOW = 65_536
#: ``1 / Phi^-1(3/4)``: ``MAD_TO_SIGMA * MAD`` estimates a Gaussian's standard deviation.
MAD_TO_SIGMA = 1.4826
# The interquartile range of a Gaussian is 2 * Phi^-1(3/4) = 1.349 standard deviations,
# and its mean absolute deviation sqrt(2 / pi) of one.
_IQR_PER_SIGMA = 1.349
_MEAN_AD_TO_SIGMA = math.sqrt(math.pi / 2)


def robust_scale(values: NDArray[np.float64], centre: float) -> float:
    """The spread of ``values`` around ``centre`` (their median), in standard deviations of
    a Gaussian: ``1.4826 * MAD``, else IQR / 1.349, else mean |x - centre| * sqrt(pi/2),
    else 0 (every value equal). The first that is non-zero (module docstring)."""
    deviations = np.abs(values - centre)
    mad = float(np.median(deviations))
    if mad > 0.0:
        return MAD_TO_SIGMA * mad
    q25, q75 = np.percentile(values, [25.0, 75.0])
    iqr = float(q75 - q25)
    if iqr > 0.0:
        return iqr / _IQR_PER_SIGMA
    return float(np.mean(deviations)) * _MEAN_AD_TO_SIGMA


class RobustRewardNormaliser:
    """Median/MAD z-score over the last ``window`` rewards (module docstring); the same
    interface as :class:`.normalise.RewardNormaliser` (``update``, ``normalise``,
    ``count``, ``copy``)."""

    __slots__ = ("_clip_sigmas", "_count", "_window")

    def __init__(
        self,
        window: int = DEFAULT_REWARD_WINDOW,
        rewards: Iterable[float] = (),
        count: int | None = None,
        *,
        clip_sigmas: float | None = None,
    ) -> None:
        """``rewards``: the window's contents, oldest first (a snapshot's); ``count``: the
        rewards folded in over the normaliser's life (default ``len(rewards)``)."""
        if isinstance(window, bool) or not isinstance(window, int):
            raise ValueError(f"window must be an integer, got {window!r}")
        if not MIN_REWARD_WINDOW <= window <= MAX_REWARD_WINDOW:
            raise ValueError(
                f"window must be in [{MIN_REWARD_WINDOW}, {MAX_REWARD_WINDOW}], got {window}"
            )
        if clip_sigmas is not None and not (math.isfinite(clip_sigmas) and clip_sigmas > 0):
            raise ValueError(f"clip_sigmas must be a finite number > 0 or None, got {clip_sigmas}")
        values = [check_reward(r) for r in rewards]
        if len(values) > window:
            raise ValueError(f"{len(values)} rewards do not fit a window of {window}")
        total = len(values) if count is None else int(count)
        # A window holds every reward until it is full, then exactly ``window`` of them.
        if total < 0 or len(values) != min(total, window):
            raise ValueError(
                f"a window of {window} after {total} rewards holds {min(max(total, 0), window)}, "
                f"not {len(values)}"
            )
        self._clip_sigmas = clip_sigmas
        self._window: deque[float] = deque(values, maxlen=window)
        self._count = total

    @property
    def count(self) -> int:
        """Number of rewards folded in so far (the window keeps the last ``window``)."""
        return self._count

    @property
    def window(self) -> int:
        """Most rewards kept."""
        return self._window.maxlen or 0

    @property
    def rewards(self) -> tuple[float, ...]:
        """The window's rewards, oldest first."""
        return tuple(self._window)

    def _values(self) -> NDArray[np.float64]:
        return np.fromiter(self._window, dtype=np.float64, count=len(self._window))

    @property
    def centre(self) -> float:
        """The window's median (0 while empty)."""
        return float(np.median(self._values())) if self._window else 0.0

    @property
    def scale(self) -> float:
        """The window's robust spread (:func:`robust_scale`; 0 while empty)."""
        if not self._window:
            return 0.0
        values = self._values()
        return robust_scale(values, float(np.median(values)))

    def statistics(self) -> tuple[float, float]:
        """``(centre, scale)``: the window's median and robust spread (0, 0 while empty)."""
        if not self._window:
            return 0.0, 0.0
        values = self._values()
        centre = float(np.median(values))
        return centre, robust_scale(values, centre)

    def _z(self, value: float, values: NDArray[np.float64]) -> float:
        n = len(values)
        if n == 0:
            return 0.0
        centre = float(np.median(values))
        scale = robust_scale(values, centre)
        if scale == 0.0:
            # Every reward in the window is equal: no spread to measure a distance by.
            return 0.0
        bound = math.sqrt(n - 1)
        if self._clip_sigmas is not None:
            bound = min(bound, self._clip_sigmas)
        z = (value - centre) / (scale + EPS)
        return min(max(z, -bound), bound)

    def normalise(self, reward: float) -> float:
        """Z-score ``reward`` against the current window, without folding it in."""
        return self._z(check_reward(reward), self._values())

    def update(self, reward: float) -> float:
        """Fold ``reward`` into the window (dropping the oldest when full), then return its
        robust z-score against the window."""
        value = check_reward(reward)
        self._window.append(value)
        self._count += 1
        return self._z(value, self._values())

    def copy(self) -> RobustRewardNormaliser:
        """An independent copy (to roll back to)."""
        return RobustRewardNormaliser(
            self.window, self._window, self._count, clip_sigmas=self._clip_sigmas
        )

    def state(self) -> tuple[int, tuple[float, ...]]:
        """``(count, rewards)``: everything needed to rebuild this normaliser exactly."""
        return self._count, tuple(self._window)
