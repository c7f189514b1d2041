"""LinUCB state (Li et al. 2010) as used by KNEXA-FL's CPM (Algorithm 2, Algorithm 3 l.12).

The model keeps ``A^-1`` and ``b`` for a ridge regression of reward on context:
``A = ridge * I + sum x x^T``, ``b = sum r x``, ``theta = A^-1 b``. A candidate's
upper confidence bound is ``theta^T x + beta * sqrt(x^T A^-1 x)``.

Each observation updates ``A^-1`` in O(d^2) by Sherman–Morrison,

    A^-1 <- A^-1 - (A^-1 x)(A^-1 x)^T / (1 + x^T A^-1 x),

written as ``A^-1 -= s s^T`` with ``s = A^-1 x / sqrt(1 + x^T A^-1 x)`` (``A^-1`` is
symmetric, so ``A^-1 x x^T A^-1 = u u^T`` with ``u = A^-1 x``). In that form every update
keeps ``A^-1`` *bitwise* symmetric — ``s_i * s_j == s_j * s_i`` in IEEE arithmetic.

Sherman–Morrison alone is not numerically stable: every update subtracts a rank-one term,
and with large, nearly collinear contexts the rounding accumulates until ``A^-1`` loses
positive definiteness (measured: two colluding agents did it in ~130 updates). So ``A``
itself is kept too (``A += x x^T``: additions of symmetric positive semi-definite terms
to ``ridge * I``, which cannot lose definiteness), and ``A^-1`` is re-derived from a
Cholesky factor of ``A`` every :data:`DEFAULT_REFACTOR_EVERY` updates and whenever a
cheap per-update check fails. :meth:`LinUCB.check` is the full O(d^3) validation run
before a state is persisted. Contexts are bounded by the caller
(:meth:`~.features.ContextFeatures.bound_profiles`), which keeps ``cond(A)`` within what
float64 resolves for any realistic number of updates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.linalg
from numpy.typing import NDArray

from .features import FeatureLayout

__all__ = ["DEFAULT_REFACTOR_EVERY", "INVERSE_TOLERANCE", "LinUCB", "PairTables"]


@dataclass(frozen=True)
class PairTables:
    """Per-agent pieces of the exact pair UCB (:meth:`LinUCB.pair_tables`) for one bandit
    state: one row per agent of ``table`` (scoring dtype) and ``scal`` (float64), the
    column spans, and the combo and ``z`` weights taken from ``A^-1`` and ``theta``."""

    table: NDArray[np.floating[Any]]
    scal: NDArray[np.float64]
    spans: tuple[int, int, int, int, int, int, int, int]
    kk: NDArray[np.float64]
    mean_c: NDArray[np.float64]
    z_weights: tuple[NDArray[Any], NDArray[Any], NDArray[Any]] | None
    n_updates: int


# Unordered pairs scored per block in score_pairs (bounds the O(block * d) temporaries).
_PAIR_BLOCK = 1024

#: Updates between re-derivations of ``A^-1`` from a Cholesky factor of ``A``. At d = 132 a
#: re-factorisation costs ~1 ms, so once per 64 updates adds ~2% to an update's cost while
#: bounding how far Sherman–Morrison rounding can drift between two exact points.
DEFAULT_REFACTOR_EVERY = 64
#: ``max |A A^-1 - I|`` accepted by :meth:`LinUCB.check` (relative to ``cond(A)`` scale).
INVERSE_TOLERANCE = 1e-6


def _square(arr: NDArray[np.float64], name: str) -> NDArray[np.float64]:
    mat = np.array(arr, dtype=np.float64)
    if mat.ndim != 2 or mat.shape[0] != mat.shape[1] or mat.shape[0] < 1:
        raise ValueError(f"{name} must be a square matrix, got shape {mat.shape}")
    if not np.all(np.isfinite(mat)):
        raise ValueError(f"{name} must be finite")
    scale = max(float(np.max(np.abs(mat))), 1.0)
    if not np.allclose(mat, mat.T, rtol=0.0, atol=1e-9 * scale):
        raise ValueError(f"{name} must be symmetric")
    return mat


def _is_pd(mat: NDArray[np.float64]) -> bool:
    try:
        np.linalg.cholesky(mat)
    except np.linalg.LinAlgError:
        return False
    return True


def _spd_inverse(mat: NDArray[np.float64]) -> NDArray[np.float64] | None:
    """Inverse of a symmetric positive definite matrix through its Cholesky factor.

    ``A = L L^T`` so ``A^-1 = L^-T L^-1``; the result is symmetrised (one GEMM is not
    bitwise symmetric). ``None`` if ``mat`` is not positive definite.
    """
    try:
        low = np.linalg.cholesky(mat)
    except np.linalg.LinAlgError:
        return None
    eye = np.eye(mat.shape[0])
    low_inv = scipy.linalg.solve_triangular(low, eye, lower=True, check_finite=False)
    inv: NDArray[np.float64] = low_inv.T @ low_inv
    return (inv + inv.T) * 0.5


class LinUCB:
    """Ridge-regression bandit state with Sherman–Morrison updates and batch UCB scoring.

    ``A`` is kept beside ``A^-1`` (a rank-one add, exact to rounding and always symmetric
    positive definite while ``ridge > 0``), and ``A^-1`` is re-derived from a Cholesky
    factor of ``A`` every ``refactor_every`` updates and whenever a cheap check after an
    update fails (a non-positive denominator or diagonal entry). Sherman–Morrison alone
    accumulates rounding that, with adversarial contexts, drives ``A^-1`` indefinite.
    """

    __slots__ = (
        "_a",
        "_a_inv",
        "_b",
        "_buf",
        "_dim",
        "_n_updates",
        "_pending",
        "_refactor_every",
        "_refactors",
        "_ridge",
        "_theta",
    )

    def __init__(
        self, dim: int, ridge: float = 1.0, *, refactor_every: int = DEFAULT_REFACTOR_EVERY
    ) -> None:
        if dim < 1:
            raise ValueError("dim must be >= 1")
        if not (math.isfinite(ridge) and ridge > 0):
            raise ValueError("ridge must be a positive finite number")
        if refactor_every < 1:
            raise ValueError("refactor_every must be >= 1")
        self._dim = int(dim)
        self._ridge = float(ridge)
        self._refactor_every = int(refactor_every)
        self._a: NDArray[np.float64] = np.eye(dim, dtype=np.float64) * ridge
        self._a_inv: NDArray[np.float64] = np.eye(dim, dtype=np.float64) / ridge
        self._b: NDArray[np.float64] = np.zeros(dim, dtype=np.float64)
        # Contexts not yet folded into A: A is needed only to re-derive A^-1 (every
        # refactor_every updates), so the rank-one adds are batched into one GEMM there.
        self._pending: list[NDArray[np.float64]] = []
        # Scratch for the rank-one term, so an update allocates only O(d).
        self._buf: NDArray[np.float64] = np.empty((dim, dim), dtype=np.float64)
        self._n_updates = 0
        self._refactors = 0
        self._theta: NDArray[np.float64] | None = None

    @classmethod
    def from_arrays(
        cls,
        a_inv: NDArray[np.float64],
        b: NDArray[np.float64],
        n_updates: int,
        a: NDArray[np.float64] | None = None,
        *,
        ridge: float = 1.0,
        refactor_every: int = DEFAULT_REFACTOR_EVERY,
    ) -> LinUCB:
        """Rebuild a state from stored arrays (copies them); raises ``ValueError`` if invalid.

        With ``a`` (``A``) given, ``A`` is the source of truth: it must be symmetric
        positive definite, and the stored ``A^-1`` is kept only if it is positive definite
        and inverts ``A`` to :data:`INVERSE_TOLERANCE`, else re-derived from ``A``. Without
        ``A`` (a state written before ``A`` was stored), ``A^-1`` must be positive definite
        and ``A`` is derived from it.
        """
        inv = _square(a_inv, "a_inv")
        vec = np.array(b, dtype=np.float64)
        if vec.shape != (inv.shape[0],):
            raise ValueError(f"b must have shape ({inv.shape[0]},), got {vec.shape}")
        if not np.all(np.isfinite(vec)):
            raise ValueError("b must be finite")
        if n_updates < 0:
            raise ValueError("n_updates must be >= 0")
        state = cls(inv.shape[0], ridge, refactor_every=refactor_every)
        inv = (inv + inv.T) * 0.5
        if a is None:
            if not _is_pd(inv):
                raise ValueError("a_inv must be positive definite")
            full = _spd_inverse(inv)
            if full is None:
                raise ValueError("a_inv must be positive definite")
            state._a = full
            state._a_inv = inv
        else:
            mat = _square(a, "a")
            if mat.shape != inv.shape:
                raise ValueError(f"a has shape {mat.shape}, a_inv {inv.shape}")
            state._a = (mat + mat.T) * 0.5
            state._a_inv = inv
            if not state.check():
                state.refactor()
        state._b = vec
        state._n_updates = int(n_updates)
        return state

    @property
    def dim(self) -> int:
        """Context dimension d."""
        return self._dim

    @property
    def a_inv(self) -> NDArray[np.float64]:
        """Read-only view of ``A^-1`` (d, d)."""
        view = self._a_inv.view()
        view.flags.writeable = False
        return view

    @property
    def b(self) -> NDArray[np.float64]:
        """Read-only view of ``b`` (d,)."""
        view = self._b.view()
        view.flags.writeable = False
        return view

    @property
    def n_updates(self) -> int:
        """Number of observations folded in."""
        return self._n_updates

    @property
    def theta(self) -> NDArray[np.float64]:
        """``A^-1 b`` (read-only; computed once per change of state, not per call)."""
        if self._theta is None:
            theta = self._a_inv @ self._b
            theta.flags.writeable = False
            self._theta = theta
        return self._theta

    def _fold_pending(self) -> None:
        if self._pending:
            xs = np.stack(self._pending)
            self._pending.clear()
            # X^T X is symmetric in exact arithmetic, not bitwise: symmetrise once per fold.
            gram = xs.T @ xs
            self._a += (gram + gram.T) * 0.5

    @property
    def a(self) -> NDArray[np.float64]:
        """Read-only view of ``A = ridge I + sum x x^T`` (d, d)."""
        self._fold_pending()
        view = self._a.view()
        view.flags.writeable = False
        return view

    @property
    def refactors(self) -> int:
        """Re-derivations of ``A^-1`` from ``A`` since this object was made."""
        return self._refactors

    def prepare(self, x: NDArray[np.float64]) -> NDArray[np.float64]:
        """Validate ``x`` and return the Sherman–Morrison factor ``s``; changes no state.

        Split from :meth:`commit` so a caller can validate everything it will change
        before changing any of it. Raises ``ValueError`` for a wrong shape or a
        non-finite ``x``. A non-positive denominator with a finite ``x`` means ``A^-1``
        drifted: it is re-derived from ``A`` (the same matrix, exactly) and the factor
        computed again.
        """
        if x.shape != (self._dim,):
            raise ValueError(f"context must have shape ({self._dim},), got {x.shape}")
        if not np.all(np.isfinite(x)):
            raise ValueError("context is not finite")
        u = self._a_inv @ x
        denom = 1.0 + float(np.dot(x, u))
        if not (math.isfinite(denom) and denom >= 1.0):
            # x^T A^-1 x >= 0 for a positive definite A^-1: anything less is drift.
            self.refactor()
            u = self._a_inv @ x
            denom = 1.0 + float(np.dot(x, u))
            if not (math.isfinite(denom) and denom > 0.0):
                raise ValueError("context overflows the bandit (x^T A^-1 x is not finite)")
        u *= 1.0 / math.sqrt(denom)
        return u

    def commit(self, x: NDArray[np.float64], s: NDArray[np.float64], reward: float) -> None:
        """Apply ``A += x x^T``, ``A^-1 -= s s^T`` and ``b += reward * x``.

        ``s`` comes from :meth:`prepare`. Every :data:`DEFAULT_REFACTOR_EVERY` updates, or
        when the diagonal of ``A^-1`` turns non-positive, ``A^-1`` is re-derived from ``A``.
        """
        # np.dot of a column and a row is a k = 1 GEMM (BLAS, ~1.5x faster than np.outer);
        # each entry is still the single product s_i * s_j, so the result stays symmetric.
        np.dot(s[:, None], s[None, :], out=self._buf)
        np.subtract(self._a_inv, self._buf, out=self._a_inv)
        self._pending.append(np.array(x, dtype=np.float64))
        self._b += reward * x
        self._n_updates += 1
        self._theta = None
        if self._n_updates % self._refactor_every == 0 or float(np.min(np.diag(self._a_inv))) <= 0:
            self.refactor()

    def refactor(self) -> None:
        """Re-derive ``A^-1`` from a Cholesky factor of ``A``.

        Raises ``ValueError`` if ``A`` is not positive definite, which cannot happen for
        ``ridge > 0`` and finite contexts short of overflow (the caller bounds contexts).
        """
        self._fold_pending()
        inv = _spd_inverse(self._a)
        if inv is None:
            raise ValueError("A is not positive definite")
        self._a_inv = inv
        self._theta = None
        self._refactors += 1

    def check(self) -> bool:
        """Full validation, O(d^3): ``A^-1`` symmetric, positive definite, inverse of ``A``.

        Meant before a state is persisted, not per update.
        """
        self._fold_pending()
        inv = self._a_inv
        if not (np.all(np.isfinite(inv)) and np.array_equal(inv, inv.T) and _is_pd(inv)):
            return False
        resid = float(np.max(np.abs(self._a @ inv - np.eye(self._dim))))
        return resid <= INVERSE_TOLERANCE

    def update(self, x: NDArray[np.float64], reward: float) -> None:
        """Fold one observation ``(x, reward)`` in: O(d^2), no matrix inverse."""
        ctx = np.asarray(x, dtype=np.float64)
        if not math.isfinite(reward):
            raise ValueError("reward must be finite")
        self.commit(ctx, self.prepare(ctx), reward)

    def update_block(self, xs: NDArray[np.float64], rewards: NDArray[np.float64]) -> None:
        """Fold ``k`` observations (rows of ``xs``) at once by the Woodbury identity.

        ``A^-1 -= U^T C^-1 U`` with ``U = X A^-1`` and ``C = I + X A^-1 X^T`` (k x k,
        factored by Cholesky): a few GEMMs instead of ``k`` rank-one passes over ``A^-1``,
        equal to ``k`` calls of :meth:`update` to rounding (the CPM's group commit applies
        a whole batch this way). One row goes through :meth:`update` (bitwise the same as
        the sequential path). Raises ``ValueError`` with no state changed for a bad shape
        or a non-finite entry.
        """
        if xs.ndim != 2 or xs.shape[1] != self._dim or rewards.shape != (xs.shape[0],):
            raise ValueError(f"expected (k, {self._dim}) contexts and (k,) rewards")
        if not (np.all(np.isfinite(xs)) and np.all(np.isfinite(rewards))):
            raise ValueError("contexts and rewards must be finite")
        k = xs.shape[0]
        if k == 0:
            return
        if k == 1:
            self.commit(xs[0], self.prepare(xs[0]), float(rewards[0]))
            return
        u = xs @ self._a_inv
        try:
            low = np.linalg.cholesky(np.eye(k) + u @ xs.T)
        except np.linalg.LinAlgError:
            # I + X A^-1 X^T is positive definite for a positive definite A^-1: drift.
            self.refactor()
            u = xs @ self._a_inv
            low = np.linalg.cholesky(np.eye(k) + u @ xs.T)
        w = scipy.linalg.solve_triangular(low, u, lower=True, check_finite=False)
        delta = w.T @ w
        self._a_inv -= (delta + delta.T) * 0.5
        self._b += rewards @ xs
        self._pending.extend(np.array(xs, dtype=np.float64))
        before = self._n_updates
        self._n_updates += k
        self._theta = None
        crossed = before // self._refactor_every != self._n_updates // self._refactor_every
        if crossed or float(np.min(np.diag(self._a_inv))) <= 0:
            self.refactor()

    def score(
        self, contexts: NDArray[np.float64], beta: float
    ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """UCB and mean for each row of ``contexts`` (M, d), vectorised.

        ``mean = X theta``; ``ucb = mean + beta * sqrt(rowsum((X A^-1) * X))``. The
        quadratic form is clipped at 0 before the square root: it is non-negative in exact
        arithmetic, but rounding can leave ``-1e-17`` for a near-null direction.
        """
        if contexts.ndim != 2 or contexts.shape[1] != self._dim:
            raise ValueError(f"contexts must have shape (M, {self._dim}), got {contexts.shape}")
        mean = contexts @ self.theta
        quad = np.einsum("ij,ij->i", contexts @ self._a_inv, contexts)
        np.maximum(quad, 0.0, out=quad)
        np.sqrt(quad, out=quad)
        quad *= beta
        quad += mean
        return quad, mean

    def score_pairs(
        self,
        layout: FeatureLayout,
        profiles: NDArray[np.float64],
        trust: NDArray[np.float64] | None,
        left: NDArray[np.intp],
        right: NDArray[np.intp],
        beta: float,
        *,
        dtype: type[np.floating[Any]] = np.float64,
    ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """Exact UCB and mean of every candidate tuple of the pairs ``(left[p], right[p])``.

        Returns two ``(n_pairs, 2 * C)`` arrays (``C`` = protocols x roles): columns
        ``[0, C)`` are ``left -> right`` with one-hot combo ``c``, columns ``[C, 2C)`` are
        ``right -> left``. Equal (to rounding) to :meth:`score` on the contexts built by
        :class:`~.features.ContextFeatures` — but without building them. The context is
        ``x = E_s u_s + E_r u_r + E_z z + k_c`` with ``u_a = [p_a, t_a]`` per agent,
        ``z = [|p_i - p_j|, p_i * p_j]`` per unordered pair (the same for both
        directions) and ``k_c`` the one-hot plus bias, so ``x^T A^-1 x`` splits into
        per-agent terms (computed once per agent), one ``z^T M_zz z`` per pair, and dot
        products of length ``d_p``. That is ~``(2 d_p)^2`` work per pair instead of
        ``2 C d^2`` with ``d ~ 4 d_p``, and no ``(M, d)`` context matrix.
        """
        tables = self.pair_tables(layout, profiles, trust, dtype=dtype)
        return self.score_pair_tables(tables, left, right, beta)

    def pair_tables(
        self,
        layout: FeatureLayout,
        profiles: NDArray[np.float64],
        trust: NDArray[np.float64] | None,
        *,
        dtype: type[np.floating[Any]] = np.float64,
    ) -> PairTables:
        """The per-agent pieces of :meth:`score_pairs` for every agent of ``profiles``,
        computed once so that several sets of pairs among them (a round's refill passes)
        are scored without repeating them. Valid until the bandit is next updated."""
        lay = layout
        m = self._a_inv
        th = self.theta
        n, dp = profiles.shape
        if dp != lay.profile_dim or lay.dim != self._dim:
            raise ValueError("layout does not match the profiles or this bandit")
        s_idx = np.arange(lay.sender.start, lay.sender.stop)
        r_idx = np.arange(lay.receiver.start, lay.receiver.stop)
        if lay.trust_sender is not None and lay.trust_receiver is not None:
            if trust is None or trust.shape != (n,):
                raise ValueError("trust features are on: trust must have shape (N,)")
            u = np.hstack([profiles, trust[:, None]])
            s_idx = np.append(s_idx, lay.trust_sender)
            r_idx = np.append(r_idx, lay.trust_receiver)
        else:
            u = profiles
        du = u.shape[1]
        oh_idx = np.arange(lay.onehot.start, lay.onehot.stop)
        n_c = len(oh_idx)
        k_rows = m[oh_idx] + m[lay.bias]  # (C, d): row c is M k_c
        kk = k_rows[np.arange(n_c), oh_idx] + k_rows[:, lay.bias]
        mean_c = th[oh_idx] + th[lay.bias]
        inter = lay.absdiff is not None and lay.product is not None
        z_idx = (
            np.r_[
                np.arange(lay.absdiff.start, lay.absdiff.stop),
                np.arange(lay.product.start, lay.product.stop),
            ]
            if lay.absdiff is not None and lay.product is not None
            else np.empty(0, dtype=np.intp)
        )
        dz = len(z_idx)
        # One table row per agent, so each block needs two row gathers (the pair's two
        # agents) instead of a dozen column-block gathers:
        #   [u | 2 M_sr^T u | 2 M_sz^T u | 2 M_rz^T u | h_s | h_r]
        # (h: the agent-combo cross terms) in the scoring dtype, and beside it the per-agent
        # quadratic self-terms and means [q_s, q_r, mean_s, mean_r] in float64.
        c_cross, c_gs = du, 2 * du
        c_hs = 2 * du + 2 * dz
        c_hr = c_hs + n_c
        dt = np.dtype(dtype)
        if dt not in (np.float32, np.float64):
            raise ValueError("dtype must be float32 or float64")
        table = np.empty((n, c_hr + n_c), dtype=dt)
        table[:, :du] = u
        # Every projection in one GEMM against [M_sr | M_sz | M_rz | K_s | K_r], the factor
        # 2 folded into the weights (scaling by 2 is exact, so this equals 2 * (u @ M)).
        weights = [m[np.ix_(s_idx, r_idx)]]
        if dz:
            weights += [m[np.ix_(s_idx, z_idx)], m[np.ix_(r_idx, z_idx)]]
        weights += [k_rows[:, s_idx].T, k_rows[:, r_idx].T]
        table[:, c_cross:] = u @ (2.0 * np.hstack(weights))
        scal = np.empty((n, 4), dtype=np.float64)
        scal[:, 0] = np.einsum("ij,ij->i", u @ m[np.ix_(s_idx, s_idx)], u)
        scal[:, 1] = np.einsum("ij,ij->i", u @ m[np.ix_(r_idx, r_idx)], u)
        scal[:, 2] = u @ th[s_idx]
        scal[:, 3] = u @ th[r_idx]
        if inter:
            m_zz = m[np.ix_(z_idx, z_idx)].astype(dt)
            k_z = (2.0 * k_rows[:, z_idx]).T.astype(dt)
            th_z = th[z_idx].astype(dt)

        return PairTables(
            table=table,
            scal=scal,
            spans=(dp, du, dz, n_c, c_cross, c_gs, c_hs, c_hr),
            kk=kk,
            mean_c=mean_c,
            z_weights=(m_zz, k_z, th_z) if inter else None,
            n_updates=self._n_updates,
        )

    def score_pair_tables(
        self,
        tables: PairTables,
        left: NDArray[np.intp],
        right: NDArray[np.intp],
        beta: float,
    ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """:meth:`score_pairs` of the pairs ``(left[p], right[p])`` (indices into the
        agents ``tables`` was built for). Raises ``ValueError`` if the bandit was updated
        since ``tables`` was built."""
        if tables.n_updates != self._n_updates:
            raise ValueError("pair tables are stale: the bandit was updated since they were built")
        table, scal, kk, mean_c = tables.table, tables.scal, tables.kk, tables.mean_c
        dp, du, dz, n_c, c_cross, c_gs, c_hs, c_hr = tables.spans
        inter = tables.z_weights is not None
        if tables.z_weights is not None:
            m_zz, k_z, th_z = tables.z_weights
        dt = table.dtype
        n_pairs = len(left)
        ucb = np.empty((n_pairs, 2 * n_c), dtype=np.float64)
        mean = np.empty((n_pairs, 2 * n_c), dtype=np.float64)
        for lo in range(0, n_pairs, _PAIR_BLOCK):
            li, rj = left[lo : lo + _PAIR_BLOCK], right[lo : lo + _PAIR_BLOCK]
            # ndarray.take copies whole rows ~2x faster than fancy indexing (numpy 2.x).
            ti, tj = table.take(li, axis=0), table.take(rj, axis=0)
            si, sj = scal.take(li, axis=0), scal.take(rj, axis=0)
            rows = len(ti)
            ui, uj = ti[:, :du], tj[:, :du]
            fwd = si[:, 0] + sj[:, 1] + np.einsum("ij,ij->i", ti[:, c_cross:c_gs], uj)
            rev = sj[:, 0] + si[:, 1] + np.einsum("ij,ij->i", tj[:, c_cross:c_gs], ui)
            m_fwd = si[:, 2] + sj[:, 3]
            m_rev = sj[:, 2] + si[:, 3]
            combo = ti[:, c_hs:c_hr] + tj[:, c_hr:], tj[:, c_hs:c_hr] + ti[:, c_hr:]
            if inter:
                pi, pj = ui[:, :dp], uj[:, :dp]
                z = np.empty((rows, dz), dtype=dt)
                np.subtract(pi, pj, out=z[:, :dp])
                np.abs(z[:, :dp], out=z[:, :dp])
                np.multiply(pi, pj, out=z[:, dp:])
                q_z = np.einsum("ij,ij->i", z @ m_zz, z)
                # z . g for both agents and both roles at once: (rows, 2) per agent.
                gi = np.einsum("ikd,id->ik", ti[:, c_gs:c_hs].reshape(rows, 2, dz), z)
                gj = np.einsum("ikd,id->ik", tj[:, c_gs:c_hs].reshape(rows, 2, dz), z)
                fwd += q_z + gi[:, 0] + gj[:, 1]
                rev += q_z + gj[:, 0] + gi[:, 1]
                z_c = z @ k_z + kk
                m_z = z @ th_z
                m_fwd += m_z
                m_rev += m_z
            else:
                z_c = np.broadcast_to(kk, (rows, n_c))
            for col, (quad, mu, per_combo) in enumerate(
                ((fwd, m_fwd, combo[0]), (rev, m_rev, combo[1]))
            ):
                block = quad[:, None] + per_combo + z_c
                np.maximum(block, 0.0, out=block)
                np.sqrt(block, out=block)
                block *= beta
                mu_block = mu[:, None] + mean_c
                cols = slice(col * n_c, (col + 1) * n_c)
                mean[lo : lo + rows, cols] = mu_block
                ucb[lo : lo + rows, cols] = block + mu_block
        return ucb, mean
