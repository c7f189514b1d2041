"""FedProxy's Block Influence (Eq. 4) and the choice of the blocks a proxy keeps.

Section 4.1 of the FedProxy paper (after ShortGPT): the influence of transformer block ``i``
is one minus the mean cosine similarity between the hidden state a token has entering the
block and the one it has leaving it,

    BI_i = 1 − E_{X ~ D_pub, t} [ cos(X_{i,t}, X_{i+1,t}) ],

so a block that leaves every token's direction unchanged (the identity, or a rescaling) has
``BI = 0``. The proxy keeps the most influential blocks.

* :func:`cosine_sums` — the sans-IO core: the sum of ``cos(x_in, x_out)`` over the tokens of
  a batch (padding masked out) and the number of tokens.
* :func:`block_influence` — runs a causal LM over tokenised public data and returns
  ``BI_i`` per block, reading each block's input and output with forward hooks (the
  model's ``hidden_states`` output cannot be used: its last entry is after the final norm).
* :func:`kept_count` / :func:`blocks_to_keep` — how many blocks survive a compression ratio
  and which.

Choices the paper leaves open (also in ``docs/fedproxy.md``): the expectation is a
token-weighted mean over every non-padding token of every public text; a zero vector's
cosine is 0 (``torch.nn.functional.cosine_similarity``'s ``eps``); ``ratio`` is the
paper's *compression* ratio, the share of blocks removed (Table 8: 30 % compression performs
best, 70 % loses capacity), ``floor(ratio · L)`` blocks are removed, so
``L − floor(ratio · L) = ceil((1 − ratio) · L)`` are kept (at least one); ties in BI keep
the earlier block.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

import torch
from peerlm.agent.fedproxy.proxy import ProxyError, block_list
from peerlm.agent.training import eval_mode
from torch import nn

__all__ = [
    "DEFAULT_RATIO",
    "block_influence",
    "blocks_to_keep",
    "cosine_sums",
    "kept_count",
    "token_batches",
]

#: Table 8: 50 % compression balances quality and client cost.
DEFAULT_RATIO: Final = 0.5
# float rounding in ratio * layers (0.3 * 10 = 3.0000000000000004) must not change a count
_FLOOR_SLACK: Final = 1e-9


def cosine_sums(
    inputs: torch.Tensor, outputs: torch.Tensor, mask: torch.Tensor | None = None
) -> tuple[float, int]:
    """``(Σ_t cos(inputs[t], outputs[t]), tokens)`` over the unmasked tokens.

    ``inputs`` and ``outputs`` are ``(batch, seq, hidden)`` (or any ``(..., hidden)``);
    ``mask`` has their leading shape, non-zero where a token counts. Cosines are taken in
    float64 so a sum over many tokens does not drift.
    """
    if inputs.shape != outputs.shape:
        raise ProxyError(
            f"block input {tuple(inputs.shape)} and output {tuple(outputs.shape)} differ",
            reason="shape",
        )
    cos = torch.nn.functional.cosine_similarity(
        inputs.detach().to(torch.float64), outputs.detach().to(torch.float64), dim=-1
    )
    if mask is None:
        return float(cos.sum()), int(cos.numel())
    if mask.shape != cos.shape:
        raise ProxyError(
            f"mask {tuple(mask.shape)} does not match tokens {tuple(cos.shape)}", reason="shape"
        )
    keep = mask.to(torch.bool)
    return float(cos[keep].sum()), int(keep.sum())


def token_batches(
    rows: Sequence[Sequence[int]], *, batch_size: int, pad_id: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(input_ids, attention_mask)`` batches of token rows, right-padded with ``pad_id``.

    Empty rows are skipped (they hold no token to measure).
    """
    if batch_size < 1:
        raise ProxyError(f"batch size must be at least 1, not {batch_size}", reason="empty")
    kept_rows = [list(row) for row in rows if len(row) > 0]
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    for start in range(0, len(kept_rows), batch_size):
        chunk = kept_rows[start : start + batch_size]
        width = max(len(row) for row in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, row in enumerate(chunk):
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, : len(row)] = 1
        out.append((ids, mask))
    return out


def _hidden(value: Any) -> torch.Tensor:
    # Decoder blocks return a tensor (transformers 5: GPT-2, GPT-NeoX, Qwen2) or a tuple
    # whose first entry is the hidden state (BLOOM).
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, tuple) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    raise ProxyError(f"unexpected block output {type(value).__name__}", reason="model")


def block_influence(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    progress: Callable[[int], None] | None = None,
) -> list[float]:
    """``BI_i`` (Eq. 4) of every transformer block of ``model`` over ``batches``.

    ``batches`` yields ``(input_ids, attention_mask)`` pairs (right padding; the mask is 1
    on real tokens). The model runs in eval mode without gradients or cache; its mode is
    restored afterwards. ``progress`` is called with the number of batches done. Refuses
    data with no token at all.
    """
    blocks = block_list(model)
    sums = [0.0] * len(blocks)
    tokens = [0] * len(blocks)
    current_mask: list[torch.Tensor] = []

    def hook_for(index: int) -> Callable[..., None]:
        def hook(
            _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
        ) -> None:
            entering = args[0] if args else kwargs["hidden_states"]
            s, n = cosine_sums(_hidden(entering), _hidden(output), current_mask[0])
            sums[index] += s
            tokens[index] += n

        return hook

    handles = [
        block.register_forward_hook(hook_for(i), with_kwargs=True) for i, block in enumerate(blocks)
    ]
    try:
        with eval_mode(model):
            for done, (input_ids, attention_mask) in enumerate(batches, start=1):
                current_mask[:] = [attention_mask]
                model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
                if progress is not None:
                    progress(done)
    finally:
        for handle in handles:
            handle.remove()
    if not tokens or tokens[0] == 0:
        raise ProxyError("the public data held no token", reason="empty")
    return [1.0 - s / n for s, n in zip(sums, tokens, strict=True)]


def kept_count(layers: int, ratio: float) -> int:
    """Blocks a proxy of an ``layers``-block model keeps at compression ``ratio``.

    ``ratio`` is the share removed, in ``[0, 1)``: ``floor(ratio · layers)`` blocks go, so
    ``ceil((1 − ratio) · layers)`` stay, and never fewer than one.
    """
    if layers < 1:
        raise ProxyError(f"a model needs at least one block, not {layers}", reason="model")
    if not (math.isfinite(ratio) and 0.0 <= ratio < 1.0):
        raise ProxyError(f"ratio must be in [0, 1), got {ratio}", reason="ratio")
    removed = math.floor(ratio * layers + _FLOOR_SLACK)
    return max(1, layers - removed)


def blocks_to_keep(influence: Sequence[float], ratio: float) -> tuple[int, ...]:
    """The indices (ascending) of the ``kept_count`` blocks of highest BI.

    Ties keep the earlier block. Refuses a non-finite influence.
    """
    for i, value in enumerate(influence):
        if not math.isfinite(value):
            raise ProxyError(f"block {i} has influence {value}", reason="non_finite")
    keep = kept_count(len(influence), ratio)
    ranked = sorted(range(len(influence)), key=lambda i: (-influence[i], i))
    return tuple(sorted(ranked[:keep]))
