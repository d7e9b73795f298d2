"""The open swarm against untrusted input (ftis_engine/openswarm): what a peer, or the coordinator, can send and what
each side refuses, counts and bounds. Unit tests on the decisions (Coordinator.handle, SwarmClient._receive,
OpenExchange._deliver and receive with a fake client), and two over loopback sockets for ZeroMQ's frame cap."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

zmq = pytest.importorskip("zmq")

from ftis_engine.config import load_config  # noqa: E402
from ftis_engine.exchange import Parcel  # noqa: E402
from ftis_engine.exchange.async_ import Mailbox  # noqa: E402
from ftis_engine.openswarm.client import SwarmClient  # noqa: E402
from ftis_engine.openswarm.coordinator import MAX_LIVE, MAX_NOISY, MAX_SOURCE, Coordinator  # noqa: E402
from ftis_engine.openswarm.member import OpenExchange  # noqa: E402
from ftis_engine.openswarm.schedule import OpenSchedule, PeerBook, split_sampler  # noqa: E402
from ftis_engine.openswarm.wire import MAGIC, MAX_HEADER, MAX_INT, mac_matches, pack, parcel_mac, unpack  # noqa: E402

from .helpers import ROOT  # noqa: E402
from .test_openswarm import DATA, NO_LINKS, SHARED, TOKENIZER, Running, join, kinds, until  # noqa: E402

KEY = bytes(range(32))


def refusal(outgoing) -> str:
    (reply,) = outgoing
    assert reply[1][1] == b"refuse"
    return json.loads(reply[1][2])["reason"]


def parcel(name="a", step=1, version=0, words=1, body=b"\x00" * 4, **extra):
    return pack("parcel", {"name": name, "step": step, "version": version, "words": words, **extra}, body)


def quiet_client(on_parcel=lambda *parcel: None, name="me", **kw) -> SwarmClient:
    """A client whose I/O thread never starts: its _receive is called by hand."""
    return SwarmClient("tcp://127.0.0.1:1", name, TOKENIZER, SHARED, DATA, 1 << 10, on_parcel, **kw)


class FakeClient:
    """The coordinator's last word as a member's exchange reads it."""

    def __init__(self, view: dict[str, int]):
        self.view = view  # name -> newest step
        self.dropped = 0
        self.gone: set[str] = set()  # what SwarmClient.departed() says next

    def departed(self) -> set[str]:
        gone, self.gone = self.gone, set()
        return gone

    def members(self) -> dict[str, dict]:
        return {name: {"step": step, "tokenizer": TOKENIZER, "source": "", **NO_LINKS}
                for name, step in self.view.items()}

    def check(self) -> None:
        pass


def exchange(*overrides: str, peers=("peer",)) -> OpenExchange:
    """tiny-s's exchange (8 steps), its client a fake: itself and `peers` live at step 0."""
    config = load_config(ROOT / "configs/swarm/tiny-s.yaml", ["train.steps=8", "rollout.group_size=4",
                                                              "rollout.prompts_per_step=2", *overrides])
    ex = OpenExchange("tcp://127.0.0.1:1", config)
    ex.tokenizer = TOKENIZER
    ex.client = FakeClient({"tiny-s": 0, **{p: 0 for p in peers}})
    ex._limit = lambda sender, step: 1000
    return ex


def taken(ex: OpenExchange, step: int = 8) -> list[Parcel]:
    return ex.mailbox.take_due(step, time.time(), None)


# ------------------------------------------------------------------------------------------------- empty parcels


def test_the_coordinator_refuses_a_parcel_of_no_words_and_relays_an_honest_empty_step():
    coordinator = Coordinator(SHARED, lease_s=10, max_body=100)
    coordinator.handle(b"A", join("a"), now=0)
    coordinator.handle(b"B", join("b"), now=0)
    assert coordinator.handle(b"A", parcel(words=0, body=b""), now=1) == []
    assert coordinator.refused == 1
    # an honest member with nothing this step sends a buffer of 0 sequences: one word
    assert kinds(coordinator.handle(b"A", parcel(words=1, body=b"\x00" * 4), now=1)) == [(b"B", "parcel")]


def test_a_client_counts_a_parcel_of_no_words_as_malformed_and_never_hands_it_on():
    got = []
    client = quiet_client(lambda *p: got.append(p))
    client._receive(None, parcel(name="peer", words=0, body=b""))
    assert client.malformed == 1 and got == []
    client._receive(None, parcel(name="peer"))
    assert got == [("peer", 1, 0, b"\x00" * 4, "")]


def test_a_parcel_that_makes_on_parcel_raise_is_counted_and_the_client_thread_goes_on():
    def on_parcel(*parcel):
        raise ValueError("a bad parcel")

    client = quiet_client(on_parcel)
    for _ in range(2):
        client._receive(None, parcel(name="peer"))  # raised out of the I/O thread's loop before: its end
    assert client.parcel_errors == 2 and client.error is None


@pytest.mark.parametrize("body", [b"", b"\x01\x02\x03"])
def test_the_exchange_refuses_an_empty_or_ragged_body_unread_and_counts_it(body):
    ex = exchange()
    ex._deliver("peer", 1, 0, body)  # torch.frombuffer raised on an empty one
    (got,) = taken(ex)
    assert got.refused.startswith(f"a body of {len(body)} bytes") and got.buffer.numel() == 0 and ex.refused == 1


# ------------------------------------------------------------------------------------------------- own samplers


