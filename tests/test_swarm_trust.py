"""What one party says never becomes the open swarm's truth (issue 78): the swarm's training set is the
coordinator's own, from its config, never the first joiner's or its log's; what a coordinator announces is held to
the rules its own config obeys. In-process: the coordinator's decisions (Coordinator.handle) and the client's
(SwarmClient._receive), no sockets but one loopback pair."""

from __future__ import annotations

import json

import pytest

zmq = pytest.importorskip("zmq")

from ftis_engine.config import ConfigError, load_config  # noqa: E402
from ftis_engine.openswarm.client import CoordinatorRefused, SwarmClient  # noqa: E402
from ftis_engine.openswarm.coordinator import (  # noqa: E402
    MAX_LIVE,
    Coordinator,
    SwarmLogError,
    load_swarm_config,
    shared_settings,
)
from ftis_engine.openswarm.joining import dataset_hash, training_set_hash  # noqa: E402
from ftis_engine.openswarm.rules import MAX_PARTS, list_parts  # noqa: E402
from ftis_engine.openswarm.wire import MAX_HEADER, pack  # noqa: E402
from ftis_engine.data.tasks import TaskError, load_task  # noqa: E402

from .helpers import ROOT, command_here  # noqa: E402
from .test_openswarm import TOKENIZER, join, kinds  # noqa: E402

SWARM_YAML = ROOT / "configs/swarm/swarm.yaml"
STRANGER = "ee" * 32  # a made-up training-set hash


def member_digest(name: str = "tiny-s", *overrides: str) -> str:
    """The training-set hash a member of the shipped configs joins with, computed as its run does (session.open_run
    loads the task, openswarm.member.announced hashes it): the oracle."""
    config = load_config(ROOT / "configs/swarm" / f"{name}.yaml", list(overrides))
    return dataset_hash(load_task(config.data, config.seed, config.eval.datasets, eval_reward=config.eval.reward))


def swarm_coordinator(*overrides: str, **kw) -> Coordinator:
    """A coordinator of the shipped swarm config, as `swarm serve` builds it (cli.swarm_serve)."""
    return Coordinator(shared_settings(load_swarm_config(SWARM_YAML, overrides)), lease_s=10, max_body=100, **kw)


def refusal(outgoing) -> str:
    (reply,) = outgoing
    assert reply[1][1] == b"refuse"
    return json.loads(reply[1][2])["reason"]


# ------------------------------------------------------------------------------------------------- the training set


def test_the_swarms_training_set_is_the_one_its_config_names_as_each_member_computes_it():
    coordinator = swarm_coordinator()
    assert coordinator.dataset == member_digest("tiny-s") == member_digest("tiny-m-lora")
    assert swarm_coordinator("data.task=tiny-add").dataset == member_digest("tiny-s", "data.task=tiny-add")
    assert swarm_coordinator("seed=3").dataset == member_digest("tiny-s", "seed=3") != coordinator.dataset


def test_a_stranger_who_joins_first_with_a_made_up_hash_is_refused_and_locks_nobody_out():
    """The coordinator took the first joiner's hash as the swarm's: a stranger joining first with a made-up one had
    every honest member refused ('training set differs')."""
    coordinator = swarm_coordinator()
    shared = coordinator.shared
    said = refusal(coordinator.handle(b"X", join("stranger", shared=shared, dataset=STRANGER), now=0))
    assert said.startswith("data: this member's training set (sha256 eeeeeeeeeeee...) differs from the swarm's")
    assert coordinator.live == {} and coordinator.dataset == member_digest()
    for identity, name in ((b"A", "tiny-s"), (b"B", "tiny-m-lora")):
        out = coordinator.handle(identity, join(name, shared=shared, dataset=member_digest()), now=1)
        assert kinds(out)[0] == (identity, "welcome")
    assert sorted(coordinator.live) == ["tiny-m-lora", "tiny-s"]


