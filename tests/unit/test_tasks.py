"""The task bank, problem files, the client split, the transfer set, federation data, HumanEval."""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from peerlm.agent.eval.sandbox import run_many
from peerlm.agent.tasks.bank import CATEGORIES, TEMPLATES, choose_inputs, generate_bank, render
from peerlm.agent.tasks.dataset import (
    MAX_FIELD_BYTES,
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
from peerlm.agent.tasks.humaneval import HUMANEVAL_SIZE, load_humaneval
from peerlm.agent.tasks.world import DEFAULT_PRIVATE_CATEGORIES, WorldSpec
from typer.testing import CliRunner

from peerlm.app.cli_data import app as data_app

SAMPLES_PER_TEMPLATE = 3


def _identity(problem: Problem) -> tuple[str, str]:
    return problem.entry_point, problem.reference


# --------------------------------------------------------------------------------- bank


def test_categories_and_templates() -> None:
    assert len(CATEGORIES) == 12 and len(set(CATEGORIES)) == 12
    assert tuple(TEMPLATES) == CATEGORIES
    for category, templates in TEMPLATES.items():
        assert len(templates) >= 4, category
        assert len({t.key for t in templates}) == len(templates)
        assert all(t.category == category for t in templates)


@pytest.fixture(scope="module")
def template_samples() -> list[tuple[str, Problem]]:
    """SAMPLES_PER_TEMPLATE rendered problems from every template: (template key, problem)."""
    samples = []
    for category, templates in TEMPLATES.items():
        for template in templates:
            rng = random.Random(f"test/{template.key}")
            for i in range(SAMPLES_PER_TEMPLATE):
                spec = template.build(rng)
                problem = render(spec, choose_inputs(spec), f"t/{template.key}/{i}", category)
                samples.append((template.key, problem))
    return samples


def test_problem_shape(template_samples: list[tuple[str, Problem]]) -> None:
    for key, p in template_samples:
        assert p.prompt.startswith(f"def {p.entry_point}("), key
        assert p.prompt.endswith('    """\n    '), key  # the model continues the body
        assert p.prompt.count(">>> ") == 1, key  # one example
        body_lines = p.reference.rstrip("\n").split("\n")
        assert 1 <= len(body_lines) <= 6, key
        assert all(line.startswith("    ") for line in body_lines[1:]), key
        compile(p.prompt + p.reference, key, "exec")  # syntax only, nothing runs here
        asserts = [line for line in p.tests.splitlines() if line.strip()]
        assert 3 <= len(asserts) <= 5 and all(a.startswith("assert ") for a in asserts), key
        expected = {line.rsplit(" == ", 1)[1] for line in asserts}
        assert len(expected) >= 2, key  # a constant function cannot pass


@pytest.mark.slow
def test_every_template_reference_passes_and_a_wrong_body_fails(
    template_samples: list[tuple[str, Problem]],
) -> None:
    programs = [p.program(p.reference) for _, p in template_samples]
    # One wrong completion per template: a constant is never right (see test_problem_shape).
    wrong = [
        (key, p) for i, (key, p) in enumerate(template_samples) if i % SAMPLES_PER_TEMPLATE == 0
    ]
    programs += [p.program("return None\n") for _, p in wrong]
    results = run_many(programs, max_workers=2, timeout_s=10)
    n = len(template_samples)
    for (key, p), result in zip(template_samples, results[:n], strict=True):
        assert result.passed, (key, p.prompt + p.reference + p.tests, result.stderr_tail)
    for (key, _), result in zip(wrong, results[n:], strict=True):
        assert result.status == "failed", key


def test_bank_is_deterministic_distinct_and_large() -> None:
    bank = generate_bank(20, seed=7)
    assert bank == generate_bank(20, seed=7)
    assert bank != generate_bank(20, seed=8)
    assert len(bank) == 240
    assert Counter(p.category for p in bank) == dict.fromkeys(CATEGORIES, 20)
    ids = [p.task_id for p in bank]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"bank/[a-z_]+/\d{4}", i) for i in ids)
    assert ids[0] == "bank/string/0000"
    big = generate_bank(300, seed=0)  # "hundreds of distinct problems" per category
    assert len({_identity(p) for p in big}) == len(big) == 3600
    assert len({p.prompt for p in big}) == len(big)


def test_bank_refuses_impossible_sizes() -> None:
    with pytest.raises(ValueError, match="ran out of distinct problems"):
        generate_bank(5000, seed=0)
    with pytest.raises(ValueError):
        generate_bank(-1, seed=0)
    assert generate_bank(0, seed=0) == []