def signed(name, step, version, body, key=KEY):
    return parcel_mac(key, name, step, version, body)


def test_a_parcel_under_this_members_sampler_name_is_taken_only_signed_with_its_samplers_key():
    ex = exchange("members.0.samplers=1", peers=("tiny-s/sampler-0", "tiny-s/sampler-3", "bob/sampler-0"))
    ex.key = KEY
    body = torch.zeros(1, dtype=torch.int32).numpy().tobytes()
    ex._deliver("tiny-s/sampler-0", 2, 0, body, "")  # a peer that joined under its sampler's name: no mac
    ex._deliver("tiny-s/sampler-0", 2, 0, body, signed("tiny-s/sampler-0", 2, 0, body, key=b"\x01" * 32))
    ex._deliver("tiny-s/sampler-0", 2, 0, body, signed("tiny-s/sampler-0", 3, 0, body))  # another parcel's
    ex._deliver("tiny-s/sampler-3", 2, 0, body, signed("tiny-s/sampler-3", 2, 0, body))  # it has one sampler
    refused = taken(ex)
    assert len(refused) == 4 and all(p.refused for p in refused) and ex.refused == 4
    assert "not signed with the key of this member's samplers" in refused[0].refused
    assert "this member has 1 sampler(s)" in refused[-1].refused
    ex._deliver("tiny-s/sampler-0", 2, 0, body, signed("tiny-s/sampler-0", 2, 0, body))
    ex._deliver("bob/sampler-0", 2, 0, body, "")  # another member's sampler: a peer, checked as one downstream
    assert [p.refused for p in taken(ex)] == [None, None]


def test_a_member_without_samplers_takes_nothing_under_its_samplers_names():
    ex = exchange(peers=("tiny-s/sampler-0",))
    body = b"\x00" * 4
    ex._deliver("tiny-s/sampler-0", 2, 0, body, signed("tiny-s/sampler-0", 2, 0, body))
    (got,) = taken(ex)
    assert "this member has 0 sampler(s)" in got.refused


def test_only_this_members_own_samplers_are_its_own_in_the_schedule():
    config = load_config(ROOT / "configs/swarm/tiny-s.yaml", ["members.0.samplers=1"])
    book = PeerBook("tiny-s")
    for name in ("tiny-s/sampler-0", "tiny-s/sampler-9", "bob/sampler-0", "bob"):
        book.number(name)
    roles = OpenSchedule(config, (0, 1, 2), book).roles
    assert roles == [(0, None), (0, 0), (2, 9), (3, 0), (4, None)]  # sampler-9 is no sampler of its: a peer's


def test_membership_reaches_the_receiver_and_schedule_as_an_event_and_nothing_writes_into_them():
    """Who is live and which peers' tokenizers loaded come up in Arrivals.peers (issue 69: no transport writes into
    the receiver's checker or the schedule); the receiver reads them there, and its schedule's senders and budget
    follow them: a peer that joins counts from the receive that says so, one that leaves from the next."""
    from ftis_engine.exchange.admission import Admission
    from ftis_engine.exchange.verify import RolloutChecker

    ex = exchange("swarm.max_lead=null", "swarm.mode=async")
    schedule = OpenSchedule(ex.config, (0, 1, 2), ex.book)
    checker = RolloutChecker(None, None, vocab_size=100, max_new_tokens=8)
    receiver = Admission(ex.config, schedule, checker, 0)
    assert schedule.senders(0) == [] and receiver.budget == 0  # nobody is known live before a receive
    got = ex.receive(0, 1)
    assert got.peers.live == (0, ex.book.number("peer")) and got.peers.foreign == {}
    assert schedule.senders(0) == [] and checker.foreign == {}  # the transport wrote nothing into them
    receiver.receive(got.parcels, 1, peers=got.peers)
    assert schedule.senders(0) == [1] and receiver.budget == 8  # the peer's step: 2 prompts x 4
    ex.client.view["bob"] = 0  # a peer joins
    got = ex.receive(0, 2)
    receiver.receive(got.parcels, 2, peers=got.peers)
    assert schedule.senders(0) == [1, 2] and receiver.budget == 16
    del ex.client.view["peer"]  # and one leaves
    got = ex.receive(0, 3)
    receiver.receive(got.parcels, 3, peers=got.peers)
    assert schedule.senders(0) == [2] and receiver.budget == 8
    receiver.receive([], 4)  # a receive that says nothing of membership (one world's) changes nothing
    assert schedule.senders(0) == [2]


def test_a_sampler_name_is_as_sampler_name_writes_it():
    assert split_sampler("a/sampler-1") == ("a", 1)
    for alias in ("a/sampler-01", "a/sampler-\u0661", "a/sampler-+1", "a/sampler- 1", "a/sampler-1234567"):
        assert split_sampler(alias) is None, alias


def test_a_sampler_signs_its_parcels_and_a_learner_checks_the_signature():
    client = quiet_client(name="tiny-s/sampler-0", key=KEY)
    body = b"\x05\x00\x00\x00"
    assert client.publish(3, 2, body)
    _, header, got = unpack(client._outbox.get_nowait(), 100)
    assert mac_matches(KEY, "tiny-s/sampler-0", 3, 2, got, header["mac"])
    assert not mac_matches(KEY, "tiny-s/sampler-0", 3, 2, b"\x06\x00\x00\x00", header["mac"])
    assert not mac_matches(KEY, "tiny-s/sampler-0", 3, 2, got, "\ud800" * 64)  # any string, never an error
    learner = quiet_client()
    assert learner.publish(3, 2, body) and "mac" not in unpack(learner._outbox.get_nowait(), 100)[1]  # none