def test_a_restart_on_a_log_whose_first_join_was_a_strangers_takes_the_configs_training_set(tmp_path):
    """A log written before this fix: the stranger's join (its hash) first, then it left. A restart restored that
    hash and the swarm stayed locked until the log was deleted; now the config's set is the swarm's."""
    shared = swarm_coordinator().shared
    log = tmp_path / "coordinator.jsonl"
    records = [{"time": 0, "event": "start", "member": None, "shared": shared, "lease_s": 10},
               {"time": 1, "event": "join", "member": "stranger", "step": 0, "tokenizer": TOKENIZER, "source": "",
                "dataset": STRANGER, "identity": "58", "live": ["stranger"]},
               {"time": 2, "event": "leave", "member": "stranger", "step": 0, "live": []},
               {"time": 3, "event": "restored", "member": None, "members": [], "dataset": STRANGER, "live": []}]
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    restarted = swarm_coordinator(log_path=log, now=100)
    assert restarted.dataset == member_digest()
    out = restarted.handle(b"A", join("tiny-s", shared=shared, dataset=member_digest()), now=101)
    assert kinds(out)[0] == (b"A", "welcome")
    assert refusal(restarted.handle(b"X", join("x", shared=shared, dataset=STRANGER), now=101)).startswith("data:")
    start = [json.loads(line) for line in log.read_text().splitlines() if '"start"' in line][-1]
    assert start["dataset"] == member_digest()  # what its own restart compares


def test_a_restart_with_another_training_set_than_its_log_holds_is_refused_at_start(tmp_path):
    log = tmp_path / "coordinator.jsonl"
    old = swarm_coordinator(log_path=log)
    old.handle(b"A", join("tiny-s", shared=old.shared, dataset=old.dataset), now=0)
    del old
    written = log.read_bytes()
    with pytest.raises(SwarmLogError, match=r"coordinator.jsonl is the log of a swarm that trained on another "
                                            r"training set \(sha256 [0-9a-f]{12}\.\.\. there, eeeeeeeeeeee\.\.\. "):
        swarm_coordinator(log_path=log, dataset=STRANGER)
    assert log.read_bytes() == written
    assert swarm_coordinator(log_path=log, now=5).live.keys() == {"tiny-s"}  # its own set: restored


def test_the_operator_may_name_the_training_set_but_only_as_a_digest():
    assert swarm_coordinator(dataset="ab" * 32).dataset == "ab" * 32
    with pytest.raises(ValueError, match="dataset: 'AB.*' is not a sha256 hex digest"):
        swarm_coordinator(dataset="AB" * 32)


@pytest.mark.timeout(120)  # before the fix it served (forever) a swarm whose training set it never read
def test_a_coordinator_that_cannot_read_its_training_set_stops_at_start_naming_the_field(tmp_path, capsys):
    broken = tmp_path / "train.jsonl"
    broken.write_text("not a JSON line\n")
    shared = {"seed": 0, "data": {"task": "jsonl", "train_path": str(broken)}}
    with pytest.raises(TaskError, match="data.train_path"):
        Coordinator(shared, lease_s=10, max_body=100)
    done = command_here(capsys, "swarm", "serve", "--config", SWARM_YAML, "--bind", "tcp://127.0.0.1:0", "--set",
                        "data.task=jsonl", "--set", f"data.train_path={broken}", "--output-dir", tmp_path / "out")
    (line,) = done.stderr.splitlines()
    assert done.returncode == 2 and line.startswith("error: data.train_path") and "train.jsonl" in line, line
    assert not (tmp_path / "out" / "coordinator.jsonl").exists()


def test_training_set_hash_reads_the_training_set_only():
    """The rewards are not loaded (they change no example): a reward module the coordinator's machine lacks does
    not stop it."""
    data = {"task": "tiny-add", "reward": "no_such_module_anywhere:reward"}
    assert training_set_hash(data, 0) == training_set_hash({"task": "tiny-add"}, 0) == member_digest(
        "tiny-s", "data.task=tiny-add")


# ------------------------------------------------------------------------------------------------- what it announces


def quiet_client(shared=None, **kw) -> SwarmClient:
    """A client whose I/O thread never starts: its _receive is called by hand."""
    shared = shared if shared is not None else {"seed": 0, "data": {"task": "tiny-add"}, "train": {"steps": 5}}
    return SwarmClient("tcp://127.0.0.1:1", "me", TOKENIZER, shared, "ab" * 32, 1 << 10, lambda *p: None, **kw)


