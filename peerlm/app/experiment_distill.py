"""The distillation exchanges of the experiment: a teacher's package of X_u answers and a
student's AKD integration of it (the agent's own :func:`~peerlm.agent.integrate_package`),
the reward's examples, and the two strategies built on them beyond pairing: Central-KD
and Oracle pairing.

Central-KD with heterogeneous tokenizers. FedMD's server averages the clients' logits,
which is undefined across vocabularies. The probability of a *string* is not: here the
ensemble teacher is the mixture ``p_bar(y | x) = (1/N) sum_i p_i(y | x)`` of the clients'
sequence distributions, each client scoring a string under its own canonical tokenisation
(EOS included). Every client sends its guardrailed greedy completion of each transfer
prompt; every client scores every candidate (the scores are what is averaged, as FedMD
averages logits); the server broadcasts, per prompt, the candidate with the highest
ensemble log-likelihood per UTF-8 byte, ``log p_bar(y | x) / max(1, bytes(y))`` (per byte,
or the shortest candidate would always win). Each client then runs AKD on this one
consensus package, with the same alpha schedule as the P2P strategies.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from peerlm.app.experiment_eval import probe_loss
from peerlm.app.experiment_world import Client, World, round_config

if TYPE_CHECKING:
    from peerlm.agent import AnsweredProbe, Integration, ModelHost

__all__ = [
    "PACKAGE_TIME",
    "central_kd",
    "consensus_texts",
    "exchange_record",
    "integrate",
    "oracle_exchange",
    "reward_examples",
    "reward_scope",
    "teacher_answers",
    "teacher_package",
    "teacher_package_bytes",
]

#: The time stamp of every package the experiment builds: a fixed one, of a real clock's
#: length, so that a package's measured bytes (its KB and the probe reward's penalty) do not
#: depend on the digits of ``time.time()``'s repr (they made two runs of a seed differ).
PACKAGE_TIME = 1_800_000_000.123456


def reward_examples(world: World, student: Client, i: int) -> list[tuple[str, str]]:
    """Where student ``i`` measures L_pre and L_post: its validation data (Eq. 3 as in the
    paper), the public probe set, or the probe problems of its lacked categories
    (``probe_scope``; our choices, :mod:`peerlm.app.experiment`). Under ``answered`` the
    whole probe: where the gate judges and a merge is measured; an AKD package's reward is
    measured on :func:`reward_scope`'s part of it."""
    if world.plan.reward != "probe":
        return student.val_examples
    if world.plan.probe_scope in ("all", "answered", "routed"):
        return world.probe_examples
    lacked = world.slices[i].lacked
    # A client that lacks nothing (every private skill its own) has no such probe: the
    # whole probe then, so that it still measures what an exchange did.
    return [(p.prompt, p.reference) for p in world.probe if p.category in lacked] or (
        world.probe_examples
    )


def reward_scope(world: World, student: Client) -> AnsweredProbe | None:
    """With ``probe_scope: answered``, the probe problems of the categories a package answers
    (the agent's ``reward_scope``); with ``routed``, of those the ones ``student``'s router
    sends to its peer slot; None otherwise."""
    from peerlm.agent import AnsweredProbe

    if world.plan.reward != "probe" or world.plan.probe_scope not in ("answered", "routed"):
        return None
    answered = AnsweredProbe.of(
        ((p.prompt, p.reference, p.category) for p in world.probe),
        world.transfer,
        world.transfer_categories,
    )
    if world.plan.probe_scope == "routed":
        return answered.routed(student.router.to_peer if student.router is not None else None)
    return answered


def integrate(
    world: World,
    student: Client,
    package: Any,
    kilobytes: float,
    seed: int,
    i: int,
    t: int,
) -> Integration:
    """``student`` distils ``package`` by AKD where its integrations write (the peer slot,
    with its rehearsal, under ``separate``; :meth:`Client.integrate`), and counts the steps
    when it learnt anything: the Oracle's trials and central KD's lessons (Random-P2P's and
    KNEXA-FL's go through the agent's protocol, :mod:`peerlm.app.experiment_agent`)."""
    from peerlm.agent import integrate_package, learnt_anything

    result: Integration = student.integrate(
        world.plan,
        f"akd-{package.__class__.__name__}",
        integrate_package,
        student.host,
        package,
        kilobytes=kilobytes,
        local_examples=student.train_examples,
        val_examples=reward_examples(world, student, i),
        transfer_prompts=world.transfer,
        config=round_config(world.plan, seed, i, integration=True).integrating(),
        t=t,
        learns=student.slot_learns(world.plan),
        reward_scope=reward_scope(world, student),
    )
    if learnt_anything(result):
        student.peer_steps += world.plan.integration_steps
    return result