def test_the_coordinator_refuses_a_mac_that_is_not_one():
    coordinator = Coordinator(SHARED, lease_s=10, max_body=100)
    coordinator.handle(b"A", join("a"), now=0)
    coordinator.handle(b"B", join("b"), now=0)
    assert coordinator.handle(b"A", parcel(mac="x" * 5000), now=1) == [] and coordinator.refused == 1
    assert kinds(coordinator.handle(b"A", parcel(mac="0" * 64), now=1)) == [(b"B", "parcel")]


# ------------------------------------------------------------------------------------------------- joins


@pytest.mark.parametrize("field, value, said", [
    ("tokenizer", "t" * 60_000, "tokenizer: 'tttt"),
    ("tokenizer", "AB" * 32, "tokenizer:"),
    ("dataset", "zz", "dataset: 'zz' is not a sha256 hex digest"),
    ("source", "a" * (MAX_SOURCE + 1), "source:"),
    ("source", "builtin:tiny s", "source:"),
    ("name", "n" * 60_000, "name: 'nnnn"),
    ("name", "a\n", "name:"),
    ("name", "a/sampler-01", "name:"),
    ("name", "a/b", "name:"),
])
def test_a_join_whose_name_hashes_or_source_break_their_format_is_refused_naming_the_field(field, value, said):
    coordinator = Coordinator(SHARED, lease_s=10, max_body=100)
    header = {"name": "a", "tokenizer": TOKENIZER, "source": "", "shared": SHARED, "dataset": DATA, "step": 0,
              field: value}
    out = coordinator.handle(b"A", pack("join", header), now=0)
    assert refusal(out).startswith(said) and len(out[0][1][2]) < 1000  # one short line
    assert coordinator.live == {}


def test_a_join_of_sampler_and_hub_names_is_welcome():
    coordinator = Coordinator(SHARED, lease_s=10, max_body=100)
    for identity, name, source in ((b"A", "tiny-s", "builtin:tiny-s"), (b"S", "tiny-s/sampler-0", "builtin:tiny-s"),
                                   (b"Q", "qwen", "Qwen/Qwen2.5-0.5B-Instruct"), (b"P", "p", "packaged:smollm2-135m")):
        header = {"name": name, "tokenizer": TOKENIZER, "source": source, "shared": SHARED, "dataset": DATA,
                  "step": 0}
        assert kinds(coordinator.handle(identity, pack("join", header), now=0))[0] == (identity, "welcome")


def test_one_connection_holds_one_name():
    coordinator = Coordinator(SHARED, lease_s=10, max_body=100)
    coordinator.handle(b"A", join("a"), now=0)
    assert refusal(coordinator.handle(b"A", join("b"), now=1)).startswith("name: this connection already holds 'a'")
    assert kinds(coordinator.handle(b"A", join("a", step=3), now=1))[0] == (b"A", "welcome")  # its own, again
    assert sorted(coordinator.live) == ["a"]


def _list_of(messages: list[list[bytes]], client: SwarmClient) -> dict:
    """What `client` holds after the coordinator's messages to one member (each through the wire's own checks)."""
    for frames in messages:
        assert len(frames[2]) <= MAX_HEADER  # every message, every part of a list, fits one header
        client._receive(None, frames)
    return client.members()


def test_the_swarm_holds_max_live_names_and_each_part_of_its_member_list_fits_one_header():
    """MAX_LIVE names, each entry as large as a join may make it: the welcome and the whole list go out in parts of
    one header each, and a member given them holds exactly the coordinator's list (its own view is the oracle)."""
    import zmq

    longest = {**SHARED, "train": {"steps": MAX_INT}}  # a run as long as a step can count: the largest steps
    coordinator = Coordinator(longest, lease_s=10, max_body=100)
    for k in range(MAX_LIVE):  # each as large as a join may make it, at the largest step
        name = f"{k:04d}" + "n" * 96 + ("/sampler-999999" if k % 2 else "")
        header = {"name": name, "tokenizer": TOKENIZER, "source": "s" * MAX_SOURCE, "shared": longest,
                  "dataset": DATA, "step": MAX_INT}
        if not k % 2:  # a member that listens (a sampler only sends)
            header.update(address="tcp://" + "h" * 51 + ":65535", key=zmq.curve_keypair()[0].decode())
        out = coordinator.handle(str(k).encode(), pack("join", header), now=0)
        assert kinds(out)[0] == (str(k).encode(), "welcome"), k
    assert refusal(coordinator.handle(b"X", join("x", shared=longest), now=0)).startswith("the swarm is full")
    assert MAX_LIVE >= 1000 and len(json.dumps(coordinator._view())) > 4 * MAX_HEADER  # the list spans parts

    def member() -> SwarmClient:
        return SwarmClient("tcp://127.0.0.1:1", "me", TOKENIZER, longest, DATA, 1 << 10, lambda *p: None)

    last = str(MAX_LIVE - 1).encode()
    joiner = member()
    # the last joiner's welcome and the parts after it (nothing else came to it)
    welcome = [frames for identity, frames in out if identity == last]
    assert [f[1] for f in welcome][0] == b"welcome" and len(welcome) > 1
    assert _list_of(welcome, joiner) == coordinator._view() and joiner._joined.is_set() and joiner.malformed == 0
    # the whole list, as once a lease, to every live member
    outgoing = coordinator._members(now=coordinator.lease_s)
    assert {identity for identity, _ in outgoing} == {str(k).encode() for k in range(MAX_LIVE)}
    assert _list_of([f for i, f in outgoing if i == b"7"], member()) == coordinator._view()
    # every name replaced at once: the changes (all left, all joined) would not fit; the whole list goes instead
    coordinator.live = {f"{k:04d}" + "m" * 96: entry for k, entry in enumerate(coordinator.live.values())}
    outgoing = coordinator._members(now=coordinator.lease_s + 0.5)
    assert {f[1] for _, f in outgoing} == {b"members"}
    assert _list_of([f for i, f in outgoing if i == b"7"], joiner) == coordinator._view() and joiner.malformed == 0


