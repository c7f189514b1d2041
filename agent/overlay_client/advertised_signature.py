"""Is a pulled adapter the one its overlay signature advertised? (the student's check).

An overlay search ranks peers by the cosine between the querier's signature and the
signature each peer *published*; PDFL then weighs each pulled adapter by that similarity.
Nothing tied the published signature to the adapter the peer serves: a member could
advertise a signature close to everyone's, be found by every search with the largest
similarity, take the largest weight in every anchor, and serve any adapter.

:func:`recomputed_similarity` recomputes, from the pulled adapter, the signature the peer
should have published at the querier's cardinality P, and its cosine with the querier's
own signature; :func:`check_advertised` refuses a peer whose advertised similarity exceeds
that by more than a tolerance (reason ``signature_mismatch``).

Choices made here:

* **Importance = |w|.** A peer's published mask comes from its importance EMA (Sec. 3.2),
  which the student cannot see; the recomputation takes the adapter's own magnitudes,
  what the EMA is after its first update and what it tracks.
* **One-sided, with a tolerance.** Only an advertised similarity *above* the recomputed
  one is refused (a lower one costs the peer weight, no one else). Honest peers change
  their adapter between publishing and serving (aggregation, a round of training) and the
  EMA lags: measured on the micro models, an extra round of training at learning rate
  1e-2 after publishing moved the recomputed cosine 0.11 below the advertised one at most
  (0.04 at 1e-3); the default tolerance is 0.2 (``PullSettings.signature_tolerance``).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from peerlm.overlay import Signature, flatten_adapter, make_signature, sparse_cosine

__all__ = ["SignatureMismatch", "check_advertised", "recomputed_similarity"]


class SignatureMismatch(ValueError):
    """The adapter is not what its advertised signature said; ``reason`` is a metric label."""

    reason = "signature_mismatch"


def recomputed_similarity(query: Signature, state: Mapping[str, torch.Tensor]) -> float:
    """Cosine between ``query`` (our published signature) and the signature of ``state``
    at ``query``'s cardinality, importance ``|w|`` (see the module docstring). 0.0 when
    ``state`` is of another parameter space than ``query``'s."""
    weights, space = flatten_adapter(state)
    p = min(query.p, int(weights.shape[0]))
    theirs = make_signature(weights, np.abs(weights), max(p, 1), space)
    return float(sparse_cosine(query, theirs))


def check_advertised(
    query: Signature, state: Mapping[str, torch.Tensor], advertised: float, tolerance: float
) -> float:
    """Raise :class:`SignatureMismatch` when ``advertised`` (the search's similarity)
    exceeds the similarity recomputed from ``state`` by more than ``tolerance``; else
    return the recomputed similarity."""
    found = recomputed_similarity(query, state)
    if not advertised <= found + tolerance:
        raise SignatureMismatch(
            f"advertised similarity {advertised:.3f}, the pulled adapter's {found:.3f} "
            f"(tolerance {tolerance:g})"
        )
    return found
