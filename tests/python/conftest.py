"""pytest set-up for the `bmtrain` Python package tests.

Run (CPU, Gloo ranks):   PYTHONPATH=<dir holding bmtrain/> python -m pytest tests/python -q
Run (GPU, NCCL ranks):   BMT_TEST_DEVICE=cuda PYTHONPATH=... python -m pytest tests/python -q
Each multi-rank test launches (once per worker file and world size) `torchrun --standalone` on the files in
workers/; see launcher.py.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import launcher as _launcher  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped when none is visible)")
    config.addinivalue_line("markers", "cuda_variant: runs only with BMT_TEST_DEVICE=cuda")


def pytest_collection_modifyitems(config, items):
    has_gpu = _launcher.gpu_count() > 0 and _launcher.test_device() == "cuda"
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a GPU and BMT_TEST_DEVICE=cuda"))


@pytest.fixture(scope="session")
def launcher():
    lau = _launcher.Launcher()
    yield lau
    lau.cleanup()