def test_a_step_past_two_to_the_31_is_refused_by_the_wire():
    coordinator = Coordinator(SHARED, lease_s=10, max_body=100)
    coordinator.handle(b"A", join("a"), now=0)
    beat = [MAGIC, b"beat", json.dumps({"name": "a", "step": 2 ** 31}).encode()]
    assert coordinator.handle(b"A", beat, now=1) == [] and coordinator.live["a"].step == 0


# ------------------------------------------------------------------------------------------------- the lead bound


def test_a_live_peer_that_never_publishes_costs_one_timeout_not_one_every_step(monkeypatch):
    """The lead bound's waits are counted, not timed: a wait that runs out reports its whole time-out at once."""
    from ftis_engine.openswarm import member as member_module

    waits = []

    def counted(check=None):
        def wait(ready, timeout_s, what):
            if ready():
                return 0.0, True
            waits.append(timeout_s)
            return timeout_s, False
        return wait

    monkeypatch.setattr(member_module, "poll", counted)
    ex = exchange("swarm.max_lead=0", "swarm.timeout_s=1", peers=("slow",))
    first = ex.receive(0, 5)
    assert waits == [1.0] and first.lead_wait_seconds == 1.0 and ex._given_up == {"slow"}  # waited once, warned
    assert ex.receive(0, 6).lead_wait_seconds == 0.0 and waits == [1.0]  # then goes on without it
    ex.client.view["slow"] = 7  # it catches up: the bound holds for it again
    assert ex.receive(0, 7).lead_wait_seconds == 0.0 and ex._given_up == set() and waits == [1.0]
    assert ex.receive(0, 8).lead_wait_seconds == 1.0 and waits == [1.0, 1.0]


# ------------------------------------------------------------------------------------------------- parked parcels


@pytest.mark.parametrize("name, step, version, said", [
    ("peer", 3, 10 ** 9, "policy version 1000000000 declared for step 3"),
    ("peer", 3, 1, "policy version 1 declared for step 3"),
    ("peer", 9, 8, "step 9, outside 1..train.steps=8"),
    ("bob/sampler-0", 3, 8, "policy version 8: after the run's last step (7)"),
])
def test_a_parcel_no_step_will_take_is_refused_and_never_parks_in_the_mailbox(name, step, version, said):
    ex = exchange(peers=(name,))
    ex._deliver(name, step, version, b"\x00" * 4)
    (got,) = ex.mailbox.take_due(1, time.time(), 2)  # the receiver's step 1 (max_lead 2): taken at once
    assert got.refused.startswith(said) and len(ex.mailbox) == 0


def test_a_mailbox_keeps_no_box_for_a_sender_it_has_emptied():
    box = Mailbox(4)
    box.put(Parcel(7, 1, 0, torch.zeros(1, dtype=torch.int32)))
    assert len(box.take_due(1, time.time())) == 1 and box._parcels == {}


def test_a_peer_no_longer_live_is_forgotten_and_counted_from_what_it_publishes_when_it_rejoins():
    ex = exchange("swarm.max_lead=null")
    ex._deliver("peer", 5, 4, b"\x00" * 4)
    assert ex._published() == {"peer": 5}
    del ex.client.view["peer"]  # its lease ran out
    ex.receive(0, 6)
    assert ex.book.published == {}
    ex.client.view["peer"] = 2  # back, resumed from its step 2 checkpoint
    assert ex._published() == {"peer": 2} and ex.book.number("peer") == 1  # its number is its own again


# ------------------------------------------------------------------------------------------------ the coordinator's log


def test_a_restarted_coordinator_keeps_the_swarms_training_set(tmp_path):
    log = tmp_path / "coordinator.jsonl"
    old = Coordinator(SHARED, lease_s=5, max_body=100, log_path=log)
    old.handle(b"A", join("a"), now=0)
    del old
    new = Coordinator(SHARED, lease_s=5, max_body=100, log_path=log, now=100)
    assert new.dataset == DATA
    assert refusal(new.handle(b"B", join("b", dataset="cd" * 32), now=101)).startswith("data: this member's training")


def test_a_flood_of_bad_messages_is_logged_a_few_lines_a_minute_without_the_live_list(tmp_path):
    log = tmp_path / "coordinator.jsonl"
    coordinator = Coordinator(SHARED, lease_s=1000, max_body=100, log_path=log)
    coordinator.handle(b"A", join("a"), now=0)
    for k in range(200):
        coordinator.handle(b"X", [MAGIC, b"beat", b"{not json"], now=1)
        coordinator.handle(str(k).encode(), join("n" * 60_000 + str(k)), now=1)
    coordinator.handle(b"X", [MAGIC, b"beat", b"{not json"], now=62)  # a minute on: the count, then logged again
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(records) == 2 + MAX_NOISY + 2 and coordinator.refused == 401  # start and join, then the noisy
    assert records[-2] == {**records[-2], "event": "suppressed", "count": 400 - MAX_NOISY}
    assert all("live" not in r and len(json.dumps(r)) < 1000 for r in records[2:])
    assert Coordinator(SHARED, lease_s=5, max_body=100, log_path=log, now=100).live.keys() == {"a"}  # restorable


