"""swarm.mode async across processes (gloo on CPU): members of different speeds keep learning from each other
within the lead bound, an update takes at most its budget, staleness stays bounded, queues stay bounded in a long
run, every parcel is checked, members leave at different times, a transport's own error says so, and a killed
rank stops the swarm for a --resume (or a restart)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time

import pytest

from .helpers import TINY, run_records
from .ports import free_port
from .test_swarm import HERE, _args, _env, _kill_rank_after_first_checkpoint, _steps, _train, kill_and_restart

ASYNC = ("swarm.mode=async", "eval.at_start=false", "checkpoint.every=0")


def _launch_timed(world: int, args: list[str], modes: dict[int, str] | None = None, timeout=300):
    """Hand-launch `world` ranks (as torchrun would); returns (exit code, stderr, when it exited: seconds since the
    epoch, comparable with the records' ended_at) each."""
    port = free_port()
    procs, start = [], time.time()
    for rank in range(world):
        env = _env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(HERE / "swarm_worker.py"), (modes or {}).get(rank, "none"),
                                   *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    ended: dict[int, float] = {}
    while len(ended) < world and time.time() - start < timeout:
        for rank, p in enumerate(procs):
            if rank not in ended and p.poll() is not None:
                ended[rank] = time.time()
        time.sleep(0.05)
    return [(p.wait(timeout=10), p.stderr.read(), ended.get(rank)) for rank, p in enumerate(procs)]


THREE = "  - name: tiny-l\n    model: builtin:tiny-l\n    lr: 1.0e-3\nalgorithm:"  # a third member, the slowest


def _three_members(tmp_path) -> pathlib.Path:
    config = tmp_path / "three.yaml"
    config.write_text(TINY.read_text().replace("algorithm:", THREE))
    return config


@pytest.mark.slow
def test_with_max_lead_null_a_fast_member_never_waits_for_a_slow_one_and_leaves_first(tmp_path):
    results = _launch_timed(2, _args(tmp_path, "train.steps=6", *ASYNC, "swarm.max_lead=null"), modes={1: "slow:2"})
    assert [code for code, _, _ in results] == [0, 0], results
    records = run_records(tmp_path / "swarm", "train")
    fast = [r for r in records if r["member"] == "tiny-s"]
    slow = [r for r in records if r["member"] == "tiny-m-lora"]
    assert [r["step"] for r in fast] == [r["step"] for r in slow] == list(range(1, 7))
    for r in records:  # no lead wait at all (the policy: test_async.py's fake-links test)
        assert r["lead_wait_seconds"] == 0
        assert r["staleness_max"] is None or r["staleness_max"] <= 8
    # the slow member sleeps 2 s a step (12 s): the fast one ran ahead, so it trained on few of its rollouts,
    # and the slow one on the fast one's newer rollouts (negative staleness: the peer is ahead)
    assert sum(r["peer_sequences"] for r in fast) < sum(r["own_sequences"] for r in slow)
    assert min(r["staleness_min"] for r in slow if r["staleness_min"] is not None) < 0
    # leaving: the fast member ended its last step before the slow one ended its step 4 (two steps still to go,
    # which it took alone), and its process (final eval, plots, exit) had gone before the slow one's last step
    # ended: orders of events in the two members' own logs, not durations (its exit under a loaded machine took
    # longer than the slow one's 2 s steps: 1.4 s past the slow one's step 4 beside another test's processes)
    assert fast[-1]["ended_at"] < slow[3]["ended_at"]
    assert results[0][2] < slow[-1]["ended_at"]
    final = json.loads((tmp_path / "swarm" / "final_eval.json").read_text())
    assert {r["member"] for r in final} == {"tiny-s", "tiny-m-lora"}  # merged by the two ranks as they left


@pytest.mark.slow
@pytest.mark.parametrize("members", [2, 3])
def test_members_of_different_speeds_keep_learning_from_each_other_within_the_lead(tmp_path, members):
    """tiny-s and tiny-l (three times slower by its size; with 3 processes tiny-m-lora between them), the default
    async settings: max_lead 2, max_staleness 8, the budget one step of every peer."""
    config = _three_members(tmp_path) if members == 3 else TINY
    overrides = ["train.steps=30", "rollout.group_size=16", "rollout.prompts_per_step=6", "rollout.max_new_tokens=2",
                 "swarm.mode=async", "eval.at_start=false", "checkpoint.every=0", "eval.max_samples=8"]
    if members == 2:
        overrides += ["members.1.model=builtin:tiny-l", "members.1.name=tiny-l", "members.1.lora=null"]
    results = _launch_timed(members, _args(tmp_path, *overrides, config=config))
    assert [code for code, _, _ in results] == [0] * members, results
    records = run_records(tmp_path / "swarm", "train")
    lead, staleness = 2, 8
    budget = {r["member"]: 16 * 6 - r["own_sequences"] for r in records}  # the other members' share of a step
    for name in budget:
        mine = [r for r in records if r["member"] == name]
        assert [r["step"] for r in mine] == list(range(1, 31))
        # (a member's last steps may go without: its faster peers finished; their rollouts were taken freshest
        # first, up to max_lead versions ahead)
        # (how many depends on the machine's load: the intake and lead policies are unit-tested with fake links)
        after = [r for r in mine if r["step"] > lead]
        assert sum(r["peer_sequences"] > 0 for r in after) >= 0.5 * len(after), (name, [r["peer_sequences"]
                                                                                           for r in mine])
        for r in mine:
            assert r["peer_sequences"] <= budget[name] and r["sequences"] == r["own_sequences"] + r["peer_sequences"]
            if r["peer_sequences"]:
                assert -lead <= r["staleness_min"] <= r["staleness_max"] <= staleness
            # a member waits only when it is more than max_lead steps ahead of its slowest live peer
            assert (r["lead_wait_seconds"] > 0) == (r["lead_steps"] is not None and r["lead_steps"] > lead), r
    fast = [r for r in records if r["member"] == "tiny-s"]
    assert sum(r["lead_wait_seconds"] > 0 for r in fast) >= 1  # it did run ahead, and was held at the bound


@pytest.mark.slow
def test_three_processes_each_train_on_both_peers_bit_exact(tmp_path):
    results = _launch_timed(3, _args(tmp_path, "train.steps=3", "rollout.prompts_per_step=6", *ASYNC,
                                     config=_three_members(tmp_path)))
    assert [code for code, _, _ in results] == [0, 0, 0], results
    records = run_records(tmp_path / "swarm", "train")
    made = {(r["member"], r["step"]): r["rollouts_sha256"] for r in records}
    senders = {r["member"]: set() for r in records}
    for r in records:
        assert r["rejected_batches"] == 0 and r["stale_dropped"] == 0 and r["link_refused"] == 0
        for key, digest in r["received_sha256"].items():
            peer, step = key.split("@")
            assert digest == made[(peer, int(step))]  # what the peer encoded at that step is what it trained on
            senders[r["member"]].add(peer)
    # by its last step every member has waited for both peers' first step (max_lead 2) and trained on it
    assert all(len(peers) == 2 for peers in senders.values()), senders


@pytest.mark.slow
def test_a_300_step_run_keeps_its_queues_and_memory_flat_when_a_fast_member_runs_away(tmp_path):
    # max_lead null: nothing holds the fast member back, so everything it sends piles up at the slow one
    results = _launch_timed(2, _args(tmp_path, "train.steps=300", "rollout.group_size=2", "rollout.prompts_per_step=2",
                                     "rollout.max_new_tokens=2", *ASYNC, "eval.max_samples=4",
                                     "swarm.max_lead=null", "swarm.max_staleness=4"), modes={1: "slow:0.03"},
                            timeout=600)
    assert [code for code, _, _ in results] == [0, 0], results
    records = run_records(tmp_path / "swarm", "train")
    capacity = 4 + 0 + 2  # max_staleness + max_lead + 2 parcels per sender
    for r in records:
        assert r["in_flight"] <= capacity and r["intake_waiting"] <= 2 * (4 + 1)
        assert r["peer_sequences"] <= 2
    slow = [r for r in records if r["member"] == "tiny-m-lora"]
    assert sum(r["surplus_dropped"] for r in slow) > 0  # what could not be kept was dropped, and counted
    for name in ("tiny-s", "tiny-m-lora"):
        rss = [r["rss_mib"] for r in records if r["member"] == name]
        assert len(rss) == 300 and max(rss[100:]) - rss[99] < 25, (name, rss[99], max(rss[100:]))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ids", "oversized"])
def test_a_corrupt_peer_parcel_is_dropped_and_the_stream_goes_on(tmp_path, mode):
    results = _launch_timed(2, _args(tmp_path, "train.steps=4", *ASYNC), modes={1: f"async-{mode}"})
    assert [code for code, _, _ in results] == [0, 0], results
    records = run_records(tmp_path / "swarm", "train")
    honest = [r for r in records if r["member"] == "tiny-s"]
    if mode == "ids":  # read, checked and refused by admission
        assert sum(r["rejected_batches"] for r in honest) >= 1
    # oversized (4 MB more than any honest parcel): over the links' cap, never read (ZeroMQ closes the connection)
    assert all(r["peer_sequences"] == 0 and r["received_sha256"] == {} for r in honest)
    cheated = [r for r in records if r["member"] == "tiny-m-lora"]
    assert all(r["rejected_batches"] == 0 for r in cheated) and sum(r["peer_sequences"] for r in cheated) > 0


@pytest.mark.slow
def test_malformed_control_messages_are_drained_counted_and_the_stream_goes_on(tmp_path):
    # every other message rank 1 sends is a TAKEN with a 50-word body (none belongs) or of an unknown kind
    results = _launch_timed(2, _args(tmp_path, "train.steps=4", *ASYNC), modes={1: "async-junk"})
    assert [code for code, _, _ in results] == [0, 0], results
    refusals = [line for line in results[0][1].splitlines() if "peer rank 1 sent" in line]
    assert 1 <= len(refusals) <= 3 and "further refusals from this peer are counted" in results[0][1]
    records = run_records(tmp_path / "swarm", "train")
    assert sum(r["peer_sequences"] for r in records if r["member"] == "tiny-s") > 0
    assert all(r["rejected_batches"] == 0 for r in records)
    assert sum(r["link_refused"] for r in records if r["member"] == "tiny-s") >= 1  # reported in its records
    assert all(r["link_refused"] == 0 for r in records if r["member"] != "tiny-s")


@pytest.mark.slow
def test_kill_9_stops_the_swarm_and_resume_finishes_it_with_no_gap_and_the_loss_logged(tmp_path):
    args = _args(tmp_path, "train.steps=30", "checkpoint.every=2", "swarm.mode=async", "swarm.timeout_s=60")
    proc = subprocess.Popen([sys.executable, "-m", "ftis_engine", *args, "--nproc", "2"], env=_env(),
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _kill_rank_after_first_checkpoint(tmp_path, proc)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1 and "swarm stopped" in err and "--resume" in err, err
    done = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "swarm" / "checkpoints").glob("step-*"))
    assert done  # complete checkpoints only: each a state.json and every member
    for step in done:
        assert (tmp_path / "swarm" / "checkpoints" / f"step-{step}" / "state.json").is_file()
    resumed = subprocess.run([sys.executable, "-m", "ftis_engine", *args, "--nproc", "2", "--resume",
                          "--set", "train.steps=8"], env=_env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert _steps(tmp_path) == {m: list(range(1, 9)) for m in ("tiny-s", "tiny-m-lora")}
    lost = [r for r in run_records(tmp_path / "swarm") if r["kind"] == "resume"]
    assert {r["member"] for r in lost} == {"tiny-s", "tiny-m-lora"} and all(r["step"] == done[-1] for r in lost)


@pytest.mark.parametrize("transport", [pytest.param("links", marks=pytest.mark.integration),
                                       pytest.param("broadcast", marks=pytest.mark.slow)])
def test_a_sampler_rank_streams_rollouts_tagged_with_weights_at_most_weight_sync_every_behind(tmp_path, transport):
    # swarm.timeout_s=8 against a run of 12+ s: the directions that carry nothing (tiny-m-lora -> the sampler) stay
    # up through ZeroMQ's heartbeats (links.py), which a connection silent past swarm.timeout_s would fail.
    # broadcast: the weights go as bf16 in the member's own group (gloo here, NCCL between GPUs)
    args = _args(tmp_path, "train.steps=8", *ASYNC, "members.0.samplers=1", "members.0.weight_sync_every=2",
                 "swarm.timeout_s=8", f"swarm.weights_transport={transport}")
    results = _launch_timed(3, args, modes={0: "slow:1.5"})  # the learner is slower than its sampler
    assert [code for code, _, _ in results] == [0, 0, 0], results
    records = run_records(tmp_path / "swarm")
    rounds = [r for r in records if r["kind"] == "sample"]
    learner = [r for r in _train(records) if r["member"] == "tiny-s"]
    assert rounds and all(r["member"] == "tiny-s" and r["rank"] == r["endpoint"] == 2 for r in rounds)
    assert {r["weights_transport"] for r in rounds} == {transport}
    for r in rounds:  # the weights a round used existed when it began (their update had ended: updated_at)...
        made = sum(1 for t in learner if t["updated_at"] <= r["started_at"])
        assert r["policy_version"] <= made, (made, r)
        # ... and lag the learner's version then (steps fully ended: pushed too) by at most weight_sync_every
        version_then = sum(1 for t in learner if t["ended_at"] <= r["started_at"])
        assert version_then - r["policy_version"] <= 2, (version_then, r)
        assert r["policy_version"] % 2 == 0  # weights come every 2 steps: versions 0, 2, 4
    assert {r["policy_version"] for r in rounds} >= {0, 2}
    # backpressure: a round r starts only when the learner has taken round r - 3 (max_lead 2), so between two of
    # the learner's steps the sampler adds at most 3 rounds (unbounded, it would make one every ~0.1 s)
    assert len(rounds) <= 3 * (len(learner) + 1) and sum(r["waited_seconds"] for r in rounds) > 0
    for r in _train(records):  # both learners train on the sampler's rollouts, checked like any peer's
        assert r["rejected_batches"] == 0
    used = [k for r in _train(records) for k in r["received_sha256"] if k.startswith("tiny-s/sampler-0@")]
    assert used and any(k.startswith("tiny-s/sampler-0@") for r in _train(records) if r["member"] == "tiny-s"
                        for k in r["received_sha256"])


@pytest.mark.slow
def test_a_sampler_of_a_member_on_two_ranks_streams_over_the_links_where_endpoints_and_ranks_differ(tmp_path):
    """tiny-s on ranks 0-1 (sharded), tiny-m-lora on rank 2, tiny-s's sampler on rank 3: the links' endpoints are
    the members' leaders and the samplers, so endpoint numbers and ranks no longer coincide (every other sampler
    test has one-rank members). The sampler gets its learner's weights (from the leader) and both learners
    train on its rollouts, checked like any peer's."""
    args = _args(tmp_path, "train.steps=4", *ASYNC, "members.0.ranks=2", "members.0.samplers=1",
                 "members.0.weight_sync_every=1", "swarm.timeout_s=30", "swarm.weights_transport=links")
    results = _launch_timed(4, args, timeout=600)
    assert [code for code, _, _ in results] == [0, 0, 0, 0], results
    records = run_records(tmp_path / "swarm")
    rounds = [r for r in records if r["kind"] == "sample"]
    # the record names the process (rank 3) and, apart, its endpoint on the links (2: after the two leaders)
    assert rounds and all(r["member"] == "tiny-s" and (r["rank"], r["endpoint"]) == (3, 2) for r in rounds)
    assert max(r["policy_version"] for r in rounds) >= 1  # weights reached it from the sharded learner
    assert _steps(tmp_path) == {m: [1, 2, 3, 4] for m in ("tiny-s", "tiny-m-lora")}
    assert all(r["rejected_batches"] == 0 for r in _train(records))
    for name in ("tiny-s", "tiny-m-lora"):
        assert any(k.startswith("tiny-s/sampler-0@") for r in _train(records) if r["member"] == name
                   for k in r["received_sha256"]), name


@pytest.mark.slow
def test_an_error_in_a_transport_thread_surfaces_with_its_own_message_not_as_a_lost_peer(tmp_path):
    # max_lead 0 and 8 steps: rank 1 needs rank 0's steps to go on, so it cannot finish before rank 0 is gone
    # (with the default lead of 2 and 4 steps, a fast rank 1 could end its run first, and exit 0)
    results = _launch_timed(2, _args(tmp_path, "train.steps=8", *ASYNC, "swarm.max_lead=0"),
                            modes={0: "handler-error"})
    code, err, _ = results[0]
    assert code == 1 and ("error: rank 0 failed in the exchange: TransportError: rank 0: receiving from peer rank 1 "
                          "failed: ValueError: injected fault in deliver") in err, err
    assert "lost contact" not in err and "Traceback" in err  # the cause's traceback follows the one line
    assert results[1][0] != 0, results[1][1][-3000:]  # the other rank stops too (its peer is gone)


def test_sampler_ranks_need_async_mode_and_their_own_processes(tmp_path, capsys):
    """Refused in this process before any rank starts: the unit tier (moved from the slow tier in issue 69, where it
    sat with its file's process tests though it starts none)."""
    from .helpers import command_here

    result = command_here(capsys, *_args(tmp_path, "members.0.samplers=1"))
    assert result.returncode == 2 and result.stderr.strip().startswith("error: members.0.samplers: sampler ranks need")
    result = command_here(capsys, *_args(tmp_path, "members.0.samplers=1", *ASYNC), "--nproc", "2")
    assert result.returncode == 2 and "--nproc 2: the config needs 3 processes" in result.stderr


@pytest.mark.slow
def test_with_restarts_a_killed_async_rank_comes_back_and_the_run_finishes_every_step(tmp_path):
    kill_and_restart(tmp_path, "train.steps=16", "swarm.mode=async")
    assert _steps(tmp_path) == {m: list(range(1, 17)) for m in ("tiny-s", "tiny-m-lora")}
    resumed = [r for r in run_records(tmp_path / "swarm") if r["kind"] == "resume"]
    assert {r["member"] for r in resumed} == {"tiny-s", "tiny-m-lora"}  # the restart happened, and says what it lost
    checkpoints = tmp_path / "swarm" / "checkpoints"
    assert (checkpoints / "step-16" / "state.json").is_file() and not list(checkpoints.glob(".tmp-step-*"))
