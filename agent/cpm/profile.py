"""The agent profile p_i sent to the CPM (KNEXA-FL rebuttal section, d_p = 32).

Layout: :data:`peerlm.services.cpm.PROFILE_LAYOUT`, the one definition, owned by the CPM
that validates what agents send; this module fills it:

* ``[0:8]`` static: one-hot of the LLM backbone family (:data:`FAMILIES`).
* ``[8:20]`` dynamic, each squashed to a bounded range so no feature dominates the bandit:

  ===  =======================================================
  8    pass@1 on the local validation set (the CPM baselines read this index)
  9    pass@5 (0 when not measured)
  10   validation loss / 10
  11   perplexity squashed as ppl / (ppl + 100)
  12   delta pass@1 since the previous round
  13   delta validation loss since the previous round (/10)
  14   delta of the squashed perplexity since the previous round
  15   LoRA trainable share of parameters
  16   log10(trainable parameters) / 10
  17   last reward received as a student, squashed with tanh
  18   exchanges completed / (exchanges + 10)
  19   round progress t / T (0 when T is open-ended)
  ===  =======================================================

* ``[20:32]`` distribution: the normalised category histogram of the private training set,
  optionally with Laplace noise of scale ``1/epsilon`` per bin (sensitivity of a count
  histogram is 1 sample), then clipped at 0 and renormalised. With noise this is
  epsilon-differentially private with respect to one training sample; the CPM never sees
  more than this histogram of the data.

Beside the vector, a profile declares the agent's parameter-space fingerprint
(:func:`parameter_space_fingerprint`) and the protocols it executes, which the CPM uses to
decide which protocols of its menu are admissible for a pair (``docs/matchmaker.md``).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray
from peerlm.services.cpm import PROFILE_LAYOUT

if TYPE_CHECKING:
    from peerlm.agent.modelhost import ModelHost

__all__ = [
    "FAMILIES",
    "PARAM_SPACE_SCHEME",
    "PROFILE_DIM",
    "AgentMetrics",
    "build_profile",
    "family_index",
    "host_parameter_space",
    "parameter_space_fingerprint",
]

#: Prefix of :func:`parameter_space_fingerprint`'s value (a new recipe gets a new one, so
#: agents of two recipes never look alike).
PARAM_SPACE_SCHEME = "ps1"
# Model-config keys that name, place or date a checkpoint without changing what its
# parameters mean; everything else in ``config.to_dict()`` is architecture.
_NOT_ARCHITECTURE = frozenset(
    {"name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache"}
)

_LAYOUT = PROFILE_LAYOUT
PROFILE_DIM = _LAYOUT.dim
#: The eight static slots. ``other`` takes any architecture not listed.
FAMILIES: tuple[str, ...] = (
    "gpt2",
    "gpt_neox",
    "bloom",
    "qwen2",
    "llama",
    "opt",
    "mistral",
    "other",
)


def family_index(model_type: str) -> int:
    """Slot of a transformers ``model_type`` (qwen2/qwen3 share the qwen2 slot)."""
    key = {"qwen3": "qwen2", "qwen2_moe": "qwen2", "codegen": "gpt2", "gpt_bigcode": "gpt2"}.get(
        model_type, model_type
    )
    return FAMILIES.index(key) if key in FAMILIES else FAMILIES.index("other")


@dataclass(frozen=True)
class AgentMetrics:
    """What the agent measured this round (and the previous one, for deltas)."""

    pass_at_1: float
    pass_at_5: float
    val_loss: float
    prev_pass_at_1: float
    prev_val_loss: float
    trainable_share: float
    trainable_parameters: int
    last_reward: float
    exchanges: int
    round: int
    total_rounds: int


def _log_ppl(loss: float) -> float:
    # Cross-entropy in nats is log-perplexity; clip so a diverged model stays finite.
    return float(min(max(loss, 0.0), 50.0))


def _squash_ppl(loss: float) -> float:
    ppl = math.exp(loss)
    return ppl / (ppl + 100.0)


def build_profile(
    model_type: str,
    m: AgentMetrics,
    category_counts: NDArray[np.float64],
    *,
    dp_epsilon: float | None = None,
    rng: np.random.Generator | None = None,
) -> NDArray[np.float64]:
    """Assemble p_i. ``category_counts`` are raw per-category sample counts (12)."""
    if category_counts.shape != (12,):
        raise ValueError(f"expected 12 category counts, got shape {category_counts.shape}")
    p = np.zeros(PROFILE_DIM, dtype=np.float64)
    p[family_index(model_type)] = 1.0
    loss = _log_ppl(m.val_loss)
    prev_loss = _log_ppl(m.prev_val_loss)
    dynamic = [
        m.pass_at_1,
        m.pass_at_5,
        loss / 10.0,
        _squash_ppl(loss),
        m.pass_at_1 - m.prev_pass_at_1,
        (loss - prev_loss) / 10.0,
        _squash_ppl(loss) - _squash_ppl(prev_loss),
        m.trainable_share,
        math.log10(max(m.trainable_parameters, 1)) / 10.0,
        math.tanh(m.last_reward),
        m.exchanges / (m.exchanges + 10.0),
        (m.round / m.total_rounds) if m.total_rounds > 0 else 0.0,
    ]
    p[_LAYOUT.dynamic] = dynamic
    counts = category_counts.astype(np.float64).copy()
    if dp_epsilon is not None:
        if dp_epsilon <= 0:
            raise ValueError("dp_epsilon must be positive")
        gen = rng if rng is not None else np.random.default_rng()
        counts = counts + gen.laplace(0.0, 1.0 / dp_epsilon, size=counts.shape)
    counts = np.clip(counts, 0.0, None)
    total = counts.sum()
    p[_LAYOUT.distribution] = counts / total if total > 0 else np.full(12, 1.0 / 12)
    return p


def parameter_space_fingerprint(
    model_config: Mapping[str, Any],
    tokenizer_hash: str,
    lora_r: int,
    lora_alpha: float,
    adapter_shapes: Mapping[str, tuple[int, ...]],
) -> str:
    """``ps1:`` + SHA-256 of what makes two agents' adapters mergeable, never parameters.

    Hashed, as canonical JSON: the backbone configuration (``config.to_dict()`` without
    the keys that only name, place or date a checkpoint, nor private ``_``-keys), the
    tokenizer hash, LoRA ``r`` and ``alpha`` (the scaling ``alpha / r`` decides what
    ``B A`` means) and every adapter tensor's name and shape (the target modules, as
    resolved). Equal fingerprints: the adapter codec's checks on a pulled adapter pass
    (``docs/matchmaker.md``, "The fingerprint", for what it cannot tell apart).
    """
    arch = {
        k: v
        for k, v in model_config.items()
        if not k.startswith("_") and k not in _NOT_ARCHITECTURE
    }
    doc = {
        "config": arch,
        "tokenizer": tokenizer_hash,
        "lora": {"r": int(lora_r), "alpha": float(lora_alpha)},
        "shapes": {k: list(adapter_shapes[k]) for k in sorted(adapter_shapes)},
    }
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str)
    return f"{PARAM_SPACE_SCHEME}:{hashlib.sha256(blob.encode()).hexdigest()}"


def host_parameter_space(host: ModelHost) -> str:
    """:func:`parameter_space_fingerprint` of a loaded model host (reads its adapter's
    tensor shapes: call it where the host may be used, the daemon's model thread)."""
    spec = host.adapter_spec()
    return parameter_space_fingerprint(
        host.model.config.to_dict(), spec.tokenizer_hash, spec.lora_r, spec.lora_alpha, spec.shapes
    )
