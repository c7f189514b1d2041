"""The bundled code-generation task family: 12 categories of small, templated problems.

The problems are meant for tiny language models (a few million parameters trained for
minutes on a CPU), so every template produces a short, stylistically regular body (1 to 6
lines) under a one-line description and one example. Templates are parameterised by
constants, operators, labels and function names; a seed draws hundreds of distinct
problems per category. The fixed order of :data:`CATEGORIES` is the index of the 12-dim
category histogram in agent profiles.

Expected test outputs come from a plain Python *oracle* written beside each body (never
from executing generated text in this process); the unit tests run every template's
reference against its tests in the sandbox, which keeps the two in agreement.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from peerlm.agent.tasks.dataset import Problem

__all__ = [
    "CATEGORIES",
    "PROBE_SEED_OFFSET",
    "PUBLIC_PER_CATEGORY",
    "PUBLIC_SEED",
    "TEMPLATES",
    "Spec",
    "Template",
    "choose_inputs",
    "function_key",
    "generate_bank",
    "probe_problems",
    "public_problems",
    "render",
    "render_function",
]

#: Category names; their order is the category-histogram index.
CATEGORIES: tuple[str, ...] = (
    "string",
    "arithmetic",
    "list",
    "conditional",
    "loop",
    "dict",
    "search",
    "number_theory",
    "recursion",
    "format",
    "boolean",
    "sequence",
)

#: Seed of the *public* problems (the tiny models' pre-training corpus, not any
#: federation's data). Federation data never holds one of them (:func:`generate_bank`'s
#: ``exclude``), whatever its own seed, so pre-training cannot have seen a private,
#: validation, transfer or test problem.
PUBLIC_SEED = 1_000_003
#: Public problems per category; smaller public corpora are prefixes of this one.
PUBLIC_PER_CATEGORY = 150

_N_TESTS = 4  # asserts per problem; the first input is also the docstring example
_MIN_TESTS = 3
_MAX_TRIES = 64  # draws without a new problem before a template counts as exhausted
_LETTERS = "abcdeilmnorstu"

Args = tuple[object, ...]
_Variant = tuple[str, str, Callable[..., object]]  # (body, description, oracle)
_T = TypeVar("_T")
_K = TypeVar("_K")


@dataclass(frozen=True)
class Spec:
    """One drawn problem before rendering: signature, description, body, oracle, inputs."""

    entry_point: str
    params: str  # e.g. "xs: list[int]"
    returns: str  # e.g. "int"
    doc: str
    body: str  # unindented lines joined by "\n"
    oracle: Callable[..., object]
    sample: Callable[[], Args]  # draws one argument tuple (from the template's rng)


@dataclass(frozen=True)
class Template:
    """A parameterised problem family: ``build(rng)`` draws one :class:`Spec`."""

    category: str
    key: str
    build: Callable[[random.Random], Spec]


def choose_inputs(spec: Spec, count: int = _N_TESTS) -> tuple[Args, ...]:
    """Up to ``count`` distinct argument tuples whose outputs are not all equal.

    The last slot is kept for an input with a second distinct output, so a function that
    returns a constant cannot pass the tests; fewer inputs come back only when
    ``spec.sample`` cannot supply them.
    """
    picked: list[Args] = []
    seen: set[str] = set()
    outputs: set[str] = set()
    for _ in range(100 * count):
        args = spec.sample()
        key = _lit(args)
        if key in seen:
            continue
        seen.add(key)
        output = _lit(spec.oracle(*args))
        if len(picked) == count - 1 and outputs == {output}:
            continue
        picked.append(args)
        outputs.add(output)
        if len(picked) == count:
            break
    return tuple(picked)


def render(spec: Spec, inputs: Sequence[Args], task_id: str, category: str) -> Problem:
    """Turn a spec and its test inputs (the first is the docstring example) into a Problem."""
    from peerlm.agent.tasks.dataset import Problem  # dataset imports this module

    name = spec.entry_point
    prompt = _prompt(name, spec.params, spec.returns, spec.doc, inputs[0], spec.oracle)
    reference = _reference(spec.body)
    tests = "".join(
        f"assert {_call(name, args)} == {_lit(spec.oracle(*args))}\n" for args in inputs
    )
    return Problem(
        task_id=task_id,
        category=category,
        prompt=prompt,
        reference=reference,
        tests=tests,
        entry_point=name,
    )


def render_function(
    name: str,
    params: str,
    returns: str,
    doc: str,
    body: str,
    oracle: Callable[..., object],
    example: Args,
) -> str:
    """A complete function in the bank's style (prompt, then body), as pre-training text."""
    return _prompt(name, params, returns, doc, example, oracle) + _reference(body)


def _prompt(
    name: str, params: str, returns: str, doc: str, example: Args, oracle: Callable[..., object]
) -> str:
    return (
        f"def {name}({params}) -> {returns}:\n"
        f'    """{doc}\n'
        "\n"
        f"    >>> {_call(name, example)}\n"
        f"    {_lit(oracle(*example))}\n"
        '    """\n'
        "    "
    )


def _reference(body: str) -> str:
    first, *rest = body.split("\n")
    return first + "\n" + "".join(f"    {line}\n" for line in rest)


def function_key(problem: Problem) -> tuple[str, str]:
    """What makes two problems the same function: its name and its body (the reference).

    Two problems with the same key differ at most in their docstring example and tests.
    """
    return (problem.entry_point, problem.reference)


def generate_bank(
    n_per_category: int | Mapping[str, int],
    seed: int,
    *,
    exclude: Collection[tuple[str, str]] = (),
) -> list[Problem]:
    """``n_per_category`` distinct problems for each category, deterministic for a seed.

    Templates take turns within a category; a problem is new when its function (name and
    body) is, so no function appears twice with different examples. Functions whose
    :func:`function_key` is in ``exclude`` are skipped as if already drawn (the federation
    data exclude the public pre-training problems this way). Task ids are
    ``bank/<category>/<NNNN>``. Raises ``ValueError`` when a category's templates cannot
    supply that many distinct problems (a few hundred per category are available).
    ``n_per_category`` may be a mapping from category to count (missing: none); a
    category's problems for a smaller count are a prefix of those for a larger one.
    """
    counts = (
        {c: n_per_category.get(c, 0) for c in CATEGORIES}
        if isinstance(n_per_category, Mapping)
        else dict.fromkeys(CATEGORIES, n_per_category)
    )
    for category, count in counts.items():
        if count < 0:
            raise ValueError(f"n_per_category must not be negative, got {count} for {category}")
    excluded = frozenset(exclude)
    problems: list[Problem] = []
    for category in CATEGORIES:
        problems.extend(_generate_category(category, counts[category], seed, excluded))
    return problems


#: Added to a world's seed for its probe set, so the probe does not replay the data's draws.
PROBE_SEED_OFFSET = 7_777_777


def probe_problems(
    per_category: int, seed: int, taken: Iterable[Problem], categories: Collection[str]
) -> list[Problem]:
    """A labelled public *probe set*: ``per_category`` fresh problems of each of
    ``categories``, none of whose functions is in ``taken`` (a federation's data) or in the
    pre-training corpus. Where a student measures Eq. 3's losses when its reward is the
    probe's (docs/experiment.md, "The reward"); deterministic for a world ``seed``."""
    exclude = {function_key(p) for p in public_problems()} | {function_key(p) for p in taken}
    problems = generate_bank(per_category, seed + PROBE_SEED_OFFSET, exclude=exclude)
    return [p for p in problems if p.category in categories]


def public_problems(
    n_per_category: int = PUBLIC_PER_CATEGORY, *, hidden: Collection[str] = ()
) -> list[Problem]:
    """The public, bank-style problems of the models' pre-training corpus (:data:`PUBLIC_SEED`).

    Per category, a smaller ``n_per_category`` gives a prefix of a larger one, so every
    public corpus is inside the default one that federation data exclude. Task ids are
    ``public/<category>/<NNNN>``. Categories in ``hidden`` (a world's private categories)
    are left out: a model pre-trained on the result has never seen them.
    """
    unknown = sorted(set(hidden) - set(CATEGORIES))
    if unknown:
        raise ValueError(f"unknown hidden categories: {', '.join(unknown)}")
    if n_per_category > PUBLIC_PER_CATEGORY:
        raise ValueError(
            f"at most {PUBLIC_PER_CATEGORY} public problems per category (federation data "
            "exclude exactly those)"
        )
    return [
        replace(p, task_id="public/" + p.task_id.removeprefix("bank/"))
        for p in generate_bank(n_per_category, PUBLIC_SEED)
        if p.category not in hidden
    ]


