"""A generated code value chain: FedWave's multi-stage workflow data, built from the task bank.

FedWave is evaluated on MSCoRe (business workflows whose stages feed each other), which
cannot be downloaded here. This module derives a three-stage value chain from the bundled
problem bank (:mod:`peerlm.agent.tasks.bank`) instead:

====================  ==============================  =====================================
stage (default name)  input                           reference output
====================  ==============================  =====================================
``specify``           a requirement in words          the signature and docstring
``implement``         the signature and docstring     the body (``prompt + body`` compiles)
``test``              the whole function              the unit tests (``assert`` lines)
====================  ==============================  =====================================

Each stage's input is exactly the previous stage's reference output, and the stages need
different skills (turning prose into a typed signature with an example, writing code,
writing calls with their expected values). Every artefact comes from one bank problem:
the signature and docstring are its ``prompt``, the body its ``reference``, the tests its
``tests``; the requirement is its prompt retold in words (name, arguments, return type, the
one-line description and the example).

**The split** (:func:`build_code_chain`): one pool of distinct bank functions (the public
pre-training functions excluded, as the federation data do) is shuffled under the seed and
cut into disjoint parts: a test part (whole chains, held by nobody), a public part
(requirements only: the prompts of the DPO phase) and one part per stage. A stage's agents
hold the examples of their stage's part only, dealt round robin. No function appears in two
parts, so no stage's private data holds another stage's reference for any problem (the
``implement`` data would otherwise contain the ``specify`` stage's answers as inputs).
See docs/fedwave.md for why this is a fair stand-in for MSCoRe.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from peerlm.agent.fedwave.workflow import Workflow
from peerlm.agent.tasks.bank import CATEGORIES, function_key, generate_bank, public_problems
from peerlm.agent.tasks.dataset import Problem

__all__ = [
    "CODE_CHAIN_STAGES",
    "ChainItem",
    "ChainSplit",
    "StageExample",
    "build_code_chain",
    "chain_of",
    "requirement_of",
]

#: The chain's stages in order (a workflow for it has three stages; names may differ).
CODE_CHAIN_STAGES: tuple[str, ...] = ("specify", "implement", "test")

_PROMPT = re.compile(
    r'^def (?P<name>\w+)\((?P<params>.*)\) -> (?P<returns>.+):\n    """(?P<doc>.+)\n\n'
    r'    >>> (?P<call>.+)\n    (?P<value>.+)\n    """\n    $'
)
_BODY_INDENT = "    "


@dataclass(frozen=True)
class StageExample:
    """One private training example of a stage: its input and its reference output."""

    task_id: str
    stage: str
    source: str
    target: str


@dataclass(frozen=True)
class ChainItem:
    """One bank problem walked through the whole chain (test chains and references)."""

    problem: Problem
    requirement: str

    @property
    def artefacts(self) -> tuple[str, str, str, str]:
        """(requirement, signature and docstring, body, tests): stage i maps [i] to [i+1]."""
        p = self.problem
        signature = p.prompt.removesuffix(_BODY_INDENT)
        return (self.requirement, signature, _BODY_INDENT + p.reference, p.tests)

    def example(self, stage_index: int, stage_name: str | None = None) -> StageExample:
        """The stage's (input, reference) pair for this problem."""
        if not 0 <= stage_index < len(CODE_CHAIN_STAGES):
            raise IndexError(f"the code chain has stages 0..{len(CODE_CHAIN_STAGES) - 1}")
        parts = self.artefacts
        source = parts[stage_index]
        if stage_index == 2:  # the tester sees the whole function
            source = parts[1] + parts[2]
        return StageExample(
            task_id=self.problem.task_id,
            stage=stage_name or CODE_CHAIN_STAGES[stage_index],
            source=source,
            target=parts[stage_index + 1],
        )


@dataclass(frozen=True)
class ChainSplit:
    """A workflow's data: private examples per stage and agent, test chains, public prompts."""

    stages: tuple[str, ...]
    private: Mapping[str, Mapping[str, tuple[StageExample, ...]]]  # stage -> agent -> data
    test: tuple[ChainItem, ...]
    public: tuple[str, ...]  # requirements (stage-0 inputs) of functions nobody holds

    def of_agent(self, agent: str) -> tuple[StageExample, ...]:
        """The private examples of ``agent``; ``KeyError`` if it holds none."""
        for by_agent in self.private.values():
            if agent in by_agent:
                return by_agent[agent]
        raise KeyError(f"agent {agent!r} holds no workflow data")


