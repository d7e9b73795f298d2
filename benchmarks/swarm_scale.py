"""The open swarm at scale (issue 80): 8, 16, 32 and 64 members over delayed, lossy links, through today's one
coordinator, measured at each size.

    python benchmarks/swarm_scale.py                           # 8 16 32 64 members, 20 steps, the real-PEFT profile
    python benchmarks/swarm_scale.py --sizes 8 --steps 6       # one size, short
    python benchmarks/swarm_scale.py --quick                   # 4 members, 8 steps, unshaped (the suite's smoke run)
    python benchmarks/swarm_scale.py --peers-per-step 4 --behind-nat 8                      # direct exchange
    python benchmarks/swarm_scale.py --membership dht --peers-per-step 4 --sizes 8 16 32    # no coordinator at all

**The members replay; they do not train.** A member here is a process with the open swarm's real parts and no
model: its transport (openswarm.member.OpenExchange: the client, the lead bound, the mailbox, the refusals of the
I/O thread), its schedule (openswarm.schedule.OpenSchedule: its own deal of prompts by name and step) and its
receiver (exchange.admission.Admission with its RolloutChecker: the size, step, version, time, staleness and
replay checks, the values of every rollout, the claims check and the re-score of every reward by the task's
reward function). What it sends is what a real member of the profile sends: its dealt prompts' groups, with
completion lengths drawn from the profile's recorded lengths, each token drawn uniformly from the vocabulary and
claimed at its true probability 1/V (so the claims check passes them as it passes an honest sampler's), its reward
scored by the task's reward. Generation and the update are a sleep each (`--gen-seconds`, `--update-seconds`:
no CPU), so 64 members fit the two cores; what the members do not do is load a model, generate and train.

Profiles (the parcels' sizes, from real runs' records):
    peft    the real-PEFT study (configs/study/real-peft.yaml): SmolLM2-135M's tokenizer, gsm8k-calc, 4 prompts x 8
            completions a member a step, completions of 22 tokens on average (at most 24): ~6.6 KB a parcel
    paper   the paper's shapes: 12 prompts x 12 completions a member a step, completions of 300 tokens on average
            (at most 768): ~350 KB a parcel

The network: every host in a network namespace (tests/netlab.py), the coordinator's link unshaped, each member's
link delayed by a one-way delay drawn from [--min-delay-ms, --max-delay-ms] (seeded) and dropping --loss of its
packets each way; netem where the kernel has it, else the lab's TUN shaper (user space: the table says which).
Churn: one member is killed with SIGKILL at step --kill-at (the coordinator notices it when its lease runs out) and
a newcomer starts when the first member has done --join-at steps; the others hold before their step --join-at + 2
until they see it live (a newcomer's start-up, seconds under load, would otherwise meet a swarm that has finished).
Start: every member waits until all have joined before its first step.

Measured per size: bytes and parcels a step through the coordinator (its interface's counters, TCP included, and
the relay's parcel count) and into each member, the coordinator's CPU seconds a step and its resident memory,
each member's wait a step (the lead bound's included), the staleness of what it admitted, the sequences it dropped
(stale, surplus, unsent) and refused, the time from a newcomer's start to its welcome and to its first parcel
reaching a peer, and the time from the kill to the coordinator's expiry of the killed member. Each member also
watches its own view of the swarm (every 0.2 s): the time until the members see the killed one gone and the
newcomer live (the median over them) is measured alike with or without a coordinator.

--membership dht (pip install 'ftis-engine[dht]'; needs --peers-per-step): no coordinator; the first member starts
the swarm's DHT (openswarm/dht.py) and every other joins through its DHT address. The membership's cost is then
each member's own: its DHT processes (hivemind's forked node and its libp2p daemon), CPU and proportional set size,
sampled every few seconds. ~330 MB each (plans/issue-80-hivemind-probe.md): 32 members fit this machine's 24 GiB
beside their replays, 64 do not.

Writes benchmarks/results/swarm_scale.{json,md,png} (--output). Needs root (namespaces).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

from ftis_engine.report.metrics import read_metrics  # noqa: E402

PORT = 5555
PROFILES = {
    # prompts a member a step, completions a prompt, mean and largest completion length (tokens)
    "peft": {"model": "packaged:smollm2-135m-instruct", "task": "gsm8k-calc", "prompts": 4, "group": 8,
             "mean_tokens": 22, "max_tokens": 24,
             "source": "benchmarks/results/real_peft_study (exchange_tokens / exchange_sequences: 703 / 32)"},
    # the peft shape with a built-in tokenizer: nothing to fetch (the test suite's smoke run)
    "quick": {"model": "builtin:tiny-s", "task": "gsm8k-calc", "prompts": 4, "group": 8, "mean_tokens": 22,
              "max_tokens": 24, "source": "the peft profile's shape, with the built-in tiny-s tokenizer"},
    "paper": {"model": "packaged:smollm2-135m-instruct", "task": "gsm8k-calc", "prompts": 12, "group": 12,
              "mean_tokens": 300, "max_tokens": 768,
              "source": "the paper's shapes (configs/paper/): 24 prompts x 12 a step, 768 new tokens at most"},
}
DATA = ROOT.parent / "shared" / "data" / "gsm8k"


def swarm_overrides(profile: dict, steps: int, lease_s: float, peers_per_step: int | None = None) -> list[str]:
    """The shared settings every member and the coordinator run with (the profile's step)."""
    return [*([f"swarm.peers_per_step={peers_per_step}"] if peers_per_step else []),
            f"members.0.model={profile['model']}", f"data.task={profile['task']}",
            f"data.train_path={DATA / 'train.jsonl'}", f"data.eval_paths.gsm8k-calc={DATA / 'test.jsonl'}",
            f"train.steps={steps}",
            f"rollout.group_size={profile['group']}", f"rollout.prompts_per_step={profile['prompts']}",
            f"rollout.max_new_tokens={profile['max_tokens']}", "swarm.mode=async", "swarm.max_lead=2",
            "swarm.max_staleness=4", f"swarm.lease_s={lease_s}", "swarm.timeout_s=300", "eval.every=0",
            "members.0.device=cpu"]


def load_swarm_config(name: str, overrides: list[str]):
    from ftis_engine.config import load_config

    return load_config(ROOT / "configs/swarm/tiny-s.yaml",
                       [f"members.0.name={name}", f"run_name={name}", *overrides])


# ----------------------------------------------------------------------------------------------- a replay member


def replay_member(name: str, address: str, overrides: list[str], profile: dict, seed: int, gen_s: float,
                  update_s: float, wait_for: int, out: pathlib.Path, newcomer: str = "", newcomer_by: int = 0,
                  listen: str | None = None) -> None:
    """One member that replays (see the module): joins, waits until `wait_for` members are live (0: not at all),
    then steps until train.steps, one JSON line a step in `out`. newcomer: a name it waits to see live before its
    step `newcomer_by` (at most swarm.timeout_s), so that a newcomer that starts slowly still meets the swarm."""
    import torch

    from ftis_engine.data.rollouts import Rollout, encode
    from ftis_engine.data.tasks import load_task
    from ftis_engine.exchange.admission import Admission
    from ftis_engine.exchange.verify import RolloutChecker
    from ftis_engine.model.models import load_tokenizer, vocabulary_hash
    from ftis_engine.openswarm.joining import dataset_hash
    from ftis_engine.openswarm.member import OpenExchange
    from ftis_engine.openswarm.schedule import OpenSchedule
    from ftis_engine.topology.schedule import learner_version

    started = time.time()
    config = load_swarm_config(name, overrides)
    task = load_task(config.data, config.seed)
    tokenizer = load_tokenizer(config.members[0].model)
    vocab = len(tokenizer)
    exchange = OpenExchange(address, config, listen=listen)
    exchange.tokenizer, exchange.dataset, exchange.source = (vocabulary_hash(tokenizer), dataset_hash(task),
                                                             config.members[0].model)
    schedule = OpenSchedule(config, tuple(range(len(task.train))), exchange.book)
    checker = RolloutChecker(task, tokenizer, vocab, config.rollout.max_new_tokens)
    receiver = Admission(config, schedule, checker, 0)
    joining = time.time()
    exchange.start(schedule.parcel_limit, 0)
    welcomed = time.time()
    views = _ViewWatcher(exchange.client)
    rng = random.Random(seed)
    claim = -math.log(vocab)  # the true log-probability of a uniform draw: an honest claim
    with open(out, "w") as records:
        maddrs = exchange.client.maddrs() if hasattr(exchange.client, "maddrs") else []  # on a DHT: join through it
        records.write(json.dumps({"kind": "start", "member": name, "step": 0, "started": started, "joining": joining,
                                  "welcomed": welcomed, "maddrs": maddrs}) + "\n")
        records.flush()
        deadline = time.monotonic() + config.swarm.timeout_s
        while wait_for and len(exchange.client.members()) < wait_for and time.monotonic() < deadline:
            time.sleep(0.1)
        for step in range(1, config.train.steps + 1):
            if newcomer and step == newcomer_by:
                deadline = time.monotonic() + config.swarm.timeout_s
                while newcomer not in exchange.client.members() and time.monotonic() < deadline:
                    time.sleep(0.1)
            begun = time.time()
            time.sleep(gen_s)
            rollouts = []
            for prompt, count in sorted(schedule.deal(step)[0].items()):
                for _ in range(count):
                    length = max(1, min(profile["max_tokens"], round(rng.expovariate(1 / profile["mean_tokens"]))))
                    ids = [rng.randrange(vocab) for _ in range(length)]
                    rollouts.append(Rollout(0, prompt, torch.tensor(ids, dtype=torch.int32),
                                            torch.full((length,), claim, dtype=torch.float32), 0.0, "length",
                                            learner_version(step), time.time()))
            rewards = task.score(tokenizer, [r.completion_ids for r in rollouts],
                                 [task.train[r.prompt_index] for r in rollouts])
            for r, reward in zip(rollouts, rewards):
                r.reward = float(reward)
            buffer = encode(rollouts)
            sent = exchange.send({0: buffer}, step)[0]
            arrivals = exchange.receive(0, step)
            got = receiver.receive(arrivals.parcels, step, arrivals.dropped_sequences, own_sequences=len(rollouts),
                                   own_lengths=[r.num_tokens for r in rollouts], peers=arrivals.peers)
            time.sleep(update_s)
            metrics = got.metrics()
            records.write(json.dumps({
                "kind": "step", "member": name, "step": step, "begun": begun, "ended": time.time(), "sent_bytes": sent,
                "own_bytes": 4 * buffer.numel(), "parcels": len(arrivals.parcels),
                "received_bytes": sum(4 * p.buffer.numel() for p in arrivals.parcels),
                "wait_seconds": arrivals.wait_seconds, "lead_wait_seconds": arrivals.lead_wait_seconds,
                "live": len(exchange.client.members()), "outbox_dropped": arrivals.outbox_dropped,
                "refused": exchange.refused,
                "senders": sorted({exchange.book.name(p.sender) for p in arrivals.parcels}),
                **{k: metrics[k] for k in ("staleness_mean", "staleness_max", "staleness_seconds_mean",
                                           "stale_dropped", "surplus_dropped", "duplicate_dropped",
                                           "rejected_batches", "peer_sequences")}}) + "\n")
            records.flush()
        views.close()
        records.write(json.dumps({"kind": "views", "member": name, "step": config.train.steps, **views.seen}) + "\n")
    exchange.finish()


class _ViewWatcher:
    """A member's own view of the swarm, polled every 0.2 s: when it first saw each name live (`first_live`) and
    when it first saw each name gone after that (`first_gone`), by this machine's clock."""

    def __init__(self, client):
        import threading

        self.client, self.seen = client, {"first_live": {}, "first_gone": {}}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="view-watcher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            now, live = time.time(), set(self.client.members())
            for name in live:
                self.seen["first_live"].setdefault(name, now)
            for name in self.seen["first_live"]:
                if name not in live:
                    self.seen["first_gone"].setdefault(name, now)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)


