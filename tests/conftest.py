import os
import tempfile

import torch

# Inductor's on-disk caches key a compiled graph on its code, not on the schemas of the custom ops
# it calls, so a machine's cache from before a schema change can serve a stale graph: each test
# process compiles into its own fresh folder (a shell's own choice wins).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="streamkl-tests-inductor-"))

# Without a GPU the triton backend runs on CPU tensors in Triton's interpreter, which reads this
# variable once, when triton is first imported: set it before any test module imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _clean_backend_env(monkeypatch):
    """Each test starts from the default backend choice, whatever the shell exported."""
    for name in (
        "STREAMKL_BACKEND",
        "STREAMKL_REFERENCE_CHUNK",
        "STREAMKL_TRITON_SPLIT_K",
        "STREAMKL_TRITON_BWD",
        "STREAMKL_CUDA_BWD",
    ):
        monkeypatch.delenv(name, raising=False)
