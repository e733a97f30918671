import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _clean_backend_env(monkeypatch):
    """Each test starts from the default backend choice, whatever the shell exported."""
    monkeypatch.delenv("STREAMKL_BACKEND", raising=False)
    monkeypatch.delenv("STREAMKL_REFERENCE_CHUNK", raising=False)