# ------------------------------------------------------------------------------ JSONL


def _problem(**overrides: str) -> Problem:
    fields = {
        "task_id": "x/1",
        "category": "string",
        "prompt": 'def f(s: str) -> str:\n    """Ünïcode ✓ prompt."""\n    ',
        "reference": "return s\n",
        "tests": "assert f('a') == 'a'\n",
        "entry_point": "f",
    }
    fields.update(overrides)
    return Problem(**fields)


def test_problem_json_round_trip(tmp_path: Path) -> None:
    bank = [*generate_bank(3, seed=1), _problem()]
    for p in bank:
        assert Problem.from_json(p.to_json()) == p
        assert Problem.from_dict(json.loads(p.to_json())) == p
    path = tmp_path / "sub" / "problems.jsonl"
    write_jsonl(path, bank)
    assert read_jsonl(path) == bank
    assert "Ünïcode ✓" in path.read_text(encoding="utf-8")  # UTF-8, not \u escapes
    write_jsonl(path, bank[:2])  # replaces atomically, leaves no temporary files
    assert read_jsonl(path) == bank[:2]
    assert sorted(f.name for f in path.parent.iterdir()) == ["problems.jsonl"]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"task_id": "a"}', "missing field"),
        (json.dumps({**_problem().to_dict(), "extra": "x"}), "unknown field"),
        (json.dumps({**_problem().to_dict(), "tests": 5}), "'tests' must be a string"),
        (json.dumps({**_problem().to_dict(), "entry_point": "not valid"}), "entry_point"),
        (json.dumps({**_problem().to_dict(), "task_id": ""}), "task_id"),
        (json.dumps({**_problem().to_dict(), "prompt": "x" * (MAX_FIELD_BYTES + 1)}), "limit"),
    ],
)
def test_malformed_jsonl_names_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(_problem().to_json() + "\n\n" + line + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=message) as err:
        read_jsonl(path)
    assert str(err.value).startswith(f"{path}:3: ")


def test_non_utf8_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"task_id": "\xe9"}\n')
    with pytest.raises(ValueError, match=r":1: not UTF-8"):
        read_jsonl(path)


def test_problem_validation_on_construction() -> None:
    with pytest.raises(TypeError):
        _problem(prompt=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="limit"):
        _problem(tests="é" * MAX_FIELD_BYTES)  # 2 bytes per character in UTF-8


# ----------------------------------------------------------------- partition and splits


def _skew(clients: list[list[Problem]], everything: list[Problem]) -> float:
    """Mean total-variation distance of client category mixes from the overall mix."""
    overall = category_histogram(everything)
    return float(np.mean([0.5 * np.abs(category_histogram(c) - overall).sum() for c in clients]))


def test_dirichlet_partition_is_disjoint_complete_and_deterministic() -> None:
    bank = generate_bank(40, seed=0)
    clients = dirichlet_partition(bank, 6, alpha=0.1, seed=3)
    flat = [p.task_id for c in clients for p in c]
    assert sorted(flat) == sorted(p.task_id for p in bank)  # covers all, no duplicates
    assert len(set(flat)) == len(flat)
    assert all(len(c) >= 8 for c in clients)
    assert clients == dirichlet_partition(bank, 6, alpha=0.1, seed=3)
    assert clients != dirichlet_partition(bank, 6, alpha=0.1, seed=4)


def test_small_alpha_skews_and_large_alpha_spreads() -> None:
    bank = generate_bank(50, seed=0)
    for seed in range(3):
        skewed = _skew(dirichlet_partition(bank, 4, alpha=0.1, seed=seed), bank)
        uniform = _skew(dirichlet_partition(bank, 4, alpha=100.0, seed=seed), bank)
        assert skewed > 0.4  # each client sees a few categories
        assert uniform < 0.1  # every client sees nearly the bank's mix


def test_partition_repair_gives_everyone_a_minimum() -> None:
    bank = generate_bank(10, seed=0)  # 120 problems
    for alpha in (0.001, 0.1):
        clients = dirichlet_partition(bank, 10, alpha=alpha, seed=1, min_per_client=10)
        assert [len(c) for c in clients] == [12] * 10 or min(len(c) for c in clients) >= 10
        assert sum(len(c) for c in clients) == 120
    with pytest.raises(ValueError, match="cannot give"):
        dirichlet_partition(bank, 20, min_per_client=7)
    with pytest.raises(ValueError):
        dirichlet_partition(bank, 3, alpha=0.0)


