"""AKD knowledge packages: round trips, strict validation, guardrail on the way in, no pickle."""

from __future__ import annotations

import ast
import json
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy
from peerlm.agent.exchange import package as pkg_module
from peerlm.agent.exchange.package import (
    PACKAGE_CONTENT_TYPE,
    LogitsItem,
    LogitsPackage,
    PackageError,
    TextItem,
    TextPackage,
    build_logits_package,
    build_text_package,
    decode_package,
    encode_package,
    package_size_kb,
    prompt_sha256,
    student_limits,
    text_pairs,
)
from peerlm.agent.vetting.guardrail import Guardrail, placeholder

ROOT = Path(__file__).resolve().parents[2]
TRANSFER = "ab" * 32
PROMPTS = ["def add(a, b):", "def fib(n):", 'def greet(name):\n    """Say hello."""']


def _text_package(**over: Any) -> TextPackage:
    fields: dict[str, Any] = {
        "teacher": "a1",
        "directive_id": "0123456789abcdef0123456789abcdef",
        "transfer_sha256": TRANSFER,
        "model_family": "llama",
        "items": tuple(
            TextItem(str(i), prompt_sha256(p), f"    return {i}  # é ✓\n")
            for i, p in enumerate(PROMPTS)
        ),
        "created_at": 1_700_000_000.25,
    }
    fields.update(over)
    return TextPackage(**fields)


def _logits_package(dtype: Any = np.float16, **over: Any) -> LogitsPackage:
    rng = np.random.default_rng(0)
    items = []
    for i, p in enumerate(PROMPTS):
        length = 3 + i
        probs = rng.dirichlet(np.ones(5), size=length)
        top = np.sort(probs, axis=1)[:, ::-1][:, :4]
        items.append(
            LogitsItem(
                str(i),
                prompt_sha256(p),
                rng.integers(0, 100, size=(length, 4), dtype=np.int32),
                np.log(top).astype(dtype),
            )
        )
    fields: dict[str, Any] = {
        "teacher": "a2",
        "directive_id": "d-1",
        "transfer_sha256": TRANSFER,
        "model_family": "gpt2",
        "items": tuple(items),
        "temperature": 2.5,
        "tokenizer_sha256": "cd" * 32,
        "vocab_size": 100,
        "created_at": 5.0,
    }
    fields.update(over)
    return LogitsPackage(**fields)


def test_text_round_trip() -> None:
    package = _text_package()
    data = encode_package(package)
    assert data[8:9] == b"{"  # a safetensors file: u64 header length, then JSON
    decoded = decode_package(data)
    assert decoded == package
    assert decoded.mode == "text"
    assert package_size_kb(data) == len(data) / 1024
    assert package_size_kb(2048) == 2.0
    assert PACKAGE_CONTENT_TYPE == "application/vnd.peerlm.akd+safetensors"


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_logits_round_trip(dtype: Any) -> None:
    package = _logits_package(dtype)
    decoded = decode_package(encode_package(package))
    assert isinstance(decoded, LogitsPackage)
    assert decoded.top_k == 4 and decoded.temperature == 2.5 and decoded.vocab_size == 100
    assert decoded.tokenizer_sha256 == "cd" * 32
    for mine, theirs in zip(package.items, decoded.items, strict=True):
        assert mine.prompt_id == theirs.prompt_id and mine.prompt_sha256 == theirs.prompt_sha256
        assert theirs.token_ids.dtype == np.int32 and theirs.logprobs.dtype == dtype
        np.testing.assert_array_equal(mine.token_ids, theirs.token_ids)
        np.testing.assert_array_equal(mine.logprobs, theirs.logprobs)


def test_empty_packages_round_trip() -> None:
    assert decode_package(encode_package(_text_package(items=()))).items == ()
    empty = decode_package(encode_package(_logits_package(items=())))
    assert empty.items == () and empty.mode == "logits"