def requirement_of(problem: Problem) -> str:
    """The problem's prompt retold in words: what the ``specify`` stage starts from.

    ``ValueError`` when the prompt is not in the bank's format (one-line description, one
    example).
    """
    match = _PROMPT.match(problem.prompt)
    if match is None:
        raise ValueError(f"{problem.task_id}: prompt is not in the bank's format")
    params = _split_params(match["params"])
    if params:
        pairs = (p.partition(":") for p in params)
        described = [f"{name.strip()} ({_article(kind.strip())})" for name, _, kind in pairs]
        takes = "takes " + _join(described)
    else:
        takes = "takes no arguments"
    return (
        f"Write a function named {match['name']} that {takes} and returns "
        f"{_article(match['returns'])}. {match['doc']} For example, {match['call']} gives "
        f"{match['value']}.\n"
    )


def chain_of(problem: Problem) -> ChainItem:
    """The chain item of one bank problem."""
    return ChainItem(problem=problem, requirement=requirement_of(problem))


def build_code_chain(
    workflow: Workflow,
    *,
    per_stage: int,
    n_test: int,
    n_public: int,
    seed: int,
    categories: Sequence[str] = CATEGORIES,
) -> ChainSplit:
    """The code chain's data for a three-stage ``workflow``, deterministic for a seed.

    ``per_stage`` examples go to each stage (split round robin among its agents, each of
    which gets at least one), ``n_test`` whole chains are held out, and ``n_public``
    requirements are public. The functions of all parts are pairwise distinct, and none is
    a public pre-training function. Problems are drawn evenly from ``categories``.
    """
    if len(workflow.stages) != len(CODE_CHAIN_STAGES):
        raise ValueError(
            f"the code chain has {len(CODE_CHAIN_STAGES)} stages "
            f"({' -> '.join(CODE_CHAIN_STAGES)}); the workflow has {len(workflow.stages)}"
        )
    for count, what in ((per_stage, "per_stage"), (n_test, "n_test"), (n_public, "n_public")):
        if count < 0:
            raise ValueError(f"{what} must not be negative, got {count}")
    for stage in workflow.stages:
        if per_stage < len(stage.agents):
            raise ValueError(
                f"stage {stage.name!r} has {len(stage.agents)} agents but per_stage is "
                f"{per_stage}: every agent needs data"
            )
    unknown = sorted(set(categories) - set(CATEGORIES))
    if unknown or not categories:
        raise ValueError(f"categories must be bank categories, got {list(categories)}")
    total = len(CODE_CHAIN_STAGES) * per_stage + n_test + n_public
    each = math.ceil(total / len(categories))
    public = {function_key(p) for p in public_problems()}
    pool = generate_bank({c: each for c in categories}, seed, exclude=public)
    rng = random.Random(f"peerlm-fedwave-chain/{seed}")
    rng.shuffle(pool)
    items = [chain_of(p) for p in pool[:total]]
    test = tuple(items[:n_test])
    public_prompts = tuple(item.requirement for item in items[n_test : n_test + n_public])
    private: dict[str, Mapping[str, tuple[StageExample, ...]]] = {}
    start = n_test + n_public
    for index, stage in enumerate(workflow.stages):
        part = items[start + index * per_stage : start + (index + 1) * per_stage]
        examples = [item.example(index, stage.name) for item in part]
        private[stage.name] = MappingProxyType(
            {agent: tuple(examples[k :: len(stage.agents)]) for k, agent in enumerate(stage.agents)}
        )
    return ChainSplit(
        stages=workflow.stage_names,
        private=MappingProxyType(private),
        test=test,
        public=public_prompts,
    )


def _split_params(params: str) -> list[str]:
    """Split ``a: int, xs: dict[str, int]`` at the top-level commas."""
    parts: list[str] = []
    depth = 0
    current: list[str] = []
    for char in params:
        if char in "[(":
            depth += 1
        elif char in "])":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(char)
    if "".join(current).strip():
        parts.append("".join(current).strip())
    return parts


def _join(words: Sequence[str]) -> str:
    if len(words) <= 2:
        return " and ".join(words)
    return ", ".join(words[:-1]) + " and " + words[-1]


def _article(kind: str) -> str:
    return ("an " if kind[:1].lower() in "aeiou" else "a ") + kind