def test_split_validation() -> None:
    bank = generate_bank(5, seed=0)
    train, val = split_validation(bank, 0.2, seed=1)
    assert len(val) == 12 and len(train) == 48
    assert {p.task_id for p in train}.isdisjoint(p.task_id for p in val)
    assert (train, val) == split_validation(bank, 0.2, seed=1)
    assert split_validation(bank[:3], 0.01, seed=0)[1] != []  # at least one when n >= 2
    assert split_validation(bank, 0.0, seed=0) == (bank, [])
    with pytest.raises(ValueError):
        split_validation(bank, 1.0, seed=0)


# ------------------------------------------------------------- transfer set, histogram


def test_transfer_hash_is_canonical_stable_and_content_sensitive() -> None:
    prompts = ["def f():\n    ", "déf g():\n    "]
    expected = hashlib.sha256(
        json.dumps(prompts, ensure_ascii=False, separators=(",", ":")).encode()
    ).hexdigest()
    assert transfer_set_sha256(prompts) == expected
    assert transfer_set_sha256(list(prompts)) == expected
    assert transfer_set_sha256(prompts[::-1]) != expected  # order matters
    assert transfer_set_sha256([prompts[0], prompts[1] + " "]) != expected
    assert transfer_set_sha256([]) == hashlib.sha256(b"[]").hexdigest()
    bank = generate_bank(2, seed=0)
    assert transfer_set(bank) == [p.prompt for p in bank]


def test_category_histogram() -> None:
    bank = generate_bank(2, seed=0)
    hist = category_histogram(bank[:2] + bank[-1:])  # two "string", one "sequence"
    assert hist.shape == (12,) and hist.sum() == pytest.approx(1.0)
    assert hist[category_index("string")] == pytest.approx(2 / 3)
    assert hist[category_index("sequence")] == pytest.approx(1 / 3)
    assert category_index("string") == 0 and category_index("sequence") == 11
    assert not category_histogram([]).any()
    other = _problem(category="humaneval")
    with pytest.raises(ValueError, match="unknown category"):
        category_histogram([other])
    assert category_histogram([other, bank[0]], ignore_unknown=True)[0] == 1.0


# ----------------------------------------------------------------------- federation data


_SMALL = WorldSpec(
    per_private_category=30, per_public_category=12, test_per_category=3,
    transfer_per_private=6, transfer_per_public=2,
)  # fmt: skip


def test_build_federation_data(tmp_path: Path) -> None:
    out = tmp_path / "data"
    manifest = build_federation_data(out, 4, alpha=0.1, seed=5, world=_SMALL)
    test = read_jsonl(out / "test.jsonl")
    transfer = read_jsonl(out / "transfer.jsonl")
    clients = [
        (read_jsonl(out / f"clients/{i}/train.jsonl"), read_jsonl(out / f"clients/{i}/val.jsonl"))
        for i in range(4)
    ]
    assert len(test) == 36 and len(transfer) == 4 * 6 + 8 * 2
    assert Counter(p.category for p in test) == dict.fromkeys(CATEGORIES, 3)  # stratified
    # Every prefix of the transfer set covers the world in proportion (private: 3x public).
    head = Counter(p.category for p in transfer[:20])
    assert all(head[c] == 3 for c in _SMALL.private_categories), head
    assert all(head[c] == 1 for c in _SMALL.public_categories), head
    parts = [test, transfer] + [part for pair in clients for part in pair]
    ids = [p.task_id for part in parts for p in part]
    assert len(ids) == len(set(ids)) == 4 * 30 + 8 * 12  # disjoint and complete
    assert len({_identity(p) for part in parts for p in part}) == len(ids)
    assert manifest.client_sizes == tuple((len(t), len(v)) for t, v in clients)
    assert manifest.transfer_sha256 == transfer_set_sha256(transfer_set(transfer))
    assert read_manifest(out) == manifest
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk["categories"] == list(CATEGORIES) and on_disk["alpha"] == 0.1
    assert on_disk["sizes"]["clients"][0] == {
        "train": len(clients[0][0]),
        "val": len(clients[0][1]),
    }

    before = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    assert build_federation_data(out, 4, alpha=0.1, seed=5, world=_SMALL) == manifest
    after = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    assert after == before  # idempotent, byte for byte

    with pytest.raises(FileExistsError, match="overwrite"):
        build_federation_data(out, 2, seed=5, world=_SMALL)
    smaller = build_federation_data(out, 2, seed=5, world=_SMALL, overwrite=True)
    assert smaller.n_clients == 2
    assert sorted(d.name for d in (out / "clients").iterdir()) == ["0", "1"]  # no stale 2, 3


