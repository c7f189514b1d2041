"""Undoing the disguises a leaked secret hides behind, and personal data (Guardrail helpers).

* invisible characters: zero-width spaces and joiners, word joiners, byte-order marks and
  bidirectional controls (Unicode category ``Cf``) split a secret for the eye and for
  regular expressions; :func:`strip_invisible` removes them all.
* string concatenation: ``"AKIA" + "IOSF…"`` or adjacent literals ``("ghp_" "abc…")``;
  :func:`encoded_spans` joins each run of literals and tests the joined value.
* encodings: runs of hex digits, ``\\xNN`` escapes, base32 and base64 are decoded; a
  decoded value that is printable text is tested.
* personal data: :data:`PII_PATTERNS` with validators (Luhn for card numbers, the SSA's
  invalid areas for SSNs, :mod:`ipaddress` for internal addresses).

The secret test itself is the caller's (the Guardrail's patterns and entropy rule), passed
in as a function, so this module holds no policy about what a secret looks like.
"""

from __future__ import annotations

import ast
import base64
import binascii
import ipaddress
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

__all__ = ["PII_PATTERNS", "PiiPattern", "encoded_spans", "luhn_valid", "strip_invisible"]

_MAX_DECODE: Final = 4096  # characters of one run worth decoding


def strip_invisible(text: str) -> tuple[str, int]:
    """``text`` without format (``Cf``) characters, and how many runs were removed."""
    if text.isascii():
        return text, 0
    out: list[str] = []
    runs = 0
    previous_removed = False
    for ch in text:
        if unicodedata.category(ch) == "Cf":
            if not previous_removed:
                runs += 1
            previous_removed = True
            continue
        previous_removed = False
        out.append(ch)
    return ("".join(out), runs) if runs else (text, 0)


_LITERAL = r"(?:[rRbBuU]{0,2})(?:\"(?:[^\"\\\n]|\\.)*\"|'(?:[^'\\\n]|\\.)*')"
_CONCAT: Final = re.compile(rf"{_LITERAL}(?:(?:\s|\\\n)*\+?(?:\s|\\\n)*{_LITERAL})+")
_HEX: Final = re.compile(r"(?<![0-9A-Za-z])(?:[0-9A-Fa-f]{2}){10,}(?![0-9A-Za-z])")
_ESCAPES: Final = re.compile(r"(?:\\x[0-9A-Fa-f]{2}){8,}")
_BASE32: Final = re.compile(r"(?<![A-Za-z0-9])[A-Z2-7]{16,}={0,6}(?![A-Za-z0-9])")
_BASE64: Final = re.compile(r"(?<![A-Za-z0-9+/])[A-Za-z0-9+/]{16,}={0,2}(?![A-Za-z0-9+/])")


def _literal_value(raw: str) -> str:
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return raw.strip("\"'")
    if isinstance(value, bytes):
        return value.decode("latin-1")
    return str(value)


def _printable(data: bytes) -> str | None:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text if text.isprintable() and len(text) >= 8 else None


def _decode_hex(run: str) -> str | None:
    return _printable(bytes.fromhex(run))


def _decode_escapes(run: str) -> str | None:
    return _printable(bytes(int(run[i + 2 : i + 4], 16) for i in range(0, len(run), 4)))


def _decode_base32(run: str) -> str | None:
    core = run.rstrip("=")
    try:
        return _printable(base64.b32decode(core + "=" * (-len(core) % 8)))
    except (binascii.Error, ValueError):
        return None


def _decode_base64(run: str) -> str | None:
    core = run.rstrip("=")
    try:
        return _printable(base64.b64decode(core + "=" * (-len(core) % 4), validate=True))
    except (binascii.Error, ValueError):
        return None


_DECODERS: Final[tuple[tuple[re.Pattern[str], Callable[[str], str | None]], ...]] = (
    (_ESCAPES, _decode_escapes),
    (_HEX, _decode_hex),
    (_BASE32, _decode_base32),
    (_BASE64, _decode_base64),
)


def encoded_spans(text: str, is_secret: Callable[[str], bool]) -> list[tuple[int, int]]:
    """Spans of ``text`` whose joined or decoded value ``is_secret`` (merged, in order)."""
    spans: list[tuple[int, int]] = []
    for match in _CONCAT.finditer(text):
        parts = re.findall(_LITERAL, match.group())
        if is_secret("".join(_literal_value(p) for p in parts)):
            spans.append(match.span())
    for pattern, decode in _DECODERS:
        for match in pattern.finditer(text):
            run = match.group()
            if len(run) > _MAX_DECODE:
                continue
            decoded = decode(run)
            if decoded is not None and is_secret(decoded):
                spans.append(match.span())
    spans.sort()
    merged: list[tuple[int, int]] = []
    for begin, end in spans:
        if merged and begin <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((begin, end))
    return merged


def luhn_valid(digits: str) -> bool:
    """The Luhn checksum of a digit string (card numbers)."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2 == 1:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _card(match: re.Match[str]) -> bool:
    digits = re.sub(r"[ -]", "", match.group())
    return 13 <= len(digits) <= 19 and digits[0] in "23456" and luhn_valid(digits)


def _ssn(match: re.Match[str]) -> bool:
    area, group, serial = match.group().split("-")
    return area not in ("000", "666") and area[0] != "9" and group != "00" and serial != "0000"


def _internal_ip(match: re.Match[str]) -> bool:
    try:
        address = ipaddress.ip_address(match.group())
    except ValueError:
        return False
    # Loopback and unspecified addresses are everywhere in ordinary code and say nothing
    # about anyone's network; private, link-local and unique-local ones do.
    return (address.is_private or address.is_link_local) and not (
        address.is_loopback or address.is_unspecified
    )


@dataclass(frozen=True)
class PiiPattern:
    """A personal-data candidate and the check a candidate must pass."""

    kind: str
    regex: re.Pattern[str]
    valid: Callable[[re.Match[str]], bool]


PII_PATTERNS: Final[tuple[PiiPattern, ...]] = (
    PiiPattern("ssn", re.compile(r"(?<![\w-])\d{3}-\d{2}-\d{4}(?![\w-])"), _ssn),
    PiiPattern("card_number", re.compile(r"(?<![\w-])\d(?:[ -]?\d){12,18}(?![\w-])"), _card),
    PiiPattern(
        "phone",
        re.compile(
            r"(?<![\w+.-])(?:\+?1[ .-]?)?(?:\(\d{3}\)[ .-]?|\d{3}[ .-])\d{3}[ .-]\d{4}(?![\w-])"
            r"|(?<![\w+])\+\d{1,3}(?:[ .-]\(?\d{1,4}\)?){2,5}(?![\w-])"
        ),
        lambda m: 10 <= sum(ch.isdigit() for ch in m.group()) <= 15,
    ),
    PiiPattern(
        "internal_ip",
        re.compile(
            r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?![\w.])"
            r"|(?<![\w:])(?:f[cdCD][0-9a-fA-F]{2}|fe80):[0-9a-fA-F:]{2,}(?![\w:])"
        ),
        _internal_ip,
    ),
)
