"""Leaked private code, compared on code tokens (the Guardrail's ``private_code`` kind).

Whitespace-separated word n-grams are too coarse for dense code: ``return x*7+7`` is one
"word", and a private body of six code tokens never fills an 8-word window. Here texts are
split by a small Python lexer (regular expressions, because model output is often not
valid Python and :mod:`tokenize` stops at the first error) into names, literals and
operators; whitespace and comments are dropped, literals are made canonical (``'a'`` ==
``"a"``, ``0x10`` == ``16``).

Each text gives two token streams: *verbatim* (names as written) and *renamed* (every name
that is not a keyword or builtin becomes ``ID``, so a copy with renamed variables still
matches). Windows of ``n`` tokens are hashed (64-bit, as the word index does) and kept in
sorted arrays; a text shorter than ``n`` tokens (a one-line function body) is looked up as
a whole among the private windows of its own length, down to :data:`MIN_TOKENS`. Windows
that also occur in the public texts are dropped: a template or idiom everyone knows is not
a leak. A verbatim window must contain an operator or a literal (a run of plain words is
prose, left to the Guardrail's word n-grams); a renamed window must contain a literal,
because structure alone (``return ID + ID``) is what every program looks like: the private
part of templated code is its constants and strings.
"""

from __future__ import annotations

import ast
import builtins
import hashlib
import keyword
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

__all__ = [
    "MIN_TOKENS",
    "CodeIndex",
    "CodeToken",
    "PromptVocabulary",
    "code_tokens",
    "window_counts",
]

#: Texts (or windows) shorter than this many code tokens are never judged.
MIN_TOKENS: Final = 4

_U64 = npt.NDArray[np.uint64]
_SMALL_INTS: Final = frozenset(repr(i) for i in range(-2, 3))
_PUNCTUATION: Final = "\"'`.,:;!?()[]{}<>"
_MULTIPLIER: Final = np.uint64(0x100000001B3)
_KEEP_NAMES: Final = (
    frozenset(keyword.kwlist) | frozenset(keyword.softkwlist) | frozenset(dir(builtins))
)
_LEXER: Final = re.compile(
    r"(?P<comment>\#[^\n]*)"
    r"|(?P<string>(?:[rRbBuUfF]{1,2})?(?:\"\"\"[\s\S]*?\"\"\"|'''[\s\S]*?'''"
    r"|\"(?:[^\"\\\n]|\\.)*\"|'(?:[^'\\\n]|\\.)*'))"
    r"|(?P<number>(?:0[xXoObB][0-9a-fA-F_]+|(?:\d[\d_]*\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)[jJ]?)"
    r"|(?P<name>[^\W\d]\w*)"
    r"|(?P<op>\*\*=?|//=?|>>=?|<<=?|->|:=|[-+*/%&|^@<>=!]=|[-+*/%&|^~@<>=.,:;()\[\]{}])"
)


@dataclass(frozen=True)
class CodeToken:
    """One code token: its canonical text, its renamed form, whether it is a literal, and
    where it lies in the source text."""

    text: str
    renamed: str
    literal: bool
    start: int
    end: int


def _canonical(raw: str) -> str:
    try:
        return repr(ast.literal_eval(raw))
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return raw  # f-strings, unterminated or odd literals: as written


def code_tokens(text: str) -> list[CodeToken]:
    """The code tokens of ``text``; comments and whitespace dropped, literals canonical."""
    tokens: list[CodeToken] = []
    for match in _LEXER.finditer(text):
        kind = match.lastgroup
        raw = match.group()
        if kind == "comment" or kind is None:
            continue
        if kind in ("string", "number"):
            value = _canonical(raw) if len(raw) <= 4096 else raw
            tokens.append(CodeToken(value, value, True, match.start(), match.end()))
        elif kind == "name":
            renamed = raw if raw in _KEEP_NAMES else "ID"
            tokens.append(CodeToken(raw, renamed, False, match.start(), match.end()))
        else:
            tokens.append(CodeToken(raw, raw, False, match.start(), match.end()))
    return tokens


