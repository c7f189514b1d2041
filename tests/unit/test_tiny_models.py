"""Tiny models: built from the stdlib corpus, saved, and loaded back like any real checkpoint.

The micro size (tens of thousands of parameters, a few pre-training steps) keeps this fast;
the models are built once per session into a shared temporary folder (the build is cached,
so test_modelhost.py reuses them).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from peerlm.agent.models.lora import (
    LoraSettings,
    apply_lora,
    default_target_modules,
    known_model_types,
    trainable_share,
)
from peerlm.agent.models.tiny import (
    ARCHITECTURES,
    MANIFEST_NAME,
    BuildEvent,
    ModelInfo,
    build_models,
    read_manifest,
    stdlib_corpus,
)
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from peerlm.app.cli_models import app

CODE = 'def add(a, b):\n    """Return a + b."""\n    return a + b\n\n\nprint(add(1, 2))  # 3\n'


@pytest.fixture(autouse=True, scope="module")
def _offline(offline_hub: None) -> None:
    """Every load here is from a local directory (tests/conftest.py)."""


@pytest.fixture(scope="module")
def micro_dir(micro_models_dir: Path) -> Path:
    return micro_models_dir


@pytest.fixture(scope="module")
def micro(micro_dir: Path) -> list[ModelInfo]:
    events: list[BuildEvent] = []
    infos = build_models(micro_dir, size="micro", progress=events.append)
    assert {e.arch for e in events} == set(ARCHITECTURES)
    return infos


def test_builds_four_architectures_with_different_vocabularies(micro: list[ModelInfo]) -> None:
    assert [i.arch for i in micro] == list(ARCHITECTURES)
    vocabs = [i.vocab_size for i in micro]
    assert len(set(vocabs)) == len(vocabs), "tokenizer heterogeneity must be real"
    for info in micro:
        assert 0 < info.parameters < 200_000
        assert info.size == "micro"
        manifest = json.loads((Path(info.path) / MANIFEST_NAME).read_text())
        assert manifest["arch"] == info.arch
        assert manifest["config_hash"] == info.config_hash
        assert manifest["vocab_size"] == info.vocab_size
        assert manifest["parameters"] == info.parameters


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_loads_through_the_auto_classes(micro: list[ModelInfo], arch: str) -> None:
    info = next(i for i in micro if i.arch == arch)
    tokenizer = AutoTokenizer.from_pretrained(info.path)
    model = AutoModelForCausalLM.from_pretrained(info.path)
    assert model.config.model_type == arch
    assert len(tokenizer) == info.vocab_size
    assert tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>"
    ids = tokenizer(CODE)["input_ids"]
    assert tokenizer.decode(ids) == CODE  # byte-level: lossless
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size)
    assert model.config.vocab_size >= info.vocab_size


def test_tokenizers_split_the_same_text_differently(micro: list[ModelInfo]) -> None:
    encodings = [tuple(AutoTokenizer.from_pretrained(i.path)(CODE)["input_ids"]) for i in micro]
    assert len(set(encodings)) == len(encodings)


def test_second_build_is_cached(micro: list[ModelInfo], micro_dir: Path) -> None:
    weights = Path(micro[0].path) / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    again = build_models(micro_dir, size="micro")
    assert all(i.cached for i in again)
    assert [i.config_hash for i in again] == [i.config_hash for i in micro]
    assert weights.stat().st_mtime_ns == mtime
    assert read_manifest(Path(micro[0].path)) is not None


def test_builds_are_deterministic_and_a_new_request_rebuilds(tmp_path: Path) -> None:
    [a] = build_models(tmp_path / "a", ["gpt2"], size="micro", pretrain_steps=2, seed=3)
    [b] = build_models(tmp_path / "b", ["gpt2"], size="micro", pretrain_steps=2, seed=3)
    wa = load_file(str(Path(a.path) / "model.safetensors"))
    wb = load_file(str(Path(b.path) / "model.safetensors"))
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert a.final_loss == b.final_loss
    [c] = build_models(tmp_path / "a", ["gpt2"], size="micro", pretrain_steps=3, seed=3)
    assert not c.cached and c.steps == 3 and c.config_hash != a.config_hash


@pytest.mark.slow
def test_builds_side_by_side_give_the_same_weights(tmp_path: Path) -> None:
    """Two builds in two processes (one torch thread each) equal the same builds run one
    after another in this process with one thread: jobs never change a model."""
    events: list[BuildEvent] = []
    side = build_models(tmp_path / "p", ["gpt2", "bloom"], size="micro", pretrain_steps=2,
                        jobs=2, threads=1, progress=events.append)  # fmt: skip
    serial = build_models(tmp_path / "s", ["gpt2", "bloom"], size="micro", pretrain_steps=2,
                          jobs=1, threads=1)  # fmt: skip
    assert [i.arch for i in side] == ["gpt2", "bloom"]
    for a, b in zip(side, serial, strict=True):
        assert a.config_hash == b.config_hash and a.extra["threads"] == 1
        wa = load_file(str(Path(a.path) / "model.safetensors"))
        wb = load_file(str(Path(b.path) / "model.safetensors"))
        assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # Progress from the worker processes reaches the caller.
    assert {(e.arch, e.phase) for e in events} >= {("gpt2", "done"), ("bloom", "done")}
    assert torch.get_num_threads() >= 1


def test_hidden_categories_are_left_out_of_pretraining(tmp_path: Path) -> None:
    from peerlm.agent.models.tiny import DEFAULT_HIDDEN, public_corpus
    from peerlm.agent.tasks.world import DEFAULT_PRIVATE_CATEGORIES

    assert DEFAULT_HIDDEN == DEFAULT_PRIVATE_CATEGORIES
    texts, digest = public_corpus(4)
    everything, digest_all = public_corpus(4, hidden=())
    assert len(texts) == 8 * 4 and len(everything) == 12 * 4 and digest != digest_all
    assert not any(".get(" in t or "rjust" in t for t in texts)  # dict and format code
    [hidden] = build_models(tmp_path / "h", ["gpt2"], size="micro", pretrain_steps=1)
    [shown] = build_models(tmp_path / "a", ["gpt2"], size="micro", pretrain_steps=1, hidden=())
    assert hidden.extra["hidden_categories"] == list(DEFAULT_HIDDEN)
    assert shown.extra["hidden_categories"] == []
    assert hidden.config_hash != shown.config_hash
    with pytest.raises(ValueError, match="unknown hidden"):
        build_models(tmp_path / "x", ["gpt2"], size="micro", hidden=("cooking",))


def test_a_half_built_directory_is_rebuilt(tmp_path: Path) -> None:
    [a] = build_models(tmp_path, ["bloom"], size="micro", pretrain_steps=0)
    assert a.final_loss is None
    (Path(a.path) / "model.safetensors").unlink()
    [b] = build_models(tmp_path, ["bloom"], size="micro", pretrain_steps=0)
    assert not b.cached
    assert (Path(b.path) / "model.safetensors").is_file()


def test_bad_requests_fail_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown architecture"):
        build_models(tmp_path, ["llama"], size="micro")
    with pytest.raises(ValueError, match="size"):
        build_models(tmp_path, ["gpt2"], size="huge")  # type: ignore[arg-type]
    assert not any(tmp_path.iterdir())


def test_stdlib_corpus_is_bounded_and_stable() -> None:
    texts, digest = stdlib_corpus(50_000)
    again, digest2 = stdlib_corpus(50_000)
    assert texts == again and digest == digest2
    assert 0 < sum(len(t.encode()) for t in texts) <= 50_000 + 16  # replacement chars


# ------------------------------------------------------------------------------------ LoRA


def test_default_target_modules() -> None:
    assert default_target_modules("gpt2") == ["c_attn", "c_proj"]
    assert default_target_modules("gpt_neox") == ["query_key_value", "dense"]
    assert default_target_modules("bloom") == ["query_key_value", "dense"]
    for model_type in ("qwen2", "llama", "mistral"):
        assert default_target_modules(model_type) == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert set(ARCHITECTURES) <= set(known_model_types())
    with pytest.raises(ValueError, match="target_modules"):
        default_target_modules("mamba")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_lora_applies_with_the_architecture_defaults(micro: list[ModelInfo], arch: str) -> None:
    info = next(i for i in micro if i.arch == arch)
    model = AutoModelForCausalLM.from_pretrained(info.path)
    peft_model = apply_lora(model, LoraSettings())
    trainable, total, share = trainable_share(peft_model)
    assert 0 < trainable < total and 0 < share < 0.5
    for name, param in peft_model.named_parameters():
        assert param.requires_grad == ("lora_" in name), name
    adapted = {n.rsplit(".", 1)[-1] for n, m in peft_model.named_modules() if hasattr(m, "lora_A")}
    assert adapted == set(default_target_modules(arch))
    if arch == "gpt2":  # Conv1D layers store (in, out) weights
        assert peft_model.peft_config["default"].fan_in_fan_out


def test_lora_rank_and_explicit_targets(micro: list[ModelInfo]) -> None:
    path = micro[0].path  # gpt2
    small = trainable_share(
        apply_lora(AutoModelForCausalLM.from_pretrained(path), LoraSettings(r=2))
    )
    big = trainable_share(apply_lora(AutoModelForCausalLM.from_pretrained(path), LoraSettings(r=8)))
    assert big[0] == 4 * small[0]
    only_attn = apply_lora(
        AutoModelForCausalLM.from_pretrained(path), LoraSettings(target_modules=["c_attn"])
    )
    assert trainable_share(only_attn)[0] < big[0]
    with pytest.raises(ValueError, match="no_such_layer"):
        apply_lora(
            AutoModelForCausalLM.from_pretrained(path),
            LoraSettings(target_modules=["no_such_layer"]),
        )


# ------------------------------------------------------------------------------------- CLI


@pytest.mark.slow
def test_cli_build_json_then_list(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["build", "--size", "micro", "--dir", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["size"] == "micro"
    assert [m["arch"] for m in summary["models"]] == list(ARCHITECTURES)
    assert all(Path(m["path"]).is_dir() and not m["cached"] for m in summary["models"])
    listed = runner.invoke(app, ["list", "--dir", str(tmp_path), "--json"])
    assert listed.exit_code == 0, listed.output
    assert len(json.loads(listed.stdout)["models"]) == len(ARCHITECTURES)
    table = runner.invoke(app, ["build", "--size", "micro", "--dir", str(tmp_path)])
    assert table.exit_code == 0 and "gpt_neox" in table.stdout


def test_cli_rejects_unknown_architecture(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["build", "--arch", "t5", "--dir", str(tmp_path)])
    assert result.exit_code != 0
    hidden = CliRunner().invoke(app, ["build", "--hidden", "dict,cooking", "--dir", str(tmp_path)])
    assert hidden.exit_code != 0 and "cooking" in hidden.output
    assert not any(tmp_path.iterdir())


def test_cli_progress_off_a_terminal_is_one_line_per_tenth(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["build", "--size", "micro", "--arch", "gpt2", "--steps", "20", "--hidden", "",
              "--dir", str(tmp_path), "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("model gpt2: step")]
    assert [line.split()[3] for line in lines] == [f"{2 * i}/20" for i in range(1, 11)]
    assert "model gpt2: done" in result.stderr
    info = json.loads(result.stdout)["models"][0]
    assert info["extra"]["hidden_categories"] == [] and info["extra"]["cpu_seconds"] > 0


def test_environment_is_offline() -> None:
    assert os.environ.get("HF_HUB_OFFLINE") == "1"


def test_one_model_cache_for_up_experiment_and_build(monkeypatch: pytest.MonkeyPatch) -> None:
    from peerlm.app.cli_models import DEFAULT_DIR, MODELS_DIR_ENV, models_cache_dir

    monkeypatch.delenv(MODELS_DIR_ENV, raising=False)
    assert models_cache_dir("tiny") == DEFAULT_DIR == Path("state/models")
    assert models_cache_dir("micro") == Path("state/models-micro")
    monkeypatch.setenv(MODELS_DIR_ENV, "/srv/cache/m")
    assert models_cache_dir("tiny") == Path("/srv/cache/m")
    assert models_cache_dir("micro") == Path("/srv/cache/m-micro")


def test_a_model_another_process_put_in_place_is_accepted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shared cache: when the target appears while we build (another process built the
    same model), our rename fails and the other build is taken if it is the same model."""
    import shutil

    from peerlm.agent.models import tiny

    [first] = build_models(tmp_path, ["gpt2"], size="micro", pretrain_steps=1)
    target = Path(first.path)
    real_rmtree = shutil.rmtree

    def keep_target(path: object, *args: object, **kwargs: object) -> None:
        if Path(str(path)) != target:
            real_rmtree(str(path), ignore_errors=True)

    monkeypatch.setattr(tiny.shutil, "rmtree", keep_target)
    [again] = build_models(tmp_path, ["gpt2"], size="micro", pretrain_steps=1, force=True)
    assert again.config_hash == first.config_hash
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no leftovers
    (target / MANIFEST_NAME).write_text("{}")  # now it is not the same model
    with pytest.raises(OSError):
        build_models(tmp_path, ["gpt2"], size="micro", pretrain_steps=1, force=True)