# ------------------------------------------------------------------------------------------------- a lying coordinator


@pytest.mark.parametrize("entry", [
    {"step": 1, "tokenizer": 5, "source": "", **NO_LINKS},
    {"step": "1", "tokenizer": TOKENIZER, "source": "", **NO_LINKS},
    {"step": True, "tokenizer": TOKENIZER, "source": "", **NO_LINKS},
    {"step": 1, "tokenizer": [TOKENIZER], "source": "", **NO_LINKS},
    {"step": 1, "tokenizer": TOKENIZER},
    {"step": 1, "tokenizer": TOKENIZER, "source": None},
])
def test_a_member_list_whose_entries_break_their_types_is_counted_and_the_last_good_one_kept(entry):
    client = quiet_client()
    good = {"me": {"step": 0, "tokenizer": TOKENIZER, "source": "", **NO_LINKS}}
    client._receive(None, pack("members", {"members": good}))
    client._receive(None, pack("members", {"members": {**good, "liar": entry}}))
    assert client.malformed == 1 and client.members() == good


def test_closing_a_client_whose_thread_stopped_draining_never_blocks():
    client = quiet_client()
    client._thread = threading.Thread(target=client._stop.wait, daemon=True)  # alive, drains nothing
    client._thread.start()
    while client.publish(1, 0, b"\x00" * 4):  # its outbox full
        pass
    closing = threading.Thread(target=client.close, daemon=True)
    closing.start()
    closing.join(10)
    assert not closing.is_alive()


# ------------------------------------------------------------------------------------------------- frame caps


def test_the_coordinators_socket_never_reads_a_frame_over_the_largest_honest_one():
    running = Running()  # max_body 1 MiB
    huge, small = (zmq.Context.instance().socket(zmq.DEALER) for _ in range(2))
    try:
        for sock in (huge, small):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(running.address)
        huge.send_multipart([MAGIC, b"beat", b"{}", b"x" * ((1 << 20) + MAX_HEADER + 1)])
        time.sleep(0.5)  # it reached the coordinator (or was cut on the way)
        small.send_multipart([MAGIC, b"beat", b"{not json"])
        until(lambda: running.coordinator.refused >= 1, "the small message's refusal")
        time.sleep(0.5)
        assert running.coordinator.refused == 1  # the large one was never read (read, it would be refused too)
    finally:
        huge.close()
        small.close()
        running.close()


def test_the_clients_socket_never_reads_a_frame_over_the_largest_honest_one():
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.RCVTIMEO, 30_000)
    router.bind("tcp://127.0.0.1:*")
    client = SwarmClient(router.getsockopt_string(zmq.LAST_ENDPOINT), "me", TOKENIZER, SHARED, DATA, 100,
                         lambda *parcel: None)
    try:
        client._thread.start()
        identity, *_ = router.recv_multipart()  # its join
        router.send_multipart([identity, *pack("welcome", {"lease_s": 10.0, "members": {}})])
        until(client._joined.is_set, "the welcome")
        router.send_multipart([identity, *parcel(name="peer", words=1000, body=b"\x00" * (100 + MAX_HEADER + 1))])
        time.sleep(0.5)
        assert client.malformed == 0 and client.error is None  # never read (read, it is malformed: over max_body)
    finally:
        client.close(leave=False)
        router.close()


# ------------------------------------------------------------------------------------------------ steps past the run


@pytest.mark.parametrize("kind", ["beat", "parcel"])
def test_a_members_step_past_the_run_is_refused_so_it_cannot_turn_its_peers_lead_bound_off(kind):
    """SHARED's run has 5 steps. A member that says step 6 (or 2^31 - 1) in a beat or a parcel is refused, not
    relayed and not taken as its step: taken, no peer would ever wait for it (it would look ahead of them all)."""
    coordinator = Coordinator(SHARED, lease_s=10, max_body=100)
    coordinator.handle(b"A", join("a"), now=0)
    coordinator.handle(b"B", join("b"), now=0)
    for step in (6, MAX_INT):
        message = parcel(step=step) if kind == "parcel" else pack("beat", {"name": "a", "step": step})
        assert coordinator.handle(b"A", message, now=1) == [] and coordinator.live["a"].step == 0
    assert kinds(coordinator.handle(b"A", parcel(step=5), now=1)) == [(b"B", "parcel")]
    assert coordinator.live["a"].step == 5
    assert refusal(coordinator.handle(b"C", join("c", step=6), now=1)).startswith("step: 6, past train.steps=5")
    # a sampler's rounds are its own count, not a step of the run
    assert kinds(coordinator.handle(b"S", join("a/sampler-0", step=9), now=1))[0] == (b"S", "welcome")


def test_a_member_takes_no_step_past_the_run_from_the_coordinator_either():
    ex = exchange()  # 8 steps
    ex.client.view["peer"] = 10 ** 6
    assert ex._published() == {"peer": 0}
    ex.client.view["peer"] = 8
    assert ex._published() == {"peer": 8}


# ------------------------------------------------------------------------------------------------ peers that restart