def _hash(token: str) -> int:
    digest = hashlib.blake2b(token.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _windows(hashes: _U64, n: int) -> _U64:
    count = len(hashes) - n + 1
    if count <= 0:
        return np.zeros(0, dtype=np.uint64)
    out = np.zeros(count, dtype=np.uint64)
    with np.errstate(over="ignore"):  # arithmetic modulo 2^64 is the point
        for k in range(n):
            out = out * _MULTIPLIER + hashes[k : k + count]
    return out


def window_counts(flags: npt.NDArray[np.bool_], n: int) -> npt.NDArray[np.int64]:
    """For each window of ``n`` consecutive flags: how many are set (none if fewer flags)."""
    cumulative = np.concatenate(([0], np.cumsum(flags.astype(np.int64))))
    count = max(0, len(flags) - n + 1)
    result: npt.NDArray[np.int64] = cumulative[n : n + count] - cumulative[:count]
    return result


def _with_literal(literal: npt.NDArray[np.bool_], n: int) -> npt.NDArray[np.bool_]:
    """For each window of ``n`` tokens: does it hold a literal?"""
    result: npt.NDArray[np.bool_] = window_counts(literal, n) > 0
    return result


@dataclass(frozen=True)
class _Streams:
    verbatim: _U64
    renamed: _U64
    literal: npt.NDArray[np.bool_]
    symbol: npt.NDArray[np.bool_]


def _streams(tokens: Sequence[CodeToken]) -> _Streams:
    m = len(tokens)
    return _Streams(
        verbatim=np.fromiter((_hash("v" + t.text) for t in tokens), dtype=np.uint64, count=m),
        renamed=np.fromiter((_hash("r" + t.renamed) for t in tokens), dtype=np.uint64, count=m),
        literal=np.fromiter((t.literal for t in tokens), dtype=bool, count=m),
        symbol=np.fromiter(
            (t.literal or not t.text.isidentifier() for t in tokens), dtype=bool, count=m
        ),
    )


class PromptVocabulary:
    """The literals of a public prompt: what an answer may repeat freely.

    A teacher's completion of a transfer prompt legitimately repeats the prompt's
    constants and strings (a correct answer to "or -3 if key is missing" contains ``-3``).
    Such literals carry no private information, whatever private example also contains
    them. What identifies a private example in code is its constants and strings (module
    docstring: "the private part of templated code is its constants and strings"); its
    structure and local names are the skill a teacher is there to pass on. So, answering a
    known prompt, only a literal the prompt does not hold carries private information, and
    in prose only a run of words the prompt does not hold (see :meth:`fresh_words`).
    """

    def __init__(self, prompt: str) -> None:
        given: set[str] = set()
        # The docstring is one string literal to the lexer; its prose holds the constants
        # and strings an answer needs ("repeated 3 times, joined by ','"), so it is lexed
        # as code too, with its triple quotes blanked out.
        unquoted = prompt.replace('"""', "   ").replace("'''", "   ")
        for tok in [*code_tokens(prompt), *code_tokens(unquoted)]:
            if tok.literal:
                given.add(tok.text)
                # Prose numbers end sentences: "less than 10." lexes as 10.0.
                try:
                    value = float(tok.text)
                except ValueError:
                    continue
                if value.is_integer():
                    given.add(repr(int(value)))
        self._literals = frozenset(given)
        self._words = frozenset(w.strip(_PUNCTUATION).lower() for w in prompt.split())

    def gives(self, token: CodeToken) -> bool:
        """Whether ``token`` carries nothing beyond the prompt and the language.

        The integers -2 to 2 are the language's as much as the prompt's (``x % 2 == 0``,
        ``seq[-1] + seq[-2]``, ``range(1, n)``): they mark a template, not an example.
        """
        return not token.literal or token.text in self._literals or token.text in _SMALL_INTS

    def fresh_words(self, words: Sequence[str]) -> npt.NDArray[np.bool_]:
        """Per whitespace-separated word: does it carry information the prompt lacks?

        A word carries information when it holds a literal the prompt does not, or when it
        is a plain word (letters only once the punctuation around it is stripped, not a
        keyword or builtin) the prompt does not hold: prose. Code words (``d.items()``,
        ``{key:``) carry only their literals.
        """
        out = np.zeros(len(words), dtype=bool)
        for i, word in enumerate(words):
            core = word.strip(_PUNCTUATION)
            if core.isalpha():  # a word of prose, punctuation around it or not
                out[i] = core not in _KEEP_NAMES and core.lower() not in self._words
            else:
                out[i] = not all(self.gives(tok) for tok in code_tokens(word))
        return out

    def fresh_literals(self, words: Sequence[str]) -> npt.NDArray[np.bool_]:
        """Per word: does it hold a literal the prompt does not?"""
        return np.fromiter(
            (any(not self.gives(tok) for tok in code_tokens(w)) for w in words),
            dtype=bool,
            count=len(words),
        )


class CodeIndex:
    """Hashed code-token windows of a private set, minus those of a public set.

    Holds no text: 8 bytes per distinct window and length. ``n`` is the window length in
    code tokens; lengths :data:`MIN_TOKENS` to ``n - 1`` are kept for short texts.
    """

    def __init__(self, private_texts: Iterable[str], public_texts: Iterable[str], n: int) -> None:
        if n < MIN_TOKENS:
            raise ValueError(f"code window must be at least {MIN_TOKENS} tokens, got {n}")
        self.n = n
        private = [_streams(code_tokens(t)) for t in private_texts]
        public = [_streams(code_tokens(t)) for t in public_texts]
        self._index: dict[int, _U64] = {}
        for length in range(MIN_TOKENS, n + 1):
            mine = self._collect(private, length)
            theirs = self._collect(public, length)
            if len(theirs) and len(mine):
                mine = np.setdiff1d(mine, theirs, assume_unique=True)
            self._index[length] = mine

    @staticmethod
    def _collect(streams: Sequence[_Streams], length: int) -> _U64:
        parts = []
        for s in streams:
            verbatim = _windows(s.verbatim, length)
            parts.append(verbatim[_with_literal(s.symbol, length)])
            renamed = _windows(s.renamed, length)
            parts.append(renamed[_with_literal(s.literal, length)])
        if not parts:
            return np.zeros(0, dtype=np.uint64)
        return np.unique(np.concatenate(parts))

    @property
    def size(self) -> int:
        """Distinct windows held, all lengths together."""
        return sum(len(v) for v in self._index.values())

    def leaked_spans(
        self,
        text: str,
        skip: Sequence[tuple[int, int]] = (),
        context: PromptVocabulary | None = None,
    ) -> list[tuple[int, int]]:
        """Character spans of ``text`` covered by a private window (merged, in order).

        Tokens overlapping a ``skip`` span (a placeholder already in the text) never count.
        With a ``context`` (the public prompt ``text`` answers), a window counts only when
        it holds a literal the prompt does not (:class:`PromptVocabulary`).
        """
        tokens = [t for t in code_tokens(text) if not _overlaps(t, skip)]
        m = len(tokens)
        if m < MIN_TOKENS:
            return []
        length = min(self.n, m)
        index = self._index[length]
        if not len(index):
            return []
        s = _streams(tokens)
        verbatim_carrier, renamed_carrier = s.symbol, s.literal
        if context is not None:
            fresh = np.fromiter((not context.gives(tok) for tok in tokens), dtype=bool, count=m)
            verbatim_carrier = s.literal & fresh
            renamed_carrier = s.literal & fresh
        hits = self._hits(index, _windows(s.verbatim, length)) & _with_literal(
            verbatim_carrier, length
        )
        renamed = _windows(s.renamed, length)
        hits |= self._hits(index, renamed) & _with_literal(renamed_carrier, length)
        starts = np.flatnonzero(hits)
        if not len(starts):
            return []
        delta = np.zeros(m + 1, dtype=np.int64)
        np.add.at(delta, starts, 1)
        np.add.at(delta, starts + length, -1)
        covered = np.cumsum(delta[:-1]) > 0
        spans: list[tuple[int, int]] = []
        for i, flag in enumerate(covered.tolist()):
            if not flag:
                continue
            begin, end = tokens[i].start, tokens[i].end
            if spans and _only_space(text, spans[-1][1], begin):
                spans[-1] = (spans[-1][0], end)
            else:
                spans.append((begin, end))
        return spans

    @staticmethod
    def _hits(index: _U64, windows: _U64) -> npt.NDArray[np.bool_]:
        if not len(windows):
            return np.zeros(0, dtype=bool)
        positions = np.minimum(np.searchsorted(index, windows), len(index) - 1)
        result: npt.NDArray[np.bool_] = index[positions] == windows
        return result


def _overlaps(token: CodeToken, spans: Sequence[tuple[int, int]]) -> bool:
    return any(token.start < end and begin < token.end for begin, end in spans)


def _only_space(text: str, begin: int, end: int) -> bool:
    """Between two covered tokens lies only whitespace or comments: merge them."""
    gap = text[begin:end]
    return not gap.strip() or all(not line.strip() or line.strip().startswith("#")
                                  for line in gap.splitlines())  # fmt: skip