def test_the_copy_phase_runs_after_the_main_phase_and_enters_the_cache_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A recipe with a copy phase trains on drills after the main phase: the main phase is
    untouched (the manifest's final loss is the same), the weights and the key differ,
    and the build stays deterministic."""
    import dataclasses
    from types import MappingProxyType

    from peerlm.agent.models import tiny

    [plain] = build_models(tmp_path / "plain", ["gpt2"], size="micro", pretrain_steps=2)
    copy = dataclasses.replace(
        tiny._RECIPES["micro"], copy_drills=40, drill_share=0.8, copy_steps=3, copy_lr=1e-3
    )
    monkeypatch.setattr(tiny, "_RECIPES", MappingProxyType({**tiny._RECIPES, "micro": copy}))
    events: list[BuildEvent] = []
    [a] = build_models(tmp_path / "a", ["gpt2"], size="micro", pretrain_steps=2,
                       progress=events.append)  # fmt: skip
    [b] = build_models(tmp_path / "b", ["gpt2"], size="micro", pretrain_steps=2)
    assert a.config_hash == b.config_hash != plain.config_hash
    assert a.corpus_sha256 != plain.corpus_sha256  # the drills are part of the corpus
    assert a.final_loss == plain.final_loss  # the main phase never sees a drill
    assert a.extra["copy_drills"] == 40 and a.extra["copy_steps"] == 3
    assert a.extra["copy_final_loss"] is not None
    steps = [e.step for e in events if e.phase == "pretrain"]
    assert steps[-1] == 5 and {e.total for e in events if e.phase == "pretrain"} == {5}
    wa = load_file(str(Path(a.path) / "model.safetensors"))
    wb = load_file(str(Path(b.path) / "model.safetensors"))
    wp = load_file(str(Path(plain.path) / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not all(torch.equal(wa[k], wp[k]) for k in wa)
