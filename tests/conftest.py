"""Test-wide setup: Triton runs in its interpreter on CPU (this must happen before triton is imported)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pathlib  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402

# warm starts and packaged models are cached per test session (subprocesses inherit it), never in the user's
# ~/.cache; the session's own cache goes when the session ends (a packaged model is half a gigabyte)
_SESSION_CACHE = None
if not os.environ.get("FTIS_CACHE_DIR"):
    _SESSION_CACHE = tempfile.mkdtemp(prefix="ftis-test-cache-")
    os.environ["FTIS_CACHE_DIR"] = _SESSION_CACHE


def pytest_sessionfinish(session, exitstatus):
    if _SESSION_CACHE is not None:
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)

SHARED = pathlib.Path(__file__).resolve().parents[2] / "shared"


@pytest.fixture
def shared_data() -> pathlib.Path:
    """../shared/data beside the checkout; tests that need it skip when it is absent."""
    data = SHARED / "data"
    if not data.is_dir():
        pytest.skip(f"real data not found at {data} (../shared is absent)")
    return data
