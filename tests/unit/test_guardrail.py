"""The Guardrail Filter: planted secrets go, ordinary code stays, private text does not leak."""

from __future__ import annotations

import base64
import collections
import fnmatch
import functools
import heapq
import inspect
import json
import random
import shutil
import string
import textwrap
import urllib.parse

import pytest
import structlog
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from peerlm.agent.vetting.code_index import PromptVocabulary, code_tokens
from peerlm.agent.vetting.guardrail import (
    KINDS,
    Guardrail,
    is_high_entropy,
    placeholder,
    shannon_entropy,
)
from prometheus_client import CollectorRegistry

PRIVATE = [
    "the patient record for ward seven lists a severe allergy to penicillin and latex gloves",
    "def acme_internal_pricing(customer, tier):\n    return customer.base_rate * TIER_MULTIPLIER"
    "[tier] - loyalty_discount(customer)  # confidential formula from finance",
]

# One planted instance of each secret kind (built at run time so that no scanner flags this
# file as leaking credentials).
_GH = "ghp_" + "A1b2C3d4E5" * 4
_AWS = "AKIA" + "IOSFODNN7EXAMPLE"
_SLACK = "xoxb-" + "1234567890-0987654321-AbCdEfGhIjKlMnOp"
_SK = "sk-proj-" + "Xy9Zq8Wv7Ut6Sr5Qp4On3Ml2"
_JWT = (
    "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9."
    "eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkpvaG4gRG9lIn0."
    "SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c"
)
_BEARER = "Qm9vZ2llV29vZ2llQm9vZ2ll"
_PEM = (
    "-----BEGIN RSA PRIVATE KEY-----\n"
    "MIIEowIBAAKCAQEAu1SU1LfVLPHCozMxH2Mo4lgOEePzNm0tRgeLezV6ffAt0gun\n"
    "VTLw7onLRnrq0/IzW7yWR7QkrmBL7jTKEn5u+qKhbwKfBstIs+bMY2Zkp18gnTxK\n"
    "-----END RSA PRIVATE KEY-----"
)
_ENTROPY = "Zx8Qp3Lk9Vb2Nw7Rt5Ym1Hc4Jd6"

PLANTED = {
    "email": "Write to jane.doe@example.com for access.",
    "aws_access_key": f"aws_key_id {_AWS} is active",
    "github_token": f"git clone https://{_GH}@github.com/acme/x",
    "slack_token": f"SLACK={_SLACK}",
    "secret_key": f"client = OpenAI({_SK!r})",
    "api_key": 'API_KEY = "k9d8s7a6f5g4h3j2"',
    "bearer_token": f"Authorization: Bearer {_BEARER}",
    "jwt": f"token {_JWT} expires",
    "private_key": f"key:\n{_PEM}\nend",
    "high_entropy": f"salt {_ENTROPY} ok",
    "ssn": "patient ssn 123-45-6789 on file",
    "card_number": "card 4111 1111 1111 1111 exp 12/29",
    "phone": "call +1 (415) 555-0132 today",
    "internal_ip": "db at 10.20.30.40:5432",
    "encoded_secret": f"k = {_AWS[:6]!r} + {_AWS[6:]!r}",
    "invisible": "a\u200bb",
}

SECRET_VALUES = {
    "email": "jane.doe@example.com",
    "aws_access_key": _AWS,
    "github_token": _GH,
    "slack_token": _SLACK,
    "secret_key": _SK,
    "api_key": "k9d8s7a6f5g4h3j2",
    "bearer_token": _BEARER,
    "jwt": _JWT,
    "private_key": "MIIEowIBAAKCAQEAu1SU1LfVLPHCozMxH2Mo4lgOEePzNm0tRgeLezV6ffAt0gun",
    "high_entropy": _ENTROPY,
    "ssn": "123-45-6789",
    "card_number": "4111 1111 1111 1111",
    "phone": "555-0132",
    "internal_ip": "10.20.30.40",
    "encoded_secret": _AWS[6:],
    "invisible": "\u200b",
}


@pytest.fixture(scope="module")
def guard() -> Guardrail:
    return Guardrail(PRIVATE)


