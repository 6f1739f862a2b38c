"""The vLLM tier (`make test-vllm`): skipped, saying why, where vLLM's environment is missing."""

from __future__ import annotations

import pytest

from bench.lib.vllm_stack import vllm_python


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if vllm_python() is not None:
        return
    skip = pytest.mark.skip(
        reason="no vLLM environment: run `make vllm` first (or set BUBBLETEA_VLLM_PYTHON to a vLLM's python)"
    )
    for item in items:
        if "tests/vllm/" in str(item.fspath):
            item.add_marker(skip)