def test_default_world_is_complementary(tmp_path: Path) -> None:
    """One expert per private skill: a private category's data is at its expert only,
    public data is everywhere, and the slices partition the test set for every client."""
    manifest = build_federation_data(tmp_path, 4, seed=0)
    world = manifest.world
    assert world.private_categories == DEFAULT_PRIVATE_CATEGORIES
    assert world.skills == tuple((c,) for c in DEFAULT_PRIVATE_CATEGORIES)
    test = read_jsonl(tmp_path / "test.jsonl")
    assert len(test) == manifest.test_size == 20 * len(CATEGORIES)
    for i in range(4):
        held = read_jsonl(tmp_path / f"clients/{i}/train.jsonl")
        held += read_jsonl(tmp_path / f"clients/{i}/val.jsonl")
        private = {p.category for p in held if p.category in world.private_categories}
        assert private == set(world.own(i))
        assert {p.category for p in held} >= set(world.public_categories)
        own_count = sum(p.category in world.own(i) for p in held)
        assert own_count == 200 - 20 - 24  # the whole private pool of its skill
        slices = problem_slices(world, i, test)
        assert Counter(slices) == {"own": 20, "lacked": 60, "public": 160}
        assert world.lacked(i) == tuple(
            c for c in world.private_categories if c not in world.own(i)
        )
    assert [world.slice_of(0, c) for c in ("dict", "format", "string")] == [
        "own", "lacked", "public"
    ]  # fmt: skip
    with pytest.raises(ValueError, match="not in this world"):
        world.slice_of(0, "humaneval")