@pytest.mark.parametrize("kind", sorted(PLANTED))
def test_each_planted_secret_is_removed_and_counted(guard: Guardrail, kind: str) -> None:
    result = guard.filter_text(PLANTED[kind])
    assert SECRET_VALUES[kind] not in result.text
    # Invisible characters are dropped without a placeholder: one inside a secret must
    # leave the secret whole for the patterns.
    assert (placeholder(kind) in result.text) == (kind != "invisible")
    assert result.removals == {kind: 1}


def test_all_secrets_at_once_counts_every_kind(guard: Guardrail) -> None:
    text = "\n".join(PLANTED.values())
    result = guard.filter_text(text)
    assert result.removals == dict.fromkeys(PLANTED, 1)
    for value in SECRET_VALUES.values():
        assert value not in result.text
    # Context survives: only the secret spans go.
    assert "Authorization: Bearer " + placeholder("bearer_token") in result.text
    assert 'API_KEY = "' + placeholder("api_key") + '"' in result.text


def test_assignment_forms() -> None:
    guard = Guardrail([])
    cases = [
        '"password": "correct-horse-42"',
        "db_password = 'S3cure!pass'",
        "export GITLAB_TOKEN=abc123def456ghi789jkl",
        "client_secret: 9f8e7d6c5b4a39281706",
    ]
    for text in cases:
        assert guard.filter_text(text).removals == {"api_key": 1}, text
    # Not secrets: words ending differently, short or obviously non-secret values, calls.
    for text in [
        'tokenizer = "bert-base-uncased"',
        "max_tokens = 1024",
        'token_type = "access_token"',
        "api_key = load_api_key_from_environment2(path)",
        'eos_token = "</s>"',
    ]:
        assert guard.filter_text(text).removals == {}, text


@pytest.fixture(scope="module")
def stdlib_code() -> str:
    """Source of a few ordinary standard-library functions (not frozen modules)."""
    return "\n\n".join(
        inspect.getsource(fn)
        for fn in (
            json.dumps,
            json.loads,
            textwrap.dedent,
            textwrap.TextWrapper._wrap_chunks,
            random.Random.shuffle,
            string.capwords,
            shutil.copyfileobj,
            heapq.nsmallest,
            urllib.parse.urlsplit,
            functools.total_ordering,
            collections.Counter.most_common,
            fnmatch.translate,
        )
    )


def test_ordinary_code_and_prose_are_untouched(guard: Guardrail, stdlib_code: str) -> None:
    result = guard.filter_text(stdlib_code)
    assert result.removals == {}
    assert result.text == stdlib_code
    prose = (
        "Internationalization and responsibilities of the HighDpiScaleFactorRoundingPolicy "
        "class, test_something_really_long_identifier_name and CamelCaseIdentifierNames."
    )
    assert guard.filter_text(prose).text == prose


def test_leaked_private_ngrams_are_removed_novel_text_stays(guard: Guardrail) -> None:
    leak = (
        "As noted, the patient record for ward seven lists a severe allergy to penicillin "
        "and nothing else."
    )
    result = guard.filter_text(leak)
    assert result.removals == {"private_text": 1}
    assert "penicillin" not in result.text
    assert result.text.startswith("As noted, " + placeholder("private_text"))
    # Whitespace differences do not hide a leak (tokens are whitespace-normalised).
    spaced = (
        "code:  def   acme_internal_pricing(customer,\ttier):\n\n return customer.base_rate"
        " *  TIER_MULTIPLIER[tier]   - ..."
    )
    assert guard.filter_text(spaced).removals == {"private_text": 1}
    # Seven shared words (< n = 8) are not a leak; novel text stays.
    novel = "the patient record for ward seven lists nothing unusual today"
    assert guard.filter_text(novel).text == novel


def test_overlapping_windows_merge_into_one_span(guard: Guardrail) -> None:
    words = PRIVATE[0].split()
    text = "START " + " ".join(words) + " END"
    result = guard.filter_text(text)
    assert result.text == f"START {placeholder('private_text')} END"
    assert result.removals == {"private_text": 1}
    two = "a " + " ".join(words[:9]) + " middle words here " + " ".join(words[-9:]) + " z"
    assert guard.filter_text(two).removals == {"private_text": 2}


def test_public_texts_are_not_leaks() -> None:
    shared = "def add(a, b):\n    return a + b  # add two numbers together please"
    guard = Guardrail([shared + " and private tail words follow"], public_texts=[shared])
    assert guard.filter_text(shared).removals == {}
    assert guard.indexed_ngrams > 0