def _generate_category(
    category: str, n: int, seed: int, exclude: frozenset[tuple[str, str]] = frozenset()
) -> list[Problem]:
    # A string seed is hashed with SHA-512 by random.seed: stable across runs and versions.
    rng = random.Random(f"peerlm-bank/{seed}/{category}")
    templates = TEMPLATES[category]
    seen: set[tuple[str, str]] = set()
    exhausted: set[str] = set()
    problems: list[Problem] = []
    turn = 0
    while len(problems) < n:
        if len(exhausted) == len(templates):
            raise ValueError(
                f"category {category!r} ran out of distinct problems after {len(problems)}"
            )
        template = templates[turn % len(templates)]
        turn += 1
        if template.key in exhausted:
            continue
        for _ in range(_MAX_TRIES):
            spec = template.build(rng)
            identity = (spec.entry_point, spec.body)
            if identity in seen or (spec.entry_point, _reference(spec.body)) in exclude:
                continue
            inputs = choose_inputs(spec)
            if not _discriminating(spec, inputs):
                continue
            seen.add(identity)
            task_id = f"bank/{category}/{len(problems):04d}"
            problems.append(render(spec, inputs, task_id, category))
            break
        else:
            exhausted.add(template.key)
    return problems


def _discriminating(spec: Spec, inputs: Sequence[Args]) -> bool:
    """At least 3 tests, and not all with the same expected output."""
    return len(inputs) >= _MIN_TESTS and len({_lit(spec.oracle(*a)) for a in inputs}) >= 2


# ----------------------------------------------------------------------------- helpers