def test_a_peer_that_restarted_between_two_steps_is_counted_from_its_new_steps():
    """Peer b published step 5, crashed and came back resumed from step 2 before this member's next step: the
    member never saw it missing from the live list, but its client saw it leave (or come back at an older step),
    so the lead bound counts b at 2 (not at the 5 it published before) and waits for it again."""
    ex = exchange("swarm.max_lead=null", "swarm.timeout_s=1")
    ex._deliver("peer", 5, 4, b"\x00" * 4)
    ex.pacer.max_lead = 0  # the lead bound (exchange/pacer.py) from here on
    ex._given_up.add("peer")
    assert ex._published() == {"peer": 5}
    ex.client.view["peer"], ex.client.gone = 2, {"peer"}
    arrivals = ex.receive(0, 4)  # waits for it: 2 < 4 (one time-out)
    assert ex._published() == {"peer": 2} and arrivals.lead_steps == 2 and arrivals.lead_wait_seconds >= 1.0


def test_the_client_reports_a_name_that_left_or_came_back_at_an_older_step():
    client = quiet_client()
    # SHARED's run has 5 steps: none past it (issue 78)
    view = {"step": 4, "tokenizer": TOKENIZER, "source": "", **NO_LINKS}
    client._set_members({"me": view, "a": view, "b": view, "c": view})
    assert client.departed() == set()
    client._set_members({"me": view, "a": {**view, "step": 2}, "b": {**view, "step": 5}})  # c left, a restarted
    assert client.departed() == {"a", "c"} and client.departed() == set()
    client._set_members({"me": view, "a": {**view, "step": 2}, "b": view, "c": view})  # b's step went down
    assert client.departed() == {"b"}


# ------------------------------------------------------------------------------------------------ foreign tokenizers


def test_a_peer_that_keeps_changing_its_tokenizer_costs_one_load_until_it_leaves(monkeypatch):
    """A peer that announces a new tokenizer hash every step (a rejoin on its own connection may) made every member
    load a tokenizer (a download) in its step loop every step. Now a peer's tokenizer is loaded once while it stays
    (a change while live: not trained on), and again only for whoever holds the name after it left."""
    from ftis_engine.model import models
    from ftis_engine.openswarm import member as openswarm_member  # where the exchange looks the names up

    loads = []

    def load_tokenizer(source):
        loads.append(source)
        raise models.ModelSpecError(f"{source}: not here")

    monkeypatch.setattr(openswarm_member, "load_tokenizer", load_tokenizer)
    ex = exchange(peers=())
    ex.client = FakeClient({"tiny-s": 0})
    ex.client.members = lambda: {"tiny-s": {"step": 0, "tokenizer": TOKENIZER, "source": "", **NO_LINKS},
                                 "liar": {"step": 0, "tokenizer": f"{len(loads) + seen[0]:064x}",
                                          "source": "org/model"}}
    seen = [0]
    for step in range(1, 6):
        seen[0] += 1  # a new hash at every step
        ex.receive(0, step)
    assert loads == ["org/model"]
    ex.client.gone = {"liar"}  # it left; a new holder of the name comes
    ex.receive(0, 6)
    assert loads == ["org/model"] * 2


def test_an_open_swarm_counts_the_sequences_it_refuses_from_peers_of_another_tokenizer():
    """accept_foreign false: a peer of another tokenizer is not trained on; its parcels are refused before
    admission and their sequences reported (foreign_refused), as one world reports them."""
    from ftis_engine.data.rollouts import HEADER_WORDS

    ex = exchange("members.0.accept_foreign=false")
    ex.client.members = lambda: {"tiny-s": {"step": 0, "tokenizer": TOKENIZER, "source": "", **NO_LINKS},
                                 "other": {"step": 0, "tokenizer": "ef" * 32, "source": "org/model"}}
    body = torch.tensor([3] + [0] * (3 * HEADER_WORDS + 12), dtype=torch.int32).numpy().tobytes()
    ex._deliver("other", 1, 0, body)
    ex._deliver("other", 2, 1, torch.tensor([10 ** 6], dtype=torch.int32).numpy().tobytes())  # a claim, bounded
    assert ex.receive(0, 2).foreign_refused == 3 and ex.receive(0, 3).foreign_refused == 0
    assert len(ex.mailbox) == 0


def test_a_clients_unsent_parcels_are_counted_in_sequences_as_one_world_counts_them():
    from ftis_engine.data.rollouts import HEADER_WORDS

    client = quiet_client(name="me")
    body = torch.tensor([2] + [0] * (2 * HEADER_WORDS + 5), dtype=torch.int32).numpy().tobytes()
    while client.publish(1, 0, body):  # the I/O thread never drains it: the outbox fills
        pass
    assert client.dropped == 2
    client._count_dropped(torch.tensor([10 ** 6, 0], dtype=torch.int32).numpy().tobytes())  # a claim, bounded
    assert client.dropped == 2


# ------------------------------------------------------------------------------------------- a restarted coordinator


def test_a_restarted_coordinator_holds_a_members_place_for_its_own_connection_only(tmp_path):
    """After a restart the coordinator holds its members' places for a lease. A stranger's connection could take
    the name in that window and have the member refused when it came back (the member then exits). The place is
    held for the connection that had it: a stranger is refused, the member comes back, and after the lease a name
    that nobody reclaimed is free again."""
    log = tmp_path / "coordinator.jsonl"
    old = Coordinator(SHARED, lease_s=5, max_body=100, log_path=log)
    old.handle(b"A", join("a"), now=0)
    old.handle(b"B", join("b"), now=0)
    del old
    new = Coordinator(SHARED, lease_s=5, max_body=100, log_path=log, now=100)
    assert refusal(new.handle(b"X", join("a"), now=101)).startswith("'a' is held for its member")
    assert kinds(new.handle(b"A", join("a"), now=102))[0] == (b"A", "welcome")
    assert kinds(new.handle(b"Y", join("b"), now=106))[0] == (b"Y", "welcome")  # b never came back in its lease