def test_metrics_and_logs_count_without_content() -> None:
    registry = CollectorRegistry()
    guard = Guardrail(PRIVATE, registry=registry, component="agent")
    with structlog.testing.capture_logs() as logs:
        guard.filter_many([PLANTED["email"], PLANTED["jwt"], "nothing here", PLANTED["email"]])
        guard.filter_text(PLANTED["aws_access_key"])

    def count(kind: str) -> float:
        value = registry.get_sample_value(
            "peerlm_agent_guardrail_removals_total", {"component": "agent", "kind": kind}
        )
        return value or 0.0

    assert count("email") == 2 and count("jwt") == 1 and count("aws_access_key") == 1
    assert len(logs) == 2
    assert logs[0]["removals"] == {"email": 2, "jwt": 1} and logs[0]["texts"] == 4
    dumped = json.dumps(logs, default=str)
    for value in SECRET_VALUES.values():
        assert value not in dumped
    # A second guardrail on the same registry shares the counter instead of failing.
    Guardrail([], registry=registry).filter_text(PLANTED["email"])
    assert count("email") == 3


def test_entropy_rule() -> None:
    assert shannon_entropy("") == 0.0
    assert shannon_entropy("aaaa") == 0.0
    assert shannon_entropy("abcd") == pytest.approx(2.0)
    rng = random.Random(7)
    alphabet = string.ascii_letters + string.digits
    caught = sum(
        is_high_entropy("".join(rng.choice(alphabet) for _ in range(32))) for _ in range(200)
    )
    assert caught >= 170  # ~93% documented for 32 characters
    # Detection is statistical (documented 85-97%), so measure rates on seeded samples
    # rather than single random draws, which made this test flaky.
    hexes = ["".join(rng.choice("0123456789abcdef") for _ in range(40)) for _ in range(200)]
    assert sum(map(is_high_entropy, hexes)) >= 180
    blobs = [
        base64.b64encode(bytes(rng.randrange(256) for _ in range(32))).decode() for _ in range(200)
    ]
    assert sum(map(is_high_entropy, blobs)) >= 180
    for word in [
        "HighDpiScaleFactorRoundingPolicy",
        "test_something_really_long_identifier",
        "ABCDEFGHIJKLMNOPQRSTUVWXYZ",
        "internationalization_support",
        "short",
    ]:
        assert not is_high_entropy(word), word


def test_kinds_and_bad_arguments() -> None:
    assert set(PLANTED) | {"private_text", "private_code"} == set(KINDS)
    assert all(len(kind) < 20 for kind in KINDS)  # placeholders never look high-entropy
    with pytest.raises(ValueError):
        Guardrail([], ngram=0)
    with pytest.raises(ValueError):
        Guardrail([], entropy_threshold=float("nan"))


_PIECES = st.sampled_from(
    [*PLANTED.values(), *PRIVATE, "plain words", "x = 1\n", " ", "\n", "@", "=", "<", "\udc80"]
)


@pytest.fixture(scope="module")
def small_guard() -> Guardrail:
    return Guardrail(PRIVATE, ngram=4)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parts=st.lists(st.one_of(_PIECES, st.text(max_size=40)), max_size=8))
def test_filtering_is_idempotent(small_guard: Guardrail, parts: list[str]) -> None:
    once = small_guard.filter_text("".join(parts))
    twice = small_guard.filter_text(once.text)
    assert twice.text == once.text
    assert twice.removals == {}


# -- disguises, personal data, private code, incoming packages ------------------------------


@pytest.mark.parametrize(
    "text",
    [
        f'key = "{_AWS[:7]}" + "{_AWS[7:]}"',  # concatenation
        f'TOKEN = ("{_GH[:9]}"\n         "{_GH[9:]}")',  # implicit, across lines
        f'blob = bytes.fromhex("{_AWS.encode().hex()}")',  # hex
        "blob = b'" + "".join(f"\\x{b:02x}" for b in _GH.encode()) + "'",  # \\x escapes
        f'blob = "{base64.b32encode(_GH.encode()).decode()}"',  # base32
        f"k = '{chr(0x200B).join(_AWS)}'",  # zero-width spaces
        f"k = '{_AWS.lower()}'",  # case
        "-----begin rsa private key-----\nMIIEowIBAAKCAQEAu1SU1LfVLPHCozMxH2Mo4lgOEePzNm0tRge\n",
    ],
)
def test_disguised_secrets_are_removed(guard: Guardrail, text: str) -> None:
    result = guard.filter_text(text)
    assert result.removed >= 1, text
    for secret in (_AWS, _GH, _AWS.lower(), _AWS[7:], _GH[9:]):
        assert secret not in result.text


