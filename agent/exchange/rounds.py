"""One agent's side of a KNEXA-FL round, without I/O: what the daemon and the experiment share.

Every function here is synchronous and takes the agent's :class:`ModelHost`; none of them
talks to the network. The daemon (:mod:`peerlm.agent.daemon`) calls them from its model
worker thread around the gRPC exchange; the in-process experiment
(:mod:`peerlm.app.experiment`) calls them directly for many hosts. One code path for:

* local update on private data (Algorithm 3, phase 1);
* evaluation: validation loss and sandboxed pass@k;
* the teacher's predictions on X_u and the knowledge package, text or logits mode;
* integration of a package by AKD (Eq. 2) with the round's alpha_KD and temperature;
* the reward of Eq. 3.

Schedules (Table 6). ``alpha_KD`` runs linearly from ``alpha_kd_start`` (0.2, round 1) to
``alpha_kd_end`` (0.5, the last round); the KD temperature from ``kd_temperature_start``
(2.5) to ``kd_temperature_end`` (1.5). The paper anneals "over training"; a round is the
unit of training progress here, and with ``rounds = 0`` (run forever) the ramps never end,
so :meth:`RoundConfig.alpha_kd` holds the start value.

Package modes. ``text`` is the paper's choice: the teacher's decoded completions, which any
student re-tokenises. ``logits`` sends the teacher's top-k next-token log-probabilities on
its own completions; token distributions only compare within one id space, so a logits
package is built only for a student whose tokenizer hashes like the teacher's. The teacher
decides (it knows the student's tokenizer hash, announced with the fetch) and falls back to
text otherwise, so a student always receives something it can learn from
(:func:`choose_package_mode`). Column 0 of each row holds the token the teacher's text has at
that position (its greedy choice, bar re-tokenisation), the other k-1 columns the most
probable other tokens: the student rebuilds the teacher's exact input from column 0 and
distils on that k-token support (KL at temperature T, re-tempered from the teacher's).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, Unpack

import numpy as np
from peerlm.agent.training import TrainSettings, TrainStats, split_prompt, token_ids

if TYPE_CHECKING:
    from peerlm.agent.eval.evaluation import EvalReport
    from peerlm.agent.eval.sandbox import LimitOptions, Status
    from peerlm.agent.exchange.package import KnowledgePackage, LogitsPackage
    from peerlm.agent.modelhost import ModelHost
    from peerlm.agent.settings import AgentSettings
    from peerlm.agent.tasks.dataset import Problem
    from peerlm.agent.vetting.guardrail import Guardrail

__all__ = [
    "PACKAGE_MODES",
    "Integration",
    "PackageMode",
    "ProfileInputs",
    "RoundConfig",
    "build_package",
    "category_counts",
    "choose_package_mode",
    "evaluate_pass",
    "integrate_package",
    "linear_schedule",
    "local_update",
    "logit_entries",
    "reference_nll",
    "reward_eq3",
    "round_profile",
    "sample_completions",
    "score_completions",
    "teacher_completions",
]

PackageMode = Literal["text", "logits"]
PACKAGE_MODES: tuple[PackageMode, ...] = ("text", "logits")


def linear_schedule(start: float, end: float, t: int, total: int) -> float:
    """Value at round ``t`` (1-based) of a linear ramp from ``start`` (t=1) to ``end`` (t=T).

    ``total <= 0`` means no known end (an agent that runs forever): the ramp stays at
    ``start``. ``total == 1`` is the last round at once: ``end``.
    """
    if total <= 0:
        return start
    if total == 1:
        return end
    frac = min(max((t - 1) / (total - 1), 0.0), 1.0)
    return start + (end - start) * frac


def reward_eq3(
    loss_pre: float, loss_post: float, kilobytes: float, gamma: float, delta: float
) -> float:
    """Eq. 3: ``gamma * (L_pre - L_post) - delta * KB``."""
    return gamma * (loss_pre - loss_post) - delta * kilobytes


@dataclass(frozen=True)
class RoundConfig:
    """The round parameters of one agent (a view of :class:`~peerlm.config.AgentSettings`)."""

    total_rounds: int
    train: TrainSettings
    local_steps: int | None = None
    alpha_kd_start: float = 0.2
    alpha_kd_end: float = 0.5
    kd_temperature_start: float = 2.5
    kd_temperature_end: float = 1.5
    reward_gamma: float = 1.0
    reward_delta: float = 0.001
    max_new_tokens: int = 96
    logits_top_k: int = 16
    #: Allowed rise of the held-out loss by one integration before it is rolled back
    #: (:mod:`peerlm.agent.acceptance`); None: no gate. The agent's setting defaults to 0.1.
    acceptance_margin: float | None = None
    #: With a peer slot: the learning rate every integration into it trains at
    #: (``slot_learning_rate``; :meth:`integrating`); None: ``train``'s, the own adapter's.
    slot_learning_rate: float | None = None

    def integrating(self) -> RoundConfig:
        """The configuration an integration trains with: the slot's learning rate where one
        is set, everything else this configuration's."""
        if self.slot_learning_rate is None:
            return self
        # Validated again (model_copy would not): a rate set on the dataclass by hand too.
        train = type(self.train).model_validate(
            {**self.train.model_dump(), "learning_rate": self.slot_learning_rate}
        )
        return replace(self, train=train, slot_learning_rate=None)

    @classmethod
    def from_settings(cls, s: AgentSettings) -> RoundConfig:
        """The agent's settings as a round configuration (with a peer slot and
        ``peer_alpha_kd``, alpha_KD is that constant: the slot's integrations are the
        only ones that read it; so is ``slot_learning_rate``, through :meth:`integrating`)."""
        peer_alpha = s.peer_alpha_kd if s.integration == "separate" else None
        return cls(
            total_rounds=s.rounds,
            train=TrainSettings(
                learning_rate=s.learning_rate,
                batch_size=s.batch_size,
                grad_accumulation=s.grad_accumulation,
                max_length=s.max_length,
                seed=s.seed,
            ),
            local_steps=s.local_steps,
            alpha_kd_start=s.alpha_kd_start if peer_alpha is None else peer_alpha,
            alpha_kd_end=s.alpha_kd_end if peer_alpha is None else peer_alpha,
            kd_temperature_start=s.kd_temperature_start,
            kd_temperature_end=s.kd_temperature_end,
            reward_gamma=s.reward_gamma,
            reward_delta=s.reward_delta,
            max_new_tokens=s.max_new_tokens,
            logits_top_k=s.logits_top_k,
            acceptance_margin=s.acceptance_margin,
            slot_learning_rate=s.slot_learning_rate if s.integration == "separate" else None,
        )

    def alpha_kd(self, t: int) -> float:
        """alpha_KD of round ``t`` (Table 6: 0.2 -> 0.5, linear)."""
        return linear_schedule(self.alpha_kd_start, self.alpha_kd_end, t, self.total_rounds)

    def kd_temperature(self, t: int) -> float:
        """KD temperature of round ``t`` (Table 6: 2.5 -> 1.5, linear; logits mode)."""
        return linear_schedule(
            self.kd_temperature_start, self.kd_temperature_end, t, self.total_rounds
        )

    def train_settings(self, t: int) -> TrainSettings:
        """Training settings of round ``t``: a seed per round, so rounds draw fresh batches."""
        return self.train.model_copy(update={"seed": self.train.seed * 100_003 + t})