# ----------------------------------------------------------------------------------------------- one size


def _proc_cpu_seconds(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _proc_rss_mib(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _interface_bytes(namespace: str) -> tuple[int, int]:
    """(received, sent) bytes of a host's link, TCP and IP headers included."""
    got = subprocess.run(["ip", "netns", "exec", namespace, "cat", "/sys/class/net/v0/statistics/rx_bytes",
                          "/sys/class/net/v0/statistics/tx_bytes"], capture_output=True, text=True, check=True)
    rx, tx = got.stdout.split()
    return int(rx), int(tx)


def run_size(members: int, args, work: pathlib.Path) -> dict:
    from tests.netlab import Link, NetLab

    profile = PROFILES[args.profile]
    overrides = swarm_overrides(profile, args.steps, args.lease_s, args.peers_per_step)
    rng = random.Random(args.seed * 1000 + members)
    names = [f"m{i:02d}" for i in range(members)]
    newcomer = f"m{members:02d}"
    delays = {n: rng.uniform(args.min_delay_ms, args.max_delay_ms) for n in [*names, newcomer]}
    hosts = {"coord": Link(), **{n: Link(delay_ms=delays[n] if args.shape else 0.0,
                                        loss=args.loss if args.shape else 0.0) for n in [*names, newcomer]}}
    work.mkdir(parents=True, exist_ok=True)
    killed = names[-1] if args.kill_at else None
    events: dict = {"delays_ms": {n: round(d, 1) for n, d in delays.items()} if args.shape else {}}
    on_dht = args.membership == "dht"
    with NetLab(hosts) as lab:
        coordinator = None
        if on_dht:
            address = "dht:"  # the first member starts the swarm's DHT; the others join through its address
        else:
            address = f"tcp://{lab.address('coord')}:{PORT}"
            serve = [sys.executable, "-m", "ftis_engine", "swarm", "serve", "--config",
                     str(ROOT / "configs/swarm/swarm.yaml"), "--bind", address, "--output-dir", str(work / "coord")]
            for override in overrides:
                if not override.startswith("members."):
                    serve += ["--set", override]
            coordinator = lab.popen("coord", serve, stderr=subprocess.PIPE, text=True)
            line = coordinator.stderr.readline()
            if not line.startswith("coordinator listening"):
                raise RuntimeError(f"the coordinator did not start: {line.strip()}")
        procs = {}

        def start(name: str, wait_for: int) -> None:
            # the first member listens on a DHT: the others bootstrap through it, and a DHT client cannot serve that
            listens = args.peers_per_step and (int(name[1:]) >= args.behind_nat or (on_dht and name == names[0]))
            argv = [sys.executable, __file__, "--member", name, "--address", address, "--profile", args.profile,
                    *(["--peers-per-step", str(args.peers_per_step)] if args.peers_per_step else []),
                    *(["--listen", f"tcp://{lab.address(name)}:{PORT + 1}"] if listens else []),
                    *(["--newcomer", newcomer, "--newcomer-by", str(args.join_at + 2)]
                      if args.join_at and name != newcomer else []),
                    "--steps", str(args.steps), "--lease-s", str(args.lease_s), "--seed", str(args.seed),
                    "--gen-seconds", str(args.gen_seconds), "--update-seconds", str(args.update_seconds),
                    "--wait-for", str(wait_for), "--out", str(work / f"{name}.jsonl")]
            log = open(work / f"{name}.log", "w")
            procs[name] = lab.popen(name, argv, stdout=log, stderr=subprocess.STDOUT)

        for name in names:
            start(name, members)
            if on_dht and name == names[0]:  # the others join through its DHT address, in its start record
                address = "dht:" + _first_maddr(work / f"{name}.jsonl", procs[name], work / f"{name}.log",
                                                 args.timeout)
        cpu0, rss = None, []
        dht_costs: dict[str, dict] = {}
        sampled = 0.0
        bytes0 = None
        begun = time.time()
        deadline = time.monotonic() + args.timeout
        while time.monotonic() < deadline:
            steps = {n: _steps_done(work / f"{n}.jsonl") for n in procs}
            lead = max((steps[n] for n in names), default=0)
            if cpu0 is None and lead >= 1:  # the measured window starts with the first step
                cpu0, bytes0, t0 = (_proc_cpu_seconds(coordinator.pid) if coordinator else 0.0,
                                    _interface_bytes(lab.namespaces["coord"]), time.time())
            if cpu0 is not None and coordinator:
                rss.append(_proc_rss_mib(coordinator.pid))
            if cpu0 is not None and on_dht and time.monotonic() >= sampled:  # each member's DHT processes
                sampled = time.monotonic() + 5.0
                for name, proc in procs.items():
                    if proc.poll() is None:
                        cost = _dht_cost(proc.pid)
                        if cost:
                            dht_costs.setdefault(name, {"first": cost, "t0": time.time()}).update(
                                last=cost, t1=time.time())
            if killed and killed in procs and procs[killed].poll() is None and steps[killed] >= args.kill_at:
                procs[killed].send_signal(signal.SIGKILL)
                events["killed"] = {"name": killed, "at": time.time(), "step": steps[killed]}
            if args.join_at and newcomer not in procs and lead >= args.join_at:
                events["join_started"] = time.time()
                start(newcomer, 0)
            if all(p.poll() is not None for n, p in procs.items() if n != killed):
                break
            time.sleep(0.5)
        else:
            raise RuntimeError(f"{members} members: not done within {args.timeout} s (steps: {steps})")
        cpu1, bytes1, t1 = (_proc_cpu_seconds(coordinator.pid) if coordinator else 0.0,
                            _interface_bytes(lab.namespaces["coord"]), time.time())
        member_bytes = {n: _interface_bytes(lab.namespaces[n]) for n in procs}
        if coordinator:
            coordinator.send_signal(signal.SIGINT)
            try:
                coordinator.wait(20)
            except subprocess.TimeoutExpired:
                coordinator.kill()
    failed = {n: p.returncode for n, p in procs.items() if n != killed and p.returncode != 0}
    if failed:
        tails = {n: (work / f"{n}.log").read_text()[-600:] for n in failed}
        raise RuntimeError(f"member(s) failed: {failed}; the ends of their logs: {tails}")
    return summarise(members, args, work, procs, names, newcomer, killed, events, begun,
                     (cpu1 - cpu0, t1 - t0, bytes0, bytes1, rss), member_bytes, dht_costs)


def _first_maddr(path: pathlib.Path, proc, log: pathlib.Path, timeout: float) -> str:
    """The DHT address in the first member's start record (written once it has started the DHT)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        starts = read_metrics(path, kinds="start") if path.exists() else []
        if starts and starts[0].get("maddrs"):
            return starts[0]["maddrs"][0]
        if proc.poll() is not None:
            raise RuntimeError(f"the first member failed to start the DHT: {log.read_text()[-600:]}")
        time.sleep(0.2)
    raise RuntimeError(f"the first member did not start the DHT within {timeout:g} s")


def _dht_cost(pid: int) -> dict | None:
    """CPU seconds by process and the proportional set size (MiB) of a member's DHT processes: its descendants
    (hivemind's forked node and its libp2p daemon), None when it has none yet."""
    import psutil

    try:
        children = psutil.Process(pid).children(recursive=True)
        cpu = {c.pid: sum(c.cpu_times()[:2]) for c in children}
        pss = sum(c.memory_full_info().pss for c in children) / 2**20
    except (psutil.NoSuchProcess, psutil.AccessDenied):  # a member ending while sampled: the sample is skipped
        return None
    return {"cpu_s": cpu, "pss_mib": pss} if children else None


def _dht_cpu_share(cost: dict) -> float:
    """A member's DHT processes' share of a core between its first and last sample (a process gone before the
    last sample is left out; one born after the first counts from its start)."""
    first, last = cost["first"]["cpu_s"], cost["last"]["cpu_s"]
    return sum(cpu - first.get(pid, 0.0) for pid, cpu in last.items()) / (cost["t1"] - cost["t0"])


def _steps_done(path: pathlib.Path) -> int:
    return len(read_metrics(path, kinds="step"))  # the line a member is writing left out


def _read(path: pathlib.Path) -> list[dict]:
    """A replaying member's records (metrics.jsonl's format: the project's one reader)."""
    return read_metrics(path)


def _coordinator_events(work: pathlib.Path) -> list[dict]:
    path = work / "coord" / "coordinator.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")] if path.exists() else []


def summarise(members, args, work, procs, names, newcomer, killed, events, begun, coord, member_bytes,
              dht_costs=None) -> dict:
    cpu_s, window_s, bytes0, bytes1, rss = coord
    relay = args.membership != "dht"
    records = {n: _read(work / f"{n}.jsonl") for n in procs}
    views = [r for n in procs for r in records[n] if r["kind"] == "views"]
    seen_gone = [v["first_gone"][killed] - events["killed"]["at"] for v in views
                 if killed and "killed" in events and killed in v["first_gone"]]
    seen_live = [v["first_live"][newcomer] - events["join_started"] for v in views
                 if v["member"] != newcomer and "join_started" in events and newcomer in v["first_live"]]
    dht = [c for c in (dht_costs or {}).values() if c.get("t1", 0) > c["t0"]]
    steps = [r for n in names for r in records[n] if r["kind"] == "step"]
    total_steps = max((r["step"] for r in steps), default=0)
    per_member_steps = statistics.mean(sum(1 for r in records[n] if r["kind"] == "step") for n in names)
    expired = [e for e in _coordinator_events(work) if e.get("event") == "expired" and e.get("member") == killed]
    notice = expired[0]["time"] - events["killed"]["at"] if expired and "killed" in events else None
    silent = expired[0].get("silent_s") if expired else None  # by the coordinator's clock: at least a lease
    joined = None
    if newcomer in records and records[newcomer]:
        start = records[newcomer][0]
        first_seen = min((r["ended"] for n in names for r in records[n]
                          if r["kind"] == "step" and newcomer in r.get("senders", [])), default=None)
        joined = {"to_welcome_s": start["welcomed"] - start["joining"], "process_to_welcome_s":
                  start["welcomed"] - events["join_started"],
                  "to_first_parcel_at_a_peer_s": first_seen - events["join_started"] if first_seen else None}
    sent = [r["own_bytes"] for r in steps]
    mean = lambda xs: statistics.mean(xs) if xs else None  # noqa: E731
    result = {
        "members": members, "steps": args.steps, "member_steps_mean": per_member_steps,
        "parcel_bytes_mean": mean(sent),
        "membership": "coordinator" if relay else "dht",
        "coordinator_cpu_s_per_step": cpu_s / max(total_steps, 1) if relay else None,
        "coordinator_cpu_share": cpu_s / window_s if relay else None,
        "coordinator_rss_mib_max": max(rss) if rss else None,
        "coordinator_rx_bytes_per_step": (bytes1[0] - bytes0[0]) / max(total_steps, 1) if relay else None,
        "coordinator_tx_bytes_per_step": (bytes1[1] - bytes0[1]) / max(total_steps, 1) if relay else None,
        # a member's own DHT processes (hivemind's node and daemon), over the window they were sampled in
        "dht_cpu_share_per_member": mean([_dht_cpu_share(c) for c in dht]),
        "dht_pss_mib_per_member": mean([c["last"]["pss_mib"] for c in dht]),
        "member_rx_bytes_per_step": mean([member_bytes[n][0] / max(1, sum(1 for r in records[n] if r["kind"] == "step"))
                                          for n in names if n != killed]),
        "member_tx_bytes_per_step": mean([member_bytes[n][1] / max(1, sum(1 for r in records[n] if r["kind"] == "step"))
                                          for n in names if n != killed]),
        "parcels_in_per_step": mean([r["parcels"] for r in steps]),
        "payload_in_bytes_per_step": mean([r["received_bytes"] for r in steps]),
        "wait_s_per_step": mean([r["wait_seconds"] for r in steps]),
        "lead_wait_s_per_step": mean([r["lead_wait_seconds"] for r in steps]),
        "step_s": mean([r["ended"] - r["begun"] for r in steps]),
        "staleness_mean": mean([r["staleness_mean"] for r in steps if r["staleness_mean"] is not None]),
        **{key: sum(r[key] for r in steps) for key in ("stale_dropped", "surplus_dropped", "outbox_dropped",
                                                        "rejected_batches")},
        "refused": sum(max((r["refused"] for r in records[n] if r["kind"] == "step"), default=0) for n in names),
        "crash_noticed_s": notice, "crash_silent_s": silent, "joiner": joined, "killed": events.get("killed"),
        # by the members' own views (each polled every 0.2 s), the median over them: alike with or without a
        # coordinator
        "crash_seen_by_members_s": statistics.median(seen_gone) if seen_gone else None,
        "joiner_seen_by_members_s": statistics.median(seen_live) if seen_live else None,
        "delays_ms": events["delays_ms"],
        "wall_s": time.time() - begun,
    }
    return result


# ----------------------------------------------------------------------------------------------- report

MEASURES = [  # (key, label) of the plot's panels
    ("coordinator_tx_bytes_per_step", "coordinator out, MB/step"), ("coordinator_cpu_share", "coordinator CPU share"),
    ("coordinator_rss_mib_max", "coordinator RSS MiB"), ("member_rx_bytes_per_step", "member in, MB/step"),
    ("wait_s_per_step", "member wait s/step"), ("staleness_mean", "staleness (steps)"),
    ("crash_seen_by_members_s", "crash seen by members after s"),
]
DHT_MEASURES = [  # on a DHT the membership's cost is each member's own
    ("dht_cpu_share_per_member", "a member's DHT CPU share"), ("dht_pss_mib_per_member", "a member's DHT PSS MiB"),
    *MEASURES[3:],
]


def report(results: list[dict], settings: dict) -> str:
    rows = ["| members | parcel KB | coordinator in / out MB a step | membership CPU (share of a core) | membership "
            "memory MiB | member in / out KB a step | parcels in a step | wait s a step (lead) | staleness | dropped "
            "stale / surplus / unsent | refused | crash noticed s: coordinator / members' views | joiner welcomed s "
            "/ first parcel at a peer s / seen by members s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v, f="{:.2f}": "-" if v is None else f.format(v)  # noqa: E731
    for r in results:
        j = r["joiner"] or {}
        if r.get("membership") == "dht":  # no coordinator: each member's DHT processes
            traffic = "- (none)"
            cpu = f"{r['members']} x {fmt(r['dht_cpu_share_per_member'], '{:.3f}')} (each member's DHT)"
            memory = f"{r['members']} x {fmt(r['dht_pss_mib_per_member'], '{:.0f}')} (PSS)"
        else:
            traffic = (f"{r['coordinator_rx_bytes_per_step'] / 1e6:.2f} / "
                       f"{r['coordinator_tx_bytes_per_step'] / 1e6:.2f}")
            cpu, memory = f"{r['coordinator_cpu_share']:.2f}", fmt(r["coordinator_rss_mib_max"], "{:.0f}") + " (RSS)"
        rows.append(
            f"| {r['members']} | {fmt(r['parcel_bytes_mean'] and r['parcel_bytes_mean'] / 1e3, '{:.1f}')} | "
            f"{traffic} | {cpu} | {memory} | "
            f"{fmt(r['member_rx_bytes_per_step'] and r['member_rx_bytes_per_step'] / 1e3, '{:.0f}')} / "
            f"{fmt(r['member_tx_bytes_per_step'] and r['member_tx_bytes_per_step'] / 1e3, '{:.0f}')} | "
            f"{fmt(r['parcels_in_per_step'], '{:.1f}')} | {fmt(r['wait_s_per_step'])} "
            f"({fmt(r['lead_wait_s_per_step'])}) | {fmt(r['staleness_mean'])} | {r['stale_dropped']} / "
            f"{r['surplus_dropped']} / {r['outbox_dropped']} | {r['rejected_batches']} + {r['refused']} | "
            f"{fmt(r['crash_noticed_s'], '{:.1f}')} / {fmt(r.get('crash_seen_by_members_s'), '{:.1f}')} | "
            f"{fmt(j.get('process_to_welcome_s'), '{:.1f}')} / {fmt(j.get('to_first_parcel_at_a_peer_s'), '{:.1f}')} "
            f"/ {fmt(r.get('joiner_seen_by_members_s'), '{:.1f}')} |")
    head = (f"# The open swarm at scale (benchmarks/swarm_scale.py)\n\nMembership {settings['membership']}; exchange "
            f"{settings['exchange']}; profile {settings['profile']} "
            f"({settings['profile_source']}); {settings['steps']} steps of {settings['gen_seconds']} s generation + "
            f"{settings['update_seconds']} s update (sleeps: replaying members, no model); member links "
            f"{settings['delay']}, loss {settings['loss']} each way ({settings['shaping']}); lease "
            f"{settings['lease_s']} s; {settings['machine']}.\n\n")
    return head + "\n".join(rows) + "\n"


def plot(results: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measures = DHT_MEASURES if results[0].get("membership") == "dht" else MEASURES
    fig, axes = plt.subplots(1, len(measures), figsize=(3.2 * len(measures), 3.0))
    xs = [r["members"] for r in results]
    for ax, (key, label) in zip(axes, measures):
        scale = 1e-6 if "bytes" in key else 1.0
        ys = [None if r[key] is None else r[key] * scale for r in results]
        ax.plot(xs, [float("nan") if y is None else y for y in ys], "o-")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("members")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="peft")
    parser.add_argument("--gen-seconds", type=float, default=4.0)
    parser.add_argument("--update-seconds", type=float, default=2.0)
    parser.add_argument("--min-delay-ms", type=float, default=50.0)
    parser.add_argument("--max-delay-ms", type=float, default=200.0)
    parser.add_argument("--loss", type=float, default=0.01)
    parser.add_argument("--no-shape", dest="shape", action="store_false", help="links without delay or loss")
    parser.add_argument("--lease-s", type=float, default=10.0)
    parser.add_argument("--kill-at", type=int, default=5, help="kill the last member at this step (0: no kill)")
    parser.add_argument("--join-at", type=int, default=8, help="a newcomer joins at this step (0: none)")
    parser.add_argument("--peers-per-step", type=int, default=None,
                        help="members exchange parcels directly with this many drawn peers a step "
                        "(swarm.peers_per_step; the coordinator keeps membership only); default: through its relay")
    parser.add_argument("--membership", choices=["coordinator", "dht"], default="coordinator",
                        help="who keeps the live set: today's coordinator, or hivemind's DHT with no coordinator "
                        "(needs --peers-per-step and pip install 'ftis-engine[dht]')")
    parser.add_argument("--behind-nat", type=int, default=0,
                        help="with --peers-per-step: the first this many members only dial (no listen address)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--quick", action="store_true", help="4 members, 8 steps of 2.2 s, no shaping, a kill at "
                        "step 2 and a newcomer at 1, lease 2 s (4 s on a DHT)")
    parser.add_argument("--output", default=str(RESULTS / "swarm_scale"))
    # a member process (run by the benchmark itself)
    parser.add_argument("--member", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--wait-for", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--newcomer", default="", help=argparse.SUPPRESS)
    parser.add_argument("--newcomer-by", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--listen", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.member:
        profile = PROFILES[args.profile]
        seed = args.seed * 100003 + int(args.member[1:])
        replay_member(args.member, args.address,
                      swarm_overrides(profile, args.steps, args.lease_s, args.peers_per_step), profile, seed,
                      args.gen_seconds, args.update_seconds, args.wait_for, pathlib.Path(args.out), args.newcomer,
                      args.newcomer_by, args.listen)
        return []
    if args.membership == "dht":
        import importlib.util

        if not args.peers_per_step:
            parser.error("--membership dht: a swarm on a DHT exchanges directly; give --peers-per-step")
        if importlib.util.find_spec("hivemind") is None:
            parser.error("--membership dht: needs hivemind: pip install 'ftis-engine[dht]'")
    if args.quick:  # one small size, unshaped, with the kill and the newcomer; a built-in tokenizer
        args.profile = "quick"
        args.sizes, args.steps, args.shape, args.kill_at, args.join_at = [4], 8, False, 2, 1
        args.lease_s = 4.0 if args.membership == "dht" else 2.0  # a DHT record renews from a thread of its own
        args.gen_seconds, args.update_seconds = 2.0, 0.2
    from tests.netlab import NetLab

    problem = NetLab.unavailable()
    if problem:
        raise SystemExit(f"swarm_scale: {problem}")
    results = []
    with tempfile.TemporaryDirectory(prefix="swarm-scale-") as tmp:
        for members in args.sizes:
            print(f"{members} members ...", flush=True)
            results.append(run_size(members, args, pathlib.Path(tmp) / str(members)))
            r = results[-1]
            if r["membership"] == "dht":
                print(f"  each member's DHT: CPU {r['dht_cpu_share_per_member'] or 0:.3f}, PSS "
                      f"{r['dht_pss_mib_per_member'] or 0:.0f} MiB; member wait {r['wait_s_per_step']:.2f} s/step",
                      flush=True)
            else:
                print(f"  coordinator out {r['coordinator_tx_bytes_per_step'] / 1e6:.2f} MB/step, CPU "
                      f"{r['coordinator_cpu_share']:.2f}, member wait {r['wait_s_per_step']:.2f} s/step", flush=True)
    from tests.netlab import netem_available

    settings = {"membership": "hivemind's DHT (no coordinator)" if args.membership == "dht" else
                "the coordinator", "exchange": f"direct, {args.peers_per_step} drawn peers a step ({args.behind_nat} behind a NAT)"
                if args.peers_per_step else "through the coordinator's relay", "profile": args.profile,
                "profile_source": PROFILES[args.profile]["source"], "steps": args.steps,
                "gen_seconds": args.gen_seconds, "update_seconds": args.update_seconds, "lease_s": args.lease_s,
                "delay": f"{args.min_delay_ms:g}-{args.max_delay_ms:g} ms one way" if args.shape else "unshaped",
                "loss": args.loss if args.shape else 0.0,
                "shaping": ("netem" if netem_available() else "the lab's TUN shaper, user space") if args.shape else
                "none", "kill_at": args.kill_at, "join_at": args.join_at, "seed": args.seed,
                "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "members": "replaying (no model)"}
    output = pathlib.Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.with_suffix(".json").write_text(json.dumps({"settings": settings, "results": results}, indent=1) + "\n")
    output.with_suffix(".md").write_text(report(results, settings))
    if len(results) > 1:
        plot(results, output.with_suffix(".png"))
    print(report(results, settings))
    return results


if __name__ == "__main__":
    main()
