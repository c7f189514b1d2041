"""A FedWave workflow: an ordered list of stages, each served by one or more agents.

FedWave (``papers/fedwave.md``, Section 3) trains one *expert agent* per stage of a business
workflow (design → manufacturing → marketing …); each stage's input is the previous stage's
output. :class:`Workflow` is the part of a federation's configuration that says which stages
there are, in which order, and which agents serve each. It is a frozen pydantic section so a
settings model can hold it (``workflow:``); nothing in the agent reads it yet.

Rules, each refused with a ``ValueError`` that names the offender: at least two stages (a
workflow of one stage has no predecessor for Eq. 5-6), stage names are identifiers and
unique, each stage has at least one agent, and an agent serves exactly one stage (an expert
has one role: its private data, its VCLayer and its stage embedding belong to that role).
"""

from __future__ import annotations

import re

from pydantic import Field, field_validator, model_validator

from peerlm.config import Section

__all__ = ["MAX_STAGES", "Stage", "Workflow"]

#: A router has one output per stage; far above any business workflow's length.
MAX_STAGES = 64
_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")


class Stage(Section):
    """One stage of a workflow: its name and the agents (by certificate name) serving it."""

    name: str
    agents: tuple[str, ...] = Field(min_length=1, max_length=1024)

    @field_validator("name")
    @classmethod
    def _name_ok(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError(
                f"stage name {value!r} must be lower-case letters, digits, '_' or '-', "
                "starting with a letter, at most 63 characters"
            )
        return value

    @field_validator("agents")
    @classmethod
    def _agents_ok(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for agent in value:
            if not agent or len(agent) > 253:
                raise ValueError(f"agent name {agent!r} must be 1 to 253 characters")
        if len(set(value)) != len(value):
            raise ValueError(f"an agent is listed twice in one stage: {list(value)}")
        return value


class Workflow(Section):
    """An ordered value chain of stages (FedWave's experts in sequence)."""

    stages: tuple[Stage, ...] = Field(min_length=2, max_length=MAX_STAGES)

    @model_validator(mode="after")
    def _unique(self) -> Workflow:
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names must be unique: {names}")
        seen: dict[str, str] = {}
        for stage in self.stages:
            for agent in stage.agents:
                if agent in seen:
                    raise ValueError(
                        f"agent {agent!r} serves stages {seen[agent]!r} and {stage.name!r}; "
                        "an agent is the expert of one stage"
                    )
                seen[agent] = stage.name
        return self

    @property
    def stage_names(self) -> tuple[str, ...]:
        """The stage names in workflow order."""
        return tuple(s.name for s in self.stages)

    @property
    def agents(self) -> tuple[str, ...]:
        """Every agent of the workflow, stage by stage."""
        return tuple(a for s in self.stages for a in s.agents)

    def stage_index(self, agent: str) -> int:
        """The position of ``agent``'s stage (0 is the first); ``KeyError`` if not a member."""
        for index, stage in enumerate(self.stages):
            if agent in stage.agents:
                return index
        raise KeyError(f"agent {agent!r} is not in the workflow")

    def stage_of(self, agent: str) -> Stage:
        """The stage ``agent`` serves; ``KeyError`` if not a member."""
        return self.stages[self.stage_index(agent)]

    def adjacent(self, agent: str) -> tuple[Stage | None, Stage | None]:
        """(predecessor stage, successor stage) of ``agent``'s stage; None at the ends.

        These are the stages whose VCLayer pieces the collaborative loss (Eq. 5-6) needs.
        """
        index = self.stage_index(agent)
        before = self.stages[index - 1] if index > 0 else None
        after = self.stages[index + 1] if index + 1 < len(self.stages) else None
        return before, after