def teacher_answers(world: World, teacher: Client, t: int) -> tuple[list[int], list[str]]:
    """What ``teacher`` answers of X_u (:meth:`World.teachable`) and its greedy answers;
    with ``teach_self_check`` only those that pass their prompt's example, as the agent's
    teacher step keeps them (:func:`~peerlm.agent.exchange.self_check.self_check`).

    Generated once a round: a teacher of several students (``pairing: per_student``)
    sends each the answers of its first teaching step of round ``t`` (greedy decoding of
    the own adapter, which no exchange writes under ``separate``)."""
    if teacher.answered is None or teacher.answered[0] != t:
        teacher.answered = (t, _generate_answers(world, teacher, t))
    return teacher.answered[1]


def _generate_answers(world: World, teacher: Client, t: int) -> tuple[list[int], list[str]]:
    from peerlm.agent import self_check, teacher_completions

    chosen = world.teachable(teacher, t)
    prompts = [world.transfer[k] for k in chosen]
    completions = teacher_completions(teacher.host, prompts, world.plan.max_new_tokens)
    if not world.plan.teach_self_check:
        return chosen, completions
    checked = self_check(prompts, completions, max_workers=1)
    teacher.self_checked += checked.checked
    teacher.self_check_failed += checked.failed
    return [chosen[i] for i in checked.kept], [completions[i] for i in checked.kept]


def teacher_package_bytes(
    world: World,
    teacher: Client,
    predictions: tuple[list[int], list[str]],
    directive: str,
    mode: Literal["text", "logits"] = "text",
) -> bytes:
    """The teacher's package of ``predictions`` (:func:`teacher_answers`) as the wire
    carries it: text, or top-k logits for a student of the teacher's tokenizer."""
    from peerlm.agent import build_package

    chosen, completions = predictions
    return build_package(
        teacher.host,
        mode=mode,
        prompts=[world.transfer[k] for k in chosen],
        prompt_ids=[str(k) for k in chosen],
        completions=completions,
        teacher=teacher.name,
        directive_id=directive,
        transfer_sha256=world.transfer_sha256,
        guardrail=teacher.guardrail,
        created_at=PACKAGE_TIME,
    )


def teacher_package(
    world: World,
    teacher: Client,
    predictions: tuple[list[int], list[str]],
    directive: str,
) -> tuple[Any, float]:
    """The teacher's text package (:func:`teacher_package_bytes`) decoded as a student
    decodes it; (package, KB). For the strategies that are no protocol of the catalogue
    (Oracle pairing's trials)."""
    from peerlm.agent import decode_package

    data = teacher_package_bytes(world, teacher, predictions, directive)
    package = decode_package(
        data,
        expect_transfer_sha256=world.transfer_sha256,
        expect_directive_id=directive,
        expect_teacher=teacher.name,
    )
    return package, len(data) / 1024


def exchange_record(
    teacher: str, student: str, result: Integration, normalised: float | None
) -> dict[str, Any]:
    return {
        "teacher": teacher,
        "student": student,
        "mode": result.mode,
        "alpha_kd": round(result.alpha_kd, 4),
        "loss_pre": round(result.loss_pre, 5),
        "loss_post": round(result.loss_post, 5),
        "kilobytes": round(result.kilobytes, 2),
        "reward": round(result.reward, 6),
        "normalised_reward": None if normalised is None else round(normalised, 5),
        # 0: a package the peer slot learnt nothing of (not a lesson: experiment_ceiling).
        "steps": result.stats.steps,
    }


def consensus_texts(
    hosts: Sequence[ModelHost], prompts: Sequence[str], candidates: Sequence[Sequence[str]]
) -> list[str]:
    """Central-KD's ensemble teacher (module docstring): per prompt, the candidate with the
    highest mixture log-likelihood per UTF-8 byte under all ``hosts``.

    ``candidates[i]`` are client i's completions of ``prompts``; empty ones are not
    candidates (a prompt nobody answered gets ``""``).
    """
    out: list[str] = []
    for j, prompt in enumerate(prompts):
        options = list(dict.fromkeys(c[j] for c in candidates if c[j].strip()))
        if not options:
            out.append("")
            continue
        pairs = [(prompt, option) for option in options]
        scores = np.array([h.sequence_logprobs(pairs) for h in hosts])  # [clients, options]
        mixture = np.logaddexp.reduce(scores, axis=0) - math.log(len(hosts))
        per_byte = mixture / np.array([max(1, len(o.encode())) for o in options])
        out.append(options[int(np.argmax(per_byte))])
    return out


def central_kd(world: World, clients: list[Client], seed: int, t: int) -> list[dict[str, Any]]:
    from peerlm.agent import Guardrail, build_text_package, decode_package

    completions = []
    for c in clients:
        # What a client does not answer (``teach_scope``) is no candidate: "".
        chosen, texts = teacher_answers(world, c, t)
        vetted = c.guardrail.filter_many(texts, [world.transfer[k] for k in chosen])
        answers = [""] * len(world.transfer)
        for k, r in zip(chosen, vetted, strict=True):
            answers[k] = r.text
        completions.append(answers)
    consensus = consensus_texts([c.host for c in clients], world.transfer, completions)
    data = build_text_package(
        prompts=world.transfer,
        completions=consensus,
        teacher="central",
        directive_id=f"central-{t}",
        transfer_sha256=world.transfer_sha256,
        family="other",
        guardrail=Guardrail([]),  # the clients vetted their texts before sending
        created_at=PACKAGE_TIME,
    )
    package = decode_package(data, expect_transfer_sha256=world.transfer_sha256)
    records = []
    for i, student in enumerate(clients):
        result = integrate(world, student, package, len(data) / 1024, seed, i, t)
        student.rewards.append(result.reward)
        student.exchanges += 1
        records.append(exchange_record("central", student.name, result, None))
    return records


