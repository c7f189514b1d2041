"""A simulated agent: a real process speaking the real CPM protocol over mTLS, whose
learning is the synthetic federation of :mod:`peerlm.bench.synthetic`.

It stands in for the model-hosting agent in ``peerlm up`` and in scale tests. Each process
builds the same seeded federation and plays one client of it: its profile is that client's
profile, and as a student it draws the reward of its exchange from the environment. The
teacher's state in a student's copy advances through local training only (each process
sees its own exchanges), a simplification that does not matter for exercising the CPM.
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated

import grpc
import structlog
import typer

from peerlm.agent import CpmClient, next_directive, rest_of_round
from peerlm.config import GrpcLimits
from peerlm.node import NodeContext
from peerlm.pki.identity import Role
from peerlm.security.credentials import TlsFiles
from peerlm.wire.v1 import cpm_pb2

__all__ = ["SimAgentReport", "run_sim_agent", "sim_agent_command"]


@dataclass
class SimAgentReport:
    """What one simulated agent did; printed as one JSON line on stdout."""

    name: str
    rounds: int = 0
    as_student: int = 0
    as_teacher: int = 0
    rewards: list[float] = field(default_factory=list)
    pass_at_1_before: float = 0.0
    pass_at_1_after: float = 0.0
    errors: list[str] = field(default_factory=list)


async def run_sim_agent(
    *,
    name: str,
    index: int,
    peers: list[str],
    cpm: str,
    tls: TlsFiles | None,
    federation: str,
    rounds: int,
    seed: int,
    heterogeneity: str,
    round_timeout_s: float,
    teachers_per_student: int = 1,
) -> SimAgentReport:
    """Play ``rounds`` rounds of Algorithm 3 against the CPM at ``cpm``; more than
    ``teachers_per_student`` student directives in a round (the CPM's setting, which the
    agent is told) is reported as an error, and none of the extra ones is learnt."""
    from peerlm.bench.synthetic import SyntheticFederation  # numpy: only when run

    env = SyntheticFederation(len(peers), "high" if heterogeneity == "high" else "low", seed)
    me = env.names[index]
    env_name = dict(zip(peers, env.names, strict=True))
    report = SimAgentReport(name=name)
    report.pass_at_1_before = float(env.client_pass_at_1()[index])
    ctx = NodeContext.create(
        component="agent",
        role=Role.AGENT,
        federation=federation,
        tls=tls,
        insecure_dev=tls is None,
        limits=GrpcLimits(),
        log=structlog.get_logger("peerlm.sim_agent"),
        dev_name=name,
    )
    client = CpmClient(ctx, cpm)
    inbox: asyncio.Queue[cpm_pb2.Directive] = asyncio.Queue()

    async def follow() -> None:
        async for d in client.directives():
            await inbox.put(d)

    feed = asyncio.create_task(follow())
    try:
        await client.wait_ready(30)
        for r in range(1, rounds + 1):
            resp = await client.submit_profile(r, [float(x) for x in env.profiles()[me]], "")
            directive = await next_directive(inbox, feed, round_timeout_s)
            # A "not matched" notice: for an older round it is stale (skip it and keep
            # waiting), for ours the round is local, as the daemon does.
            while (
                directive is not None
                and directive.role == cpm_pb2.EXCHANGE_ROLE_UNMATCHED
                and directive.matchmaking_round < resp.matchmaking_round
            ):
                directive = await next_directive(inbox, feed, round_timeout_s)
            if directive is not None and directive.role == cpm_pb2.EXCHANGE_ROLE_UNMATCHED:
                directive = None
            # The round's directives (several under the CPM's pairing: per_student).
            batch = [] if directive is None else [directive, *await rest_of_round(inbox, directive)]
            learnt: list[tuple[cpm_pb2.Directive, str]] = []
            for d in batch:
                if d.role != cpm_pb2.EXCHANGE_ROLE_STUDENT:
                    report.as_teacher += 1
                elif (teacher := env_name.get(d.teacher)) is None:
                    report.errors.append(f"unknown teacher {d.teacher}")
                elif any(teacher == t for _, t in learnt):
                    report.errors.append(f"a second directive from {d.teacher} in round {r}")
                elif len(learnt) == teachers_per_student:
                    report.errors.append(
                        f"more than {teachers_per_student} teacher(s) in round {r}: {d.teacher}"
                    )
                else:
                    # Several under teachers_per_student: each lesson from the same state.
                    learnt.append((d, teacher))
            rewards = env.step([(teacher, me) for _, teacher in learnt], several_teachers=True)
            for (d, _), reward in zip(learnt, rewards, strict=True):
                await client.report_reward(d.directive_id, reward)
                report.as_student += 1
                report.rewards.append(round(reward, 6))
            report.rounds = r
    except grpc.aio.AioRpcError as err:
        report.errors.append(f"{err.code().name}: {err.details()}")
    finally:
        feed.cancel()
        await asyncio.gather(feed, return_exceptions=True)
        await client.close()
    report.pass_at_1_after = float(env.client_pass_at_1()[index])
    return report


def sim_agent_command(
    name: Annotated[str, typer.Option(help="This agent's certificate name.")],
    index: Annotated[int, typer.Option(help="Which client of the federation this agent plays.")],
    peers: Annotated[str, typer.Option(help="Comma-separated names of all agents, in order.")],
    cpm: Annotated[str, typer.Option(help="CPM HOST:PORT.")],
    ca_cert: Annotated[Path | None, typer.Option()] = None,
    cert: Annotated[Path | None, typer.Option()] = None,
    key: Annotated[Path | None, typer.Option()] = None,
    federation: Annotated[str, typer.Option()] = "peerlm",
    rounds: Annotated[int, typer.Option(min=1)] = 5,
    seed: Annotated[int, typer.Option()] = 0,
    heterogeneity: Annotated[str, typer.Option()] = "high",
    round_timeout: Annotated[float, typer.Option(help="Seconds to wait for a directive.")] = 5.0,
    teachers_per_student: Annotated[
        int, typer.Option(min=1, help="The CPM's teachers a student a round (more: an error).")
    ] = 1,
) -> None:
    """Run a simulated agent (used by `peerlm up` until the model-hosting agent lands)."""
    tls = TlsFiles(ca_cert, cert, key) if ca_cert and cert and key else None
    report = asyncio.run(
        run_sim_agent(
            name=name,
            index=index,
            peers=peers.split(","),
            cpm=cpm,
            tls=tls,
            federation=federation,
            rounds=rounds,
            seed=seed,
            heterogeneity=heterogeneity,
            round_timeout_s=round_timeout,
            teachers_per_student=teachers_per_student,
        )
    )
    sys.stdout.write(json.dumps(asdict(report)) + "\n")
    sys.stdout.flush()
    if report.errors:
        raise typer.Exit(code=1)
