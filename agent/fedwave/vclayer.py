"""The Value Chain Layer (FedWave Eq. 1) and a causal LM wrapped with it.

For an agent at stage i, with ``H ∈ ℝ^{L×d}`` the final hidden states of its (LoRA-adapted)
model, the VCLayer computes

    H'_i = Attention(X W_q,i, X W_k,i, X W_v,i) W_o,i,   X = H + e_i,

with ``W_q, W_k, W_v ∈ ℝ^{d×d_vc}`` and ``W_o ∈ ℝ^{d_vc×d}``, and the LM head reads
``H + H'_i`` instead of ``H``. Choices the paper leaves open (also in docs/fedwave.md):

* **Residual.** The paper passes ``H'_i`` to the LM head; a freshly initialised attention
  block alone would throw away the pre-trained model's prediction, so the block is a
  residual branch (``H + H'_i``), the usual way to plug a block into a trained network.
* **Causal.** The attention is causal (and ignores padded keys): the VCLayer sits under a
  next-token head, and attending to later positions would let it read the answer.
* **Multi-head.** "a specialized multi-head attention": ``heads`` heads of ``d_vc / heads``
  dimensions each, scaled dot-product; the matrices keep the paper's shapes, so ``vec(W_q)``
  (Eq. 5) is the whole projection.
* **Stage embedding.** Eq. 4's learnable ``e_i ∈ ℝ^d`` lives in the stage's VCLayer and is
  added to ``H`` before the projections (a role bias, like a segment embedding). Where it
  enters is not said in the paper; without entering the model, ``L_pos`` would train
  vectors nothing reads.
* **Initialisation.** Every weight and ``e_i`` from N(0, ``init_std``²), 0.02 by default
  (the init of the bundled architectures): the branch starts small but not zero, since
  Eq. 6 takes the cosine of its output, which is undefined at zero.

:class:`VCCausalLM` wraps any ``from_pretrained`` causal LM of the bundled architectures
(gpt2, gpt_neox, bloom, qwen2 and others with ``base_model_prefix`` and output embeddings),
with or without a peft LoRA adapter. The VCLayer is saved beside the adapter as
``vclayer.safetensors`` (:func:`save_vclayer` / :func:`load_vclayer`; bytes for the wire
with :func:`encode_vclayer` / :func:`decode_vclayer`).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch
import torch.nn.functional as F
from peerlm.agent.adapter_codec import (
    check_tensor_table,
    load_finite_tensors,
    read_safetensors_header,
)
from peerlm.agent.fedwave.errors import FedWaveError
from peerlm.agent.fedwave.params import VCLayerSettings
from safetensors.torch import save as st_save
from torch import nn

from peerlm.atomic_file import write_atomic

__all__ = [
    "VCLAYER_FILE",
    "VCLAYER_FORMAT",
    "VCCausalLM",
    "VCLayer",
    "VCLayerSettings",
    "VCOutput",
    "decode_vclayer",
    "encode_vclayer",
    "load_expert",
    "load_vclayer",
    "masked_mean",
    "save_expert",
    "save_vclayer",
    "vclayer_max_bytes",
]

#: The file name of a VCLayer saved beside its adapter.
VCLAYER_FILE: Final = "vclayer.safetensors"
#: ``peerlm.format`` of a VCLayer blob.
VCLAYER_FORMAT: Final = "peerlm-vclayer/1"
_TENSORS: Final = ("w_q", "w_k", "w_v", "w_o", "stage_embedding")
_MAX_HEADER: Final = 64 * 1024
#: A VCLayer travels in float32 only (what :func:`encode_vclayer` writes).
_DTYPES: Final = {"F32": 4}


class VCLayer(nn.Module):
    """One stage's Value Chain Layer (Eq. 1) with its stage embedding ``e_i`` (Eq. 4)."""

    def __init__(
        self,
        hidden_size: int,
        settings: VCLayerSettings | None = None,
        *,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        s = settings or VCLayerSettings()
        if hidden_size < 1:
            raise FedWaveError(f"hidden size must be positive, got {hidden_size}", reason="config")
        self.hidden_size = hidden_size
        self.settings = s

        def init(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, generator=generator) * s.init_std)

        self.w_q = init(hidden_size, s.d_vc)
        self.w_k = init(hidden_size, s.d_vc)
        self.w_v = init(hidden_size, s.d_vc)
        self.w_o = init(s.d_vc, hidden_size)
        self.stage_embedding = init(hidden_size)

    def branch(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``H'_i`` of Eq. 1 for hidden states ``(B, L, d)``; padded keys are ignored."""
        batch, length, _ = hidden.shape
        heads, head_dim = self.settings.heads, self.settings.d_vc // self.settings.heads
        x = hidden + self.stage_embedding.to(hidden.dtype)

        def split(w: torch.Tensor) -> torch.Tensor:
            return (x @ w.to(x.dtype)).view(batch, length, heads, head_dim).transpose(1, 2)

        causal = torch.ones(length, length, dtype=torch.bool, device=hidden.device).tril()
        if attention_mask is not None:
            keys = attention_mask.to(torch.bool)[:, None, None, :]
            # A position always sees itself, so a left-padded row is never all masked (NaN).
            eye = torch.eye(length, dtype=torch.bool, device=hidden.device)
            mask = causal & (keys | eye)
        else:
            mask = causal[None, None]
        out = F.scaled_dot_product_attention(split(self.w_q), split(self.w_k), split(self.w_v),
                                             attn_mask=mask)  # fmt: skip
        out = out.transpose(1, 2).reshape(batch, length, self.settings.d_vc)
        return out @ self.w_o.to(out.dtype)  # type: ignore[no-any-return]

    def forward(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``H + H'_i``: what the LM head reads."""
        return hidden + self.branch(hidden, attention_mask)

    def pooled_branch(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``f_i(H̄)`` of Eq. 6: the branch output mean-pooled over the real tokens, ``(B, d)``."""
        return masked_mean(self.branch(hidden, attention_mask), attention_mask)


def masked_mean(values: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of ``(B, L, d)`` over the positions where ``attention_mask`` is 1: ``(B, d)``."""
    if attention_mask is None:
        return values.mean(dim=1)
    weights = attention_mask.to(values.dtype).unsqueeze(-1)
    return (values * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1.0)


@dataclass(frozen=True)
class VCOutput:
    """One forward pass of :class:`VCCausalLM`."""

    logits: torch.Tensor  # (B, L, V)
    hidden: torch.Tensor  # H: the LM's final hidden states, (B, L, d)
    branch: torch.Tensor  # H'_i, (B, L, d)


class VCCausalLM(nn.Module):
    """A causal LM (plain or with a peft adapter) whose LM head reads the VCLayer's output."""

    def __init__(self, lm: nn.Module, vclayer: VCLayer) -> None:
        super().__init__()
        unwrap: Any = getattr(lm, "get_base_model", None)
        base: Any = unwrap() if callable(unwrap) else lm
        prefix = getattr(base, "base_model_prefix", "")
        backbone = getattr(base, prefix, None) if prefix else None
        head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
        if not isinstance(backbone, nn.Module) or not isinstance(head, nn.Module):
            raise FedWaveError(
                f"{type(base).__name__} exposes no backbone ({prefix!r}) and LM head",
                reason="config",
            )
        hidden_size = int(base.config.hidden_size)
        if vclayer.hidden_size != hidden_size:
            raise FedWaveError(
                f"VCLayer of width {vclayer.hidden_size} for a model of width {hidden_size}",
                reason="shape",
            )
        self.lm = lm
        self.vclayer = vclayer
        # Kept out of the module tree: they are the LM's own modules, registered under lm.
        self._backbone = [backbone]
        self._head = [head]

    def hidden_states(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """H: the final (normalised) hidden states the LM head would read, ``(B, L, d)``."""
        out = self._backbone[0](input_ids=input_ids, attention_mask=attention_mask)
        return out.last_hidden_state  # type: ignore[no-any-return]

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> VCOutput:
        """Logits from ``H + H'_i``, with ``H`` and ``H'_i`` for the collaborative loss."""
        hidden = self.hidden_states(input_ids, attention_mask)
        branch = self.vclayer.branch(hidden, attention_mask)
        logits = self._head[0](hidden + branch)
        return VCOutput(logits=logits, hidden=hidden, branch=branch)


def encode_vclayer(layer: VCLayer, *, stage: str = "") -> bytes:
    """The layer as safetensors bytes (float32), its shape settings in the metadata."""
    meta = {
        "format": "pt",
        "peerlm.format": VCLAYER_FORMAT,
        "peerlm.vclayer": json.dumps(
            {"hidden_size": layer.hidden_size, **layer.settings.model_dump()}, sort_keys=True
        ),
        "peerlm.stage": stage,
    }
    state = {name: getattr(layer, name).detach().to(torch.float32).contiguous().cpu()
             for name in _TENSORS}  # fmt: skip
    return st_save(state, metadata=meta)


def decode_vclayer(
    data: bytes, *, hidden_size: int | None = None, settings: VCLayerSettings | None = None,
    max_bytes: int | None = None,
) -> tuple[VCLayer, str]:  # fmt: skip
    """(layer, stage) from untrusted bytes; ``FedWaveError`` on anything that does not fit.

    When ``hidden_size`` or ``settings`` are given, the blob must match them (a peer's
    VCLayer must fit this model). Checks, cheapest first: size, header, metadata, tensor
    table (names, shapes, dtype, offsets), finite values; the safetensors steps are the
    shared ones of :mod:`peerlm.agent.adapter_codec`.
    """
    limit = max_bytes if max_bytes is not None else _max_bytes(hidden_size, settings)
    header = read_safetensors_header(
        data, what="VCLayer", max_bytes=limit, max_header_bytes=_MAX_HEADER, error=FedWaveError
    )
    meta = header.metadata
    if meta.get("peerlm.format") != VCLAYER_FORMAT:
        raise FedWaveError(f"not a {VCLAYER_FORMAT} blob", reason="format")
    try:
        shape_meta = json.loads(meta["peerlm.vclayer"])
        width = int(shape_meta.pop("hidden_size"))
        found = VCLayerSettings.model_validate(shape_meta)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        # pydantic's ValidationError is a ValueError; a non-object JSON has no .pop.
        raise FedWaveError(f"unreadable VCLayer metadata: {exc}", reason="decode") from None
    if hidden_size is not None and width != hidden_size:
        raise FedWaveError(f"VCLayer width {width}, this model's {hidden_size}", reason="shape")
    if settings is not None and (found.d_vc, found.heads) != (settings.d_vc, settings.heads):
        raise FedWaveError(
            f"VCLayer d_vc/heads {found.d_vc}/{found.heads}, expected "
            f"{settings.d_vc}/{settings.heads}",
            reason="shape",
        )
    if width < 1:
        raise FedWaveError(f"VCLayer width {width}", reason="shape")
    expected = {"w_q": (width, found.d_vc), "w_k": (width, found.d_vc),
                "w_v": (width, found.d_vc), "w_o": (found.d_vc, width),
                "stage_embedding": (width,)}  # fmt: skip
    check_tensor_table(header, expected, dtypes=_DTYPES, what="VCLayer", error=FedWaveError)
    state = load_finite_tensors(data, what="VCLayer", error=FedWaveError)
    layer = VCLayer(width, found)
    with torch.no_grad():
        for name in _TENSORS:
            getattr(layer, name).copy_(state[name])
    return layer, meta.get("peerlm.stage", "")


def vclayer_max_bytes(hidden_size: int, settings: VCLayerSettings) -> int:
    """The largest blob a VCLayer of this width and settings encodes to (float32 tensors
    plus the header bound): what a peer's VCLayer may be at most."""
    floats = 4 * hidden_size * settings.d_vc + hidden_size
    return 8 + _MAX_HEADER + 4 * floats


def _max_bytes(hidden_size: int | None, settings: VCLayerSettings | None) -> int | None:
    if hidden_size is None or settings is None:
        return None
    return vclayer_max_bytes(hidden_size, settings)


def save_vclayer(layer: VCLayer, directory: Path, *, stage: str = "") -> Path:
    """Write ``directory/vclayer.safetensors`` atomically (beside a saved peft adapter)."""
    return write_atomic(directory / VCLAYER_FILE, encode_vclayer(layer, stage=stage))


def load_vclayer(
    directory: Path, *, hidden_size: int | None = None, settings: VCLayerSettings | None = None
) -> tuple[VCLayer, str]:
    """Read ``directory/vclayer.safetensors`` (checked like a peer's blob)."""
    path = directory / VCLAYER_FILE
    limit = _max_bytes(hidden_size, settings)
    size = path.stat().st_size
    if limit is not None and size > limit:
        raise FedWaveError(f"{path}: {size} bytes exceeds {limit}", reason="too_large")
    return decode_vclayer(path.read_bytes(), hidden_size=hidden_size, settings=settings)


def save_expert(model: VCCausalLM, directory: Path, *, stage: str = "") -> None:
    """Save an expert: its peft adapter (``save_pretrained``) and its VCLayer beside it.

    A model without an adapter saves only the VCLayer (its base is loaded by name or path).
    """
    save = getattr(model.lm, "save_pretrained", None)
    if hasattr(model.lm, "get_base_model") and save is not None:
        save(str(directory))
    save_vclayer(model.vclayer, directory, stage=stage)


def load_expert(
    base: nn.Module, directory: Path, *, settings: VCLayerSettings | None = None
) -> tuple[VCCausalLM, str]:
    """Rebuild an expert saved by :func:`save_expert` on ``base`` (a ``from_pretrained`` LM).

    The adapter is loaded with peft when ``directory`` holds one (``adapter_config.json``).
    """
    lm: nn.Module = base
    if (directory / "adapter_config.json").is_file():
        from peft import PeftModel

        with warnings.catch_warnings():
            # peft probes transformers 5's deprecated ``is_gradient_checkpointing``; not ours.
            warnings.filterwarnings(
                "ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning
            )
            lm = PeftModel.from_pretrained(base, str(directory))
    hidden = int(getattr(base, "config").hidden_size)  # noqa: B009
    layer, stage = load_vclayer(directory, hidden_size=hidden, settings=settings)
    return VCCausalLM(lm, layer), stage