def oracle_exchange(
    world: World, clients: list[Client], seed: int, t: int
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Try every ordered pair, keep the pairs of largest true probe gain.

    The gain of (teacher, student) is the student's probe-loss drop from integrating the
    teacher's package (whatever ``reward`` the plan uses). Pairs are chosen greedily by
    gain under the plan's ``pairing``, as the matchmakers do (:func:`_oracle_keeps`); the
    chosen students keep their trial adapter, the others are restored (a student kept
    with several teachers under ``teachers_per_student`` learns the further ones' lessons
    again on top). Returns the records and every pair's gain (``"teacher>student"``), for
    the CPM's figures.
    """

    predictions = {c.name: teacher_answers(world, c, t) for c in clients}
    probe = world.probe_examples
    trials: dict[tuple[int, int], tuple[float, Any, Integration, float]] = {}
    separate = world.plan.integration == "separate"
    for si, student in enumerate(clients):
        # The trials start from what integrations write to (the peer slot, or the adapter),
        # and the gain is measured on the model that answers (routed, or the adapter).
        before_slot = student.slot.saved()
        before = {k: v.clone() for k, v in student.host.adapter_state().items()}
        pre = probe_loss(student, probe)
        for ti, teacher in enumerate(clients):
            if ti == si:
                continue
            directive = f"oracle-{t}-{teacher.name}-{student.name}"
            package, kb = teacher_package(world, teacher, predictions[teacher.name], directive)
            result = integrate(world, student, package, kb, seed, si, t)
            post = probe_loss(student, probe)
            after: Any
            if separate:
                # A package the slot learns nothing of left it as it was, uncounted.
                after = student.slot.saved()
                student.slot.restore(before_slot)
            else:
                after = {k: v.clone() for k, v in student.host.adapter_state().items()}
                student.host.load_adapter_state(before)
            trials[(ti, si)] = (pre - post, after, result, kb)
    records: list[dict[str, Any]] = []
    # Kept best gain first, so a student's first kept trial is its best teacher's: its
    # trial state is taken as it is. Under teachers_per_student > 1 every further teacher's
    # lesson (its trial started from the round's state, like the first's) is integrated
    # again on top of the lessons kept before it, as a student of several teachers learns.
    learnt: set[int] = set()
    for (ti, si), (gain, after, result, _kb) in _oracle_keeps(world.plan, len(clients), trials):
        student = clients[si]
        if si in learnt:
            teacher = clients[ti]
            directive = f"oracle-{t}-{teacher.name}-{student.name}-kept"
            package, kb = teacher_package(world, teacher, predictions[teacher.name], directive)
            result = integrate(world, student, package, kb, seed, si, t)
        elif separate:
            student.slot.restore(after)
        else:
            student.host.load_adapter_state(after)
        learnt.add(si)
        student.rewards.append(result.reward)
        student.exchanges += 1
        records.append(
            {
                **exchange_record(clients[ti].name, student.name, result, None),
                "probe_gain": round(gain, 6),
            }
        )
    gains = {
        f"{clients[ti].name}>{clients[si].name}": round(g[0], 6) for (ti, si), g in trials.items()
    }
    return records, gains


def _oracle_keeps(
    plan: Any, n: int, trials: Mapping[tuple[int, int], tuple[float, Any, Any, float]]
) -> list[tuple[tuple[int, int], tuple[float, Any, Any, float]]]:
    """The trials the Oracle keeps, by the walk of the plan's ``pairing``: largest gain
    first, disjoint pairs (at most N/2), or under ``per_student`` each student's best
    ``teachers_per_student`` teachers within ``teacher_capacity``
    (:func:`peerlm.services.cpm.matching`'s walks)."""
    from peerlm.services.cpm import greedy_disjoint_sequential, greedy_students

    walk = sorted(trials.items(), key=lambda kv: (-kv[1][0], kv[0]))
    senders = np.asarray([ti for (ti, _), _ in walk], dtype=np.intp)
    receivers = np.asarray([si for (_, si), _ in walk], dtype=np.intp)
    if plan.pairing == "per_student":
        capacity = n if plan.teacher_capacity is None else plan.teacher_capacity
        served, load = np.zeros(n, dtype=np.intp), np.zeros(n, dtype=np.intp)
        k = plan.lessons_per_student
        kept = greedy_students(senders, receivers, n * k, served, load, capacity, k)
    else:
        order = np.arange(len(walk), dtype=np.intp)
        kept = greedy_disjoint_sequential(senders, receivers, order, n // 2, n)
    return [walk[k] for k in kept]