def _lit(value: object) -> str:
    """A Python literal with double-quoted strings (the style the bodies use)."""
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_lit(v) for v in value) + "]"
    if isinstance(value, tuple):
        inner = ", ".join(_lit(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_lit(k)}: {_lit(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _call(name: str, args: Args) -> str:
    return f"{name}({', '.join(_lit(a) for a in args)})"


def _word(rng: random.Random, lo: int = 3, hi: int = 7) -> str:
    return "".join(rng.choice(_LETTERS) for _ in range(rng.randint(lo, hi)))


def _words(rng: random.Random, lo: int = 2, hi: int = 5) -> list[str]:
    return [_word(rng) for _ in range(rng.randint(lo, hi))]


def _ints(rng: random.Random, lo: int = -9, hi: int = 20, min_len: int = 3,
          max_len: int = 6) -> list[int]:  # fmt: skip
    return [rng.randint(lo, hi) for _ in range(rng.randint(min_len, max_len))]


def _with_letter(rng: random.Random, letter: str, times: int) -> str:
    chars = list(_word(rng))
    for _ in range(times):
        chars.insert(rng.randint(0, len(chars)), letter)
    return "".join(chars)


def _str_dict(rng: random.Random, lo: int = -9, hi: int = 20) -> dict[str, int]:
    return {_word(rng, 2, 5): rng.randint(lo, hi) for _ in range(rng.randint(2, 4))}


_ARITH: Mapping[str, tuple[str, Callable[[int, int], int]]] = MappingProxyType(
    {
        "+": ("plus", lambda a, b: a + b),
        "-": ("minus", lambda a, b: a - b),
        "*": ("times", lambda a, b: a * b),
        "//": ("floor-divided by", lambda a, b: a // b),
        "%": ("modulo", lambda a, b: a % b),
    }
)
_CMP: Mapping[str, tuple[str, Callable[[int, int], bool]]] = MappingProxyType(
    {
        ">": ("greater than", lambda a, b: a > b),
        "<": ("less than", lambda a, b: a < b),
        ">=": ("at least", lambda a, b: a >= b),
        "<=": ("at most", lambda a, b: a <= b),
        "==": ("equal to", lambda a, b: a == b),
        "!=": ("not equal to", lambda a, b: a != b),
    }
)


def _op(rng: random.Random, ops: str) -> tuple[str, str, Callable[[int, int], int]]:
    op = rng.choice(ops.split())
    word, fn = _ARITH[op]
    return op, word, fn


def _cmp(rng: random.Random, ops: str) -> tuple[str, str, Callable[[int, int], bool]]:
    op = rng.choice(ops.split())
    word, fn = _CMP[op]
    return op, word, fn


def _name(rng: random.Random, *names: str) -> str:
    return rng.choice(names)


# ------------------------------------------------------------------------------ string


def _string_repeat(rng: random.Random) -> Spec:
    k = rng.randint(2, 4)
    sep = rng.choice(["", "-", " ", "+", ",", "|"])
    doc = f"Return s repeated {k} times" + (f", joined by {_lit(sep)}." if sep else ".")
    return Spec(
        _name(rng, "repeat_text", "echo_word", "duplicate", "stamp"),
        "s: str",
        "str",
        doc,
        f"return {_lit(sep)}.join([s] * {k})",
        lambda s: sep.join([s] * k),
        lambda: (_word(rng),),
    )


def _string_wrap(rng: random.Random) -> Spec:
    tokens = ["<", ">", "[", "]", "*", "#", "_", "~", "!", "="]
    pre, suf = rng.choice(tokens), rng.choice(tokens)
    return Spec(
        _name(rng, "wrap", "decorate", "frame_text", "surround"),
        "s: str",
        "str",
        f"Return s with {_lit(pre)} in front and {_lit(suf)} at the end.",
        f"return {_lit(pre)} + s + {_lit(suf)}",
        lambda s: pre + s + suf,
        lambda: (_word(rng),),
    )


def _string_replace(rng: random.Random) -> Spec:
    old = rng.choice(_LETTERS)
    new = rng.choice([c for c in _LETTERS + "*-_" if c != old])
    return Spec(
        _name(rng, "replace_char", "swap_letter", "mask", "substitute"),
        "s: str",
        "str",
        f"Return s with every {_lit(old)} replaced by {_lit(new)}.",
        f"return s.replace({_lit(old)}, {_lit(new)})",
        lambda s: s.replace(old, new),
        lambda: (_with_letter(rng, old, rng.randint(0, 2)),),
    )


def _string_case(rng: random.Random) -> Spec:
    method, words = rng.choice(
        [
            ("upper", "converted to upper case"),
            ("lower", "converted to lower case"),
            ("title", "in title case"),
            ("capitalize", "with only its first letter in upper case"),
            ("swapcase", "with the case of every letter swapped"),
        ]
    )
    reverse = rng.random() < 0.5
    subject = "s[::-1]" if reverse else "s"

    def oracle(s: str) -> str:
        value = s[::-1] if reverse else s
        result: str = getattr(value, method)()
        return result

    def make() -> Args:
        word = _word(rng)
        return ("".join(c.upper() if rng.random() < 0.3 else c for c in word),)

    return Spec(
        _name(rng, "change_case", "restyle", "convert", "normalize_text"),
        "s: str",
        "str",
        "Return s " + ("reversed and " if reverse else "") + words + ".",
        f"return {subject}.{method}()",
        oracle,
        make,
    )


def _string_count(rng: random.Random) -> Spec:
    letter = rng.choice(_LETTERS)
    return Spec(
        _name(rng, "count_letter", "tally", "occurrences", "letter_count"),
        "s: str",
        "int",
        f"Return how many times {_lit(letter)} occurs in s.",
        f"return s.count({_lit(letter)})",
        lambda s: s.count(letter),
        lambda: (_with_letter(rng, letter, rng.randint(0, 3)),),
    )


def _string_slice(rng: random.Random) -> Spec:
    k = rng.randint(1, 3)
    step = rng.randint(2, 4)
    body, doc, oracle = rng.choice(
        [
            (f"return s[{k}:] + s[:{k}]", f"Return s rotated left by {k} characters.",
             lambda s: s[k:] + s[:k]),
            (f"return s[:{k + 1}]", f"Return the first {k + 1} characters of s.",
             lambda s: s[: k + 1]),
            (f"return s[-{k + 1}:]", f"Return the last {k + 1} characters of s.",
             lambda s: s[-(k + 1):]),
            (f"return s[::{step}]",
             f"Return every {step}-th character of s, starting with the first.",
             lambda s: s[::step]),
        ]
    )  # fmt: skip
    return Spec(
        _name(rng, "cut", "slice_text", "take_part", "trim_word"),
        "s: str",
        "str",
        doc,
        body,
        oracle,
        lambda: (_word(rng, 5, 8),),
    )


# -------------------------------------------------------------------------- arithmetic


def _arith_affine(rng: random.Random) -> Spec:
    a, b = rng.randint(2, 9), rng.randint(1, 20)
    op, word, fn = _op(rng, "+ -")
    return Spec(
        _name(rng, "scale_shift", "affine", "transform", "apply_rule"),
        "x: int",
        "int",
        f"Return x times {a} {word} {b}.",
        f"return x * {a} {op} {b}",
        lambda x: fn(x * a, b),
        lambda: (rng.randint(-20, 20),),
    )


def _arith_binop(rng: random.Random) -> Spec:
    op, word, fn = _op(rng, "+ - * // %")
    k = rng.randint(0, 9)
    tail = f" + {k}" if k else ""
    return Spec(
        _name(rng, "combine", "calc", "operate", "mix"),
        "a: int, b: int",
        "int",
        f"Return a {word} b" + (f", plus {k}." if k else "."),
        f"return a {op} b{tail}",
        lambda a, b: fn(a, b) + k,
        lambda: (rng.randint(-30, 30), rng.randint(1, 9)),
    )


def _arith_poly(rng: random.Random) -> Spec:
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    return Spec(
        _name(rng, "poly", "quadratic", "evaluate", "curve"),
        "x: int",
        "int",
        f"Return x squared plus {a} times x plus {b}.",
        f"return x * x + {a} * x + {b}",
        lambda x: x * x + a * x + b,
        lambda: (rng.randint(-10, 10),),
    )


def _arith_distance(rng: random.Random) -> Spec:
    t, k = rng.randint(-10, 20), rng.randint(1, 5)
    scaled = f" * {k}" if k > 1 else ""
    return Spec(
        _name(rng, "distance", "gap", "how_far", "offset"),
        "x: int",
        "int",
        f"Return the distance between x and {t}" + (f", times {k}." if k > 1 else "."),
        f"return abs(x - {t}){scaled}",
        lambda x: abs(x - t) * k,
        lambda: (rng.randint(-30, 30),),
    )


def _arith_power(rng: random.Random) -> Spec:
    p, c = rng.randint(2, 3), rng.randint(1, 20)
    return Spec(
        _name(rng, "power_minus", "raise_and_drop", "pow_shift", "lift"),
        "x: int",
        "int",
        f"Return x to the power {p}, minus {c}.",
        f"return x ** {p} - {c}",
        lambda x: x**p - c,
        lambda: (rng.randint(-6, 9),),
    )


def _arith_divmod(rng: random.Random) -> Spec:
    k = rng.randint(2, 12)
    return Spec(
        _name(rng, "split_units", "quotient_remainder", "divide", "share"),
        "n: int",
        "tuple[int, int]",
        f"Return the quotient and the remainder of n divided by {k}, as a tuple.",
        f"return (n // {k}, n % {k})",
        lambda n: (n // k, n % k),
        lambda: (rng.randint(0, 100),),
    )


# -------------------------------------------------------------------------------- list


def _list_map(rng: random.Random) -> Spec:
    op, word, fn = _op(rng, "+ - * // %")
    k = rng.randint(2, 9)
    return Spec(
        _name(rng, "map_values", "transform_all", "apply_each", "update_list"),
        "xs: list[int]",
        "list[int]",
        f"Return a list with every element of xs {word} {k}.",
        f"return [x {op} {k} for x in xs]",
        lambda xs: [fn(x, k) for x in xs],
        lambda: (_ints(rng),),
    )


def _list_filter(rng: random.Random) -> Spec:
    op, word, fn = _cmp(rng, "> < >= <= !=")
    k = rng.randint(-5, 10)
    return Spec(
        _name(rng, "keep", "select", "filter_values", "pick"),
        "xs: list[int]",
        "list[int]",
        f"Return the elements of xs that are {word} {k}, in order.",
        f"return [x for x in xs if x {op} {k}]",
        lambda xs: [x for x in xs if fn(x, k)],
        lambda: (_ints(rng),),
    )


def _list_filter_mod(rng: random.Random) -> Spec:
    k = rng.randint(2, 5)
    r = rng.randint(0, k - 1)
    return Spec(
        _name(rng, "keep_class", "residue_filter", "select_mod", "bucket"),
        "xs: list[int]",
        "list[int]",
        f"Return the elements of xs whose remainder modulo {k} is {r}, in order.",
        f"return [x for x in xs if x % {k} == {r}]",
        lambda xs: [x for x in xs if x % k == r],
        lambda: (_ints(rng, 0, 30),),
    )


def _list_reorder(rng: random.Random) -> Spec:
    i, step = rng.randint(1, 3), rng.randint(2, 3)
    body, doc, oracle = rng.choice(
        [
            (f"return xs[{i}:] + xs[:{i}]", f"Return xs rotated left by {i} positions.",
             lambda xs: xs[i:] + xs[:i]),
            (f"return xs[-{i}:] + xs[:-{i}]", f"Return xs rotated right by {i} positions.",
             lambda xs: xs[-i:] + xs[:-i]),
            (f"return xs[::{step}]",
             f"Return every {step}-th element of xs, starting with the first.",
             lambda xs: xs[::step]),
            ("return xs[::-1]", "Return xs in reverse order.", lambda xs: xs[::-1]),
        ]
    )  # fmt: skip
    return Spec(
        _name(rng, "reorder", "shuffle_fixed", "arrange", "permute"),
        "xs: list[int]",
        "list[int]",
        doc,
        body,
        oracle,
        lambda: (_ints(rng, min_len=4, max_len=7),),
    )


def _list_pairwise(rng: random.Random) -> Spec:
    op, word, fn = _op(rng, "+ - *")
    noun = {"+": "sum", "-": "difference", "*": "product"}[op]
    return Spec(
        _name(rng, "neighbours", "pairwise", "adjacent", "steps", "link_pairs"),
        "xs: list[int]",
        "list[int]",
        f"Return the {noun} of each element of xs and the next one ({word}).",
        f"return [xs[i] {op} xs[i + 1] for i in range(len(xs) - 1)]",
        lambda xs: [fn(xs[i], xs[i + 1]) for i in range(len(xs) - 1)],
        lambda: (_ints(rng),),
    )


def _list_zip(rng: random.Random) -> Spec:
    op, word, fn = _op(rng, "+ - *")
    k = rng.randint(1, 5)
    left = f"a * {k}" if k > 1 else "a"
    scaled = f"{k} times " if k > 1 else ""
    return Spec(
        _name(rng, "zip_with", "combine_lists", "merge_pairs", "pair_up"),
        "xs: list[int], ys: list[int]",
        "list[int]",
        f"Return {scaled}each element of xs {word} the element of ys at the same position "
        "(up to the shorter list).",
        f"return [{left} {op} b for a, b in zip(xs, ys)]",
        lambda xs, ys: [fn(a * k, b) for a, b in zip(xs, ys, strict=False)],
        lambda: (_ints(rng), _ints(rng)),
    )


# ------------------------------------------------------------------------- conditional

_LABEL_PAIRS = [
    ("high", "low"),
    ("big", "small"),
    ("hot", "cold"),
    ("yes", "no"),
    ("pass", "fail"),
    ("on", "off"),
    ("up", "down"),
]


def _cond_threshold(rng: random.Random) -> Spec:
    op, word, fn = _cmp(rng, "> >= < <=")
    t = rng.randint(0, 50)
    a, b = rng.choice(_LABEL_PAIRS)
    return Spec(
        _name(rng, "label", "classify", "judge", "rate"),
        "x: int",
        "str",
        f"Return {_lit(a)} if x is {word} {t}, otherwise {_lit(b)}.",
        f"if x {op} {t}:\n    return {_lit(a)}\nreturn {_lit(b)}",
        lambda x: a if fn(x, t) else b,
        lambda: (rng.randint(t - 10, t + 10),),
    )


def _cond_three_way(rng: random.Random) -> Spec:
    lo = rng.randint(0, 20)
    hi = lo + rng.randint(5, 30)
    a, b, c = rng.choice(
        [
            ("small", "medium", "large"),
            ("cold", "warm", "hot"),
            ("low", "mid", "high"),
            ("child", "teen", "adult"),
            ("bronze", "silver", "gold"),
        ]
    )
    return Spec(
        _name(rng, "bucket", "grade", "size_class", "band"),
        "x: int",
        "str",
        f"Return {_lit(a)} if x is less than {lo}, {_lit(b)} if it is less than {hi}, "
        f"otherwise {_lit(c)}.",
        f"if x < {lo}:\n    return {_lit(a)}\nif x < {hi}:\n    return {_lit(b)}\nreturn {_lit(c)}",
        lambda x: a if x < lo else (b if x < hi else c),
        lambda: (rng.randint(lo - 10, hi + 10),),
    )


def _cond_divisible_label(rng: random.Random) -> Spec:
    k = rng.randint(2, 7)
    a, b = rng.choice([("yes", "no"), ("hit", "miss"), ("on", "off"), ("even", "odd")])
    return Spec(
        _name(rng, "check", "divisible_label", "tag", "mark"),
        "x: int",
        "str",
        f"Return {_lit(a)} if x is divisible by {k}, otherwise {_lit(b)}.",
        f"return {_lit(a)} if x % {k} == 0 else {_lit(b)}",
        lambda x: a if x % k == 0 else b,
        lambda: (rng.randint(0, 40),),
    )


def _cond_clamp(rng: random.Random) -> Spec:
    lo = rng.randint(-10, 10)
    hi = lo + rng.randint(1, 20)
    return Spec(
        _name(rng, "clamp", "limit", "bound", "fit_range"),
        "x: int",
        "int",
        f"Return x limited to the range from {lo} to {hi}.",
        f"if x < {lo}:\n    return {lo}\nif x > {hi}:\n    return {hi}\nreturn x",
        lambda x: min(max(x, lo), hi),
        lambda: (rng.randint(lo - 10, hi + 10),),
    )


def _cond_pick(rng: random.Random) -> Spec:
    cmp, _, better = _cmp(rng, "> <")
    op, word, fn = _op(rng, "+ - *")
    k = rng.randint(1, 9)
    which = "larger" if cmp == ">" else "smaller"
    return Spec(
        _name(rng, "choose", "pick_one", "select_value", "prefer"),
        "a: int, b: int",
        "int",
        f"Return the {which} of a and b, {word} {k}.",
        f"if a {cmp} b:\n    return a {op} {k}\nreturn b {op} {k}",
        lambda a, b: fn(a, k) if better(a, b) else fn(b, k),
        lambda: (rng.randint(-20, 20), rng.randint(-20, 20)),
    )


def _cond_fizz(rng: random.Random) -> Spec:
    k = rng.randint(2, 9)
    word = rng.choice(["fizz", "buzz", "bang", "ping", "zap"])
    return Spec(
        _name(rng, "fizz", "say", "shout", "speak"),
        "x: int",
        "str",
        f"Return {_lit(word)} if x is divisible by {k}, otherwise x as a string.",
        f"if x % {k} == 0:\n    return {_lit(word)}\nreturn str(x)",
        lambda x: word if x % k == 0 else str(x),
        lambda: (rng.randint(1, 50),),
    )


# -------------------------------------------------------------------------------- loop


def _loop_sum(rng: random.Random) -> Spec:
    op, word, fn = _op(rng, "+ - *")
    k = rng.randint(1, 9)
    return Spec(
        _name(rng, "total", "accumulate", "sum_up", "add_all"),
        "xs: list[int]",
        "int",
        f"Return the sum of x {word} {k} over all elements x of xs.",
        f"total = 0\nfor x in xs:\n    total += x {op} {k}\nreturn total",
        lambda xs: sum(fn(x, k) for x in xs),
        lambda: (_ints(rng),),
    )


def _loop_count(rng: random.Random) -> Spec:
    op, word, fn = _cmp(rng, "> < >= <= == !=")
    k = rng.randint(-5, 10)
    return Spec(
        _name(rng, "count_if", "how_many", "tally_values", "count_matches"),
        "xs: list[int]",
        "int",
        f"Return how many elements of xs are {word} {k}.",
        f"count = 0\nfor x in xs:\n    if x {op} {k}:\n        count += 1\nreturn count",
        lambda xs: sum(1 for x in xs if fn(x, k)),
        lambda: (_ints(rng, -5, 10),),
    )


def _loop_range_sum(rng: random.Random) -> Spec:
    start, step = rng.randint(0, 5), rng.randint(1, 4)
    return Spec(
        _name(rng, "range_total", "sum_steps", "series_sum", "stride_sum"),
        "n: int",
        "int",
        f"Return the sum of the numbers from {start} up to (not including) n, counting by {step}.",
        f"total = 0\nfor i in range({start}, n, {step}):\n    total += i\nreturn total",
        lambda n: sum(range(start, n, step)),
        lambda: (rng.randint(0, 30),),
    )


def _loop_product(rng: random.Random) -> Spec:
    init = rng.randint(1, 5)
    scaled = f"{init} times " if init > 1 else ""
    return Spec(
        _name(rng, "product", "multiply_all", "prod", "times_all"),
        "xs: list[int]",
        "int",
        f"Return {scaled}the product of the elements of xs.",
        f"result = {init}\nfor x in xs:\n    result *= x\nreturn result",
        lambda xs: init * _product(xs),
        lambda: (_ints(rng, -5, 5, 2, 5),),
    )


def _product(xs: list[int]) -> int:
    result = 1
    for x in xs:
        result *= x
    return result


def _loop_count_chars(rng: random.Random) -> Spec:
    chars = "".join(sorted(rng.sample(_LETTERS, rng.randint(2, 4))))
    return Spec(
        _name(rng, "count_chars", "char_tally", "count_some", "letters_in"),
        "s: str",
        "int",
        f"Return how many characters of s are one of {_lit(chars)}.",
        f"count = 0\nfor ch in s:\n    if ch in {_lit(chars)}:\n        count += 1\nreturn count",
        lambda s: sum(1 for ch in s if ch in chars),
        lambda: (_word(rng, 4, 9),),
    )


def _loop_best(rng: random.Random) -> Spec:
    t = rng.randint(-10, 20)
    variants: list[_Variant] = [
        ("best = xs[0]\nfor x in xs:\n    if x > best:\n        best = x\nreturn best",
         "Return the largest element of xs.", max),
        ("best = xs[0]\nfor x in xs:\n    if x < best:\n        best = x\nreturn best",
         "Return the smallest element of xs.", min),
        (f"best = xs[0]\nfor x in xs:\n    if abs(x - {t}) < abs(best - {t}):\n"
         "        best = x\nreturn best",
         f"Return the element of xs closest to {t} (the first one on ties).",
         lambda xs: min(xs, key=lambda x: abs(x - t))),
    ]  # fmt: skip
    body, doc, oracle = rng.choice(variants)
    return Spec(
        _name(rng, "best", "find_best", "champion", "winner"),
        "xs: list[int]",
        "int",
        doc,
        body,
        oracle,
        lambda: (_ints(rng, -15, 25),),
    )


# -------------------------------------------------------------------------------- dict


def _dict_group_count(rng: random.Random) -> Spec:
    k = rng.randint(2, 6)
    variant = rng.choice(["mod", "len", "first", "last"])
    if variant == "mod":
        return Spec(
            _name(rng, "count_by_remainder", "histogram", "group_count", "tally_by"),
            "xs: list[int]",
            "dict[int, int]",
            f"Return a dict mapping each remainder modulo {k} to how many elements of xs have it.",
            f"counts = {{}}\nfor x in xs:\n    key = x % {k}\n"
            "    counts[key] = counts.get(key, 0) + 1\nreturn counts",
            lambda xs: _count_by(xs, lambda x: x % k),
            lambda: (_ints(rng, 0, 20, 3, 7),),
        )
    expr, what, key_fn, key_type = {
        "len": ("len(w)", "word length", len, "int"),
        "first": ("w[0]", "first letter", lambda w: w[0], "str"),
        "last": ("w[-1]", "last letter", lambda w: w[-1], "str"),
    }[variant]
    return Spec(
        _name(rng, "count_by", "group_words", "word_histogram", "tally_words"),
        "words: list[str]",
        f"dict[{key_type}, int]",
        f"Return a dict mapping each {what} to how many words have it.",
        f"counts = {{}}\nfor w in words:\n    key = {expr}\n"
        "    counts[key] = counts.get(key, 0) + 1\nreturn counts",
        lambda words: _count_by(words, key_fn),
        lambda: (_words(rng, 3, 6),),
    )


def _count_by(items: list[_T], key: Callable[[_T], _K]) -> dict[_K, int]:
    counts: dict[_K, int] = {}
    for item in items:
        k = key(item)
        counts[k] = counts.get(k, 0) + 1
    return counts


def _dict_get(rng: random.Random) -> Spec:
    default = rng.randint(-5, 20)

    def make() -> Args:
        d = _str_dict(rng)
        key = rng.choice([*d, _word(rng, 2, 5)])
        return (d, key)

    return Spec(
        _name(rng, "lookup", "get_value", "fetch", "value_of"),
        "d: dict[str, int], key: str",
        "int",
        f"Return the value stored for key in d, or {default} if key is missing.",
        f"return d.get(key, {default})",
        lambda d, key: d.get(key, default),
        make,
    )


def _dict_map_values(rng: random.Random) -> Spec:
    op, word, fn = _op(rng, "+ - * // %")
    c = rng.randint(2, 9)
    return Spec(
        _name(rng, "update_values", "map_dict", "adjust", "rescale"),
        "d: dict[str, int]",
        "dict[str, int]",
        f"Return a new dict with the keys of d and every value {word} {c}.",
        f"return {{key: value {op} {c} for key, value in d.items()}}",
        lambda d: {key: fn(value, c) for key, value in d.items()},
        lambda: (_str_dict(rng),),
    )


def _dict_filter(rng: random.Random) -> Spec:
    op, word, fn = _cmp(rng, "> < >= <=")
    t = rng.randint(-5, 15)
    return Spec(
        _name(rng, "filter_dict", "keep_entries", "select_items", "prune"),
        "d: dict[str, int]",
        "dict[str, int]",
        f"Return the entries of d whose value is {word} {t}.",
        f"return {{key: value for key, value in d.items() if value {op} {t}}}",
        lambda d: {key: value for key, value in d.items() if fn(value, t)},
        lambda: (_str_dict(rng),),
    )


def _dict_from_words(rng: random.Random) -> Spec:
    k = rng.randint(2, 5)
    letter = rng.choice(_LETTERS)
    expr, doc, fn, value_type = rng.choice(
        [
            ("len(w)", "its length", len, "int"),
            ("w.upper()", "the word in upper case", str.upper, "str"),
            ("w[0]", "its first letter", lambda w: w[0], "str"),
            ("w[::-1]", "the word reversed", lambda w: w[::-1], "str"),
            (f"len(w) * {k}", f"{k} times its length", lambda w: len(w) * k, "int"),
            (f"w.count({_lit(letter)})", f"how many times {_lit(letter)} occurs in it",
             lambda w: w.count(letter), "int"),
        ]
    )  # fmt: skip
    return Spec(
        _name(rng, "index_words", "word_map", "describe_words", "build_table"),
        "words: list[str]",
        f"dict[str, {value_type}]",
        f"Return a dict mapping each word in words to {doc}.",
        f"return {{w: {expr} for w in words}}",
        lambda words: {w: fn(w) for w in words},
        lambda: (_words(rng),),
    )


def _dict_invert_or_sum(rng: random.Random) -> Spec:
    k = rng.randint(1, 9)
    if rng.random() < 0.25:

        def make_unique() -> Args:
            keys = _words(rng, 2, 4)
            values = rng.sample(range(-9, 30), len(keys))
            return (dict(zip(keys, values, strict=True)),)

        return Spec(
            _name(rng, "invert", "swap_pairs", "reverse_map", "flip_dict"),
            "d: dict[str, int]",
            "dict[int, str]",
            "Return d with keys and values swapped (the values of d are distinct).",
            "return {value: key for key, value in d.items()}",
            lambda d: {value: key for key, value in d.items()},
            make_unique,
        )
    scaled = f" * {k}" if k > 1 else ""
    return Spec(
        _name(rng, "sum_values", "dict_total", "value_sum", "weigh"),
        "d: dict[str, int]",
        "int",
        ("Return the sum of the values of d" + (f", times {k}." if k > 1 else ".")),
        f"return sum(d.values()){scaled}",
        lambda d: sum(d.values()) * k,
        lambda: (_str_dict(rng),),
    )


# ------------------------------------------------------------------------------ search


def _search_sort(rng: random.Random) -> Spec:
    k, t = rng.randint(2, 5), rng.randint(-5, 15)
    variants: list[_Variant] = [
        ("return sorted(xs)", "Return xs sorted in ascending order.", sorted),
        ("return sorted(xs, reverse=True)", "Return xs sorted in descending order.",
         lambda xs: sorted(xs, reverse=True)),
        ("return sorted(xs, key=abs)",
         "Return xs sorted by absolute value, keeping the original order on ties.",
         lambda xs: sorted(xs, key=abs)),
        (f"return sorted(xs, key=lambda x: x % {k})",
         f"Return xs sorted by remainder modulo {k}, keeping the original order on ties.",
         lambda xs: sorted(xs, key=lambda x: x % k)),
        (f"return sorted(xs, key=lambda x: abs(x - {t}))",
         f"Return xs sorted by distance from {t}, keeping the original order on ties.",
         lambda xs: sorted(xs, key=lambda x: abs(x - t))),
    ]  # fmt: skip
    body, doc, oracle = rng.choice(variants)
    return Spec(
        _name(rng, "sort_values", "order", "arrange_numbers", "rank"),
        "xs: list[int]",
        "list[int]",
        doc,
        body,
        oracle,
        lambda: (_ints(rng, -10, 20, 4, 7),),
    )


def _search_first_index(rng: random.Random) -> Spec:
    op, word, fn = _cmp(rng, "> < >= <= ==")
    t = rng.randint(-5, 15)
    return Spec(
        _name(rng, "find_first", "first_index", "locate", "index_of"),
        "xs: list[int]",
        "int",
        f"Return the index of the first element of xs that is {word} {t}, or -1 if there is none.",
        f"for i, x in enumerate(xs):\n    if x {op} {t}:\n        return i\nreturn -1",
        lambda xs: next((i for i, x in enumerate(xs) if fn(x, t)), -1),
        lambda: (_ints(rng, -10, 20),),
    )


def _search_kth(rng: random.Random) -> Spec:
    k = rng.randint(0, 2)
    ordinal = ("smallest", "second smallest", "third smallest")[k]
    largest = rng.random() < 0.5
    if largest:
        ordinal = ordinal.replace("smallest", "largest")
    index = -(k + 1) if largest else k
    return Spec(
        _name(rng, "kth", "order_statistic", "nth_value", "pick_rank"),
        "xs: list[int]",
        "int",
        f"Return the {ordinal} element of xs (counting repeated values separately).",
        f"return sorted(xs)[{index}]",
        lambda xs: sorted(xs)[index],
        lambda: (_ints(rng, -10, 20, 4, 7),),
    )


def _search_sort_words(rng: random.Random) -> Spec:
    letter = rng.choice(_LETTERS)
    variants: list[_Variant] = [
        ("return sorted(words)", "Return words in alphabetical order.", sorted),
        ("return sorted(words, key=len)",
         "Return words sorted by length, keeping the original order on ties.",
         lambda ws: sorted(ws, key=len)),
        ("return sorted(words, key=len, reverse=True)",
         "Return words sorted from longest to shortest, keeping the original order on ties.",
         lambda ws: sorted(ws, key=len, reverse=True)),
        ("return sorted(words, key=lambda w: w[-1])",
         "Return words sorted by their last letter, keeping the original order on ties.",
         lambda ws: sorted(ws, key=lambda w: w[-1])),
        (f"return sorted(words, key=lambda w: w.count({_lit(letter)}))",
         f"Return words sorted by how many times {_lit(letter)} occurs in them, keeping "
         "the original order on ties.",
         lambda ws: sorted(ws, key=lambda w: w.count(letter))),
    ]  # fmt: skip
    body, doc, oracle = rng.choice(variants)
    return Spec(
        _name(rng, "sort_words", "order_words", "arrange", "word_order"),
        "words: list[str]",
        "list[str]",
        doc,
        body,
        oracle,
        lambda: (_words(rng, 3, 5),),
    )


def _search_max_key(rng: random.Random) -> Spec:
    k = rng.randint(2, 9)
    fn_name, which = rng.choice([("max", "largest"), ("min", "smallest")])
    pick = max if fn_name == "max" else min
    return Spec(
        _name(rng, "best_by_remainder", "extreme_mod", "pick_by_key", "select_by"),
        "xs: list[int]",
        "int",
        f"Return the first element of xs with the {which} remainder modulo {k}.",
        f"return {fn_name}(xs, key=lambda x: x % {k})",
        lambda xs: pick(xs, key=lambda x: x % k),
        lambda: (_ints(rng, 0, 40, 3, 6),),
    )


def _search_insert_index(rng: random.Random) -> Spec:
    t = rng.randint(-5, 25)
    op, side = rng.choice([("<", "before"), ("<=", "after")])
    fn = _CMP[op][1]
    return Spec(
        _name(rng, "insert_position", "search_sorted", "find_slot", "bisect_index"),
        "xs: list[int]",
        "int",
        f"Return the index at which {t} would be inserted into the sorted list xs, {side} "
        "any equal elements.",
        f"i = 0\nwhile i < len(xs) and xs[i] {op} {t}:\n    i += 1\nreturn i",
        lambda xs: next((i for i, x in enumerate(xs) if not fn(x, t)), len(xs)),
        lambda: (sorted(_ints(rng, -10, 30, 3, 7)),),
    )


# ----------------------------------------------------------------------- number theory


def _nt_divisible(rng: random.Random) -> Spec:
    k = rng.randint(2, 13)
    return Spec(
        _name(rng, "is_multiple", "divisible", "check_divisor", "fits"),
        "n: int",
        "bool",
        f"Return True if n is divisible by {k}, otherwise False.",
        f"return n % {k} == 0",
        lambda n: n % k == 0,
        lambda: (rng.randint(0, 100),),
    )


def _nt_digits(rng: random.Random) -> Spec:
    b = rng.randint(2, 10)
    base = "" if b == 10 else f" in base {b}"
    if rng.random() < 0.5:
        return Spec(
            _name(rng, "digit_sum", "sum_digits", "cross_sum", "digits_total"),
            "n: int",
            "int",
            f"Return the sum of the digits of n{base} (n >= 0).",
            f"total = 0\nwhile n > 0:\n    total += n % {b}\n    n //= {b}\nreturn total",
            lambda n: _digits(n, b, sum),
            lambda: (rng.randint(0, 500),),
        )
    return Spec(
        _name(rng, "digit_count", "num_digits", "length_of", "count_digits"),
        "n: int",
        "int",
        f"Return the number of digits of n{base}, or 0 for n = 0.",
        f"count = 0\nwhile n > 0:\n    count += 1\n    n //= {b}\nreturn count",
        lambda n: _digits(n, b, len),
        lambda: (rng.randint(0, 500),),
    )


def _digits(n: int, base: int, combine: Callable[[list[int]], int]) -> int:
    digits = []
    while n > 0:
        digits.append(n % base)
        n //= base
    return combine(digits)


def _nt_gcd(rng: random.Random) -> Spec:
    k = rng.randint(6, 60)
    return Spec(
        _name(rng, "gcd_with", "common_divisor", "greatest_common", "shared_factor"),
        "n: int",
        "int",
        f"Return the greatest common divisor of n and {k}.",
        f"a, b = n, {k}\nwhile b:\n    a, b = b, a % b\nreturn a",
        lambda n: _gcd(n, k),
        lambda: (rng.randint(1, 100),),
    )


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def _nt_power_mod(rng: random.Random) -> Spec:
    e, m = rng.randint(2, 5), rng.randint(3, 13)
    return Spec(
        _name(rng, "power_mod", "mod_pow", "cycle_value", "clock_power"),
        "n: int",
        "int",
        f"Return n to the power {e}, modulo {m}.",
        f"return n ** {e} % {m}",
        lambda n: n**e % m,
        lambda: (rng.randint(0, 30),),
    )


def _nt_divisors(rng: random.Random) -> Spec:
    k = rng.randint(0, 5)
    cond = f"n % d == 0 and d > {k}" if k else "n % d == 0"
    what = f"the divisors of n greater than {k}" if k else "the divisors of n"
    variants: list[tuple[str, str, Callable[[list[int]], object], str]] = [
        ("[d for d in range(1, n + 1) if {c}]", "Return a list of {w}, ascending.",
         list, "list[int]"),
        ("len([d for d in range(1, n + 1) if {c}])", "Return how many of {w} there are.",
         len, "int"),
        ("sum(d for d in range(1, n + 1) if {c})", "Return the sum of {w}.", sum, "int"),
    ]  # fmt: skip
    shape, doc, combine, returns = rng.choice(variants)
    return Spec(
        _name(rng, "divisors", "factors_of", "divisor_info", "split_factors"),
        "n: int",
        returns,
        doc.format(w=what),
        "return " + shape.format(c=cond),
        lambda n: combine([d for d in range(1, n + 1) if n % d == 0 and d > k]),
        lambda: (rng.randint(1, 60),),
    )


def _nt_digit_place(rng: random.Random) -> Spec:
    k = rng.randint(1, 3)
    p = 10**k
    if rng.random() < 0.5:
        return Spec(
            _name(rng, "last_digits", "tail_digits", "low_part", "suffix_number"),
            "n: int",
            "int",
            f"Return the number formed by the last {k} digit(s) of n (n >= 0).",
            f"return n % {p}",
            lambda n: n % p,
            lambda: (rng.randint(0, 99999),),
        )
    return Spec(
        _name(rng, "digit_at", "place_digit", "get_digit", "nth_digit"),
        "n: int",
        "int",
        f"Return the digit in the {p}s place of n (n >= 0).",
        f"return n // {p} % 10",
        lambda n: n // p % 10,
        lambda: (rng.randint(0, 99999),),
    )


# --------------------------------------------------------------------------- recursion


def _rec_scaled_sum(rng: random.Random) -> Spec:
    k = rng.randint(1, 9)
    name = _name(rng, "tri_sum", "sum_to", "stack_sum", "recursive_total")
    term = f"n * {k}" if k > 1 else "n"
    return Spec(
        name,
        "n: int",
        "int",
        f"Return {k} * (1 + 2 + ... + n), computed recursively; 0 for n <= 0.",
        f"if n <= 0:\n    return 0\nreturn {term} + {name}(n - 1)",
        lambda n: k * n * (n + 1) // 2 if n > 0 else 0,
        lambda: (rng.randint(0, 15),),
    )


def _rec_step_product(rng: random.Random) -> Spec:
    base, step = rng.randint(1, 5), rng.randint(1, 3)
    name = _name(rng, "fact", "step_product", "falling", "chain_product")

    def oracle(n: int) -> int:
        return base if n <= 1 else n * oracle(n - step)

    return Spec(
        name,
        "n: int",
        "int",
        f"Return f(n) = n * f(n - {step}) for n > 1, and {base} for n <= 1, recursively.",
        f"if n <= 1:\n    return {base}\nreturn n * {name}(n - {step})",
        oracle,
        lambda: (rng.randint(0, 10),),
    )


def _rec_fib(rng: random.Random) -> Spec:
    a, b = rng.randint(0, 5), rng.randint(1, 5)
    name = _name(rng, "fib", "lucas_like", "term", "two_step")

    def oracle(n: int) -> int:
        x, y = a, b
        for _ in range(n):
            x, y = y, x + y
        return x

    return Spec(
        name,
        "n: int",
        "int",
        f"Return term n (from 0) of the sequence that starts {a}, {b} and continues with "
        "the sum of the previous two terms, recursively.",
        f"if n == 0:\n    return {a}\nif n == 1:\n    return {b}\n"
        f"return {name}(n - 1) + {name}(n - 2)",
        oracle,
        lambda: (rng.randint(0, 12),),
    )


def _rec_affine(rng: random.Random) -> Spec:
    b, c = rng.randint(2, 5), rng.randint(0, 5)
    name = _name(rng, "grow", "compound", "iterate", "recur")
    tail = f" + {c}" if c else ""

    def oracle(n: int) -> int:
        return 1 if n == 0 else b * oracle(n - 1) + c

    return Spec(
        name,
        "n: int",
        "int",
        f"Return f(n) where f(0) = 1 and f(n) = {b} * f(n - 1){tail}, recursively.",
        f"if n == 0:\n    return 1\nreturn {b} * {name}(n - 1){tail}",
        oracle,
        lambda: (rng.randint(0, 8),),
    )


def _rec_list_sum(rng: random.Random) -> Spec:
    k = rng.randint(1, 9)
    name = _name(rng, "rec_sum", "sum_list", "fold", "add_up")
    head = f"xs[0] * {k}" if k > 1 else "xs[0]"
    what = f"{k} times each element" if k > 1 else "the elements"
    return Spec(
        name,
        "xs: list[int]",
        "int",
        f"Return the sum of {what} of xs, computed recursively.",
        f"if not xs:\n    return 0\nreturn {head} + {name}(xs[1:])",
        lambda xs: k * sum(xs),
        lambda: (_ints(rng, -9, 20, 0, 6),),
    )


def _rec_count_or_digits(rng: random.Random) -> Spec:
    if rng.random() < 0.5:
        letter = rng.choice(_LETTERS)
        name = _name(rng, "count_rec", "rec_count", "letter_hits", "scan")
        return Spec(
            name,
            "s: str",
            "int",
            f"Return how many times {_lit(letter)} occurs in s, computed recursively.",
            f"if not s:\n    return 0\nreturn (1 if s[0] == {_lit(letter)} else 0) + {name}(s[1:])",
            lambda s: s.count(letter),
            lambda: (_with_letter(rng, letter, rng.randint(0, 3)),),
        )
    b = rng.randint(2, 10)
    name = _name(rng, "digit_sum_rec", "rec_digits", "fold_digits", "digit_total")
    base = "" if b == 10 else f" in base {b}"
    return Spec(
        name,
        "n: int",
        "int",
        f"Return the sum of the digits of n{base} (n >= 0), computed recursively.",
        f"if n < {b}:\n    return n\nreturn n % {b} + {name}(n // {b})",
        lambda n: _digits(n, b, sum),
        lambda: (rng.randint(0, 500),),
    )


# ------------------------------------------------------------------------------ format


def _fmt_greet(rng: random.Random) -> Spec:
    greeting = rng.choice(["Hello", "Hi", "Welcome", "Goodbye", "Dear", "Good morning", "Hey"])
    punct = rng.choice(["!", ".", "?", "!!"])
    return Spec(
        _name(rng, "greet", "salute", "welcome_message", "address"),
        "name: str",
        "str",
        f'Return the text "{greeting}, <name>{punct}" for the given name.',
        f'return f"{greeting}, {{name}}{punct}"',
        lambda name: f"{greeting}, {name}{punct}",
        lambda: (_word(rng).capitalize(),),
    )


def _fmt_pad(rng: random.Random) -> Spec:
    w = rng.randint(3, 8)
    fill = rng.choice(["*", ".", "-", "#"])
    body, doc, oracle = rng.choice(
        [
            (f"return str(n).zfill({w})",
             f"Return n as a string padded with zeros on the left to width {w}.",
             lambda n: str(n).zfill(w)),
            (f"return str(n).rjust({w}, {_lit(fill)})",
             f"Return n as a string padded with {_lit(fill)} on the left to width {w}.",
             lambda n: str(n).rjust(w, fill)),
            (f"return str(n).ljust({w}, {_lit(fill)})",
             f"Return n as a string padded with {_lit(fill)} on the right to width {w}.",
             lambda n: str(n).ljust(w, fill)),
        ]
    )  # fmt: skip
    return Spec(
        _name(rng, "pad", "pad_number", "fixed_width", "align"),
        "n: int",
        "str",
        doc,
        body,
        oracle,
        lambda: (rng.randint(0, 9999),),
    )


def _fmt_join(rng: random.Random) -> Spec:
    sep = rng.choice([", ", "-", " ", " | ", "/", ";", "+", "::"])
    body, doc, oracle = rng.choice(
        [
            (f"return {_lit(sep)}.join(words)", f"Return the words joined by {_lit(sep)}.",
             lambda ws: sep.join(ws)),
            (f"return {_lit(sep)}.join(reversed(words))",
             f"Return the words in reverse order, joined by {_lit(sep)}.",
             lambda ws: sep.join(reversed(ws))),
            (f"return {_lit(sep)}.join(sorted(words))",
             f"Return the words in alphabetical order, joined by {_lit(sep)}.",
             lambda ws: sep.join(sorted(ws))),
        ]
    )  # fmt: skip
    return Spec(
        _name(rng, "join_words", "glue", "concat_all", "sentence"),
        "words: list[str]",
        "str",
        doc,
        body,
        oracle,
        lambda: (_words(rng),),
    )


def _fmt_key_value(rng: random.Random) -> Spec:
    sep = rng.choice(["=", ": ", " -> ", ":", " = "])
    left, right = rng.choice([("", ""), ("[", "]"), ("(", ")"), ("<", ">")])
    return Spec(
        _name(rng, "describe", "pair_text", "label_value", "show_entry"),
        "key: str, value: int",
        "str",
        f'Return the text "{left}<key>{sep}<value>{right}".',
        f'return f"{left}{{key}}{sep}{{value}}{right}"',
        lambda key, value: f"{left}{key}{sep}{value}{right}",
        lambda: (_word(rng, 2, 6), rng.randint(-50, 200)),
    )


def _fmt_decimals(rng: random.Random) -> Spec:
    p = rng.randint(0, 4)
    unit = rng.choice(["", " kg", " m", "%", " s", " km"])
    return Spec(
        _name(rng, "format_number", "show_amount", "round_text", "display"),
        "x: float",
        "str",
        f"Return x written with {p} digit(s) after the decimal point, followed by {_lit(unit)}.",
        f'return f"{{x:.{p}f}}{unit}"',
        lambda x: f"{x:.{p}f}{unit}",
        lambda: (round(rng.uniform(-100, 100), 5),),
    )


def _fmt_numbers(rng: random.Random) -> Spec:
    sep = rng.choice([", ", "-", " ", "|", ";", "+"])
    k = rng.randint(1, 5)
    item = f"str(x * {k})" if k > 1 else "str(x)"
    what = f"{k} times each number in xs" if k > 1 else "the numbers in xs"
    return Spec(
        _name(rng, "join_numbers", "number_line", "render_list", "serialize"),
        "xs: list[int]",
        "str",
        f"Return {what}, written in order and joined by {_lit(sep)}.",
        f"return {_lit(sep)}.join({item} for x in xs)",
        lambda xs: sep.join(str(x * k) for x in xs),
        lambda: (_ints(rng, -9, 30),),
    )


# ----------------------------------------------------------------------------- boolean


def _bool_range(rng: random.Random) -> Spec:
    lo = rng.randint(-10, 20)
    hi = lo + rng.randint(1, 30)
    inside = rng.random() < 0.5
    if inside:
        body, doc = f"return {lo} <= x <= {hi}", f"Return True if {lo} <= x <= {hi}."
    else:
        body = f"return x < {lo} or x > {hi}"
        doc = f"Return True if x lies outside the range from {lo} to {hi}."
    return Spec(
        _name(rng, "in_range", "within", "check_range", "is_inside")
        if inside
        else _name(rng, "out_of_range", "outside", "is_outside", "beyond"),
        "x: int",
        "bool",
        doc,
        body,
        lambda x: (lo <= x <= hi) == inside,
        lambda: (rng.randint(lo - 10, hi + 10),),
    )


def _bool_both(rng: random.Random) -> Spec:
    op1, word1, fn1 = _cmp(rng, "> < >= <= ==")
    op2, word2, fn2 = _cmp(rng, "> < >= <= ==")
    k1, k2 = rng.randint(-5, 10), rng.randint(-5, 10)
    conj = rng.choice(["and", "or"])

    def oracle(a: int, b: int) -> bool:
        x, y = fn1(a, k1), fn2(b, k2)
        return (x and y) if conj == "and" else (x or y)

    return Spec(
        _name(rng, "both_hold", "check_pair", "condition", "test_values"),
        "a: int, b: int",
        "bool",
        f"Return True if a is {word1} {k1} {conj} b is {word2} {k2}.",
        f"return a {op1} {k1} {conj} b {op2} {k2}",
        oracle,
        lambda: (rng.randint(k1 - 5, k1 + 5), rng.randint(k2 - 5, k2 + 5)),
    )


def _bool_xor(rng: random.Random) -> Spec:
    k = rng.randint(-5, 10)
    same = rng.random() < 0.5
    op = "==" if same else "!="
    doc = (
        f"Return True if both or neither of a and b are greater than {k}."
        if same
        else f"Return True if exactly one of a and b is greater than {k}."
    )
    return Spec(
        _name(rng, "agree", "same_side", "both_or_neither", "match_sides")
        if same
        else _name(rng, "exactly_one", "xor_check", "odd_one", "differ"),
        "a: int, b: int",
        "bool",
        doc,
        f"return (a > {k}) {op} (b > {k})",
        lambda a, b: ((a > k) == (b > k)) == same,
        lambda: (rng.randint(k - 6, k + 6), rng.randint(k - 6, k + 6)),
    )


def _bool_all_any(rng: random.Random) -> Spec:
    op, word, fn = _cmp(rng, "> < >= <= !=")
    k = rng.randint(-5, 10)
    quant = rng.choice(["all", "any"])
    subject = "every element" if quant == "all" else "at least one element"
    agg = all if quant == "all" else any
    return Spec(
        _name(rng, "check_all", "test_list", "quantify", "holds"),
        "xs: list[int]",
        "bool",
        f"Return True if {subject} of xs is {word} {k}.",
        f"return {quant}(x {op} {k} for x in xs)",
        lambda xs: agg(fn(x, k) for x in xs),
        lambda: (_ints(rng, k - 8, k + 8, 2, 5),),
    )


def _bool_affix(rng: random.Random) -> Spec:
    p, q = rng.choice(_LETTERS), rng.choice(_LETTERS)
    conj = rng.choice(["and", "or"])

    def oracle(s: str) -> bool:
        x, y = s.startswith(p), s.endswith(q)
        return (x and y) if conj == "and" else (x or y)

    def make() -> Args:
        word = _word(rng)
        if rng.random() < 0.5:
            word = p + word
        if rng.random() < 0.5:
            word = word + q
        return (word,)

    return Spec(
        _name(rng, "matches", "check_ends", "affix_test", "edge_letters"),
        "s: str",
        "bool",
        f"Return True if s starts with {_lit(p)} {conj} ends with {_lit(q)}.",
        f"return s.startswith({_lit(p)}) {conj} s.endswith({_lit(q)})",
        oracle,
        make,
    )


def _bool_divisibility(rng: random.Random) -> Spec:
    a, b = sorted(rng.sample(range(2, 10), 2))
    conj = rng.choice(["and", "or"])

    def oracle(n: int) -> bool:
        x, y = n % a == 0, n % b == 0
        return (x and y) if conj == "and" else (x or y)

    return Spec(
        _name(rng, "divisible_pair", "multiple_test", "both_divide", "check_factors"),
        "n: int",
        "bool",
        f"Return True if n is divisible by {a} {conj} by {b}.",
        f"return n % {a} == 0 {conj} n % {b} == 0",
        oracle,
        lambda: (rng.randint(0, 90),),
    )


# ---------------------------------------------------------------------------- sequence


def _seq_arith(rng: random.Random) -> Spec:
    a = rng.choice([v for v in range(-5, 11) if v])
    d = rng.randint(1, 9)
    return Spec(
        _name(rng, "arith_seq", "progression", "linear_terms", "count_up"),
        "n: int",
        "list[int]",
        f"Return the first n terms of the arithmetic sequence that starts at {a} and grows by {d}.",
        f"return [{a} + {d} * i for i in range(n)]",
        lambda n: [a + d * i for i in range(n)],
        lambda: (rng.randint(0, 8),),
    )


def _seq_geom(rng: random.Random) -> Spec:
    a, r = rng.randint(1, 5), rng.randint(2, 4)
    return Spec(
        _name(rng, "geom_seq", "doubling", "powers_list", "grow_terms"),
        "n: int",
        "list[int]",
        f"Return the first n terms of the geometric sequence that starts at {a} with ratio {r}.",
        f"return [{a} * {r} ** i for i in range(n)]",
        lambda n: [a * r**i for i in range(n)],
        lambda: (rng.randint(0, 7),),
    )


def _seq_powers(rng: random.Random) -> Spec:
    p, c = rng.randint(2, 3), rng.randint(0, 9)
    tail = f" + {c}" if c else ""
    return Spec(
        _name(rng, "squares", "power_terms", "shifted_powers", "table"),
        "n: int",
        "list[int]",
        f"Return i to the power {p}" + (f" plus {c}" if c else "") + ", for i from 0 to n - 1.",
        f"return [i ** {p}{tail} for i in range(n)]",
        lambda n: [i**p + c for i in range(n)],
        lambda: (rng.randint(0, 8),),
    )


def _seq_range(rng: random.Random) -> Spec:
    start, step = rng.randint(0, 9), rng.randint(2, 6)
    return Spec(
        _name(rng, "stride", "every_nth", "skip_count", "range_list"),
        "n: int",
        "list[int]",
        f"Return the numbers from {start} up to (not including) n, counting by {step}.",
        f"return list(range({start}, n, {step}))",
        lambda n: list(range(start, n, step)),
        lambda: (rng.randint(0, 40),),
    )


def _seq_fib(rng: random.Random) -> Spec:
    a, b = rng.randint(0, 5), rng.randint(1, 5)
    return Spec(
        _name(rng, "fib_list", "sum_sequence", "fibonacci_like", "build_terms"),
        "n: int",
        "list[int]",
        f"Return the first n terms of the sequence that starts {a}, {b} and continues "
        "with the sum of the previous two terms.",
        f"seq = [{a}, {b}]\nwhile len(seq) < n:\n    seq.append(seq[-1] + seq[-2])\nreturn seq[:n]",
        lambda n: _fib_list(a, b, n),
        lambda: (rng.randint(0, 10),),
    )


def _fib_list(a: int, b: int, n: int) -> list[int]:
    seq = [a, b]
    while len(seq) < n:
        seq.append(seq[-1] + seq[-2])
    return seq[:n]


def _seq_cycle(rng: random.Random) -> Spec:
    m, k = rng.randint(2, 7), rng.randint(2, 5)
    x, y = rng.choice([("a", "b"), ("on", "off"), ("x", "o"), ("tick", "tock"), ("L", "R")])
    body, doc, oracle, returns = rng.choice(
        [
            (f"return [i % {m} for i in range(n)]",
             f"Return the remainders modulo {m} of 0, 1, ..., n - 1.",
             lambda n: [i % m for i in range(n)], "list[int]"),
            (f"return [i * {k} % {m} for i in range(n)]",
             f"Return (i * {k}) modulo {m} for i from 0 to n - 1.",
             lambda n: [i * k % m for i in range(n)], "list[int]"),
            (f"return [{_lit(x)} if i % 2 == 0 else {_lit(y)} for i in range(n)]",
             f"Return a list of n items alternating {_lit(x)} and {_lit(y)}, starting with "
             f"{_lit(x)}.",
             lambda n: [x if i % 2 == 0 else y for i in range(n)], "list[str]"),
        ]
    )  # fmt: skip
    return Spec(
        _name(rng, "cycle", "pattern", "repeat_pattern", "wave"),
        "n: int",
        returns,
        doc,
        body,
        oracle,
        lambda: (rng.randint(0, 10),),
    )


# ---------------------------------------------------------------------------- registry


def _family(category: str, *builders: Callable[[random.Random], Spec]) -> tuple[Template, ...]:
    return tuple(Template(category, b.__name__.lstrip("_"), b) for b in builders)


#: Templates per category, in a fixed order (generation takes them in turns).
TEMPLATES: Mapping[str, tuple[Template, ...]] = MappingProxyType(
    {
        "string": _family(
            "string", _string_repeat, _string_wrap, _string_replace, _string_case,
            _string_count, _string_slice,
        ),
        "arithmetic": _family(
            "arithmetic", _arith_affine, _arith_binop, _arith_poly, _arith_distance,
            _arith_power, _arith_divmod,
        ),
        "list": _family(
            "list", _list_map, _list_filter, _list_filter_mod, _list_reorder, _list_pairwise,
            _list_zip,
        ),
        "conditional": _family(
            "conditional", _cond_threshold, _cond_three_way, _cond_divisible_label,
            _cond_clamp, _cond_pick, _cond_fizz,
        ),
        "loop": _family(
            "loop", _loop_sum, _loop_count, _loop_range_sum, _loop_product, _loop_count_chars,
            _loop_best,
        ),
        "dict": _family(
            "dict", _dict_group_count, _dict_get, _dict_map_values, _dict_filter,
            _dict_from_words, _dict_invert_or_sum,
        ),
        "search": _family(
            "search", _search_sort, _search_first_index, _search_kth, _search_sort_words,
            _search_max_key, _search_insert_index,
        ),
        "number_theory": _family(
            "number_theory", _nt_divisible, _nt_digits, _nt_gcd, _nt_power_mod, _nt_divisors,
            _nt_digit_place,
        ),
        "recursion": _family(
            "recursion", _rec_scaled_sum, _rec_step_product, _rec_fib, _rec_affine,
            _rec_list_sum, _rec_count_or_digits,
        ),
        "format": _family(
            "format", _fmt_greet, _fmt_pad, _fmt_join, _fmt_key_value, _fmt_decimals,
            _fmt_numbers,
        ),
        "boolean": _family(
            "boolean", _bool_range, _bool_both, _bool_xor, _bool_all_any, _bool_affix,
            _bool_divisibility,
        ),
        "sequence": _family(
            "sequence", _seq_arith, _seq_geom, _seq_powers, _seq_range, _seq_fib, _seq_cycle,
        ),
    }
)  # fmt: skip
