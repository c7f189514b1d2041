"""FedProxy's cohort member (Algorithm 1, client side): pull the proxy, train it with PCR,
serve the update to the owner.

Round ``t``: the member pulls the owner's proxy ``φ^(t−1)`` with the conflict scores
``C^(t−1)`` (``PullProxy``; the next round is waited for at the owner), checks it
(:func:`~peerlm.agent.fedproxy.config.member_proxy_config`: the configuration must be the
one the member's own base model implies, only the kept blocks are the owner's, so nothing
is built from the owner's sizes; :func:`~peerlm.agent.fedproxy.codec.decode_proxy`: the
tensor table of that configuration; the blocks of the rounds before; finite; scores in
[0, 1]), writes it to ``fedproxy.proxy_path`` (``save_pretrained``, renamed into place),
measures it on its own validation texts, trains it locally with the task loss plus PCR
(:class:`~peerlm.agent.fedproxy.pcr.ConflictRegulariser`, Eq. 8–9, ``λ_reg``; round 1 has no scores,
so no penalty) with the token embeddings frozen, and publishes the result on its update
board, from which only its owner may pull it (``PullUpdate``).

What the owner learns from an update (docs/fedproxy.md, "Hostile members"): the update
carries the token embeddings exactly as pulled (an embedding row moves only for tokens the
member trained on, so moved rows would name its vocabulary), and a
:class:`~peerlm.agent.fedproxy.codec.HarmReport`: the member's loss on its own validation
of the proxy it trained and of the one before. A published proxy that harmed the member
beyond ``fedproxy.harm_margin`` is rolled back by the owner on that report.

The training itself is the caller's (a :data:`Trainer`): the agent trains on its private
data; :func:`text_trainer` is full-parameter AdamW on a list of texts.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import torch
from peerlm.agent.fedproxy.admission import token_embedding_keys
from peerlm.agent.fedproxy.codec import (
    HarmReport,
    ProxyPayload,
    decode_proxy,
    encode_update,
    read_proxy_header,
)
from peerlm.agent.fedproxy.config import member_proxy_config
from peerlm.agent.fedproxy.pcr import ConflictRegulariser
from peerlm.agent.fedproxy.proxy import ProxyError, ProxyInfo
from peerlm.agent.fedproxy.service import ProxyExchangeService, RoundBoard, pull_proxy
from peerlm.agent.peer.client import PeerExchangeError
from peerlm.agent.peer.stream import PeerStreamer
from peerlm.agent.settings import FedProxySettings
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from peerlm.node import NodeContext

__all__ = [
    "Evaluator",
    "ProxyMember",
    "Trainer",
    "build_proxy_model",
    "frozen_embeddings",
    "proxy_from",
    "save_model_atomic",
    "text_loss",
    "text_trainer",
]

#: Trains the proxy in place for one round; the regulariser (None in round 1) is PCR's
#: penalty to add to the task loss before ``backward``.
Trainer = Callable[[PreTrainedModel, ConflictRegulariser | None], None]


def build_proxy_model(payload: ProxyPayload) -> PreTrainedModel:
    """The proxy a decoded payload describes, with its weights (a plain causal LM)."""
    return proxy_from(payload.config or {}, payload.state)


def proxy_from(raw_config: dict[str, Any], state: Mapping[str, torch.Tensor]) -> PreTrainedModel:
    """A model of configuration ``raw_config`` (``to_dict`` form) holding ``state``."""
    config = _config(raw_config)
    model: PreTrainedModel = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    model.load_state_dict(dict(state), strict=True)
    as_module: torch.nn.Module = model  # transformers' own .eval signature does not type-check
    as_module.eval()
    return model


def _config(raw: dict[str, Any]) -> Any:
    kind = raw.get("model_type")
    fields = {k: v for k, v in raw.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(str(kind), **fields)
    except (ValueError, TypeError, KeyError) as err:  # an unknown model type or bad fields
        raise ProxyError(f"proxy configuration refused: {err}", reason="model") from None


def text_trainer(
    tokenizer: Any,
    texts: Sequence[str],
    *,
    steps: int,
    learning_rate: float,
    batch_size: int = 4,
    max_length: int = 128,
    seed: int = 0,
) -> Trainer:
    """Full-parameter AdamW for ``steps`` steps on batches of ``texts`` (causal LM loss on
    the whole text), plus the PCR penalty when there is one. Deterministic under ``seed``."""
    if not texts:
        raise ValueError("a trainer needs texts")

    def train(model: Any, regulariser: ConflictRegulariser | None) -> None:
        gen = torch.Generator().manual_seed(seed)
        optimiser = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
        model.train()
        for _ in range(steps):
            pick = torch.randint(0, len(texts), (batch_size,), generator=gen).tolist()
            batch = tokenizer(
                [texts[i] for i in pick],
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=max_length,
            )
            labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
            loss = model(**batch, labels=labels, use_cache=False).loss
            if regulariser is not None:
                loss = loss + regulariser.penalty(model)
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            optimiser.step()
        model.eval()

    return train


#: A proxy's held-out loss (mean token cross-entropy, nats) on texts the caller chose.
Evaluator = Callable[[PreTrainedModel], float]


def text_loss(
    tokenizer: Any, texts: Sequence[str], *, batch_size: int = 4, max_length: int = 128
) -> Evaluator:
    """The mean token cross-entropy of a proxy on ``texts``, tokenised as
    :func:`text_trainer` tokenises (whole text, truncated to ``max_length``), token-weighted,
    without gradients: the FedProxy owner's acceptance gate measures merges with it."""
    if not texts:
        raise ValueError("an evaluator needs texts")

    def evaluate(model: Any) -> float:
        total, count = 0.0, 0
        with torch.inference_mode():
            for lo in range(0, len(texts), batch_size):
                batch = tokenizer(
                    list(texts[lo : lo + batch_size]),
                    return_tensors="pt",
                    padding=True,
                    truncation=True,
                    max_length=max_length,
                )
                labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
                # The model's loss is the mean over the batch's scored positions: weight it
                # by their count so that batches of different lengths add up exactly.
                scored = int((labels[:, 1:] != -100).sum())
                loss = model(**batch, labels=labels, use_cache=False).loss
                total += float(loss) * scored
                count += scored
        return total / count if count else float("nan")

    return evaluate