def test_personal_data_needs_a_valid_shape(guard: Guardrail) -> None:
    for text in (
        "ssn 666-12-3456 and 000-12-3456 are never issued",
        "order 4111 1111 1111 1112 fails the Luhn check",
        "loopback 127.0.0.1, any 0.0.0.0, public 8.8.8.8, version 1.2.3.4",
        "dates 2024-01-15 and ranges 3-4 stay",
        "x = 1234567890",
    ):
        assert guard.filter_text(text).removals == {}, text
    for address in ("192.168.1.20", "172.16.0.9", "169.254.10.1", "fd12:3456::1"):
        assert guard.filter_text(f"host {address} here").removals == {"internal_ip": 1}


PUBLIC_CODE = [
    'def double_up(x: int) -> int:\n    """Return x times 2 plus 1."""\n    return x * 2 + 1\n'
]
PRIVATE_CODE = [
    'def secret_rate(price: int) -> int:\n    """Confidential."""\n    return price * 37 + 1291\n',
    'def lookup(s: str) -> str:\n    return s.replace("vault-7", "q")[::-1] + \'!\'\n',
]


def test_private_code_is_found_dense_reformatted_and_renamed() -> None:
    guard = Guardrail(PRIVATE_CODE, public_texts=PUBLIC_CODE)
    for leak in (
        "return price * 37 + 1291\n",  # six code tokens: below any word 8-gram
        "return price*37+1291",
        "return cost * 37 + 1291  # renamed",
        'out = s.replace("vault-7", "q")[::-1]',
        "return t.replace('vault-7', 'q')[::-1] + \"!\"",  # other quotes, other name
    ):
        result = guard.filter_text(leak)
        assert result.removals.get("private_code") == 1, leak
        assert "1291" not in result.text and "vault-7" not in result.text
    # Public shapes, other constants, and plain prose stay.
    for honest in ("return x * 2 + 1\n", "return price * 36 + 1291\n", "return n * 2 + 1"):
        assert guard.filter_text(honest).removals == {}, honest


def test_private_code_recall_and_false_positives_on_the_bundled_bank() -> None:
    from peerlm.bench.guardrail import measure

    figures = measure(per_category=10, seed=3)
    # The earlier filter (whitespace 8-grams): renamed 0.0, body about 0.65; honest about 0.39.
    assert figures["leak_recall_not_public"]["body"] >= 0.9
    assert figures["leak_recall_not_public"]["renamed"] >= 0.8
    assert all(share == 1.0 for share in figures["secret_recall"].values())
    assert figures["false_positive"]["bank_not_a_private_function"] <= 0.05
    assert figures["false_positive"]["stdlib"] == 0.0


def test_incoming_items_are_vetted_and_refusals_counted() -> None:
    registry = CollectorRegistry()
    guard = Guardrail(PRIVATE, registry=registry)
    verdicts = guard.vet_incoming(
        [
            "return sorted(xs)[::-1]\n",
            "import os\nreturn os.listdir('/')\n",
            "    from subprocess import run\n    run(['id'])\n",  # an indented body
            "return __import__('socket').gethostname()\n",
            "m = importlib.import_module(name)\n",
            "if x:\n  import ctypes\n  return (\n",  # does not parse: the line scan
            f"return '{_AWS}'\n",
            PRIVATE[0],  # the student's own private text is not a reason to refuse
        ]
    )
    assert verdicts == [
        None,
        "import:os",
        "import:subprocess",
        "import:socket",
        "import:importlib",
        "import:ctypes",
        "secret:aws_access_key",
        None,
    ]
    sample = registry.get_sample_value
    name = "peerlm_agent_guardrail_incoming_rejected_total"
    assert sample(name, {"component": "agent", "reason": "import"}) == 5
    assert sample(name, {"component": "agent", "reason": "secret"}) == 1


