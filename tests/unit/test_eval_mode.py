"""training.eval_mode: a read-only forward pass leaves the model's mode as it found it."""

from __future__ import annotations

import pytest
import torch
from peerlm.agent.training import eval_mode


@pytest.mark.parametrize("training", [True, False])
def test_mode_and_autograd_for_the_block_restored_after(training: bool) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Dropout(0.5))
    model.train(training)
    with eval_mode(model):
        assert not model.training and not model[1].training
        out = model(torch.ones(1, 3))
        assert not out.requires_grad  # no graph is built
    assert model.training is training and model[1].training is training
    with pytest.raises(RuntimeError, match="boom"), eval_mode(model):
        raise RuntimeError("boom")
    assert model.training is training
    assert model(torch.ones(1, 3)).requires_grad  # autograd is back