class ProxyMember:
    """A member's rounds: pull from the owner of ``settings``, train with ``trainer``.

    ``base_config``: the configuration of the base model this member holds (the agent's
    ``model``); the only proxy configuration accepted is the one it implies with the
    owner's kept blocks (:func:`~peerlm.agent.fedproxy.config.member_proxy_config`).

    ``evaluate``: the held-out loss of a proxy on the member's own validation texts
    (:func:`text_loss`), measured on every pulled proxy before it is trained (``losses``)
    and reported to the owner with the update (the member's side of the acceptance gate);
    None: not measured, nothing reported."""

    def __init__(
        self,
        ctx: NodeContext,
        settings: FedProxySettings,
        trainer: Trainer,
        *,
        base_config: PretrainedConfig,
        clock: Callable[[], float] = time.monotonic,
        evaluate: Evaluator | None = None,
    ) -> None:
        if settings.owner or not settings.owner_name or not settings.owner_address:
            raise ValueError("a member needs fedproxy.owner_name and fedproxy.owner_address")
        self._ctx, self._settings, self._trainer, self._clock = ctx, settings, trainer, clock
        self._base_config = base_config
        self.owner: str = settings.owner_name
        self.board = RoundBoard(horizon=None)
        self.info: ProxyInfo | None = None
        self.model: PreTrainedModel | None = None
        self._evaluate = evaluate
        #: SHA-256 of every proxy payload pulled (and checked), by round: equal to the
        #: owner's ``published`` digest of that round.
        self.pulled: dict[int, str] = {}
        #: With ``evaluate``: the held-out loss of every pulled proxy, before training, by
        #: round (the member's own validation texts; what it can see of the merges).
        self.losses: dict[int, float] = {}
        self._trained = ctx.counter(
            "peerlm_agent_fedproxy_updates_trained_total",
            "Rounds a member trained the proxy in and offered the update to its owner",
        )
        self._refused = ctx.counter(
            "peerlm_agent_fedproxy_payloads_refused_total",
            "Proxies (at a member) and updates (at the owner) refused as bad input",
            ("kind", "reason"),
        )

    def service(
        self, *, chunk_bytes: int, max_wait_s: float, streamer: PeerStreamer | None = None
    ) -> ProxyExchangeService:
        """The ``ProxyExchange`` service of this member: its updates, to its owner only."""
        return ProxyExchangeService(
            updates=self.board,
            owner=self.owner,
            chunk_bytes=chunk_bytes,
            max_wait_s=max_wait_s,
            registry=self._ctx.registry,
            signer=self._ctx.signer,
            log=self._ctx.log,
            streamer=streamer,
        )

    async def pull(self, wanted: int, *, wait_s: float) -> ProxyPayload:
        """The owner's proxy of round ``wanted`` (0: its current one), checked; asks again
        every ``retry_s`` while the owner is unreachable or not ready, for up to ``wait_s``.
        A round that no longer exists is replaced by the owner's current one."""
        s = self._settings
        assert s.owner_address is not None
        end = self._clock() + wait_s
        while True:
            left = end - self._clock()
            try:
                got, data = await pull_proxy(
                    self._ctx,
                    s.owner_address,
                    wanted,
                    owner=self.owner,
                    max_bytes=s.max_proxy_bytes,
                    timeout_s=max(0.05, min(left, s.round_deadline_s)),
                )
                break
            except PeerExchangeError as err:
                if err.code == grpc.StatusCode.NOT_FOUND and wanted:
                    self._ctx.log.warning("fedproxy_round_missed", round=wanted)
                    wanted = 0
                    continue
                # Not there yet, or no next round within the call: ask again.
                retry = err.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                if not retry or self._clock() >= end:
                    raise
                await asyncio.sleep(min(s.retry_s, max(0.0, end - self._clock())))
        try:
            derived = member_proxy_config(
                self._base_config, _header_config(data, s.max_proxy_bytes)
            )
            payload = decode_proxy(
                data,
                derived.shapes,
                max_bytes=s.max_proxy_bytes,
                round_=got,
                expected_info=self.info,
            )
            # The model is built from the configuration derived from the base, never from
            # the owner's numbers (they were checked equal; this makes it so by construction).
            payload = replace(payload, config=derived.config.to_dict())
        except ProxyError as err:
            self._refused.labels("proxy", err.reason).inc()
            self._ctx.log.warning(
                "fedproxy_proxy_refused", round=got, reason=err.reason, detail=str(err)
            )
            raise
        self.pulled[payload.round] = hashlib.sha256(data).hexdigest()
        return payload

    async def _take(
        self, wanted: int, wait_s: float | None
    ) -> tuple[ProxyPayload, PreTrainedModel]:
        """Pull round ``wanted``, build it and keep it at ``proxy_path``."""
        s = self._settings
        payload = await self.pull(
            wanted, wait_s=wait_s if wait_s is not None else 2 * s.round_deadline_s + 60.0
        )
        model = await asyncio.to_thread(build_proxy_model, payload)
        await asyncio.to_thread(save_model_atomic, model, s.proxy_path)
        self.info = payload.info
        if self._evaluate is not None:
            self.losses[payload.round] = await asyncio.to_thread(self._evaluate, model)
        return payload, model

    async def keep(self, wanted: int, *, wait_s: float | None = None) -> int:
        """Pull round ``wanted`` and keep it at ``proxy_path`` without training: after its
        last round a member takes the owner's final merge (and, by waiting for it, keeps
        serving its last update until the owner has collected); the round kept."""
        payload, model = await self._take(wanted, wait_s)
        self.model = model
        return payload.round

    async def run_round(self, wanted: int = 0, *, wait_s: float | None = None) -> int:
        """Pull round ``wanted`` (0: the current), keep it, train it, offer the update;
        the round trained."""
        s = self._settings
        payload, model = await self._take(wanted, wait_s)
        regulariser = (
            ConflictRegulariser(
                {k: v.clone() for k, v in payload.state.items()},
                payload.conflict,
                s.lambda_reg,
            )
            if payload.conflict
            else None
        )
        await asyncio.to_thread(self._train, model, regulariser)
        update = encode_update(
            model.state_dict(), payload.info, payload.round, self._report(payload.round)
        )
        await self.board.publish(payload.round, update)
        self.model = model
        self._trained.inc()
        self._ctx.log.info(
            "fedproxy_update_ready",
            round=payload.round,
            bytes=len(update),
            pcr=regulariser is not None,
        )
        return payload.round

    def _train(self, model: PreTrainedModel, regulariser: ConflictRegulariser | None) -> None:
        """The trainer's round with the token embeddings frozen, and put back as pulled
        after it whatever the trainer did (a trainer may turn gradients back on)."""
        with frozen_embeddings(model):
            self._trainer(model, regulariser)

    def _report(self, round_: int) -> HarmReport | None:
        """The loss of round ``round_``'s proxy and of the one pulled before it, on this
        member's validation texts; None before the member has two measured proxies."""
        earlier = [r for r in self.losses if r < round_]
        if round_ not in self.losses or not earlier:
            return None
        previous = max(earlier)
        report = HarmReport(round_, self.losses[round_], previous, self.losses[previous])
        self._ctx.log.info("fedproxy_harm_measured", **report.to_dict())
        return report


@contextmanager
def frozen_embeddings(model: PreTrainedModel) -> Iterator[None]:
    """The token embeddings of ``model`` (input and output, tied or not) take no gradient
    inside the block and hold their values from before it at the end."""
    keys = token_embedding_keys(model)
    state = model.state_dict()
    saved = {key: state[key].detach().clone() for key in keys}
    parameters = dict(model.named_parameters(remove_duplicate=False))
    flags = {key: parameters[key].requires_grad for key in keys}
    for key in keys:
        parameters[key].requires_grad_(False)
    try:
        yield
    finally:
        with torch.no_grad():
            for key in keys:
                parameters[key].copy_(saved[key])
                parameters[key].requires_grad_(flags[key])


def _header_config(data: bytes, max_bytes: int) -> dict[str, Any]:
    config = read_proxy_header(data, kind="proxy", max_bytes=max_bytes).config
    assert config is not None
    return config


def save_model_atomic(model: PreTrainedModel, path: Path) -> None:
    """``save_pretrained`` into a sibling folder, then renamed over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)