# ------------------------------------------------------------------------------- phase 1


def local_update(
    host: ModelHost, examples: Sequence[tuple[str, str]], config: RoundConfig, t: int
) -> TrainStats:
    """Local PEFT update on private (prompt, solution) pairs (Algorithm 3, l.2)."""
    return host.train_local(examples, config.train_settings(t), steps=config.local_steps)


def sample_completions(
    host: ModelHost,
    problems: Sequence[Problem],
    *,
    max_new_tokens: int,
    n: int = 1,
    temperature: float = 0.0,
    seed: int = 0,
) -> dict[str, list[str]]:
    """``n`` completions per problem (greedy copies at temperature 0), by task id.

    Generation stops at the end of the function body (``ModelHost.generate``'s stops and
    its dedent rule), the same cut for every evaluation and for teacher predictions.
    """
    completions = host.generate(
        [p.prompt for p in problems],
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        n=n,
        seed=seed,
    )
    return {p.task_id: c for p, c in zip(problems, completions, strict=True)}


def score_completions(
    problems: Sequence[Problem],
    completions: Mapping[str, Sequence[str]],
    *,
    ks: Sequence[int] = (1,),
    max_workers: int = 2,
    known: MutableMapping[str, Status] | None = None,
    **limits: Unpack[LimitOptions],
) -> EvalReport:
    """Run ``completions`` in the sandbox: pass@k per problem (unbiased estimator), means.
    ``known``: programs already run under these limits, and their status
    (:func:`~peerlm.agent.eval.evaluation.evaluate`); ``limits`` go to
    :func:`~peerlm.agent.eval.sandbox.run_program`.

    Raises :class:`~peerlm.agent.eval.sandbox.SandboxUnavailable` when the sandbox cannot
    confine the code and ``allow_unconfined`` (the operator's opt-out) is false.
    """
    from peerlm.agent.eval.evaluation import evaluate

    return evaluate(
        problems,
        completions,
        ks=tuple(ks),
        max_workers=max_workers,
        known=known,
        **limits,
    )


