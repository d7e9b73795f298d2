"""Test-wide setup: Triton runs in its interpreter on CPU (this must happen before triton is imported)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pathlib  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402

# warm starts are cached per test session (subprocesses inherit it), never in the user's ~/.cache
os.environ.setdefault("FTIS_CACHE_DIR", tempfile.mkdtemp(prefix="ftis-test-cache-"))

SHARED = pathlib.Path(__file__).resolve().parents[2] / "shared"


@pytest.fixture
def shared_data() -> pathlib.Path:
    """../shared/data beside the checkout; tests that need it skip when it is absent."""
    data = SHARED / "data"
    if not data.is_dir():
        pytest.skip(f"real data not found at {data} (../shared is absent)")
    return data