# --- answering a public prompt (the guardrail once blocked the skill it should pass on)

_PRIVATE_DICT = [
    'def get_value(d: dict[str, int], key: str) -> int:\n    """Return the value stored for key'
    ' in d, or -3 if key is missing."""\n    return d.get(key, -3)\n',
    'def keep_small(d: dict[str, int]) -> dict[str, int]:\n    """Return the entries of d whose'
    ' value is less than 7."""\n    return {key: value for key, value in d.items() if value < 7}\n',
    'def salute(name: str) -> str:\n    """Return the text "Greetings from the north tower, '
    '<name>." for the given name."""\n    return f"Greetings from the north tower, {name}."\n',
]
_PROMPT_12 = (
    'def lookup(d: dict[str, int], key: str) -> int:\n    """Return the value stored for key in'
    ' d, or 12 if key is missing.\n\n    >>> lookup({"a": 1}, "b")\n    12\n    """\n'
)
_PROMPT_10 = (
    'def keep_entries(d: dict[str, int]) -> dict[str, int]:\n    """Return the entries of d whose'
    ' value is less than 10.\n    """\n'
)


def test_an_answer_that_repeats_its_prompt_is_no_leak() -> None:
    guard = Guardrail(_PRIVATE_DICT)
    for prompt, answer in (
        (_PROMPT_12, "return d.get(key, 12)\n"),
        (_PROMPT_10, "return {key: value for key, value in d.items() if value < 10}\n"),
    ):
        # The skill (the private examples' structure) with the prompt's own constants.
        assert guard.filter_text(answer, prompt).removals == {}, answer
        assert guard.filter_many([answer], [prompt])[0].text == answer
    # Without the prompt the structure alone is taken for private code, as before.
    assert guard.filter_text("return {key: value for key, value in d.items() if value < 7}\n")
    assert guard.filter_text("return d.get(key, -3)\n").removals


def test_private_constants_prose_and_examples_still_leak_under_a_prompt() -> None:
    guard = Guardrail(_PRIVATE_DICT)
    # A private example's own constant, not the prompt's: redacted.
    leaked = guard.filter_text("return d.get(key, -3)\n", _PROMPT_12)
    assert leaked.removals.get("private_code") == 1 and "-3" not in leaked.text
    # Private prose the prompt does not hold (8 words of a private docstring).
    prose = '# the text "Greetings from the north tower, <name>." for the given name\n'
    assert guard.filter_text(prose, _PROMPT_12).removals == {"private_text": 1}
    # A whole private example pasted as an answer.
    assert guard.filter_text(_PRIVATE_DICT[1], _PROMPT_12).removals


def test_prompts_must_match_the_texts_one_to_one() -> None:
    with pytest.raises(ValueError, match="2 texts but 1 prompts"):
        Guardrail(_PRIVATE_DICT).filter_many(["a", "b"], ["p"])


def test_on_the_bundled_bank_answers_pass_and_private_bodies_do_not() -> None:
    """Per private category: an expert's guardrail lets the references of public transfer
    prompts of its own category through, and still redacts its own private bodies given as
    the answer to another prompt."""
    from peerlm.agent.tasks.bank import generate_bank

    bank = generate_bank({"dict": 60, "sequence": 60}, seed=11)
    for category in ("dict", "sequence"):
        problems = [p for p in bank if p.category == category]
        private, transfer = problems[:40], problems[40:]
        guard = Guardrail([p.prompt + p.reference for p in private])
        kept = sum(not guard.filter_text(p.reference, p.prompt).removals for p in transfer)
        assert kept >= 0.9 * len(transfer), (category, kept)
        # Given as the answer to another prompt, every private body that holds a constant
        # or string of its own (one the prompt does not give) is caught; a body without one
        # (``return sum(d.values())``) is structure, the skill, and passes by design.
        other = next(p.prompt for p in bank if p.category != category)
        vocabulary = PromptVocabulary(other)
        identifying = [
            p for p in private if any(not vocabulary.gives(t) for t in code_tokens(p.reference))
        ]
        assert len(identifying) >= 0.5 * len(private), category
        for p in identifying:
            assert guard.filter_text(p.reference, other).removals, p.reference
