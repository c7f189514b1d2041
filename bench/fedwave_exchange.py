"""FedWave's exchange on loopback over real mTLS: how long a round's pulls and the router
aggregate take, how many bytes each agent pulls, and whether every agent ends equal.

A workflow of ``--stages`` stages with ``--agents`` agents dealt round robin (each agent a
server with its own certificate from a throw-away CA, all in this process). Each round every
agent publishes a fresh router (random, its own ``n_i``) and VCLayer of width ``--width``
(default 128, the shipped tiny gpt2's), then all agents pull concurrently
(``pull_round``: every other router, the adjacent stages' VCLayers) and aggregate
(Eq. 9). Reported per round: the wall time until the last agent has aggregated, and whether
all aggregates are bit-identical. Not a test: nothing here asserts a time.

    python -m peerlm.bench.fedwave_exchange [--agents 4] [--stages 3] [--width 128]
        [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog
import torch
from peerlm.agent import (
    FedWaveExchangeService,
    FedWaveSettings,
    PartKind,
    PartStore,
    ShapeBounds,
    aggregate_round_routers,
    encode_router,
    encode_vclayer,
    pull_round,
    router_shapes,
    serve_fedwave,
)

from peerlm.config import GrpcLimits
from peerlm.node import NodeContext
from peerlm.pki.ca import init_ca, issue_certificate
from peerlm.pki.identity import Role
from peerlm.security.credentials import TlsFiles

__all__ = ["main", "run"]


def _settings(agents: int, stages: int) -> FedWaveSettings:
    names = [f"w{i}" for i in range(agents)]
    dealt: list[list[str]] = [[] for _ in range(stages)]
    for i, name in enumerate(names):
        dealt[i % stages].append(name)
    return FedWaveSettings.model_validate(
        {"workflow": {"stages": [{"name": f"s{i}", "agents": a} for i, a in enumerate(dealt)]}}
    )


async def _run(agents: int, stages: int, width: int, rounds: int) -> dict[str, Any]:
    if agents < stages:
        raise SystemExit(f"--agents ({agents}) must be at least --stages ({stages})")
    settings = _settings(agents, stages)
    workflow = settings.workflow
    assert workflow is not None
    log = structlog.get_logger("bench")
    with tempfile.TemporaryDirectory() as tmp:
        pki = Path(tmp)
        init_ca(pki, federation="bench")
        for name in workflow.agents:
            issue_certificate(pki, Role.AGENT, name, sans=["127.0.0.1"])
        nodes: dict[str, tuple[NodeContext, FedWaveExchangeService, Any]] = {}
        for name in workflow.agents:
            ctx = NodeContext.create(
                component="agent", role=Role.AGENT, federation="bench",
                tls=TlsFiles.from_directory(pki, name), insecure_dev=False,
                limits=GrpcLimits(), log=log, listen="127.0.0.1:0",
            )  # fmt: skip
            service = FedWaveExchangeService(
                workflow, name, PartStore(), chunk_bytes=GrpcLimits().chunk_bytes,
                registry=ctx.registry, signer=ctx.signer, log=log,
            )  # fmt: skip
            server = await serve_fedwave(ctx, service, listen="127.0.0.1:0")
            nodes[name] = (ctx, service, server)
        endpoints = {n: f"127.0.0.1:{nodes[n][2].port}" for n in nodes}
        shapes = router_shapes(settings.initial_router(width))
        bounds = ShapeBounds(router_shapes=shapes, hidden_size=width, vclayer=settings.vclayer)
        seconds: list[float] = []
        identical: list[bool] = []
        router_bytes = vclayer_bytes = 0
        try:
            for t in range(1, rounds + 1):
                routers = {}
                for i, name in enumerate(workflow.agents):
                    router = settings.initial_router(width)
                    with torch.no_grad():
                        for p in router.parameters():
                            p.add_(
                                torch.randn(
                                    p.shape, generator=torch.Generator().manual_seed(t * 1000 + i)
                                )
                                * 0.01
                            )
                    stage = workflow.stage_index(name)
                    blob = encode_router(router, n_samples=10 + 7 * i, round=t)
                    layer = encode_vclayer(
                        settings.initial_vclayer(width, stage), stage=workflow.stages[stage].name
                    )
                    router_bytes, vclayer_bytes = len(blob), len(layer)
                    nodes[name][1].store.publish(
                        t, {PartKind.ROUTER: blob, PartKind.VCLAYER: layer}
                    )
                    routers[name] = router

                async def one(name: str, t: int = t, routers: dict[str, Any] = routers) -> Any:
                    ctx = nodes[name][0]
                    parts = await pull_round(
                        ctx, workflow, name, t, endpoints, bounds, deadline_s=60.0
                    )
                    i = workflow.agents.index(name)
                    merged, _ = aggregate_round_routers(
                        ctx, workflow, routers[name].state_dict(), 10 + 7 * i, parts, shapes
                    )
                    return merged

                start = time.perf_counter()
                merged = await asyncio.gather(*(one(n) for n in workflow.agents))
                seconds.append(time.perf_counter() - start)
                identical.append(
                    all(all(torch.equal(m[k], merged[0][k]) for k in m) for m in merged[1:])
                )
        finally:
            for _, _, server in nodes.values():
                await server.stop(0)
        pulled = {
            name: sum(
                ctx.registry.get_sample_value(
                    "peerlm_agent_fedwave_bytes_received_total", {"kind": kind.value}
                )
                or 0.0
                for kind in PartKind
            )
            / rounds
            for name, (ctx, _, _) in nodes.items()
        }
    return {
        "agents": agents,
        "stages": stages,
        "width": width,
        "rounds": rounds,
        "router_bytes": router_bytes,
        "vclayer_bytes": vclayer_bytes,
        "round_seconds_median": round(statistics.median(seconds), 4),
        "round_seconds_max": round(max(seconds), 4),
        "bytes_pulled_per_agent_per_round": {k: int(v) for k, v in pulled.items()},
        "all_routers_identical_every_round": all(identical),
    }


def run(agents: int = 4, stages: int = 3, width: int = 128, rounds: int = 5) -> dict[str, Any]:
    """The measurement as one JSON-ready dict."""
    return asyncio.run(_run(agents, stages, width, rounds))


def main(argv: Sequence[str] | None = None) -> None:
    """Print the table (or JSON)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(40)  # errors only: a table run
    )
    row = run(args.agents, args.stages, args.width, args.rounds)
    if args.json:
        print(json.dumps(row, indent=2))
        return
    print(
        "| agents | stages | width | router B | VCLayer B | round s (median / max) "
        "| pulled B per agent per round | identical |"
    )
    print("|---|---|---|---|---|---|---|---|")
    pulled = ", ".join(f"{k} {v}" for k, v in row["bytes_pulled_per_agent_per_round"].items())
    print(
        f"| {row['agents']} | {row['stages']} | {row['width']} | {row['router_bytes']} | "
        f"{row['vclayer_bytes']} | {row['round_seconds_median']} / {row['round_seconds_max']} "
        f"| {pulled} | {row['all_routers_identical_every_round']} |"
    )


if __name__ == "__main__":
    main()
