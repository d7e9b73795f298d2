"""One world across two hosts under torchrun (docs/distributed.md): each node a network namespace with its own
address (tests/netlab.py), both seeing the same file system as nodes see a shared --output-dir. Needs root; skipped
with the reason where namespaces cannot be made.

The case: two nodes, c10d rendezvous, gloo, one member per node; node b's worker killed with kill -9 after the first
checkpoint while node a's worker is deep in its step (stopped with SIGSTOP, so that it notices nothing). Node b's
agent restarts for the failure (its restart count 1); node a's restarts because a node waits in the rendezvous (its
count stays 0). The ranks of the new round agree on their store's round all the same (wiring.agree_round; keyed by
each node's count they met under different prefixes and timed out), resume from the checkpoint and finish: every
step trained once by each member, no gap."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from .netlab import Link, NetLab

REASON = NetLab.unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=f"network namespaces: {REASON}")]

RDZV_PORT = 29500  # on host a's own address: each namespace has its own ports
STEPS = 8
OVERRIDES = ("run_name=two-nodes", f"train.steps={STEPS}", "rollout.group_size=4", "rollout.prompts_per_step=4",
             "rollout.max_new_tokens=3", "eval.every=0", "eval.max_samples=16", "checkpoint.every=2",
             "checkpoint.keep_last=3", "train.threads=1", "swarm.timeout_s=60")


def torchrun(lab: NetLab, host: str, out, max_restarts: int) -> list[str]:
    """The command docs/distributed.md gives for one node, as this lab needs it: the namespaces share one hostname
    (which resolves to 127.0.0.1), so each node names its address (--local-addr) and host a says it hosts the
    rendezvous store (is_host; torch recognises its own hostname or address otherwise). GLOO_SOCKET_IFNAME is not
    set: the engine picks the interface towards MASTER_ADDR when the hostname resolves to loopback."""
    from .helpers import ROOT

    args = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{lab.address('a')}:{RDZV_PORT}", "--rdzv-id", "two-nodes",
            "--local-addr", lab.address(host), "--max-restarts", str(max_restarts),
            *(["--rdzv-conf", "is_host=1"] if host == "a" else []),
            "-m", "ftis_engine", "train", "--config", str(ROOT / "configs" / "tiny.yaml"), "--output-dir", str(out)]
    for override in OVERRIDES:
        args += ["--set", override]
    return args


def start(lab: NetLab, host: str, out, log, max_restarts: int = 1) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    return lab.popen(host, torchrun(lab, host, out, max_restarts),
                     env={**env, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"},
                     stdout=open(log, "w"), stderr=subprocess.STDOUT)


def worker(agent: subprocess.Popen) -> psutil.Process:
    """The agent's worker (torchrun starts it as `python -u -m ftis_engine ...`; `ip netns exec` became the agent)."""
    for child in psutil.Process(agent.pid).children():
        if "ftis_engine" in child.cmdline():
            return child
    raise AssertionError("no worker under the agent")


def told_to_stop(pid: int) -> bool:
    """Whether a stopped process has SIGTERM pending (its agent is stopping it)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)):
                return True
    return False


def until(condition, what: str, timeout: float, logs) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}:\n{logs()}")
        time.sleep(0.05)


def test_two_nodes_under_torchrun_a_node_whose_worker_was_killed_restarts_with_the_other_and_the_run_ends_with_no_gap(
        tmp_path):
    out = tmp_path / "shared"
    run_dir = out / "two-nodes"
    with NetLab({"a": Link(), "b": Link()}) as lab:
        agents = {host: start(lab, host, out, tmp_path / f"{host}.log") for host in ("a", "b")}

        def logs() -> str:
            return "\n".join(f"--- node {host}:\n{(tmp_path / f'{host}.log').read_text()[-3000:]}" for host in agents)

        until(lambda: (run_dir / "checkpoints" / "step-2").is_dir() or any(a.poll() is not None for a in agents.values()),
              "the step-2 checkpoint", 240, logs)
        assert all(a.poll() is None for a in agents.values()), logs()
        busy = worker(agents["a"])
        busy.send_signal(signal.SIGSTOP)  # deep in its step: it will not see its peer go
        try:
            killed = worker(agents["b"])
            for process in [*killed.children(recursive=True), killed]:
                process.send_signal(signal.SIGKILL)
            # node a's agent restarts its worker for node b's new rendezvous round, not for a failure (count 0)
            until(lambda: told_to_stop(busy.pid), "node a's agent to stop its worker", 120, logs)
        finally:
            busy.send_signal(signal.SIGCONT)
        codes = {host: agent.wait(300) for host, agent in agents.items()}
    assert codes == {"a": 0, "b": 0}, logs()
    from .helpers import run_records

    everything = run_records(run_dir)
    train = [r for r in everything if r["kind"] == "train"]
    for name in ("tiny-s", "tiny-m-lora"):
        assert [r["step"] for r in train if r["member"] == name] == list(range(1, STEPS + 1)), name  # once each
    resumed = [r for r in everything if r["kind"] == "resume"]
    assert len(resumed) == 2 and {r["step"] for r in resumed} <= {2, 4, 6}  # from a checkpoint, not from scratch
    assert (run_dir / "checkpoints" / f"step-{STEPS}" / "state.json").is_file()