def evaluate_pass(
    host: ModelHost,
    problems: Sequence[Problem],
    *,
    max_new_tokens: int,
    n: int = 1,
    temperature: float = 0.0,
    ks: Sequence[int] = (1,),
    seed: int = 0,
    timeout_s: float = 5.0,
    memory_mb: int = 256,
    max_workers: int = 2,
) -> EvalReport:
    """pass@k of ``host`` on ``problems``: :func:`sample_completions`, then
    :func:`score_completions`."""
    completions = sample_completions(
        host, problems, max_new_tokens=max_new_tokens, n=n, temperature=temperature, seed=seed
    )
    return score_completions(
        problems,
        completions,
        ks=ks,
        timeout_s=timeout_s,
        memory_mb=memory_mb,
        max_workers=max_workers,
    )


def reference_nll(
    host: ModelHost, problems: Sequence[Problem], *, max_length: int = 256
) -> list[float]:
    """Per problem, the negative log-likelihood of the reference solution under ``host``,
    in nats per UTF-8 byte of the reference: ``-log p(reference + EOS | prompt) / bytes``.

    A metric that moves before pass@1: it rises or falls with every token of the right
    answer, where pass@1 needs the whole body right. Per byte, not per token, so that
    models with different tokenizers compare, and long references do not dominate a mean.
    """
    scores = host.sequence_logprobs(
        [(p.prompt, p.reference) for p in problems], max_length=max_length
    )
    return [
        -s / max(1, len(p.reference.encode("utf-8"))) for p, s in zip(problems, scores, strict=True)
    ]


# ------------------------------------------------------------------------- teacher side


def teacher_completions(host: ModelHost, prompts: Sequence[str], max_new_tokens: int) -> list[str]:
    """The teacher's predictions y_j(x) on X_u: one greedy completion per prompt."""
    return [c[0] for c in host.generate(prompts, max_new_tokens=max_new_tokens, temperature=0.0)]


def choose_package_mode(
    wanted: PackageMode, teacher_tokenizer: str, student_tokenizer: str | None
) -> PackageMode:
    """``logits`` only when wanted and the student's tokenizer is the teacher's, else ``text``."""
    if wanted == "logits" and student_tokenizer == teacher_tokenizer:
        return "logits"
    return "text"