def test_build_text_package_guardrails_every_text() -> None:
    private = ["our secret onboarding checklist says to rotate the vault key every monday"]
    guard = Guardrail(private)
    completions = [
        "    return a + b",
        "    # mail ops@acme.example.com with key AKIAIOSFODNN7EXAMPLE\n    return n",
        "    print('our secret onboarding checklist says to rotate the vault key every monday')",
    ]
    data = build_text_package(
        prompts=PROMPTS,
        completions=completions,
        teacher="a1",
        directive_id="dir1",
        transfer_sha256=TRANSFER,
        family="qwen",
        guardrail=guard,
    )
    package = decode_package(data, expect_transfer_sha256=TRANSFER, expect_teacher="a1")
    assert isinstance(package, TextPackage)
    texts = [item.text for item in package.items]
    assert texts[0] == completions[0]
    assert placeholder("email") in texts[1] and placeholder("aws_access_key") in texts[1]
    assert "vault key" not in texts[2] and placeholder("private_text") in texts[2]
    assert [i.prompt_id for i in package.items] == ["0", "1", "2"]
    assert text_pairs(package, list(reversed(PROMPTS))) == list(zip(PROMPTS, texts, strict=True))
    with pytest.raises(PackageError, match="not in our transfer set"):
        text_pairs(package, PROMPTS[:2])
    with pytest.raises(PackageError, match="completions"):
        build_text_package(
            prompts=PROMPTS,
            completions=completions[:2],
            teacher="a1",
            directive_id="dir1",
            transfer_sha256=TRANSFER,
            family="qwen",
            guardrail=guard,
        )


def test_build_logits_package_withholds_items_the_guardrail_would_change() -> None:
    vocab = ["x", " ", "a1@b.example", "ok", "return"]

    def detokenize(ids: Any) -> str:
        return "".join(vocab[i] for i in ids)

    ids = [np.array([[4, 0], [1, 0], [3, 0]]), np.array([[2, 0], [3, 0]])]
    lps = [np.full((3, 2), -0.5, np.float16), np.full((2, 2), -0.5, np.float16)]
    data, withheld = build_logits_package(
        prompts=PROMPTS[:2],
        token_ids=ids,
        logprobs=lps,
        teacher="a1",
        directive_id="dir1",
        transfer_sha256=TRANSFER,
        family="gpt2",
        temperature=1.5,
        tokenizer_sha256="ef" * 32,
        vocab_size=len(vocab),
        guardrail=Guardrail([]),
        detokenize=detokenize,
    )
    assert withheld == ["1"]
    package = decode_package(data)
    assert [item.prompt_id for item in package.items] == ["0"]


def test_expectations_pin_transfer_set_directive_teacher_and_prompts() -> None:
    data = encode_package(_text_package())
    with pytest.raises(PackageError, match="different X_u"):
        decode_package(data, expect_transfer_sha256="cd" * 32)
    with pytest.raises(PackageError, match="directive"):
        decode_package(data, expect_directive_id="other")
    with pytest.raises(PackageError, match="teacher"):
        decode_package(data, expect_teacher="a9")
    ours = {str(i): prompt_sha256(p) for i, p in enumerate(PROMPTS)}
    decode_package(data, expect_prompts=ours)
    with pytest.raises(PackageError, match="SHA-256 differs"):
        decode_package(data, expect_prompts={**ours, "1": prompt_sha256("something else")})
    with pytest.raises(PackageError, match="not in our X_u"):
        decode_package(data, expect_prompts={"0": ours["0"]})


def _resave(data: bytes, edit: Callable[[dict[str, np.ndarray], dict[str, str]], None]) -> bytes:
    """Re-encode a package's tensors and metadata after ``edit``, bypassing validation."""
    tensors = safetensors.numpy.load(data)
    size = int.from_bytes(data[:8], "little")
    metadata = json.loads(data[8 : 8 + size])["__metadata__"]
    edit(tensors, metadata)
    return bytes(safetensors.numpy.save(tensors, metadata=metadata))


def _items_json(entries: Any) -> np.ndarray:
    return np.frombuffer(json.dumps(entries).encode(), dtype=np.uint8).copy()