def test_world_layouts(tmp_path: Path) -> None:
    overlap = replace(_SMALL, experts_per_skill=2, unskilled_clients=1)
    world = build_federation_data(tmp_path / "o", 4, seed=1, world=overlap).world
    # Three skilled clients, each private skill at two consecutive ones; the last has none.
    assert world.skills == (
        ("dict", "boolean", "sequence"),
        ("dict", "format", "sequence"),
        ("format", "boolean"),
        (),
    )
    assert all(len(world.experts(c)) == 2 for c in world.private_categories)
    assert world.lacked(3) == world.private_categories
    skewed = replace(_SMALL, layout="dirichlet", skill_share=0.25)
    m = build_federation_data(tmp_path / "d", 4, alpha=0.05, seed=2, world=skewed)
    assert all(1 <= len(m.world.experts(c)) <= 4 for c in m.world.private_categories)
    held = [
        Counter(p.category for p in read_jsonl(tmp_path / f"d/clients/{i}/train.jsonl"))
        + Counter(p.category for p in read_jsonl(tmp_path / f"d/clients/{i}/val.jsonl"))
        for i in range(4)
    ]
    for c in m.world.private_categories:
        pool = sum(h[c] for h in held)
        assert {i for i in range(4) if held[i][c] >= 0.25 * pool} == set(m.world.experts(c))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"private_categories": ("cooking",)}, "unknown private"),
        ({"private_categories": ("dict", "dict")}, "must not repeat"),
        ({"layout": "ring"}, "layout"),
        ({"per_private_category": 40, "test_per_category": 20}, "leaves no private data"),
        ({"experts_per_skill": 0}, "at least 1"),
        ({"skill_share": 0.0}, "skill_share"),
    ],
)
def test_world_spec_rejects_bad_fields(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WorldSpec.from_dict(fields)


def test_world_refuses_impossible_layouts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no skilled client"):
        build_federation_data(tmp_path, 2, world=replace(_SMALL, unskilled_clients=2))
    with pytest.raises(ValueError, match="exceeds"):
        build_federation_data(tmp_path, 2, world=replace(_SMALL, experts_per_skill=3))
    with pytest.raises(ValueError, match="unknown world field"):
        WorldSpec.from_dict({"experts": 1})
    assert not (tmp_path / "manifest.json").exists()


def test_cli_build_and_show(tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "fed"
    args = ["build", "--dir", str(out), "--clients", "3", "--seed", "2", "--per-private", "60",
            "--per-public", "40", "--private", "dict,format"]  # fmt: skip
    result = runner.invoke(data_app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    manifest = json.loads(result.output)
    assert manifest["n_clients"] == 3 and manifest["seed"] == 2
    assert manifest["world"]["skills"] == [["dict"], ["format"], []]
    shown = runner.invoke(data_app, ["show", "--dir", str(out), "--json"])
    assert shown.exit_code == 0, shown.output
    summary = json.loads(shown.output)
    assert set(summary["integrity"].values()) == {"ok"}
    assert [c["client"] for c in summary["clients"]] == [0, 1, 2]
    table = runner.invoke(data_app, ["show", "--dir", str(out)])
    assert table.exit_code == 0 and "files match the manifest" in table.output

    (out / "test.jsonl").write_text("")
    tampered = runner.invoke(data_app, ["show", "--dir", str(out)])
    assert tampered.exit_code == 1 and "test.jsonl: modified" in tampered.output
    refused = runner.invoke(data_app, ["build", "--dir", str(out), "--clients", "2"])
    assert refused.exit_code == 2 and "--force" in refused.output
    missing = runner.invoke(data_app, ["show", "--dir", str(tmp_path / "nope")])
    assert missing.exit_code == 2


# ---------------------------------------------------------------------------- HumanEval


def test_humaneval_loads_and_canonical_solutions_pass() -> None:
    problems = load_humaneval()
    assert len(problems) == HUMANEVAL_SIZE == 164
    assert [p.task_id for p in problems[:2]] == ["HumanEval/0", "HumanEval/1"]
    assert all(p.category == "humaneval" for p in problems)
    assert all(p.tests.endswith(f"\ncheck({p.entry_point})\n") for p in problems)
    chosen = [problems[i] for i in (0, 2, 32, 53, 162)]  # 162 imports hashlib
    results = run_many([p.program(p.reference) for p in chosen], timeout_s=10)
    assert all(r.passed for r in results), [r.stderr_tail for r in results]
    wrong = run_many([p.program("    return None\n") for p in chosen[:2]])
    assert [r.status for r in wrong] == ["failed", "failed"]


def test_docs_name_every_category_and_template() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "tasks.md").read_text()
    for index, category in enumerate(CATEGORIES):
        row = next(line for line in doc.splitlines() if line.startswith(f"| {index} | "))
        assert f"`{category}`" in row
        for template in TEMPLATES[category]:
            assert f"`{template.key}`" in row, template.key


def test_public_corpus_is_disjoint_from_federation_data(tmp_path: Path) -> None:
    """Pre-training saw the public problems; no federation part may contain one of them,
    compared by task text (function, prompt, whole function), for several seeds."""
    from peerlm.agent.tasks.bank import PUBLIC_PER_CATEGORY, function_key, public_problems

    public = public_problems()
    assert len(public) == PUBLIC_PER_CATEGORY * len(CATEGORIES)
    assert public_problems(4) == [p for p in public if int(p.task_id[-4:]) < 4]  # a prefix
    assert all(p.task_id.startswith("public/") for p in public)
    keys = {function_key(p) for p in public}
    prompts = {p.prompt for p in public}
    texts = {p.prompt + p.reference for p in public}
    for seed in (0, 1, 7):
        build_federation_data(tmp_path / str(seed), 4, seed=seed)
        parts = [tmp_path / str(seed) / "test.jsonl", tmp_path / str(seed) / "transfer.jsonl"]
        parts += sorted((tmp_path / str(seed) / "clients").glob("*/*.jsonl"))
        problems = [p for part in parts for p in read_jsonl(part)]
        assert len(problems) == 4 * 200 + 8 * 60
        assert not {function_key(p) for p in problems} & keys
        assert not {p.prompt for p in problems} & prompts
        assert not {p.prompt + p.reference for p in problems} & texts
    # Without the exclusion the seeds do collide: the exclusion is what keeps them apart.
    plain = generate_bank(50, seed=0)
    assert {function_key(p) for p in plain} & keys


def test_public_corpus_size_is_bounded() -> None:
    from peerlm.agent.tasks.bank import PUBLIC_PER_CATEGORY, public_problems

    with pytest.raises(ValueError, match="public problems"):
        public_problems(PUBLIC_PER_CATEGORY + 1)


def test_public_corpus_leaves_hidden_categories_out() -> None:
    from peerlm.agent.tasks.bank import public_problems

    hidden = public_problems(3, hidden=DEFAULT_PRIVATE_CATEGORIES)
    assert {p.category for p in hidden} == set(CATEGORIES) - set(DEFAULT_PRIVATE_CATEGORIES)
    assert hidden == [p for p in public_problems(3) if p.category not in DEFAULT_PRIVATE_CATEGORIES]
    with pytest.raises(ValueError, match="unknown hidden"):
        public_problems(3, hidden=("cooking",))