def build_package(
    host: ModelHost,
    *,
    mode: PackageMode,
    prompts: Sequence[str],
    completions: Sequence[str],
    teacher: str,
    directive_id: str,
    transfer_sha256: str,
    guardrail: Guardrail,
    top_k: int = 16,
    max_length: int = 256,
    prompt_ids: Sequence[str] | None = None,
    created_at: float | None = None,
) -> bytes:
    """The encoded knowledge package of ``completions`` to ``prompts`` (X_u), guardrailed.

    ``prompts`` may be a subset of X_u (what the teacher answers, :mod:`.teaching`);
    ``prompt_ids`` then name each one's position in X_u (default: ``"0"``, ``"1"``, ...).
    ``created_at``: the package's time stamp (default: now).

    Logits mode: the top-k of :meth:`ModelHost.topk_logits` at temperature 1 (the student
    re-tempers to its schedule); an item whose text the guardrail would change is withheld.
    """
    from peerlm.agent.exchange.package import build_logits_package, build_text_package

    if mode == "text":
        return build_text_package(
            prompts=prompts,
            completions=completions,
            teacher=teacher,
            directive_id=directive_id,
            transfer_sha256=transfer_sha256,
            family=host.family,
            guardrail=guardrail,
            prompt_ids=prompt_ids,
            created_at=created_at,
        )
    entries = host.topk_logits(
        prompts, completions, k=top_k, temperature=1.0, max_length=max_length
    )
    data, _withheld = build_logits_package(
        prompts=prompts,
        token_ids=[e["ids"] for e in entries],
        logprobs=[e["logprobs"] for e in entries],
        teacher=teacher,
        directive_id=directive_id,
        transfer_sha256=transfer_sha256,
        family=host.family,
        temperature=1.0,
        tokenizer_sha256=host.tokenizer_hash,
        vocab_size=host.vocab_size,
        guardrail=guardrail,
        detokenize=lambda ids: str(host.tokenizer.decode(list(ids), skip_special_tokens=True)),
        prompt_ids=prompt_ids,
        created_at=created_at,
    )
    return data


# ------------------------------------------------------------------------- student side


def logit_entries(
    host: ModelHost, package: LogitsPackage, prompts: Sequence[str]
) -> list[dict[str, Any]]:
    """A logits package as :meth:`ModelHost.train_akd_logits` entries, prompts from our X_u.

    The input of each item is our tokenisation of its prompt (the tokenizer is the
    teacher's, so it is the teacher's too) followed by column 0 of its rows, the tokens of
    the teacher's text. Raises :class:`~peerlm.agent.exchange.package.PackageError` for an item
    that answers a prompt outside ``prompts``.
    """
    from peerlm.agent.exchange.package import PackageError, item_prompts

    entries: list[dict[str, Any]] = []
    for item, prompt in zip(package.items, item_prompts(package, prompts), strict=True):
        if prompt is None:
            raise PackageError(
                f"item {item.prompt_id!r} answers a prompt that is not in our transfer set"
            )
        if item.token_ids.shape[0] == 0:
            continue
        head, _ = split_prompt(host.tokenizer, prompt)
        prompt_ids = token_ids(host.tokenizer, head, special=True)
        completion = [int(i) for i in item.token_ids[:, 0]]
        entries.append(
            {
                "input_ids": np.asarray(prompt_ids + completion, dtype=np.int64),
                "prompt_length": len(prompt_ids),
                "ids": item.token_ids,
                "logprobs": np.asarray(item.logprobs, dtype=np.float32),
                "temperature": package.temperature,
                "tokenizer_hash": package.tokenizer_sha256,
            }
        )
    return entries