def config_allows_lease(lease_s: float) -> bool:
    """The oracle: whether a coordinator's config takes swarm.lease_s=lease_s."""
    try:
        load_swarm_config(SWARM_YAML, [f"swarm.lease_s={lease_s!r}"])
    except ConfigError:
        return False
    return True


@pytest.mark.parametrize("lease_s", [1e-300, 0.5, 0.999, 86400.5, 1e9])
def test_a_welcome_whose_lease_no_coordinators_config_allows_is_refused_in_one_line(lease_s):
    """A member took any positive lease (1e-300 s: it beat as fast as its loop turns) where a coordinator's own
    config refuses one under 1 s."""
    assert not config_allows_lease(lease_s)
    client = quiet_client()
    client._receive(None, pack("welcome", {"lease_s": lease_s, "members": {}}))
    assert not client._joined.is_set() and client._stop.is_set() and client._beat_s == 1.0
    with pytest.raises(CoordinatorRefused) as told:
        client.check()
    line = str(told.value)
    assert line.startswith(f"the coordinator at tcp://127.0.0.1:1 announced swarm.lease_s={lease_s!r}: ")
    assert line.endswith("; this member does not join it") and "\n" not in line and len(line) < 600
    assert isinstance(told.value, ConnectionError)  # train --join tells it in one line, exit 2


@pytest.mark.parametrize("lease_s", [1, 1.0, 10.0, 86400])
def test_a_welcome_with_a_lease_a_coordinators_config_allows_is_taken(lease_s):
    assert config_allows_lease(lease_s)
    client = quiet_client()
    client._receive(None, pack("welcome", {"lease_s": lease_s, "members": {}}))
    assert client._joined.is_set() and client.error is None and client._beat_s == min(1.0, lease_s / 4)


def test_a_coordinator_announcing_a_bad_lease_over_a_socket_stops_the_members_start():
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.RCVTIMEO, 30_000)
    router.bind("tcp://127.0.0.1:*")
    client = SwarmClient(router.getsockopt_string(zmq.LAST_ENDPOINT), "me", TOKENIZER, {"train": {"steps": 5}},
                         "ab" * 32, 100, lambda *parcel: None)
    answered = []

    def answer():
        identity, *_ = router.recv_multipart()  # its join
        router.send_multipart([identity, *pack("welcome", {"lease_s": 1e-300, "members": {}})])
        answered.append(True)

    import threading

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        with pytest.raises(CoordinatorRefused, match=r"announced swarm\.lease_s=1e-300: "):
            client.start(timeout=30)
        assert answered
    finally:
        client.close(leave=False)
        thread.join(5)
        router.close()


def _entry(step: int = 0) -> dict:
    return {"step": step, "tokenizer": TOKENIZER, "source": "", "address": "", "key": ""}


def test_a_member_list_no_coordinator_sends_is_dropped_and_the_last_good_one_kept():
    """SHARED's run has 5 steps: a coordinator refuses a member's step 6 and admits MAX_LIVE names, so a list with
    either is not one it sends (a sampler's rounds are its own count)."""
    client = quiet_client()
    good = {"me": _entry(), "peer": _entry(5), "peer/sampler-0": _entry(40)}
    client._receive(None, pack("members", {"members": good}))
    assert client.members() == good and client.malformed == 0
    for members in ({**good, "peer": _entry(6)}, {f"n{k}": _entry() for k in range(MAX_LIVE + 1)}):
        for frames in _in_parts(members, number=1):
            client._receive(None, frames)
    assert client.members() == good and client.malformed == 2
    for frames in _in_parts({f"n{k}": _entry() for k in range(MAX_LIVE)}, number=2):
        client._receive(None, frames)
    assert len(client.members()) == MAX_LIVE and client.malformed == 2


