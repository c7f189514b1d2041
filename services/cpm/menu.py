"""The knowledge-exchange menu K_rec and which (pair, protocol) tuples are admissible.

The menu (``docs/matchmaker.md``, "The menu") is the kernel's protocol catalogue
(:mod:`peerlm.protocols`); this module reads its entries' attributes, never their names:

============  =========================================================================
protocol      what the student does with the teacher (the directive's sender)
============  =========================================================================
``akd``       text AKD: fetches the teacher's completions on X_u and distils them
``akd_logits``  AKD on the teacher's top-k logits (same tokenizer needed)
``pmix``      pulls the teacher's adapter and mixes it with its own (SemanticDFL PDFL)
``svd_hka``   pulls the teacher's adapter, SVD-aggregates it with its own and aligns by
              HKA on public pairs (OnePeFT)
============  =========================================================================

Admissibility, decided from profiles only (the CPM never sees parameters):

* a protocol is admissible for a pair only if **both** agents advertise it
  (:attr:`Capabilities.protocols`; an agent that advertises nothing is taken to support
  :data:`DEFAULT_AGENT_PROTOCOLS`, i.e. ``akd``, what every peerlm agent has always done);
* a protocol of :data:`SAME_SPACE_PROTOCOLS` (admissibility ``same_space`` in the
  catalogue: the merges, and logits distillation, which needs one tokenizer) is
  admissible only between agents that declared the **same
  non-empty parameter-space fingerprint** (:attr:`Capabilities.param_space`), and not
  between two agents one of which disproved the other's fingerprint by a pulled adapter
  (:attr:`Capabilities.space_excluded`; docs/matchmaker.md, "The fingerprint").

Both rules are symmetric in the pair. A third is not (**overlay narrowing**, SemanticDFL
as the CPM's candidate filter):

* a protocol of :data:`MERGE_PROTOCOLS` is admissible for ``sender -> student`` only if
  the sender is in the student's reported overlay top-K
  (:attr:`Capabilities.senders`) when the student reported one; a student that reported
  none is not narrowed. Non-merge protocols are never narrowed: AKD needs no adapter of
  the sender, so similarity in parameter space is no precondition for it.
:class:`AdmissibilityMask` evaluates them vectorised for the matchmaker's candidate pairs:
one integer per agent for its fingerprint class, one boolean row per agent for its
protocols; a pair costs a few array gathers, never a Python loop.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from peerlm.protocols import DEFAULT_PROTOCOL, names

__all__ = [
    "DEFAULT_AGENT_PROTOCOLS",
    "MAX_ADVERTISED_PROTOCOLS",
    "MAX_OVERLAY_PEERS",
    "MAX_PARAM_SPACE_LEN",
    "MENU",
    "MERGE_PROTOCOLS",
    "SAME_SPACE_PROTOCOLS",
    "AdmissibilityMask",
    "Capabilities",
    "check_overlay_peers",
    "check_param_space",
    "check_protocols",
]

#: Every protocol the CPM may recommend (K_rec); a deployment configures a subset.
MENU = names()
#: Protocols whose student pulls and merges the sender's adapter.
MERGE_PROTOCOLS = frozenset(names(kind="merge"))
#: Protocols admissible only between agents of one parameter space (same fingerprint).
SAME_SPACE_PROTOCOLS = frozenset(names(admissibility="same_space"))
#: What an agent that advertises no protocol is taken to support (agents before the menu).
DEFAULT_AGENT_PROTOCOLS = (DEFAULT_PROTOCOL,)
#: Longest parameter-space fingerprint accepted (a SHA-256 hex digest is 64; room for a
#: scheme prefix such as ``ps1:``).
MAX_PARAM_SPACE_LEN = 128
#: Most protocol names one profile may advertise.
MAX_ADVERTISED_PROTOCOLS = 16
#: Most overlay peers one profile may report (SemanticDFL's K is a handful; room to spare).
MAX_OVERLAY_PEERS = 64
_PARAM_SPACE = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_PARAM_SPACE_LEN}}}")
_PROTOCOL_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")


def check_param_space(value: str) -> str:
    """``value`` if it is empty or 1-128 characters of ``[A-Za-z0-9._:-]``; else ValueError.

    The CPM compares fingerprints for equality only; the bounds keep what a member can make
    it store small and printable (it is logged and shown by ``peerlm status``)."""
    if value and not _PARAM_SPACE.fullmatch(value):
        raise ValueError(
            f"parameter_space must be at most {MAX_PARAM_SPACE_LEN} characters of "
            f"[A-Za-z0-9._:-], got {value[:40]!r}{'...' if len(value) > 40 else ''}"
        )
    return value


def check_protocols(values: Sequence[str]) -> tuple[str, ...]:
    """The advertised protocol names as a tuple, or ValueError: at most
    :data:`MAX_ADVERTISED_PROTOCOLS`, each a lower-case identifier of at most 32
    characters, no repeats. Names outside this CPM's menu are kept (an agent may be newer
    than its CPM) and simply never match a configured protocol."""
    names = tuple(values)
    if len(names) > MAX_ADVERTISED_PROTOCOLS:
        raise ValueError(
            f"at most {MAX_ADVERTISED_PROTOCOLS} protocols may be advertised, got {len(names)}"
        )
    for name in names:
        if not isinstance(name, str) or not _PROTOCOL_NAME.fullmatch(name):
            raise ValueError(
                f"protocol name {str(name)[:40]!r} is not a lower-case identifier of at most "
                "32 characters"
            )
    if len(set(names)) != len(names):
        raise ValueError("protocols must not repeat a name")
    return names


def check_overlay_peers(
    values: Sequence[str], agent: str, known: Callable[[str], bool]
) -> tuple[str, ...]:
    """The reported overlay top-K as a tuple, or ValueError: at most
    :data:`MAX_OVERLAY_PEERS` names, no repeats, not ``agent`` itself, each ``known`` (an
    agent of the federation the CPM holds a profile of: a name it could never pair would
    only be a way to make the CPM store strings)."""
    names = tuple(values)
    if len(names) > MAX_OVERLAY_PEERS:
        raise ValueError(
            f"at most {MAX_OVERLAY_PEERS} overlay peers may be reported, got {len(names)}"
        )
    if len(set(names)) != len(names):
        raise ValueError("overlay_peers must not repeat a name")
    for name in names:
        if name == agent:
            raise ValueError("overlay_peers must not name the reporting agent itself")
        if len(name) > 64 or not known(name):
            raise ValueError(f"overlay peer {name[:64]!r} is not an agent this CPM knows")
    return names


@dataclass(frozen=True)
class Capabilities:
    """What an agent's profile declares about how it can exchange knowledge.

    ``param_space``: its parameter-space fingerprint (``""``: undeclared, so no
    same-space protocol is admissible for it); ``protocols``: the protocols it executes
    (``()``: :data:`DEFAULT_AGENT_PROTOCOLS`); ``senders``: its reported overlay top-K, the
    only admissible senders of a merge protocol to it (``None``: not reported, no
    narrowing); ``space_excluded``: agents with which no same-space protocol is
    admissible for it, in either direction (one of the two disproved the other's
    fingerprint by an adapter it pulled).
    """

    param_space: str = ""
    protocols: tuple[str, ...] = ()
    senders: frozenset[str] | None = None
    space_excluded: frozenset[str] = frozenset()

    def supports(self, protocol: str) -> bool:
        """Whether this agent executes ``protocol``."""
        return protocol in (self.protocols or DEFAULT_AGENT_PROTOCOLS)


_UNDECLARED = Capabilities()


class AdmissibilityMask:
    """Which (pair, protocol, role) tuples of a round are admissible (module docstring).

    Built once per ``select`` from the round's agents (in the matchmaker's sorted order)
    and their :class:`Capabilities` (missing agents: undeclared). :attr:`trivial` is True
    when every tuple is admissible; the matchmaker then skips the mask entirely, so a
    deployment on the default single-protocol menu selects exactly as before.
    """

    def __init__(
        self,
        ids: Sequence[str],
        capabilities: Mapping[str, Capabilities],
        protocols: Sequence[str],
        roles: Sequence[str],
    ) -> None:
        caps = [capabilities.get(a, _UNDECLARED) for a in ids]
        self._n_roles = len(roles)
        # Fingerprint classes: equal non-empty strings share an id; undeclared is -1.
        spaces = [c.param_space for c in caps]
        index: dict[str, int] = {}
        self._space = np.array(
            [index.setdefault(s, len(index)) if s else -1 for s in spaces], dtype=np.int64
        )
        self._support = np.array(
            [[c.supports(p) for p in protocols] for c in caps], dtype=bool
        ).reshape(len(caps), len(protocols))
        self._same_space = np.array([p in SAME_SPACE_PROTOCOLS for p in protocols], dtype=bool)
        all_supported = bool(self._support.all())
        one_space = bool(len(index) == 1 and np.all(self._space == 0))
        self._merge = np.array([p in MERGE_PROTOCOLS for p in protocols], dtype=bool)
        # Overlay narrowing: the allowed (sender, student) pairs as sorted int64 keys
        # ``sender * n + student``, and which students narrow at all.
        n = len(ids)
        position = {a: k for k, a in enumerate(ids)}
        self._n = n
        self._narrowed = np.array([c.senders is not None for c in caps], dtype=bool)
        self._allowed = np.sort(
            np.array(
                [
                    position[s] * n + k
                    for k, c in enumerate(caps)
                    for s in (c.senders or ())
                    if s in position
                ],
                dtype=np.int64,
            )
        )
        # Space exclusions: the excluded unordered pairs as sorted keys ``low * n + high``.
        self._excluded = np.unique(
            np.array(
                [
                    min(k, position[x]) * n + max(k, position[x])
                    for k, c in enumerate(caps)
                    for x in c.space_excluded
                    if x in position
                ],
                dtype=np.int64,
            )
        )
        narrowing = bool(self._merge.any() and self._narrowed.any())
        excluding = bool(self._same_space.any() and len(self._excluded))
        self.trivial = (
            all_supported
            and (not self._same_space.any() or one_space)
            and not narrowing
            and not excluding
        )

    def pairs(self, left: NDArray[np.intp], right: NDArray[np.intp]) -> NDArray[np.bool_]:
        """``(n_pairs, 2 * n_protocols * n_roles)`` admissibility of the pairs
        ``(left[k], right[k])`` (indices into the round's agents), in the column layout of
        :meth:`.LinUCB.score_pairs`: the forward (protocol, role) combos, then the reverse
        ones (the same but for overlay narrowing, which depends on who is the student)."""
        ok = self._support[left] & self._support[right]
        if self._same_space.any():
            sl = self._space[left]
            same = (sl == self._space[right]) & (sl >= 0)
            if len(self._excluded):
                lo = np.minimum(left, right).astype(np.int64)
                hi = np.maximum(left, right).astype(np.int64)
                same &= ~np.isin(lo * self._n + hi, self._excluded)
            ok[:, self._same_space] &= same[:, None]
        forward, reverse = ok, ok
        if self._merge.any() and self._narrowed.any():
            # left -> right: the student is right; right -> left: the student is left.
            forward, reverse = ok.copy(), ok.copy()
            forward[:, self._merge] &= self._may_send(left, right)[:, None]
            reverse[:, self._merge] &= self._may_send(right, left)[:, None]
        if self._n_roles > 1:
            forward = np.repeat(forward, self._n_roles, axis=1)
            reverse = np.repeat(reverse, self._n_roles, axis=1)
        return np.concatenate([forward, reverse], axis=1)

    def _may_send(self, sender: NDArray[np.intp], student: NDArray[np.intp]) -> NDArray[np.bool_]:
        """Whether each ``sender[k]`` may send a merge to ``student[k]`` (narrowing only)."""
        keys = sender.astype(np.int64) * self._n + student.astype(np.int64)
        listed = np.isin(keys, self._allowed, assume_unique=False)
        return ~self._narrowed[student] | listed
