"""Fixtures shared by the test modules that load the project's own micro models."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import huggingface_hub.constants
import pytest


@pytest.fixture(scope="module")
def offline_hub() -> Iterator[None]:
    """Nothing may reach a hub: every model load is from a local directory."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield


@pytest.fixture(scope="module")
def micro_models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder of micro models per session: whichever module runs first builds them."""
    return tmp_path_factory.getbasetemp() / "peerlm-micro-models"
