"""Test-wide setup: Triton runs in its interpreter on CPU (this must happen before triton is imported)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pathlib  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402

# warm starts and packaged models are cached per test session (subprocesses inherit it), never in the user's
# ~/.cache; the session's own cache goes when the session ends (a packaged model is half a gigabyte)
_SESSION_CACHE = None
if not os.environ.get("FTIS_CACHE_DIR"):
    _SESSION_CACHE = tempfile.mkdtemp(prefix="ftis-test-cache-")
    os.environ["FTIS_CACHE_DIR"] = _SESSION_CACHE


def _remove_session_cache() -> None:
    if _SESSION_CACHE is not None:
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)

SHARED = pathlib.Path(__file__).resolve().parents[2] / "shared"


@pytest.fixture
def outside(tmp_path):
    """A folder outside the directory written (a run directory, a cache): what a planted link points into, holding
    one file whose content a write through the link would change (tests of core/safefile.py's writers)."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "precious").write_text("kept")
    return folder


@pytest.fixture
def shared_data() -> pathlib.Path:
    """../shared/data beside the checkout; tests that need it skip when it is absent."""
    data = SHARED / "data"
    if not data.is_dir():
        pytest.skip(f"real data not found at {data} (../shared is absent)")
    return data


def all_skipped_reasons(stats: dict) -> list[str] | None:
    """The skip reasons when a run passed, failed and errored nothing but skipped something (a tier that ran no
    test), else None."""
    ran = sum(len(stats.get(key, [])) for key in ("passed", "failed", "error", "xfailed", "xpassed"))
    skipped = stats.get("skipped", [])
    if ran or not skipped:
        return None
    reasons = []
    for report in skipped:
        longrepr = getattr(report, "longrepr", None)
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        if reason not in reasons:
            reasons.append(reason)
    return reasons


def pytest_sessionfinish(session, exitstatus):
    _remove_session_cache()
    if os.environ.get("FTIS_CI") != "1" or hasattr(session.config, "workerinput") or exitstatus != 0:
        return  # under CI only, and on the controller (pytest-xdist's workers report to it)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    reasons = all_skipped_reasons(reporter.stats if reporter is not None else {})
    if reasons is not None:
        sys.stderr.write(f"CI: every test of this tier skipped ({len(reporter.stats['skipped'])}): "
                         f"{'; '.join(reasons)[:500]}\n")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