@pytest.mark.parametrize("loads", [True, False], ids=["loads", "does-not-load"])
def test_a_new_foreign_peers_parcels_wait_for_its_tokenizer_and_are_admitted_only_with_it(monkeypatch, loads):
    """A peer of another tokenizer sends its first parcels before this member's next step loads its tokenizer (a
    download under load can take steps): they wait in the mailbox, and are admitted if the load succeeds, or left
    out and counted (foreign_refused) if not, never validated against this member's own tokenizer (which took an
    honest peer for a liar). A peer that left (finished, or crashed) keeps its tokenizer registered for what it left
    waiting, until a new holder of its name announces another: then what the old one left goes, counted."""
    from ftis_engine.model import models
    from ftis_engine.openswarm import member as openswarm_member  # where the exchange looks the names up
    from ftis_engine.data.rollouts import HEADER_WORDS

    other = "ef" * 32

    def load_tokenizer(source):  # meanwhile, the client's I/O thread takes the peer's next parcel
        ex._deliver("bpe", 2, 1, body)
        if not loads:
            raise models.ModelSpecError(f"{source}: not here")
        return "its tokenizer"

    monkeypatch.setattr(openswarm_member, "load_tokenizer", load_tokenizer)
    monkeypatch.setattr(openswarm_member, "vocabulary_hash", lambda tokenizer: other)
    ex = exchange("swarm.max_lead=null", peers=())
    view = {"tiny-s": {"step": 0, "tokenizer": TOKENIZER, "source": "", **NO_LINKS},
            "bpe": {"step": 0, "tokenizer": other, "source": "builtin:tiny-s-bpe", **NO_LINKS}}
    ex.client.members = lambda: dict(view)
    body = torch.tensor([3] + [0] * (3 * HEADER_WORDS + 12), dtype=torch.int32).numpy().tobytes()
    ex._deliver("bpe", 1, 0, body)  # before any step of this member loaded its tokenizer
    got = ex.receive(0, 3)
    assert (len(got.parcels), got.foreign_refused) == ((2, 0) if loads else (0, 6))
    assert got.peers.foreign == ({1: "its tokenizer"} if loads else {})  # what the receiver re-encodes with
    if loads:
        ex._deliver("bpe", 3, 2, body)
        del view["bpe"]  # it finished
        ex.client.gone = {"bpe"}
        got = ex.receive(0, 4)  # what it left: admitted with its tokenizer
        assert (len(got.parcels), got.foreign_refused, got.peers.foreign) == (1, 0, {1: "its tokenizer"})
        buffer = torch.frombuffer(bytearray(body), dtype=torch.int32)
        ex.mailbox.put(Parcel(1, 4, 3, buffer, due_step=5, tokenizer=other))  # one more, delayed in transit
        # a new holder, of a third tokenizer
        view["bpe"] = {"step": 0, "tokenizer": "aa" * 32, "source": "", **NO_LINKS}
        got = ex.receive(0, 5)  # the old holder's parcel is no longer admissible
        assert (got.parcels, got.foreign_refused, got.peers.foreign) == ([], 3, {})


def test_a_steady_stream_of_messages_never_keeps_the_client_from_its_beats():
    """The client's thread reads at most RECEIVE_HWM messages a turn, then sends (its beats hold its lease): a
    stream relayed faster than it is read no longer keeps it reading for ever (here: a socket that always has
    one more message)."""
    from ftis_engine.openswarm.client import RECEIVE_HWM

    client = quiet_client()
    flood = parcel(name="peer")

    class Endless:
        reads = 0

        def recv_multipart(self, flags):
            self.reads += 1
            return flood

    socket = Endless()
    handed = []
    client._on_parcel = lambda *p: handed.append(p)
    assert client._read_some(socket) == RECEIVE_HWM == socket.reads == len(handed)


def test_a_peer_that_joins_while_a_step_waits_has_its_parcels_kept_for_the_next_step(monkeypatch):
    """A peer of another tokenizer joins and sends while this member's step waits on the lead bound, after the
    step looked for new tokenizers to load: its parcels are due, its tokenizer not yet tried. They wait in the
    mailbox for the next step, which loads it and admits them (they were counted as refused: the two-tokenizer test
    failed beside a CPU hog)."""

    from ftis_engine.openswarm import member as openswarm_member  # where the exchange looks the names up
    from ftis_engine.data.rollouts import HEADER_WORDS

    other = "ef" * 32
    monkeypatch.setattr(openswarm_member, "load_tokenizer", lambda source: "its tokenizer")
    monkeypatch.setattr(openswarm_member, "vocabulary_hash", lambda tokenizer: other)
    ex = exchange()  # max_lead 2, with a live peer of its own tokenizer: the step waits on the lead bound
    view = {"tiny-s": {"step": 0, "tokenizer": TOKENIZER, "source": "", **NO_LINKS},
            "peer": {"step": 2, "tokenizer": TOKENIZER, "source": "", **NO_LINKS}}
    ex.client.members = lambda: dict(view)
    body = torch.tensor([3] + [0] * (3 * HEADER_WORDS + 12), dtype=torch.int32).numpy().tobytes()

    def wait_lead(need):  # meanwhile, the new peer joins and its first parcel arrives (in the first step's wait)
        if "bpe" not in view:
            view["bpe"] = {"step": 1, "tokenizer": other, "source": "builtin:tiny-s-bpe", **NO_LINKS}
            ex._deliver("bpe", 1, 0, body)
        return 0.0

    monkeypatch.setattr(ex.pacer, "hold", lambda step, published, wait, peers: wait_lead(step - ex.pacer.max_lead))
    got = ex.receive(0, 3)
    assert (got.parcels, got.foreign_refused, len(ex.mailbox)) == ([], 0, 1)
    got = ex.receive(0, 4)
    assert ([p.sender for p in got.parcels], got.foreign_refused) == ([ex.book.number("bpe")], 0)


