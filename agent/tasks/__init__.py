"""Code-generation tasks: the bundled task bank, datasets and HumanEval.

``peerlm.agent.tasks.bank`` generates the 12-category bank; ``peerlm.agent.tasks.dataset``
holds :class:`Problem`, JSONL I/O, the Dirichlet client split, the transfer set and
``build_federation_data``; ``peerlm.agent.tasks.world`` the public/private split and who
holds which skill;
``peerlm.agent.tasks.humaneval`` converts the bundled HumanEval.
"""

from __future__ import annotations

from peerlm.agent.tasks.bank import CATEGORIES, generate_bank
from peerlm.agent.tasks.dataset import (
    Manifest,
    Problem,
    build_federation_data,
    category_histogram,
    category_index,
    dirichlet_partition,
    problem_slices,
    read_jsonl,
    read_manifest,
    split_validation,
    transfer_set,
    transfer_set_sha256,
    write_jsonl,
)
from peerlm.agent.tasks.world import SLICES, World, WorldSpec

__all__ = [
    "CATEGORIES",
    "SLICES",
    "Manifest",
    "Problem",
    "World",
    "WorldSpec",
    "build_federation_data",
    "category_histogram",
    "category_index",
    "dirichlet_partition",
    "generate_bank",
    "problem_slices",
    "read_jsonl",
    "read_manifest",
    "split_validation",
    "transfer_set",
    "transfer_set_sha256",
    "write_jsonl",
]
