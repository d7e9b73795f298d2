"""The open swarm's membership on hivemind's DHT (openswarm/dht.py): no coordinator, so no node whose death ends
the swarm. The DHT's tests are in the slow tier and skipped without hivemind (pip install 'ftis-engine[dht]'); the
rule for a record's stamp needs no DHT and runs in every tier."""

from __future__ import annotations

import importlib.util
import os
import signal
import time

import pytest

from ftis_engine.openswarm.client import JoinRefused  # noqa: E402
from ftis_engine.openswarm.dht import DhtMembership  # noqa: E402

from .test_openswarm import SHARED, TOKENIZER, DATA, until  # noqa: E402

needs_hivemind = pytest.mark.skipif(importlib.util.find_spec("hivemind") is None,
                                    reason="hivemind is absent: pip install 'ftis-engine[dht]'")
LEASE = 4.0


def test_a_record_stamped_off_the_readers_clock_is_left_out():
    """A record is admitted while its stamp is at most a quarter lease in the reader's future and at most a lease in
    its past (an honest member renews every quarter lease): a writer whose clock is ahead, or who lies, keeps its
    record live at most a lease and a quarter after its last renewal; one whose clock is behind drops out."""
    now = 1_000_000.0
    reader = DhtMembership([], "127.0.0.1", "a", TOKENIZER, SHARED, DATA, 8.0, steps=4, clock=lambda: now)
    record = {"step": 1, "tokenizer": TOKENIZER, "source": "", "address": "", "key": "", "left": False}
    for ahead, admitted in ((-8.0, True), (-8.001, False), (-9.0, False), (0.0, True), (2.0, True),
                            (2.001, False), (3600.0, False)):
        assert reader._admitted("b", {**record, "stamp": now + ahead}) is admitted, ahead
    assert reader._admitted("b", {**record, "stamp": int(now)}) is False  # a stamp is a float, as a clock gives


def member(name, bootstrap=(), address="", key="", clock=time.time):
    m = DhtMembership(list(bootstrap), "127.0.0.1", name, TOKENIZER, SHARED, DATA, LEASE, listen=(address, key),
                      steps=SHARED["train"]["steps"], clock=clock)
    m.start(timeout=60)
    return m


@pytest.mark.slow
@needs_hivemind
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


@pytest.mark.slow
@needs_hivemind
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


@pytest.mark.slow
@needs_hivemind
def test_a_member_whose_clock_is_off_is_refused_at_join_or_left_out_of_the_others_views(monkeypatch):
    """A joiner whose machine's clock is 30 s ahead is refused in one line naming the clock (hivemind's first ping
    compares it with the bootstrap peer's: its DHT process is forked after the patch, so it has the patched clock).
    A member whose stamps are a lease ahead (its clock passed to the membership alone: it joins) is left out of the
    others' views, and counted, while a member who joins after it is seen."""
    import hivemind.dht.protocol

    a = member("a")
    try:
        with monkeypatch.context() as patched:
            real = hivemind.dht.protocol.get_dht_time
            patched.setattr(hivemind.dht.protocol, "get_dht_time", lambda: real() + 30.0)
            with pytest.raises(JoinRefused, match=r"^this machine's clock is more than 3 s off its bootstrap peer's, "
                                                  r"past what the DHT admits \(.*\): set it right \(NTP\)") as refused:
                member("skewed", a.maddrs())
            assert "\n" not in str(refused.value)
        ahead = member("ahead", a.maddrs(), clock=lambda: time.time() + LEASE)
        b = member("b", a.maddrs())
        try:
            until(lambda: set(a.members()) == set(b.members()) == {"a", "b"}, "a and b to see each other", 60)
            assert "ahead" not in a.members() and a.malformed > 0 and b.malformed > 0
        finally:
            for m in (ahead, b):
                m.close()
    finally:
        a.close()


@pytest.mark.slow
@needs_hivemind
def test_two_member_jobs_on_a_dht_train_on_each_others_rollouts_with_no_coordinator(tmp_path):
    """No coordinator: a DHT member in this process (a metronome: it sends nothing, holds both at step 2 until both
    wait there) bootstraps two member jobs (--join dht:its address), tiny-s listening and tiny-m-lora behind a NAT (no
    --listen: a DHT client that only dials); both train on each other's directly sent parcels, none rejected."""
    import subprocess

    from .ports import free_port
    from .test_openswarm import _member_args, _member_hashes, assert_trained_on_each_other

    steps, direct = 6, "swarm.peers_per_step=1"
    # the swarm's lease (by its key, the metronome's too) long: a record outlives a busy machine's late renewal, so
    # that the metronome, whose record holds both at step 2, cannot drop out of their views and let them go early
    lease = "swarm.lease_s=600"
    metronome = DhtMembership([], "127.0.0.1", "metronome", *_member_hashes(steps, direct, lease), 600.0,
                              steps=steps)
    metronome.start(timeout=60)
    join = "dht:" + metronome.maddrs()[0]
    procs = []
    try:
        for name, listen in (("tiny-s", ["--listen", f"tcp://127.0.0.1:{free_port()}"]), ("tiny-m-lora", [])):
            log = open(tmp_path / f"{name}.log", "w")
            procs.append(subprocess.Popen([*_member_args(tmp_path, name, join, steps, direct, lease), *listen],
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


@pytest.mark.slow
@needs_hivemind
def test_the_scale_benchmark_on_a_dht_replays_members_with_no_coordinator(tmp_path):
    """benchmarks/swarm_scale.py --membership dht, quick (4 replaying members across namespaces, a kill and a
    newcomer): no coordinator runs, every parcel passes the receivers' checks, the members' views see the kill and
    the newcomer, and each member's DHT processes are measured."""
    from benchmarks import swarm_scale
    from tests.netlab import NetLab

    reason = NetLab.unavailable()
    if reason is not None:
        pytest.skip(f"network namespaces: {reason}")
    [r] = swarm_scale.main(["--quick", "--membership", "dht", "--peers-per-step", "2", "--output",
                            str(tmp_path / "swarm_scale")])
    assert r["membership"] == "dht" and r["coordinator_tx_bytes_per_step"] is None and r["crash_noticed_s"] is None
    assert r["rejected_batches"] == 0 and r["refused"] == 0 and r["parcels_in_per_step"] > 0
    assert r["crash_seen_by_members_s"] is not None and r["joiner_seen_by_members_s"] is not None
    assert r["joiner"]["to_first_parcel_at_a_peer_s"] is not None
    assert r["dht_pss_mib_per_member"] > 0 and r["dht_cpu_share_per_member"] > 0
    assert "4 x " in (tmp_path / "swarm_scale.md").read_text()
