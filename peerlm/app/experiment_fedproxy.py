"""The FedProxy strategies of ``peerlm run-experiment`` (docs/fedproxy.md).

Each client of the run is a member of one owner's cohort on the run's one family
(``--family``): the owner holds the family's full model ``M`` (the built model every client's
LoRA sits on in the other strategies), compresses it to a proxy by Block Influence on the
public transfer prompts X_u (:func:`~peerlm.agent.compress_by_influence`, κ =
``plan.proxy_ratio``), and runs the rounds of Algorithm 1:

1. every member pulls the global proxy ``φ^(t−1)`` with the conflict scores ``C^(t−1)`` (none
   in round 1), encoded as on the wire (:func:`~peerlm.agent.encode_proxy`: the bytes
   counted are the payload's);
2. trains it on its private training set (prompt + reference) with the member's own trainer
   (:func:`~peerlm.agent.text_trainer`, full-parameter AdamW), plus PCR against the
   published scores for ``fedproxy_hties`` (Eq. 8–9, ``plan.proxy_lambda_reg``);
3. sends its trained proxy back (:func:`~peerlm.agent.encode_update`, counted);
4. the owner merges by the strategy's method (:func:`~peerlm.agent.merge_proxies`) and
   fuses the new global proxy into ``M`` (Section 4.3, :func:`~peerlm.agent.fuse_into`).

What is evaluated per client is the fused ``M'``, the same model for every client: the
owner's product (Section 4.3: the proxy's layers written back into the full model) is what
the cohort's training is for, and it is a model of the same size as the other strategies'
(the proxy has half the blocks). Every client samples its own completions of it (its own
sampling seed, as in the other strategies), so the slices (own / lacked / public per
client) and the paired bootstrap are the table's. The proxy's own test NLL per slice is in
each round's record (``proxy_nll``).

Compute (optimiser steps per client per round) is matched to the adapter-merge strategies
(``fedavg_lora``): ``local_steps`` steps of ``grad_accumulation`` × 8 examples a round, and in
round 1 also the ``warmup_steps`` the other strategies' clients spent before round 1 (a
FedProxy member has no full model to warm up: it holds only the proxy, so its warm-up is
spent on the proxy in the first round). Full-parameter training at the LoRA learning rate
diverges on these models, so the proxy has its own (``plan.proxy_learning_rate``, 1e-3, the
bench's). The merge itself costs no member any step. The start differs from the other
strategies' (the base ``M``, not warmed-up adapters): comparisons *within* FedProxy are
exactly matched; against the others they carry that difference.

``fedproxy_proxytuning`` is Table 9's alternative to fusion: the same cohort as
``fedproxy_hties`` (H-TIES + PCR, the same seeds, so the same proxies round by round), but
what is evaluated is ``M`` itself, untouched, decoded by ProxyTuning from the logits
``s_M + s_φ(t) − s_φ(0)`` (:class:`~peerlm.agent.fedproxy.tuning.ProxyTunedHost`; the
anti-expert ``φ(0)`` is the proxy as compressed). Its difference with ``fedproxy_hties`` is
the plug-in alone.

``fedproxy_centsft`` is the paper's CentSFT reference (Table 2's upper bound): no proxy, no
cohort. The owner's full ``M`` is fine-tuned on every member's private texts pooled in one
place, which FedProxy exists to avoid, so it is a reference, not a protocol. Its compute is
the cohort's: each round as many optimiser steps as all members together spend on their
proxies (N × the steps above, the same batch size and learning rate), each on the full
model rather than on half of its blocks; nothing is exchanged (no bytes). Its per-round
records carry the same ``test_nll`` as the cohort's.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from peerlm.app.experiment_eval import finish_run, nll_on_test, slice_means
from peerlm.app.experiment_strategies import CENTSFT, FEDPROXY_MERGE, PROXY_TUNED
from peerlm.app.experiment_world import Client

if TYPE_CHECKING:
    from peerlm.app.experiment_plan import Event
    from peerlm.app.experiment_world import World

__all__ = ["run_fedproxy"]

#: Examples of one optimiser step of the other strategies (TrainSettings' batch size).
_MICRO_BATCH: Final = 8


def _host(model: Any, tokenizer: Any, rank: int, source: str) -> Any:
    """``model`` as a :class:`~peerlm.agent.ModelHost` for the experiment's evaluation: a
    fresh LoRA adapter (B = 0) leaves it computing exactly ``model``."""
    import torch

    from peerlm.agent import LoraSettings, ModelHost, apply_lora

    settings = LoraSettings(r=rank)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        wrapped = apply_lora(model, settings)
    return ModelHost(wrapped, tokenizer, settings, source=source)


def run_fedproxy(
    world: World,
    strategy: str,
    seed: int,
    event: Event,
) -> dict[str, Any]:
    """One FedProxy strategy under run seed ``seed``: a run record of the same shape as the
    other strategies' (clients' final metrics, NLL curve, exchanges, kilobytes, rounds)."""
    import torch
    from transformers import AutoModelForCausalLM

    from peerlm.agent import (
        ConflictRegulariser,
        ProxyTunedHost,
        compress_by_influence,
        encode_proxy,
        encode_update,
        fuse_into,
        merge_proxies,
        proxy_info,
        text_trainer,
        uses_pcr,
    )

    if strategy == CENTSFT:
        return _run_centsft(world, seed, event)
    plan = world.plan
    method = FEDPROXY_MERGE[strategy]
    family = plan.arch(0)
    started = time.perf_counter()
    path, tokenizer, full = _owner_model(world)
    compressed = compress_by_influence(full, tokenizer, world.transfer, plan.proxy_ratio)
    proxy = compressed.proxy
    # ProxyTuning's anti-expert: the proxy before any member trained it.
    anti_expert = copy.deepcopy(proxy) if strategy in PROXY_TUNED else None
    info = proxy_info(proxy)
    assert info is not None  # build_proxy records it
    config = proxy.config.to_dict()
    global_state = {k: v.detach().clone() for k, v in proxy.state_dict().items()}
    conflict: dict[str, torch.Tensor] | None = None
    texts = [[p.prompt + p.reference for p in train] for train, _val in world.clients_data]
    names = [f"agent-{i}" for i in range(plan.agents)]

    def fused_host() -> Any:
        fused = AutoModelForCausalLM.from_pretrained(path)
        proxy.load_state_dict(global_state)
        if anti_expert is not None:
            # M untouched, decoded with the offset of the global proxy (a copy: it trains on).
            base = _host(fused, tokenizer, plan.lora_rank, f"{path} proxy-tuned")
            return ProxyTunedHost(
                base, copy.deepcopy(proxy), anti_expert, beta=plan.proxy_tuning_beta
            )
        fuse_into(fused, proxy)
        return _host(fused, tokenizer, plan.lora_rank, f"{path} fused")

    def clients_of(host: Any) -> list[Client]:
        from peerlm.agent import Guardrail

        return [
            Client(name, family, host, train, val, Guardrail([]))
            for name, (train, val) in zip(names, world.clients_data, strict=True)
        ]

    def every_client(values: Sequence[float]) -> dict[int, Sequence[float]]:
        return dict.fromkeys(range(plan.agents), values)

    # Round 0: M itself (fusing the untrained proxy gives M back, tensor for tensor).
    host = fused_host()
    start = slice_means(world, every_client(nll_on_test(world, clients_of(host)[0])))
    curve = {k: [v] for k, v in start.items()}
    rounds: list[dict[str, Any]] = []
    for t in range(1, plan.rounds + 1):
        steps = plan.local_steps + (plan.warmup_steps if t == 1 else 0)
        down = len(encode_proxy(global_state, config, t, conflict))
        updates = []
        exchanges = []
        for k, name in enumerate(names):
            proxy.load_state_dict(global_state)
            regulariser = None
            if uses_pcr(method) and conflict is not None:
                regulariser = ConflictRegulariser(global_state, conflict, plan.proxy_lambda_reg)
            train = text_trainer(
                tokenizer,
                texts[k],
                steps=steps,
                learning_rate=plan.proxy_learning_rate,
                batch_size=_MICRO_BATCH * plan.grad_accumulation,
                max_length=256,
                seed=seed * 1_000 + t * 10 + k,
            )
            train(proxy, regulariser)
            state = {n: v.detach().clone() for n, v in proxy.state_dict().items()}
            up = len(encode_update(state, info, t))
            updates.append(state)
            exchanges.append(
                {
                    "teacher": "owner",
                    "student": name,
                    "mode": method,
                    "steps": steps,
                    "down_bytes": down,
                    "up_bytes": up,
                    "kilobytes": round((down + up) / 1024, 2),
                }
            )
        merged = merge_proxies(method, global_state, updates)
        global_state, conflict = merged.state, merged.conflict
        host = fused_host()
        nll = slice_means(world, every_client(nll_on_test(world, clients_of(host)[0])))
        # The global proxy itself (a copy: the host's LoRA wraps the modules it is given).
        proxy.load_state_dict(global_state)
        proxy_host = _host(copy.deepcopy(proxy), tokenizer, plan.lora_rank, "proxy")
        proxy_nll = slice_means(world, every_client(nll_on_test(world, clients_of(proxy_host)[0])))
        for name in curve:
            curve[name].append(nll[name])
        rounds.append(
            {
                "round": t,
                "test_nll": nll,
                "proxy_nll": proxy_nll,
                "exchanges": exchanges,
            }
        )
        event("round", {"strategy": strategy, "seed": seed, "round": t, "nll": nll})
    # No exchange of this strategy carries an Eq. 3 reward: its mean_reward is None.
    return finish_run(
        world,
        clients_of(host),
        strategy,
        seed,
        rounds,
        curve,
        started,
        event,
        compress={
            "kept_blocks": list(compressed.kept),
            "block_influence": [round(v, 6) for v in compressed.influence],
        },
    )


def _owner_model(world: World) -> tuple[Path, Any, Any]:
    """The owner's full model ``M`` (the run's family as built), its path and tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = world.models / world.plan.arch(0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return path, tokenizer, AutoModelForCausalLM.from_pretrained(path)


def _run_centsft(world: World, seed: int, event: Event) -> dict[str, Any]:
    """CentSFT under run seed ``seed`` (see the module): ``M`` trained on the pooled texts."""
    from peerlm.agent import Guardrail, text_trainer

    plan = world.plan
    family = plan.arch(0)
    started = time.perf_counter()
    path, tokenizer, model = _owner_model(world)
    pooled = [p.prompt + p.reference for train, _val in world.clients_data for p in train]
    names = [f"agent-{i}" for i in range(plan.agents)]

    def clients_now() -> list[Client]:
        # A copy: the host's LoRA wraps the modules it is given, and M trains on.
        host = _host(copy.deepcopy(model), tokenizer, plan.lora_rank, f"{path} centsft")
        return [
            Client(name, family, host, train, val, Guardrail([]))
            for name, (train, val) in zip(names, world.clients_data, strict=True)
        ]

    def nll_now() -> dict[str, float]:
        values = nll_on_test(world, clients_now()[0])
        return slice_means(world, dict.fromkeys(range(plan.agents), values))

    curve = {k: [v] for k, v in nll_now().items()}
    rounds: list[dict[str, Any]] = []
    for t in range(1, plan.rounds + 1):
        steps = plan.agents * (plan.local_steps + (plan.warmup_steps if t == 1 else 0))
        train = text_trainer(
            tokenizer,
            pooled,
            steps=steps,
            learning_rate=plan.proxy_learning_rate,
            batch_size=_MICRO_BATCH * plan.grad_accumulation,
            max_length=256,
            seed=seed * 1_000 + t * 10,
        )
        train(model, None)
        nll = nll_now()
        for name in curve:
            curve[name].append(nll[name])
        rounds.append({"round": t, "steps": steps, "test_nll": nll, "exchanges": []})
        event("round", {"strategy": CENTSFT, "seed": seed, "round": t, "nll": nll})
    return finish_run(world, clients_now(), CENTSFT, seed, rounds, curve, started, event)