# ------------------------------------------------------------------------------------------------ shown to a person

ANSI = "\x1b[2J\x1b[H\x1b[31mFAKE\x07"  # clears the screen, homes the cursor, writes red, rings the bell


def test_outside_text_is_shown_escaped_and_cut():
    from ftis_engine.core.errors import shown

    assert shown(ANSI) == "\\x1b[2J\\x1b[H\\x1b[31mFAKE\\x07"
    assert shown("a\nb\u202ec\u200bd\ud800") == "a\\nb\\u202ec\\u200bd\\ud800"  # line breaks, bidi, zero width
    assert shown("x" * 1000, limit=50) == "x" * 50 + "..." and shown("é" * 5) == "é" * 5
    assert shown("\x1b" * 100, limit=10) == "\\x1b\\x1b..."  # never half an escape


def test_a_hostile_coordinators_refusal_reaches_the_terminal_escaped_cut_and_in_one_line(tmp_path, capsys):
    """A coordinator (untrusted, docs/async.md) answers a join with a refusal whose reason would clear the screen
    and forge text: the member's one error line carries it escaped and cut, and nothing of the run is left."""
    from .helpers import command_here

    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.RCVTIMEO, 60_000)
    router.bind("tcp://127.0.0.1:*")
    address = router.getsockopt_string(zmq.LAST_ENDPOINT)

    def refuse() -> None:
        identity, *_ = router.recv_multipart()
        router.send_multipart([identity, *pack("refuse", {"reason": ANSI + "\nerror: forged line " + "y" * 5000})])

    thread = threading.Thread(target=refuse, daemon=True)
    thread.start()
    try:
        result = command_here(capsys, "train", "--config", ROOT / "configs/swarm/tiny-s.yaml", "--join", address,
                              "--output-dir", tmp_path / "runs", "--set", "swarm.timeout_s=60")
    finally:
        thread.join(60)
        router.close()
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: --join: the coordinator refused tiny-s: \\x1b[2J\\x1b[H\\x1b[31mFAKE\\x07\\n")
    assert all(c.isprintable() for c in line) and len(line) < 400 and line.endswith("...")
    assert not (tmp_path / "runs").exists()  # a refused join leaves no run directory behind


def test_a_member_list_or_parcel_under_a_name_no_join_can_take_is_counted_and_dropped():
    """Names, tokenizers and sources reach logs and records: the client takes only what the coordinator admits at
    a join (a member's or a sampler's name, a sha256, a plain source), so none can carry an escape."""
    got = []
    client = quiet_client(on_parcel=lambda *p: got.append(p))
    good = {"me": {"step": 0, "tokenizer": TOKENIZER, "source": "", **NO_LINKS}}
    client._receive(None, pack("members", {"members": good}))
    for members in ({**good, ANSI: {"step": 0, "tokenizer": TOKENIZER, "source": "", **NO_LINKS}},
                    {**good, "peer": {"step": 0, "tokenizer": TOKENIZER, "source": "builtin:" + ANSI}},
                    {**good, "peer": {"step": 0, "tokenizer": "not a digest", "source": "", **NO_LINKS}}):
        client._receive(None, pack("members", {"members": members}))
    client._receive(None, parcel(name=ANSI))
    assert client.malformed == 4 and client.members() == good and got == []
    client._receive(None, parcel(name="peer/sampler-0"))
    assert len(got) == 1


def test_the_coordinator_echoes_a_strangers_name_escaped(tmp_path):
    lines = []
    coordinator = Coordinator(SHARED, lease_s=10, max_body=100, echo=lines.append)
    refusal(coordinator.handle(b"X", join(ANSI), now=0))
    coordinator.handle(b"Y", pack("join", {"name": "b", "tokenizer": TOKENIZER, "source": "", "dataset": DATA,
                                           "step": 0, "shared": {**SHARED, ANSI: 1}}), now=0)
    assert len(lines) == 2 and all(c.isprintable() for line in lines for c in line), lines
    assert "\\x1b[2J" in lines[0] and "\\x1b[2J" in lines[1]


def test_the_engines_log_lines_are_escaped():
    import logging

    from ftis_engine.report.progress import ShownFormatter

    formatter = ShownFormatter("%(levelname)s %(name)s: %(message)s")
    record = logging.LogRecord("ftis_engine.exchange", logging.WARNING, __file__, 1, "peer %s: %s", ("a", ANSI), None)
    assert formatter.format(record) == "WARNING ftis_engine.exchange: peer a: \\x1b[2J\\x1b[H\\x1b[31mFAKE\\x07"
