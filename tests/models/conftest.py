"""Fixtures for model tests: every tiny architecture, saved and reloaded through Loom."""

from __future__ import annotations

import pytest
from tiny_models import TINY_BUILDERS, TinyModel, load_tiny


@pytest.fixture(scope="session", params=sorted(TINY_BUILDERS))
def tiny_model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> TinyModel:
    """Each tiny architecture, saved and loaded through Loom's HF-folder loader."""
    return load_tiny(request.param, tmp_path_factory.mktemp(f"tiny-{request.param}"))
