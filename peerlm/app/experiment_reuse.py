"""Runs of an earlier ``results.json`` standing in for new ones (``--reuse``), and the
progress file a stopped command leaves for it.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

from peerlm.app.experiment_plan import ExperimentPlan
from peerlm.app.experiment_strategies import (
    CPM_PROTOCOLS,
    MERGE_STRATEGIES,
    PROXY_TUNED,
    WITH_OVERLAY,
)
from peerlm.protocols import CATALOGUE

__all__ = [
    "ADAPTER_KILOBYTES",
    "COLLABORATION_HARNESS",
    "PROGRESS_FILE",
    "read_results",
    "reusable_runs",
    "save_progress",
]


def read_results(path: Path) -> Any:
    """A ``results.json`` as written by ``run-experiment --out``, or gzipped (``.gz``: how
    docs/results keeps the per-problem records of a run). Raises ``OSError`` or
    ``ValueError`` for a file that is neither."""
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return json.loads(data)


#: How a run counts an adapter transfer's kilobytes, written into ``results.json``: the
#: encoded safetensors bytes the wire carries (header and metadata included), since the
#: harness pulls through the agent's transport (2026-12-05). A result without the key
#: counted the tensors' bytes (1.8 % fewer per adapter, and Eq. 3's KB penalty with them).
ADAPTER_KILOBYTES: Final[str] = "encoded"


#: How the collaborative runs' harness behaves where no plan field says so, written into
#: ``results.json``: since 2026-12-07 a package the peer slot learns nothing of takes no
#: step (before, under ``slot_scope: all`` it took Eq. 2's own-data steps in the slot),
#: and the final evaluation records every ``answer_check`` policy. A stored collaborative
#: run with another marker (or none) is run again; one that trains alone still stands in.
COLLABORATION_HARNESS: Final[str] = "2026-12-07"


#: The strategies that move adapters, whose kilobytes (and, for a CPM, rewards and so
#: pairings) depend on :data:`ADAPTER_KILOBYTES`.
_MOVES_ADAPTERS: frozenset[str] = frozenset(
    {
        *MERGE_STRATEGIES,
        *WITH_OVERLAY,
        "semantic_dfl",
        *(
            strategy
            for strategy, protocols in CPM_PROTOCOLS.items()
            if any(e.is_merge for e in CATALOGUE if e.name in protocols)
        ),
    }
)


#: Plan fields that only CPM strategies read: a run of another strategy is reusable
#: whatever they say.
_CPM_ONLY_FIELDS: tuple[str, ...] = (
    "cpm_interaction_features",
    "cpm_context_columns",
    "cpm_beta",
    # Where rewards are measured steers only a bandit: a stored run of another strategy
    # keeps the rewards it measured under its own scope (reported, never acted on).
    "probe_scope",
    "cpm_merge_senders",
    "cpm_co_sender_scoring",
    "cpm_reward_normaliser",
)


#: Plan fields that only a collaborating run reads: where peers' knowledge goes, how it is
#: distilled, how much is taught and whether non-students train on own data. A client that
#: trains alone (LocalOnly, LocalOnly+) runs the same steps whatever they say, so an
#: ablation of one of them reuses the stored LocalOnly+ runs.
_COLLABORATION_ONLY_FIELDS: tuple[str, ...] = (
    "integration",
    "peer_alpha",
    "slot_scope",
    "own_steps_every_round",
    "teach_limit",
    "pairing",
    "teacher_capacity",
    "teach_self_check",
    "answer_check",
    "slot_rehearsal",
    "slot_banks",
    "slot_learning_rate",
)


#: The strategies whose clients train alone (:data:`_COLLABORATION_ONLY_FIELDS`).
_ALONE: frozenset[str] = frozenset({"local", "local_plus"})
#: What LocalOnly reads of neither: it spends no lesson's own-data steps (LocalOnly+ spends
#: as many as a student's lessons, so ``teachers_per_student`` stays in its key).
_LOCAL_ONLY_IGNORES: tuple[str, ...] = ("teachers_per_student",)


#: Plan fields that only ProxyTuning's decoding reads (:data:`PROXY_TUNED`).
_PROXY_TUNING_ONLY_FIELDS: tuple[str, ...] = ("proxy_tuning_beta",)


#: What a plan that predates a field was run with, where that differs from today's default:
#: every results.json written before ``cpm_reward_normaliser`` existed ran the z-score.
_PREDATED: Mapping[str, Any] = MappingProxyType(
    {
        "cpm_reward_normaliser": "zscore",
        # The harness before the peer slot: one adapter, own-data steps for LocalOnly+
        # only, validation, teaching and the curve every round.
        "integration": "shared",
        "peer_alpha": None,
        "own_steps_every_round": False,
        "val_every": 1,
        "curve_every": 1,
        "teach_limit": None,
        # Before ``pairing`` (2026-12-07) every pairing strategy paired disjointly.
        "pairing": "disjoint",
        # Before ``answer_check`` (2026-12-07) a routed input kept the slot's answer.
        "answer_check": "off",
        # Before ``teachers_per_student`` (2026-12-07) a student had one teacher a round.
        "teachers_per_student": 1,
        # Before ``slot_banks`` (2026-12-08) the peer slot was one adapter.
        "slot_banks": "one",
    }
)


def _reuse_key(plan: Mapping[str, Any], strategy: str) -> str:
    """What must match for a stored (strategy, seed) run to stand in for a new one: the
    whole plan but the strategy and seed lists (and the CPM's settings, for a strategy
    that has no CPM; the collaboration's settings, for one that trains alone). Fields an
    older plan lacks take what it ran with: today's defaults, or :data:`_PREDATED`'s value
    where the default changed since."""
    full = {**asdict(ExperimentPlan()), **_PREDATED, **plan}
    drop = {"strategies", "seeds"} | (set() if strategy in CPM_PROTOCOLS else set(_CPM_ONLY_FIELDS))
    if strategy not in PROXY_TUNED:
        drop |= set(_PROXY_TUNING_ONLY_FIELDS)
    if strategy in _ALONE:
        drop |= set(_COLLABORATION_ONLY_FIELDS)
    if strategy == "local":
        drop |= set(_LOCAL_ONLY_IGNORES)
    return json.dumps(
        {k: v for k, v in full.items() if k not in drop}, sort_keys=True, default=list
    )


#: The runs a command has finished so far, in its work directory (``--reuse`` takes it).
PROGRESS_FILE: Final[str] = "runs-so-far.json"


def save_progress(
    work: Path,
    plan: ExperimentPlan,
    initial_nll: Mapping[str, float],
    runs: Mapping[tuple[str, int], dict[str, Any]],
) -> None:
    """Every (strategy, seed) run finished so far (reused ones included), as a file
    ``--reuse`` accepts: a command stopped after hours keeps what it had finished."""
    from peerlm.atomic_file import write_atomic

    by_strategy: dict[str, dict[str, Any]] = {}
    for (strategy, seed), run in sorted(runs.items()):
        by_strategy.setdefault(strategy, {})[str(seed)] = run
    partial = {
        "plan": {**asdict(plan), "strategies": list(plan.strategies), "seeds": list(plan.seeds)},
        "initial_nll": dict(initial_nll),
        "runs": by_strategy,
        "adapter_kilobytes": ADAPTER_KILOBYTES,
        "collaboration_harness": COLLABORATION_HARNESS,
        "partial": True,
    }
    write_atomic(work / PROGRESS_FILE, json.dumps(partial).encode(), mode=0o644)


def reusable_runs(
    plan: ExperimentPlan,
    earlier: Sequence[Mapping[str, Any]],
    initial_nll: Mapping[str, float],
) -> dict[tuple[str, int], dict[str, Any]]:
    """The (strategy, seed) runs of ``plan`` that earlier results (``results.json``) hold,
    run under the same plan on the same world and models.

    The same world and models are checked by the round-0 test NLL per slice, which every
    run measures on them (equal to the last bit, or the earlier result is not used); the
    same plan by :func:`_reuse_key`; a strategy that moves adapters also needs the same
    :data:`ADAPTER_KILOBYTES`, and a collaborative one the same
    :data:`COLLABORATION_HARNESS`. Raises ``ValueError`` for an earlier result that
    does not match at all (another world, models or plan), so a wrong file is not
    silently ignored.
    """
    mine = asdict(plan)
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for k, old in enumerate(earlier):
        try:
            old_plan, old_runs, old_nll = old["plan"], old["runs"], old["initial_nll"]
        except (KeyError, TypeError):
            raise ValueError(f"reused result {k} is not a run-experiment results.json") from None
        if old_nll != dict(initial_nll):
            raise ValueError(
                f"reused result {k} was measured on another world or other models "
                f"(round-0 NLL {old_nll} against {dict(initial_nll)})"
            )
        matched = False
        counted = old.get("adapter_kilobytes")
        harness = old.get("collaboration_harness")
        for strategy in plan.strategies:
            if strategy not in old_runs:
                continue
            if strategy in _MOVES_ADAPTERS and counted != ADAPTER_KILOBYTES:
                continue  # its kilobytes (and a CPM's rewards) were counted otherwise
            if strategy not in _ALONE and harness != COLLABORATION_HARNESS:
                continue  # its collaboration ran under an earlier harness
            if _reuse_key(old_plan, strategy) != _reuse_key(mine, strategy):
                continue
            for seed in plan.seeds:
                run = old_runs[strategy].get(str(seed))
                if run is not None:
                    # An earlier file's run of the same key wins; this file still matched.
                    out.setdefault((strategy, seed), run)
                    matched = True
        if not matched:
            raise ValueError(
                f"reused result {k} holds no run of this plan's strategies and seeds under "
                "the same settings"
            )
    return out