def _set(key: str, value: str) -> Callable[[dict[str, np.ndarray], dict[str, str]], None]:
    def edit(_: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
        metadata[key] = value

    return edit


def _drop(key: str) -> Callable[[dict[str, np.ndarray], dict[str, str]], None]:
    def edit(_: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
        del metadata[key]

    return edit


def _tensor(name: str, value: Any) -> Callable[[dict[str, np.ndarray], dict[str, str]], None]:
    def edit(tensors: dict[str, np.ndarray], _: dict[str, str]) -> None:
        tensors[name] = value

    return edit


TEXT_CORRUPTIONS: dict[str, tuple[Callable[..., None], str]] = {
    "no transfer hash": (_drop("transfer_sha256"), "metadata keys"),
    "empty transfer hash": (_set("transfer_sha256", ""), "transfer-set SHA-256"),
    "upper-case hash": (_set("transfer_sha256", "AB" * 32), "transfer-set SHA-256"),
    "wrong format": (_set("format", "other"), "not a knowledge package"),
    "future version": (_set("version", "2"), "version"),
    "unknown mode": (_set("mode", "audio"), "unknown package mode"),
    "count mismatch": (_set("items", "7"), "announces 7 items"),
    "count not a number": (_set("items", "-1"), "not a non-negative integer"),
    "extra metadata": (_set("note", "hi"), "unexpected"),
    "bad teacher": (_set("teacher", "../etc"), "teacher"),
    "NaN time": (_set("created_at", "nan"), "not finite"),
    "items not JSON": (_tensor("items", np.frombuffer(b"\xff{", np.uint8).copy()), "UTF-8 JSON"),
    "items not a list": (_tensor("items", _items_json({"a": 1})), "not a list"),
    "item wrong keys": (
        _tensor("items", _items_json([{"prompt_id": "0"}] * 3)),
        "exactly",
    ),
    "item text not str": (
        _tensor(
            "items",
            _items_json(
                [{"prompt_id": str(i), "prompt_sha256": "a" * 64, "text": 5} for i in range(3)]
            ),
        ),
        "must be a string",
    ),
    "duplicate ids": (
        _tensor(
            "items",
            _items_json([{"prompt_id": "0", "prompt_sha256": "a" * 64, "text": ""}] * 3),
        ),
        "twice",
    ),
    "extra tensor": (_tensor("evil", np.zeros(3, np.float32)), "must hold tensors"),
    "items wrong dtype": (_tensor("items", np.zeros(3, np.int32)), "dtype"),
}


@pytest.mark.parametrize("case", sorted(TEXT_CORRUPTIONS))
def test_malformed_text_packages_are_refused(case: str) -> None:
    edit, message = TEXT_CORRUPTIONS[case]
    with pytest.raises(PackageError, match=message):
        decode_package(_resave(encode_package(_text_package()), edit))


def _scale_logprobs(factor: float) -> Callable[[dict[str, np.ndarray], dict[str, str]], None]:
    def edit(tensors: dict[str, np.ndarray], _: dict[str, str]) -> None:
        lps = tensors["logprobs"].copy()
        lps[1, 2] = factor
        tensors["logprobs"] = lps

    return edit


LOGITS_CORRUPTIONS: dict[str, tuple[Callable[..., None], str]] = {
    "NaN log-prob": (_scale_logprobs(float("nan")), "NaN or infinity"),
    "inf log-prob": (_scale_logprobs(float("-inf")), "NaN or infinity"),
    "positive log-prob": (_scale_logprobs(0.5), "<= 0"),
    "token id out of vocab": (_set("vocab_size", "50"), "token ids"),
    "zero temperature": (_set("temperature", "0.0"), "temperature"),
    "k mismatch": (_set("top_k", "3"), "shape"),
    "bad offsets": (_tensor("offsets", np.array([0, 5, 3, 15], np.int64)), "offsets"),
    "offsets too short": (_tensor("offsets", np.array([0, 15], np.int64)), "offsets"),
    "ids wrong dtype": (_tensor("token_ids", np.zeros((15, 4), np.int64)), "dtype"),
    "shape mismatch": (_tensor("logprobs", np.zeros((14, 4), np.float16)), "shapes differ"),
    "missing tokenizer hash": (_drop("tokenizer_sha256"), "metadata keys"),
}


@pytest.mark.parametrize("case", sorted(LOGITS_CORRUPTIONS))
def test_malformed_logits_packages_are_refused(case: str) -> None:
    edit, message = LOGITS_CORRUPTIONS[case]
    with pytest.raises(PackageError, match=message):
        decode_package(_resave(encode_package(_logits_package()), edit))


def test_raw_byte_corruption_and_size_limits() -> None:
    data = encode_package(_text_package())
    for bad, message in [
        (b"", "too short"),
        (b"\x00" * 7, "too short"),
        ((10**9).to_bytes(8, "little") + b"{}", "exceeds"),
        ((500).to_bytes(8, "little") + b"{}", "runs past"),
        ((2).to_bytes(8, "little") + b"[]", "not a JSON object"),
        ((2).to_bytes(8, "little") + b"{}", "__metadata__"),
        (data[:-5], "not a valid safetensors"),
        (data + b"trailing", "not a valid safetensors"),
    ]:
        with pytest.raises(PackageError, match=message):
            decode_package(bad)
    with pytest.raises(PackageError, match="max_text_bytes"):
        decode_package(data, max_text_bytes=10)
    with pytest.raises(PackageError, match="outside"):
        decode_package(data, max_items=2)
    logits = encode_package(_logits_package())
    with pytest.raises(PackageError, match="max_positions"):
        decode_package(logits, max_positions=10)


def test_encode_refuses_what_decode_would_refuse() -> None:
    with pytest.raises(PackageError, match="transfer-set"):
        encode_package(_text_package(transfer_sha256=""))
    bad = _logits_package()
    item = bad.items[0]
    nan = LogitsItem(item.prompt_id, item.prompt_sha256, item.token_ids, item.logprobs * np.nan)
    with pytest.raises(PackageError, match="NaN"):
        encode_package(_logits_package(items=(nan,)))
    mixed = (item, LogitsItem("9", "a" * 64, item.token_ids, item.logprobs.astype(np.float32)))
    with pytest.raises(PackageError, match="mix"):
        encode_package(_logits_package(items=mixed))
    with pytest.raises(PackageError, match="Unicode"):
        encode_package(_text_package(items=(TextItem("0", "a" * 64, "\udc80"),)))


def test_no_pickle_anywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither the source nor a round trip touches pickle (or torch.load/np.load)."""
    forbidden = {"pickle", "cPickle", "dill", "joblib", "marshal", "shelve"}
    for name in ("exchange/package.py", "peer/service.py", "peer/client.py", "checkpoint.py"):
        tree = ast.parse((ROOT / "agent" / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert not {a.name.split(".")[0] for a in node.names} & forbidden, name
            if isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] not in forbidden, name
            if isinstance(node, ast.Attribute) and node.attr in {"load", "loads"}:
                base = node.value
                if isinstance(base, ast.Name):
                    assert base.id not in {"torch", "np", "numpy", "pickle"}, (name, base.id)

    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("pickle used")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    assert decode_package(encode_package(_logits_package())).mode == "logits"
    assert decode_package(encode_package(_text_package())).mode == "text"
    assert pkg_module.FORMAT == "peerlm.akd"


# ------------------------------------------------------------------------ hostile teachers


def test_one_huge_completion_inside_the_package_limit_is_refused() -> None:
    """A single 8 MiB completion fits the 64 MiB package limit but not the per-item one."""
    huge = "x = 1\n" * (8 * 1024 * 1024 // 6)
    items = (TextItem("0", prompt_sha256(PROMPTS[0]), huge),)
    data = encode_package(_text_package(items=items))
    assert len(data) < 64 * 1024 * 1024
    with pytest.raises(PackageError, match="per-item limit") as err:
        decode_package(data)
    assert err.value.reason == "item_too_large"
    # Multi-byte characters count as bytes, not characters.
    wide = (TextItem("0", prompt_sha256(PROMPTS[0]), "é" * 40_000),)
    with pytest.raises(PackageError) as err:
        decode_package(encode_package(_text_package(items=wide)), max_item_text_bytes=64_000)
    assert err.value.reason == "item_too_large"
    ok = decode_package(encode_package(_text_package(items=wide)), max_item_text_bytes=80_000)
    assert isinstance(ok, TextPackage)


def test_student_limits_bound_a_package_by_the_transfer_set() -> None:
    limits = student_limits(len(PROMPTS), 4096)
    assert limits["max_items"] == len(PROMPTS)
    assert limits["max_text_bytes"] == len(PROMPTS) * (4096 + pkg_module.ITEM_OVERHEAD_BYTES)
    decode_package(encode_package(_text_package()), **limits)
    # More items than X_u has prompts: refused before the JSON is parsed.
    many = tuple(TextItem(str(i), prompt_sha256(f"p{i}"), "pass") for i in range(50))
    with pytest.raises(PackageError, match="outside"):
        decode_package(encode_package(_text_package(items=many)), **limits)
    # Many medium items whose sum exceeds what X_u can need: refused by the total bound.
    fat = tuple(TextItem(str(i), prompt_sha256(p), "y" * 4000) for i, p in enumerate(PROMPTS))
    tight = student_limits(len(PROMPTS), 1024)
    with pytest.raises(PackageError):
        decode_package(encode_package(_text_package(items=fat)), **tight)
