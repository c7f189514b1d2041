"""Copy drills: bank-style functions whose body repeats constants stated in the docstring.

Why they exist: the tiny models learned the *shape* of a solution but wrote
the wrong constants (``d.get(key, 12)`` → ``d.get(key, 5)``). The bank's templates draw
their constants from narrow ranges (a repeat count of 2-4, a letter of 14), so a model
lowers its pre-training loss by guessing a likely constant; nothing forces it to copy
the value from its prompt. A drill states one to three constants in its docstring, drawn
from wide ranges, and uses them in a one-line body: the only way to predict the body is
to copy, which is an in-context (induction-head) skill that then transfers to any
category, private ones included.

Drills are part of the tiny models' pre-training corpus only. They use generic
arithmetic, comparison-free string and list expressions (no ``dict``, formatting,
boolean or sequence constructs, the default world's private categories), their names
are ``drill_<word>`` so that no drill is a bank function, and their integer constants lie
outside the bank's range (|c| ≥ 21) so that no drill body equals a bank body.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from peerlm.agent.tasks.bank import render_function

__all__ = ["CORPUS_SEED", "copy_drills", "held_out_drills"]

#: Seed of the drills in the tiny models' pre-training corpus.
CORPUS_SEED = 2_000_003
_HELD_OUT_SEED = 99_991
_LOWER = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class _Drill:
    params: str
    returns: str
    doc: str
    body: str
    oracle: Callable[..., object]
    sample: Callable[[], tuple[object, ...]]


def _const(rng: random.Random) -> int:
    """An integer constant outside the bank's range (bank constants lie in -9..20)."""
    return rng.randint(21, 999)


def _text(rng: random.Random) -> str:
    return "".join(rng.choice(_LOWER) for _ in range(rng.randint(2, 6)))


def _ints(rng: random.Random) -> list[int]:
    return [rng.randint(-9, 30) for _ in range(rng.randint(2, 5))]


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(_LOWER) for _ in range(rng.randint(3, 7)))


def _plus(rng: random.Random) -> _Drill:
    a = _const(rng)
    return _Drill(
        "x: int", "int", f"Return x plus {a}.", f"return x + {a}",
        lambda x: x + a, lambda: (rng.randint(-9, 30),),
    )  # fmt: skip


def _affine(rng: random.Random) -> _Drill:
    a, b = rng.randint(2, 9), _const(rng)
    return _Drill(
        "x: int", "int", f"Return x times {a}, plus {b}.", f"return x * {a} + {b}",
        lambda x: x * a + b, lambda: (rng.randint(-9, 30),),
    )  # fmt: skip


def _minus_from(rng: random.Random) -> _Drill:
    a = _const(rng)
    return _Drill(
        "x: int", "int", f"Return {a} minus x.", f"return {a} - x",
        lambda x: a - x, lambda: (rng.randint(-9, 30),),
    )  # fmt: skip


def _bounded(rng: random.Random) -> _Drill:
    a = _const(rng)
    fn, word = rng.choice([(min, "smaller"), (max, "larger")])
    return _Drill(
        "x: int", "int", f"Return the {word} of x and {a}.", f"return {fn.__name__}(x, {a})",
        lambda x: fn(x, a), lambda: (rng.randint(-999, 999),),
    )  # fmt: skip


def _shift_all(rng: random.Random) -> _Drill:
    a = _const(rng)
    return _Drill(
        "xs: list[int]", "list[int]", f"Return xs with {a} added to every item.",
        f"return [v + {a} for v in xs]",
        lambda xs: [v + a for v in xs], lambda: (_ints(rng),),
    )  # fmt: skip


def _length_plus(rng: random.Random) -> _Drill:
    a = _const(rng)
    return _Drill(
        "s: str", "int", f"Return the length of s plus {a}.", f"return len(s) + {a}",
        lambda s: len(s) + a, lambda: (_word(rng),),
    )  # fmt: skip


def _append_text(rng: random.Random) -> _Drill:
    t = _text(rng)
    return _Drill(
        "s: str", "str", f'Return s followed by "{t}".', f'return s + "{t}"',
        lambda s: s + t, lambda: (_word(rng),),
    )  # fmt: skip


def _prepend_text(rng: random.Random) -> _Drill:
    t = _text(rng)
    return _Drill(
        "s: str", "str", f'Return "{t}" followed by s.', f'return "{t}" + s',
        lambda s: t + s, lambda: (_word(rng),),
    )  # fmt: skip


def _around(rng: random.Random) -> _Drill:
    t, u = _text(rng), _text(rng)
    return _Drill(
        "s: str", "str", f'Return s between "{t}" and "{u}".', f'return "{t}" + s + "{u}"',
        lambda s: t + s + u, lambda: (_word(rng),),
    )  # fmt: skip


def _swap_text(rng: random.Random) -> _Drill:
    t, u = _text(rng), _text(rng)

    def sample() -> tuple[object, ...]:
        return (_word(rng) + t + _word(rng),)

    return _Drill(
        "s: str", "str", f'Return s with every "{t}" replaced by "{u}".',
        f'return s.replace("{t}", "{u}")', lambda s: s.replace(t, u), sample,
    )  # fmt: skip


def _scaled_sum(rng: random.Random) -> _Drill:
    a = rng.randint(2, 9)
    b = _const(rng)
    return _Drill(
        "xs: list[int]", "int", f"Return {a} times the sum of xs, plus {b}.",
        f"return {a} * sum(xs) + {b}", lambda xs: a * sum(xs) + b, lambda: (_ints(rng),),
    )  # fmt: skip


_KINDS: tuple[Callable[[random.Random], _Drill], ...] = (
    _plus,
    _affine,
    _minus_from,
    _bounded,
    _shift_all,
    _length_plus,
    _append_text,
    _prepend_text,
    _around,
    _swap_text,
    _scaled_sum,
)


def copy_drills(n: int, seed: int) -> list[str]:
    """``n`` distinct drills as complete functions (prompt + body), deterministic in ``seed``."""
    rng = random.Random(seed)
    texts: list[str] = []
    seen: set[str] = set()
    while len(texts) < n:
        drill = rng.choice(_KINDS)(rng)
        name = f"drill_{_word(rng)}"
        text = render_function(name, drill.params, drill.returns, drill.doc, drill.body,
                               drill.oracle, drill.sample())  # fmt: skip
        if text not in seen:
            seen.add(text)
            texts.append(text)
    return texts


def held_out_drills(n: int, corpus_size: int) -> list[str]:
    """``n`` drills that are not among the corpus's first ``corpus_size`` (for measuring)."""
    corpus = set(copy_drills(corpus_size, CORPUS_SEED)) if corpus_size else set()
    drills: list[str] = []
    for text in copy_drills(n + corpus_size, _HELD_OUT_SEED):
        if text not in corpus:
            drills.append(text)
        if len(drills) == n:
            break
    return drills
