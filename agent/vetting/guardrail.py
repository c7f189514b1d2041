"""The Guardrail Filter: every text an agent shares is vetted here first (KNEXA-FL, Section 3).

A teacher's completions on the public transfer set X_u could still carry what the model
memorised from private data D_i: secrets that were in the training code, people's e-mail
addresses, or whole private samples. :class:`Guardrail` removes those before a package is
encoded, replacing each removed span with a placeholder ``<redacted:KIND>``:

* ``private_text``: verbatim leakage of a private training sample. The output's word
  n-grams (``ngram`` whitespace-separated tokens, 8 by default) are looked up in an index
  of every n-gram of the private set; every overlapping window is removed, overlapping
  windows merged into one span. The index stores 64-bit hashes only (8 bytes per n-gram in
  one sorted numpy array), so it is bounded by the private set's size and never holds text.
* secrets: ``private_key`` (PEM blocks), ``jwt``, ``github_token``, ``slack_token``,
  ``aws_access_key``, ``secret_key`` (``sk-…``, ``sk_live_…``), ``bearer_token`` and
  ``api_key`` (``api_key = "…"``, ``password: …`` and similar assignments);
* ``private_code``: leaked private *code*, compared on code tokens rather than words (see
  :class:`_CodeIndex`): whitespace and comments do not count, literals are canonical
  (``'a'`` and ``"a"``, ``0x10`` and ``16`` are the same token), and windows are matched
  twice, once with identifiers as written and once with every non-builtin identifier
  replaced by one placeholder (a renamed copy). Windows also in ``public_texts`` are not
  leaks; renamed windows must hold a literal (structure alone is public).
* ``email``: e-mail addresses; personal data: ``ssn`` (US social security numbers),
  ``card_number`` (13–19 digits passing the Luhn check), ``phone`` (NANP and ``+``
  international numbers with separators), ``internal_ip`` (RFC 1918, link-local and
  unique-local addresses, checked with :mod:`ipaddress`);
* ``high_entropy``: random-looking strings (see :func:`is_high_entropy`).

Disguises are undone before matching: zero-width and other invisible format characters
are removed (``invisible``), adjacent or ``+``-joined string literals are joined, and runs
of hex, ``\\xNN`` escapes, base32 and base64 are decoded; a secret found in the joined or
decoded form removes the whole disguised run (``encoded_secret``). Secret patterns ignore
case (an ``akia…`` key is still a key).

Filtering runs to a fixed point, so it is idempotent: filtering a filtered text changes
nothing. Counts go to ``peerlm_agent_guardrail_removals_total{component, kind}`` and to a
log line; neither ever contains the removed content. Apart from those two, the filter is a
pure function of its input.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import structlog
from peerlm.agent.vetting.code_index import CodeIndex, PromptVocabulary, window_counts
from peerlm.agent.vetting.disguise import PII_PATTERNS, encoded_spans, strip_invisible
from peerlm.agent.vetting.incoming import risky_imports
from prometheus_client import CollectorRegistry, Counter

from peerlm.metrics import get_counter

__all__ = [
    "DEFAULT_CODE_NGRAM",
    "DEFAULT_ENTROPY_THRESHOLD",
    "KINDS",
    "Guardrail",
    "GuardrailResult",
    "agent_guardrail",
    "is_high_entropy",
    "placeholder",
    "shannon_entropy",
]

#: Every kind of removal, in the order the filter applies them.
KINDS: Final[tuple[str, ...]] = (
    "invisible",
    "private_text",
    "private_code",
    "private_key",
    "jwt",
    "github_token",
    "slack_token",
    "aws_access_key",
    "secret_key",
    "bearer_token",
    "api_key",
    "email",
    "ssn",
    "card_number",
    "phone",
    "internal_ip",
    "encoded_secret",
    "high_entropy",
)

#: Window length, in code tokens, of the ``private_code`` check (see agent/vetting/code_index.py):
#: chosen on the bundled bank (python -m peerlm.bench.guardrail; docs/agent-exchange.md).
DEFAULT_CODE_NGRAM: Final = 6

#: Minimum Shannon entropy (bits per character) of a candidate run; see is_high_entropy.
DEFAULT_ENTROPY_THRESHOLD: Final = 3.0
#: Runs shorter than this are never judged by entropy: too few characters to tell.
MIN_ENTROPY_RUN: Final = 20
#: Minimum rate of character-class changes (lower->upper, letter<->digit) per adjacent pair.
MIN_CLASS_CHANGE_RATE: Final = 0.3
#: Maximum share of characters in pronounceable word pieces (4+ letters with a vowel).
MAX_WORD_SHARE: Final = 0.4

# Passes converge after one or two rounds (a placeholder never matches any pattern); the
# cap only guards against a pattern bug turning into an endless loop.
_MAX_PASSES: Final = 4
_MARKER: Final = "<redacted:"


def placeholder(kind: str) -> str:
    """The text that replaces a removed span of ``kind``."""
    return f"{_MARKER}{kind}>"


@dataclass(frozen=True)
class GuardrailResult:
    """A filtered text and how many spans of each kind were removed (kinds with 0 omitted)."""

    text: str
    removals: dict[str, int]

    @property
    def removed(self) -> int:
        """Total number of removed spans."""
        return sum(self.removals.values())


# -- secrets ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Pattern:
    kind: str
    regex: re.Pattern[str]
    #: Name of the group to redact; the whole match when None (keeps e.g. "Bearer ").
    group: str | None = None


_SECRET_NAME = (
    r"(?:api[_-]?key|apikey|secret(?:[_-]?access)?(?:[_-]?key)?|access[_-]?key|auth[_-]?key"
    r"|private[_-]?key|token|passw(?:or)?d|pwd|credentials?)"
)

_PATTERNS: Final[tuple[_Pattern, ...]] = (
    # PEM private keys: the whole block, or, when the END line is missing (a truncated
    # completion), the BEGIN line plus the base64 lines that follow it.
    _Pattern(
        "private_key",
        re.compile(
            r"-----BEGIN[A-Z0-9 ]{0,40}PRIVATE KEY(?: BLOCK)?-----"
            r"(?:.*?-----END[A-Z0-9 ]{0,40}PRIVATE KEY(?: BLOCK)?-----"
            r"|(?:\s*(?:Proc-Type|DEK-Info|Comment|Version):[^\n]*)*(?:\s*[A-Za-z0-9+/=]{16,})*)",
            re.DOTALL,
        ),
    ),
    # Header and payload of a JWT are base64url JSON objects, so both start with "eyJ".
    _Pattern("jwt", re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*")),
    _Pattern(
        "github_token",
        re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{36,255}|github_pat_[A-Za-z0-9_]{22,255})\b"),
    ),
    _Pattern(
        "slack_token",
        re.compile(
            r"\bxox[abposre]-[A-Za-z0-9-]{10,250}\b"
            r"|https://hooks\.slack\.com/services/[A-Za-z0-9/_-]{20,}"
        ),
    ),
    _Pattern("aws_access_key", re.compile(r"\b(?:AKIA|ASIA|ABIA|ACCA)[A-Z0-9]{16}\b")),
    _Pattern(
        "secret_key",
        re.compile(r"\bsk-[A-Za-z0-9_-]{20,}|\b[sr]k_(?:live|test)_[A-Za-z0-9]{16,}"),
    ),
    _Pattern(
        "bearer_token",
        re.compile(r"(?i)\bbearer\s+(?P<secret>[A-Za-z0-9._~+/-]{15,}[A-Za-z0-9_~+/-]=*)"),
        "secret",
    ),
    # Assignments whose name ends in a secret-ish word: `api_key = "..."`, `"password":
    # "..."`, `TOKEN=...`. The name must END in the word (`tokenizer = ...` and `max_tokens`
    # are not secrets); quoted values need 8+ characters, unquoted ones 16+ with a digit and a
    # letter and must not be a call or attribute access (ordinary code).
    _Pattern(
        "api_key",
        re.compile(
            r"(?i)\b[A-Za-z0-9_.-]{0,40}?" + _SECRET_NAME + r"(?![A-Za-z0-9_])[\"']?"
            r"\s*(?::=|=>|=|:)\s*(?P<q>[\"'])(?P<secret>[^\"'\s<>]{8,})(?P=q)"
        ),
        "secret",
    ),
    _Pattern(
        "api_key",
        re.compile(
            r"(?i)\b[A-Za-z0-9_.-]{0,40}?" + _SECRET_NAME + r"(?![A-Za-z0-9_])[\"']?"
            r"\s*(?::=|=>|=|:)[ \t]*"
            r"(?P<secret>(?=[A-Za-z0-9_+/=-]*[0-9])(?=[A-Za-z0-9_+/=-]*[A-Za-z])"
            r"[A-Za-z0-9_+/=-]{16,})(?![A-Za-z0-9_+/=.(\[-])"
        ),
        "secret",
    ),
    _Pattern(
        "email",
        re.compile(
            r"(?<![A-Za-z0-9._%+-])[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]{1,63}"
            r"(?:\.[A-Za-z0-9-]{1,63})*\.[A-Za-z]{2,24}\b"
        ),
    ),
)

# Case tricks: a secret written in other case is still the secret (``akia…``, ``BEGIN rsa
# private key``), so every secret pattern ignores case.
_PATTERNS_ANY_CASE: Final[tuple[_Pattern, ...]] = tuple(
    _Pattern(p.kind, re.compile(p.regex.pattern, p.regex.flags | re.IGNORECASE), p.group)
    for p in _PATTERNS
)
_PLACEHOLDER: Final = re.compile(r"<redacted:[a-z_]*>")

# Candidate runs for the entropy test: base64/base64url/hex alphabet, padding allowed only at
# the end (so `name=VALUE` in code is two runs, not one).
_RUN: Final = re.compile(rf"(?<![A-Za-z0-9+/_-])[A-Za-z0-9+/_-]{{{MIN_ENTROPY_RUN},}}={{0,2}}")
_SEPARATORS: Final = re.compile(r"[_\-/+]+")
_PIECES: Final = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|[0-9]+")
_VOWELS: Final = frozenset("aeiouyAEIOUY")


def shannon_entropy(text: str) -> float:
    """Shannon entropy of the character distribution of ``text``, in bits per character."""
    if not text:
        return 0.0
    n = len(text)
    return -sum(c / n * math.log2(c / n) for c in collections.Counter(text).values())


def _char_class(ch: str) -> int:
    return 0 if ch.islower() else 1 if ch.isupper() else 2


def _class_change_rate(core: str) -> float:
    """Share of adjacent pairs (within separator-free segments) that switch class.

    Counted: lower->upper and letter<->digit. Upper->lower is not counted, because every
    CamelCase word starts that way; random strings switch classes about every other pair.
    """
    changes = pairs = 0
    for segment in _SEPARATORS.split(core):
        for a, b in itertools.pairwise(segment):
            pairs += 1
            ca, cb = _char_class(a), _char_class(b)
            if ca != cb and not (ca == 1 and cb == 0):
                changes += 1
    return changes / pairs if pairs else 0.0


def _word_share(core: str) -> float:
    """Share of characters in pronounceable word pieces (4+ letters, with a vowel)."""
    wordy = sum(
        len(piece)
        for piece in _PIECES.findall(core)
        if len(piece) >= 4 and piece.isalpha() and any(ch in _VOWELS for ch in piece)
    )
    return wordy / len(core) if core else 0.0


def is_high_entropy(run: str, threshold: float = DEFAULT_ENTROPY_THRESHOLD) -> bool:
    """Whether ``run`` (a token from a base64/hex alphabet) looks like a random secret.

    All of: at least :data:`MIN_ENTROPY_RUN` characters (padding ``=`` excluded), Shannon
    entropy >= ``threshold`` bits/char, class-change rate >= :data:`MIN_CLASS_CHANGE_RATE`
    and word share < :data:`MAX_WORD_SHARE`. Entropy alone cannot separate secrets from
    identifiers at these lengths (a random 20-character string has at most log2(20) = 4.3
    bits/char, and ``HighDpiScaleFactorRoundingPolicy`` has 4.2); the two shape tests can.
    Tuned on the CPython standard library and ~17,000 installed package files (157,744
    distinct candidate runs): 608 flagged, nearly all base64 blobs, hex digests, UUIDs
    and commit URLs; while random secrets are caught at 85% (20 characters) to 93-97%
    (40 characters) for base64/alphanumeric and 91-98% for hex. Base32 strings (upper case
    and digits 2-7) are mostly missed.
    """
    core = run.rstrip("=")
    if len(core) < MIN_ENTROPY_RUN:
        return False
    return (
        shannon_entropy(core) >= threshold
        and _class_change_rate(core) >= MIN_CLASS_CHANGE_RATE
        and _word_share(core) < MAX_WORD_SHARE
    )


# -- private n-gram index ---------------------------------------------------------------------

_U64 = npt.NDArray[np.uint64]
# An odd 64-bit multiplier (the FNV-1a 64-bit prime) for the polynomial window hash; token
# hashes are independent BLAKE2b values, so collisions stay at ~2^-64 per pair.
_WINDOW_MULTIPLIER: Final = np.uint64(0x100000001B3)
_TOKEN: Final = re.compile(r"\S+")


def _token_hash(token: str) -> int:
    # surrogatepass: model output may hold lone surrogates; they must hash, not crash.
    digest = hashlib.blake2b(token.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _window_hashes(tokens: Sequence[str], n: int) -> tuple[_U64, npt.NDArray[np.bool_]]:
    """64-bit hashes of every n-token window, and which windows are usable.

    A window is unusable when one of its tokens contains a redaction placeholder: such
    windows never count as leakage, which keeps filtering idempotent.
    """
    m = len(tokens)
    if m < n:
        return np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=bool)
    hashes = np.fromiter((_token_hash(t) for t in tokens), dtype=np.uint64, count=m)
    marked = np.fromiter((_MARKER in t for t in tokens), dtype=np.int64, count=m)
    count = m - n + 1
    windows = np.zeros(count, dtype=np.uint64)
    with np.errstate(over="ignore"):  # arithmetic modulo 2^64 is the point
        for k in range(n):
            windows = windows * _WINDOW_MULTIPLIER + hashes[k : k + count]
    cumulative = np.concatenate(([0], np.cumsum(marked)))
    usable = (cumulative[n:] - cumulative[:count]) == 0
    return windows, usable


def _build_index(texts: Iterable[str], n: int) -> _U64:
    parts = []
    for text in texts:
        windows, usable = _window_hashes(_TOKEN.findall(text), n)
        parts.append(windows[usable])
    if not parts:
        return np.zeros(0, dtype=np.uint64)
    return np.unique(np.concatenate(parts))


def agent_guardrail(
    private_texts: Sequence[str],
    *,
    public_texts: Sequence[str] = (),
    ngram: int = 8,
    registry: CollectorRegistry | None = None,
    component: str = "agent",
) -> Guardrail:
    """The Guardrail an agent uses: its private set against everything public it knows.

    Public: ``public_texts`` (the transfer prompts X_u) and the bank's public pre-training
    corpus (:func:`peerlm.agent.tasks.bank.public_problems`, prompts with references), so
    code shapes and constants any model has seen are not taken for leaks.
    """
    from peerlm.agent.tasks.bank import public_problems

    public = [*public_texts, *(p.prompt + p.reference for p in public_problems())]
    return Guardrail(
        private_texts, ngram=ngram, public_texts=public, registry=registry, component=component
    )


class Guardrail:
    """Removes secrets, e-mail addresses, random-looking strings and leaked private text.

    ``private_texts`` is the agent's private set D_i; it is indexed once, at construction.
    ``public_texts`` (optional, e.g. the prompts of X_u) are subtracted from that index: an
    n-gram that is also public is not a leak, and a completion that quotes its prompt must
    not be cut. Private samples shorter than ``ngram`` tokens cannot be detected as leaks.
    """

    def __init__(
        self,
        private_texts: Sequence[str],
        *,
        ngram: int = 8,
        code_ngram: int = DEFAULT_CODE_NGRAM,
        entropy_threshold: float = DEFAULT_ENTROPY_THRESHOLD,
        public_texts: Sequence[str] = (),
        registry: CollectorRegistry | None = None,
        component: str = "agent",
    ) -> None:
        if ngram < 1:
            raise ValueError(f"ngram must be at least 1, got {ngram}")
        if not math.isfinite(entropy_threshold) or entropy_threshold < 0:
            raise ValueError(f"entropy_threshold must be finite and >= 0: {entropy_threshold}")
        self._n = ngram
        self._entropy_threshold = entropy_threshold
        index = _build_index(private_texts, ngram)
        if len(public_texts) and len(index):
            index = np.setdiff1d(index, _build_index(public_texts, ngram), assume_unique=True)
        self._index: _U64 = index
        self._code = CodeIndex(private_texts, public_texts, code_ngram) if private_texts else None
        self._component = component
        self._removals: Counter | None = None
        self._rejected: Counter | None = None
        if registry is not None:
            self._removals = get_counter(
                registry,
                "peerlm_agent_guardrail_removals_total",
                "Spans removed from outgoing texts by the Guardrail Filter, by kind",
                ("component", "kind"),
            )
            self._rejected = get_counter(
                registry,
                "peerlm_agent_guardrail_incoming_rejected_total",
                "Items of incoming packages not learnt from, by reason",
                ("component", "reason"),
            )
        self._log: Any = structlog.get_logger("peerlm.agent.vetting.guardrail").bind(
            component=component
        )

    @property
    def ngram(self) -> int:
        """Window length, in whitespace-separated tokens, of the leakage check."""
        return self._n

    @property
    def indexed_ngrams(self) -> int:
        """Distinct private n-grams in the index (8 bytes of memory each)."""
        return len(self._index)

    # -- public API ---------------------------------------------------------------------------

    def filter_text(self, text: str, prompt: str | None = None) -> GuardrailResult:
        """Filter one text; counts and logs (counts only) what was removed.

        ``prompt``: the public prompt ``text`` answers (a transfer prompt). What the answer
        repeats from it (its constants, strings, names) is never taken for a private leak.
        """
        result = self._filter(text, prompt=prompt)
        if result.removals:
            self._record(result.removals, texts=1)
        return result

    def filter_many(
        self, texts: Iterable[str], prompts: Sequence[str] | None = None
    ) -> list[GuardrailResult]:
        """Filter each text; one metric update and one log line for the whole batch.

        ``prompts``, when given, are the public prompts the texts answer, one per text
        (see :meth:`filter_text`).
        """
        texts = list(texts)
        if prompts is not None and len(prompts) != len(texts):
            raise ValueError(f"{len(texts)} texts but {len(prompts)} prompts")
        contexts = [None] * len(texts) if prompts is None else list(prompts)
        results = [
            self._filter(text, prompt=prompt) for text, prompt in zip(texts, contexts, strict=True)
        ]
        totals: collections.Counter[str] = collections.Counter()
        for result in results:
            totals.update(result.removals)
        if totals:
            self._record(dict(totals), texts=len(results))
        return results

    def vet_incoming(self, texts: Iterable[str]) -> list[str | None]:
        """Vet the items of an incoming package; per item ``None`` (learn from it) or the
        reason it is refused.

        ``secret:<kinds>``: the filter would remove something (secrets, personal data,
        disguised secrets, invisible characters; not the private-leak checks, which are
        about this agent's own data going out). ``import:<modules>``: the code imports or
        dynamically loads networking, process, file-system or introspection modules
        (:func:`peerlm.agent.vetting.incoming.risky_imports`). Refusals are counted in
        ``peerlm_agent_guardrail_incoming_rejected_total{component, reason}`` and logged
        without content.
        """
        verdicts: list[str | None] = []
        for text in texts:
            result = self._filter(text, private=False)
            if result.removals:
                verdicts.append("secret:" + ",".join(sorted(result.removals)))
                continue
            modules = risky_imports(text)
            verdicts.append("import:" + ",".join(modules) if modules else None)
        refused = collections.Counter(v.split(":", 1)[0] for v in verdicts if v is not None)
        if refused:
            if self._rejected is not None:
                for reason, count in refused.items():
                    self._rejected.labels(self._component, reason).inc(count)
            self._log.warning("guardrail_incoming_refused", items=len(verdicts), **refused)
        return verdicts

    # -- internals ----------------------------------------------------------------------------

    def _record(self, removals: dict[str, int], *, texts: int) -> None:
        if self._removals is not None:
            for kind, count in removals.items():
                self._removals.labels(self._component, kind).inc(count)
        # Counts only: the removed content must never reach a log.
        self._log.info(
            "guardrail_redacted",
            texts=texts,
            removed=sum(removals.values()),
            removals=dict(sorted(removals.items())),
        )

    def _filter(
        self, text: str, *, private: bool = True, prompt: str | None = None
    ) -> GuardrailResult:
        totals: collections.Counter[str] = collections.Counter()
        context = PromptVocabulary(prompt) if prompt is not None else None
        for _ in range(_MAX_PASSES):
            text, counts = self._one_pass(text, private=private, context=context)
            if not counts:
                break
            totals.update(counts)
        return GuardrailResult(text, {k: totals[k] for k in KINDS if totals[k]})

    def _one_pass(
        self, text: str, *, private: bool = True, context: PromptVocabulary | None = None
    ) -> tuple[str, dict[str, int]]:
        counts: dict[str, int] = {}
        text, hidden = strip_invisible(text)
        if hidden:
            counts["invisible"] = hidden
        if private:
            text, leaked = self._remove_private_ngrams(text, context)
            if leaked:
                counts["private_text"] = leaked
            if self._code is not None:
                skip = [m.span() for m in _PLACEHOLDER.finditer(text)]
                spans = self._code.leaked_spans(text, skip, context)
                if spans:
                    text = _replace_spans(text, spans, placeholder("private_code"))
                    counts["private_code"] = len(spans)
        spans = encoded_spans(text, self._is_secret)
        if spans:
            text = _replace_spans(text, spans, placeholder("encoded_secret"))
            counts["encoded_secret"] = len(spans)
        for pattern in _PATTERNS_ANY_CASE:
            text, found = _redact(pattern, text)
            if found:
                counts[pattern.kind] = counts.get(pattern.kind, 0) + found
        for pii in PII_PATTERNS:
            text, found = _redact_valid(pii.kind, pii.regex, pii.valid, text)
            if found:
                counts[pii.kind] = counts.get(pii.kind, 0) + found
        text, found = self._redact_high_entropy(text)
        if found:
            counts["high_entropy"] = found
        return text, counts

    def _remove_private_ngrams(
        self, text: str, context: PromptVocabulary | None = None
    ) -> tuple[str, int]:
        if not len(self._index):
            return text, 0
        matches = list(_TOKEN.finditer(text))
        windows, usable = _window_hashes([m.group() for m in matches], self._n)
        if not len(windows):
            return text, 0
        if context is not None:
            # Answering a public prompt, a window leaks only with a literal the prompt lacks
            # or a run of prose the prompt lacks (PromptVocabulary).
            words = [m.group() for m in matches]
            has_literal = window_counts(context.fresh_literals(words), self._n) > 0
            # Prose: at least half the window's words are plain words the prompt lacks.
            prose = window_counts(context.fresh_words(words), self._n) * 2 >= self._n
            usable = usable & (has_literal | prose)
        positions = np.searchsorted(self._index, windows)
        found = self._index[np.minimum(positions, len(self._index) - 1)] == windows
        hits = np.flatnonzero(found & usable)
        if not len(hits):
            return text, 0
        # Mark every token covered by a leaking window; runs of marked tokens are the spans
        # (so overlapping and adjacent windows merge into one removal).
        delta = np.zeros(len(matches) + 1, dtype=np.int64)
        np.add.at(delta, hits, 1)
        np.add.at(delta, hits + self._n, -1)
        covered = np.cumsum(delta[:-1]) > 0
        spans: list[tuple[int, int]] = []
        start: int | None = None
        for i, flag in enumerate(covered.tolist()):
            if flag and start is None:
                start = i
            elif not flag and start is not None:
                spans.append((matches[start].start(), matches[i - 1].end()))
                start = None
        if start is not None:
            spans.append((matches[start].start(), matches[-1].end()))
        mark = placeholder("private_text")
        pieces: list[str] = []
        cursor = 0
        for begin, end in spans:
            pieces += [text[cursor:begin], mark]
            cursor = end
        pieces.append(text[cursor:])
        return "".join(pieces), len(spans)

    def _is_secret(self, value: str) -> bool:
        """Whether a joined or decoded value holds a secret (pattern or random-looking run)."""
        if _MARKER in value:
            return False
        if any(p.regex.search(value) for p in _PATTERNS_ANY_CASE if p.kind != "email"):
            return True
        return any(
            is_high_entropy(m.group(), self._entropy_threshold) for m in _RUN.finditer(value)
        )

    def _redact_high_entropy(self, text: str) -> tuple[str, int]:
        found = 0
        mark = placeholder("high_entropy")

        def replace(match: re.Match[str]) -> str:
            nonlocal found
            if is_high_entropy(match.group(), self._entropy_threshold):
                found += 1
                return mark
            return match.group()

        return _RUN.sub(replace, text), found


def _replace_spans(text: str, spans: Sequence[tuple[int, int]], mark: str) -> str:
    pieces: list[str] = []
    cursor = 0
    for begin, end in spans:
        pieces += [text[cursor:begin], mark]
        cursor = end
    pieces.append(text[cursor:])
    return "".join(pieces)


def _redact_valid(kind: str, regex: re.Pattern[str], valid: Any, text: str) -> tuple[str, int]:
    found = 0
    mark = placeholder(kind)

    def replace(match: re.Match[str]) -> str:
        nonlocal found
        if valid(match):
            found += 1
            return mark
        return match.group()

    return regex.sub(replace, text), found


def _redact(pattern: _Pattern, text: str) -> tuple[str, int]:
    found = 0
    mark = placeholder(pattern.kind)

    def replace(match: re.Match[str]) -> str:
        nonlocal found
        found += 1
        if pattern.group is None:
            return mark
        whole, base = match.group(), match.start()
        start, end = match.span(pattern.group)
        return whole[: start - base] + mark + whole[end - base :]

    return pattern.regex.sub(replace, text), found
