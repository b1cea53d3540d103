"""Shared fixtures. The tests' helper modules (e2e_cluster, e2e_client,
proxy_helpers, fake_vllm) live beside the tests and import as top-level modules."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    """The tiny model's tokenizer (end-to-end tests)."""
    from e2e_client import load_tokenizer

    return load_tokenizer()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` skip themselves on machines without CUDA (CI has none)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
