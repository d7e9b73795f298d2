"""The open swarm's membership on hivemind's DHT (openswarm/dht.py): no coordinator, so no node whose death ends
the swarm. Skipped without hivemind (pip install 'ftis-engine[dht]')."""

from __future__ import annotations

import os
import signal

import pytest

pytest.importorskip("hivemind")

from ftis_engine.openswarm.client import JoinRefused  # noqa: E402
from ftis_engine.openswarm.dht import DhtMembership  # noqa: E402

from .test_openswarm import SHARED, TOKENIZER, DATA, until  # noqa: E402

pytestmark = pytest.mark.slow
LEASE = 4.0


def member(name, bootstrap=(), address="", key=""):
    m = DhtMembership(list(bootstrap), "127.0.0.1", name, TOKENIZER, SHARED, DATA, LEASE, listen=(address, key),
                      steps=SHARED["train"]["steps"])
    m.start(timeout=60)
    return m


def test_members_see_each_other_and_the_swarm_outlives_its_bootstrap_peer():
    """Three members join through the first; each sees all three. The first's DHT is killed (SIGKILL): the other two
    keep seeing each other, the first leaves their view when its lease runs out, and a newcomer joins through a
    survivor and is seen by both."""
    a = member("a")
    b, c = member("b", a.maddrs()), member("c", a.maddrs())
    try:
        until(lambda: all(set(m.members()) == {"a", "b", "c"} for m in (a, b, c)), "everyone to see everyone", 60)
        os.kill(a.dht.pid, signal.SIGKILL)
        until(lambda: all(set(m.members()) == {"b", "c"} for m in (b, c)), "the killed one's lease to run out", 60)
        d = member("d", b.maddrs())
        until(lambda: all(set(m.members()) == {"b", "c", "d"} for m in (b, c, d)), "the newcomer", 60)
        d.close()
        until(lambda: set(b.members()) == {"b", "c"}, "the newcomer's leave", 60)
        assert b.departed() == {"a", "d"}  # the member's transport forgets what it knew of them
    finally:
        for m in (b, c):
            m.close()
        a._stop.set()


def test_a_name_another_member_holds_is_refused_and_a_bootstrap_that_never_answers_is_one_error():
    a = member("a")
    dead = a.maddrs()[0]
    try:
        with pytest.raises(JoinRefused, match="a live member is already named 'a'"):
            member("a", [dead])
    finally:
        a.close()  # its DHT is shut down: nobody answers at its address
    with pytest.raises(ConnectionError, match="cannot join the DHT through"):
        member("b", [dead])


def test_two_member_jobs_on_a_dht_train_on_each_others_rollouts_with_no_coordinator(tmp_path):
    """No coordinator: a DHT member in this process (a metronome: it sends nothing, holds both at step 2 until both
    wait there) bootstraps two member jobs (--join dht:its address), tiny-s listening and tiny-m-lora behind a NAT (no
    --listen: a DHT client that only dials); both train on each other's directly sent parcels, none rejected."""
    import subprocess

    from .ports import free_port
    from .test_openswarm import _member_args, _member_hashes, assert_trained_on_each_other

    steps, direct = 6, "swarm.peers_per_step=1"
    metronome = DhtMembership([], "127.0.0.1", "metronome", *_member_hashes(steps, direct), 600.0, steps=steps)
    metronome.start(timeout=60)
    join = "dht:" + metronome.maddrs()[0]
    procs = []
    try:
        for name, listen in (("tiny-s", ["--listen", f"tcp://127.0.0.1:{free_port()}"]), ("tiny-m-lora", [])):
            log = open(tmp_path / f"{name}.log", "w")
            procs.append(subprocess.Popen([*_member_args(tmp_path, name, join, steps, direct), *listen],
                                          stdout=log, stderr=subprocess.STDOUT))
        # both held at their step 2 (max_lead 2 behind the metronome's 0): each has read the DHT's view while it
        # waited, so each sees the other when the metronome lets them go
        until(lambda: all(metronome.members().get(n, {}).get("step", 0) >= 2 for n in ("tiny-s", "tiny-m-lora")),
              "both to join and wait at step 2", timeout=300)
        metronome.step = steps
        assert all(p.wait(600) == 0 for p in procs), (tmp_path / "tiny-m-lora.log").read_text()[-3000:]
        assert_trained_on_each_other(tmp_path, steps)
    finally:
        for p in procs:
            p.kill()
        metronome.close()