@dataclass(frozen=True)
class Integration:
    """What integrating one package did: Eq. 2's weights and Eq. 3's reward."""

    mode: PackageMode
    alpha_kd: float
    temperature: float | None
    loss_pre: float
    loss_post: float
    kilobytes: float
    reward: float
    stats: TrainStats
    #: The update made the held-out loss worse by more than the margin and was undone;
    #: ``loss_post`` and ``reward`` are still the measured (bounded) ones, so the reward
    #: reported to the CPM is negative.
    rolled_back: bool = False
    #: The teacher's (prompt, completion) pairs a text package was distilled on (after the
    #: slot's scope, the empty and redacted items and the guardrail): what a peer slot
    #: remembers of the lesson for its rehearsal (:class:`~.peer_knowledge.PeerSlot`).
    learnt: tuple[tuple[str, str], ...] = ()


def integrate_package(
    host: ModelHost,
    package: KnowledgePackage,
    *,
    kilobytes: float,
    local_examples: Sequence[tuple[str, str]],
    val_examples: Sequence[tuple[str, str]],
    transfer_prompts: Sequence[str],
    config: RoundConfig,
    t: int,
    guardrail: Guardrail | None = None,
    reward_examples: Sequence[tuple[str, str]] | None = None,
    learns: Callable[[Sequence[str]], Sequence[bool]] | None = None,
    reward_scope: Callable[[Sequence[str]], Sequence[tuple[str, str]]] | None = None,
    rehearsal: Sequence[tuple[str, str]] = (),
) -> Integration:
    """Integrate a decoded package by AKD (Eq. 2) and compute the reward of Eq. 3.

    L_pre and L_post are the validation loss right before and after the AKD update, so the
    reward measures what this exchange did. With ``config.acceptance_margin`` set, an update
    that raises L_post above L_pre by more than the margin is rolled back (the adapter from
    before is restored, :mod:`peerlm.agent.acceptance`) and still reported with its
    negative reward: the gate that protects the student from poisoned text. Empty and
    guardrail-redacted completions are skipped; with none left the step is local training
    only on the one adapter, no step in a peer slot (``learns``, below). Text packages are
    re-tokenised (:meth:`ModelHost.train_akd`); logits packages are distilled on the
    teacher's top-k at the round's temperature (:meth:`ModelHost.train_akd_logits`), which
    raises :class:`~peerlm.agent.modelhost.TokenizerMismatchError` for another tokenizer.

    With ``reward_examples`` (a labelled public probe: the agent's ``reward_file``), L_pre
    and L_post of the reward are measured on them instead, while the gate still judges on
    ``val_examples`` (it protects what the student has); an update the gate rolled back
    reports the gate's own measurement (a negative reward: the bandit learns the pairing
    hurt), whatever the probe says.

    With ``guardrail``, incoming items are vetted first
    (:meth:`~peerlm.agent.vetting.guardrail.Guardrail.vet_incoming`): one holding a secret or
    personal data, or code importing networking, process, file-system or introspection
    modules, is not learnt from (and counted). A logits item is vetted through the text its
    completion tokens (column 0) decode to.

    With ``learns`` (a peer slot's scope, :func:`~peerlm.agent.peer_integration.slot_learns`:
    every item, or under ``slot_scope: routed`` what the router sends to the slot), an
    item whose prompt it rejects is not learnt from; a package with nothing left to learn
    (after that filter, the empty and redacted items and the guardrail) trains nothing at
    all, so L_post = L_pre and the reward is Eq. 3's -delta * KB: the CPM hears that the
    exchange taught this student nothing it would use. Without ``learns`` (the one
    adapter) such a package is Eq. 2 with nothing to distil: local training only.

    With ``reward_scope`` (``probe_scope: answered``,
    :class:`~peerlm.agent.exchange.reward_probe.AnsweredProbe`), the reward's probe is
    ``reward_scope(the prompts the package's items answer)`` (after ``learns``): the probe
    problems of the categories the package teaches. A package that teaches no category of
    the probe is measured on nothing: L_post = L_pre (the validation loss before) and the
    reward is Eq. 3's -delta * KB, whatever it trained.

    With ``rehearsal`` (a peer slot's earlier lessons, :meth:`~.peer_knowledge.PeerSlot.rehearse`),
    a text package that has something to teach is distilled together with those pairs in
    the same steps; a package with nothing to teach trains nothing whatever the rehearsal
    holds, and a logits package ignores it (its targets are token distributions).
    """
    from peerlm.agent.acceptance import AcceptanceGate, judge
    from peerlm.agent.exchange.package import TextPackage, item_prompts, text_pairs
    from peerlm.agent.exchange.peer_knowledge import learnt_items
    from peerlm.agent.vetting.guardrail import placeholder

    alpha = config.alpha_kd(t)
    settings = config.train_settings(t)
    pre, _ = host.eval_loss(val_examples, max_length=config.train.max_length)
    if not isinstance(package, TextPackage):
        # Refused whatever its items: so also when the slot's scope would leave none.
        host.check_logit_tokenizer(package.tokenizer_sha256)
    if learns is not None:
        package = learnt_items(package, transfer_prompts, learns)
    unmeasured = False
    if reward_scope is not None:
        answered = [p for p in item_prompts(package, transfer_prompts) if p is not None]
        reward_examples = list(reward_scope(answered))
        unmeasured = not reward_examples
    probe_pre = (
        host.eval_loss(reward_examples, max_length=config.train.max_length)[0]
        if reward_examples
        else None
    )
    before = host.adapter_state() if config.acceptance_margin is not None else None
    temperature: float | None = None
    learnt: tuple[tuple[str, str], ...] = ()
    if isinstance(package, TextPackage):
        mode: PackageMode = "text"
        # Not learnt from: an empty completion (it would teach "stop at once") and one the
        # teacher's guardrail redacted (its <redacted:KIND> placeholder is not code, and a
        # student trained on it would learn to write placeholders).
        redacted = placeholder("")[:-1]
        pairs = [
            (p, c)
            for p, c in text_pairs(package, transfer_prompts)
            if c.strip() and redacted not in c
        ]
        if guardrail is not None and pairs:
            verdicts = guardrail.vet_incoming([c for _, c in pairs])
            pairs = [pair for pair, verdict in zip(pairs, verdicts, strict=True) if not verdict]
        if not pairs and learns is not None:  # nothing the slot would use: no step
            return _taught_nothing(package, alpha, config, t, pre, probe_pre, kilobytes)
        if not pairs:  # nothing to learn from the teacher: local data only
            stats = host.train_local(local_examples, settings, steps=config.local_steps)
        else:
            learnt = tuple(pairs)
            stats = host.train_akd(
                local_examples, [*pairs, *rehearsal], alpha, settings, steps=config.local_steps
            )
    else:
        mode = "logits"
        temperature = config.kd_temperature(t)
        entries = logit_entries(host, package, transfer_prompts)
        if guardrail is not None and entries:
            # Token ids are numbers the filter cannot read: vet each item through the text
            # its column 0 spells in our tokenizer (it is the teacher's, or the package was
            # refused above), as the teacher's own guardrail did before sending.
            texts = [
                str(
                    host.tokenizer.decode(
                        [int(i) for i in e["input_ids"][e["prompt_length"] :]],
                        skip_special_tokens=True,
                    )
                )
                for e in entries
            ]
            verdicts = guardrail.vet_incoming(texts)
            entries = [e for e, verdict in zip(entries, verdicts, strict=True) if not verdict]
        if not entries and learns is not None:
            return _taught_nothing(package, alpha, config, t, pre, probe_pre, kilobytes)
        if not entries:
            stats = host.train_local(local_examples, settings, steps=config.local_steps)
        else:
            stats = host.train_akd_logits(
                local_examples,
                entries,
                alpha,
                settings,
                temperature=temperature,
                steps=config.local_steps,
            )
    if before is not None and config.acceptance_margin is not None:
        gate = AcceptanceGate(val_examples, config.acceptance_margin, config.train.max_length)
        verdict = gate.settle(host, before, pre)
    else:
        post, _ = host.eval_loss(val_examples, max_length=config.train.max_length)
        verdict = judge(pre, post, None)
    post = verdict.loss_post
    if probe_pre is not None and reward_examples and not verdict.rolled_back:
        probe_post = host.eval_loss(reward_examples, max_length=config.train.max_length)[0]
        pre, post = probe_pre, judge(probe_pre, probe_post, None).loss_post
    elif unmeasured and not verdict.rolled_back:
        post = pre  # nothing of the probe was taught: the KB penalty alone
    reward = reward_eq3(pre, post, kilobytes, config.reward_gamma, config.reward_delta)
    if not math.isfinite(reward):
        raise ValueError(f"reward is not finite (L_pre={pre}, L_post={post})")
    return Integration(
        mode, alpha, temperature, pre, post, kilobytes, reward, stats, verdict.rolled_back, learnt
    )