def _in_parts(members: dict, number: int) -> list[list[bytes]]:
    """A member list as a coordinator sends it: whole in one header, or in parts (rules.list_parts), each through
    the wire's checks."""
    parts = list_parts(members)
    headers = [{"members": members}] if len(parts) == 1 else [
        {"members": part, "part": k, "parts": len(parts), "list": number} for k, part in enumerate(parts)]
    return [pack("members", header) for header in headers]


def test_a_member_list_in_parts_is_taken_only_whole_and_one_not_a_coordinators_is_dropped():
    """A list in parts is taken once all its parts came in order (one connection keeps the coordinator's order: a
    gap is a lost part, and nothing of that list is taken); a list's first part drops what was held of another, and
    so do a welcome and a list in one header; a part past its count, a count past MAX_PARTS, a part without its
    list's number, or one name in two parts is counted as malformed and changes nothing."""
    client = quiet_client()
    first = {f"n{k:03d}": _entry() for k in range(600)}
    frames = _in_parts(first, number=1)
    assert len(frames) == 2 and all(len(f[2]) <= MAX_HEADER for f in frames)
    client._receive(None, frames[1])  # its first part never came: dropped
    client._receive(None, frames[0])
    assert client.members() == {}  # half a list is no list
    client._receive(None, frames[1])
    assert client.members() == first and client.malformed == 0
    second = _in_parts({f"m{k:03d}": _entry() for k in range(600)}, number=2)
    third = _in_parts({f"x{k:03d}": _entry() for k in range(600)}, number=3)
    for frames, held in (([second[0], third[1], second[1]], first),  # another list's part between list 2's
                         ([second[0], pack("members", {"members": {"me": _entry()}}), second[1]], {"me": _entry()}),
                         ([second[0], pack("welcome", {"lease_s": 10, "members": {"me": {**_entry(), "step": 1}}}),
                           second[1]], {"me": {**_entry(), "step": 1}})):
        for f in frames:
            client._receive(None, f)
        assert client.members() == held and client.malformed == 0  # list 2 never taken
    part = {"n000": _entry()}
    for header in ({"members": part, "part": 2, "parts": 2, "list": 4}, {"members": part, "part": 0, "parts": 1,
                   "list": 4}, {"members": part, "part": 0, "parts": MAX_PARTS + 1, "list": 4},
                   {"members": part, "part": 0, "parts": 2}):
        client._receive(None, pack("members", header))
    assert client.members() == {"me": {**_entry(), "step": 1}} and client.malformed == 4
    for k in (0, 1):  # n000 in both parts of list 5
        client._receive(None, pack("members", {"members": {"n000": _entry(), f"p{k}": _entry()}, "part": k,
                                               "parts": 2, "list": 5}))
    assert client.members() == {"me": {**_entry(), "step": 1}} and client.malformed == 5
    fourth = _in_parts({f"y{k:03d}": _entry() for k in range(1000)}, number=6)
    assert len(fourth) == 3
    for f in (fourth[0], fourth[2], fourth[1]):  # out of order: part 1 came late (lost, as far as order says)
        client._receive(None, f)
    assert client.members() == {"me": {**_entry(), "step": 1}} and client.malformed == 5
    for f in third:  # a whole list in order after all that
        client._receive(None, f)
    assert set(client.members()) == {f"x{k:03d}" for k in range(600)} and client.malformed == 5


# ------------------------------------------------------------------------------------------------- its log


def test_the_coordinators_log_is_never_appended_to_through_a_link(tmp_path, capsys):
    """coordinator.jsonl a link to a file elsewhere: swarm serve appended its records there."""
    outside = tmp_path / "outside.txt"
    outside.write_text("kept\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "coordinator.jsonl").symlink_to(outside)
    done = command_here(capsys, "swarm", "serve", "--config", SWARM_YAML, "--bind", "tcp://127.0.0.1:0",
                        "--output-dir", out)
    assert done.returncode == 2 and done.stderr.splitlines()[-1] == (
        f"error: {out / 'coordinator.jsonl'}: a symbolic link where a file the command writes goes: nothing is "
        "written through it; move it away (check --output-dir and the paths in the config)"), done.stderr
    assert outside.read_text() == "kept\n"
