"""threads.Worker: a worker thread's failure reaches its owner, with its type, whatever it is."""

from __future__ import annotations

import threading

import pytest

from ftis_engine.core.threads import Worker


class Owned(RuntimeError):
    """An owner's own error type, saying where."""


@pytest.mark.parametrize("error", [ValueError("a bad value"), SystemExit(3), KeyboardInterrupt()])
def test_a_workers_failure_is_kept_and_raised_as_itself_or_wrapped_with_it_as_the_cause(error):
    woke = threading.Event()

    def run(x):
        assert x == 1
        raise error

    worker = Worker(run, name="t", on_error=lambda exc: woke.set())
    worker.check()  # not started: nothing to raise
    worker.start(1)
    assert woke.wait(10)
    worker.join(10)
    assert not worker.is_alive() and worker.error is error
    with pytest.raises(type(error)) as raised:
        worker.check()
    assert raised.value is error
    with pytest.raises(Owned, match="^the worker t failed$") as wrapped:
        worker.check(lambda exc: Owned(f"the worker {worker.name} failed"))
    assert wrapped.value.__cause__ is error


def test_a_worker_that_ends_normally_has_nothing_to_raise_and_on_error_is_not_called():
    called = []
    worker = Worker(lambda: None, name="t", on_error=called.append)
    assert not worker.started
    worker.start()
    worker.join(10)
    assert worker.started and not worker.is_alive() and worker.error is None and called == []
    worker.check()


def test_on_error_runs_once_the_error_is_kept_so_a_woken_waiter_finds_it():
    seen = []
    worker = Worker(lambda: 1 / 0, name="t", on_error=lambda exc: seen.append(worker.error is exc))
    worker.start()
    worker.join(10)
    assert seen == [True]