def _taught_nothing(
    package: KnowledgePackage,
    alpha: float,
    config: RoundConfig,
    t: int,
    pre: float,
    probe_pre: float | None,
    kilobytes: float,
) -> Integration:
    """The integration of a package none of whose items the student learns from: no step,
    the losses unchanged, Eq. 3's reward the KB penalty alone."""
    loss = pre if probe_pre is None else probe_pre
    reward = reward_eq3(loss, loss, kilobytes, config.reward_gamma, config.reward_delta)
    temperature = None if package.mode == "text" else config.kd_temperature(t)
    stats = TrainStats(mean_loss=0.0, steps=0, micro_batches=0, examples=0, tokens=0, seconds=0.0)
    return Integration(package.mode, alpha, temperature, loss, loss, kilobytes, reward, stats)


@dataclass(frozen=True)
class ProfileInputs:
    """What a round measured, for the profile p_i (the dynamic features)."""

    t: int
    total_rounds: int
    val_loss: float
    pass_at_1: float  # NaN when not measured this round
    last_reward: float
    exchanges: int


def round_profile(
    host: ModelHost,
    m: ProfileInputs,
    history: Sequence[Mapping[str, float]],
    counts: np.ndarray,
    *,
    dp_epsilon: float | None = None,
    seed: int = 0,
) -> tuple[np.ndarray, float]:
    """The profile p_i of round ``m.t`` and the pass@1 it carries.

    ``history`` holds earlier rounds' ``{"loss", "pass1"}`` (the deltas compare with the
    last one). A round without a pass@k measurement carries the previous value forward.
    The DP noise (if any) is seeded by (seed, t), so a profile is reproducible.
    """
    from peerlm.agent.cpm.profile import AgentMetrics, build_profile

    prev = history[-1] if history else {"loss": m.val_loss, "pass1": m.pass_at_1}
    pass1 = m.pass_at_1
    if math.isnan(pass1):
        prev_pass = float(prev.get("pass1", 0.0))
        pass1 = 0.0 if math.isnan(prev_pass) else prev_pass
    prev_pass1 = float(prev["pass1"])
    metrics = AgentMetrics(
        pass_at_1=pass1,
        pass_at_5=0.0,
        val_loss=m.val_loss,
        prev_pass_at_1=pass1 if math.isnan(prev_pass1) else prev_pass1,
        prev_val_loss=float(prev["loss"]),
        trainable_share=host.trainable_share,
        trainable_parameters=host.trainable_parameters,
        last_reward=m.last_reward,
        exchanges=m.exchanges,
        round=m.t,
        total_rounds=m.total_rounds,
    )
    profile = build_profile(
        host.model_type,
        metrics,
        counts,
        dp_epsilon=dp_epsilon,
        rng=np.random.default_rng([seed, m.t]),
    )
    return profile, pass1


def category_counts(problems: Sequence[Problem]) -> np.ndarray:
    """Counts of ``problems`` per bank category (the profile's distribution features)."""
    from peerlm.agent.tasks.bank import CATEGORIES

    counts = np.zeros(len(CATEGORIES))
    for p in problems:
        if p.category in CATEGORIES:
            counts[CATEGORIES.index(p.category)] += 1
    return counts
