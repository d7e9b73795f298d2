"""The open swarm under churn, across hosts: the coordinator and the members each in a network namespace
(tests/netlab.py: veth links through a router with `--delay-ms` each way on every member's link), the three tiny
members of configs/swarm/ as separate `train --join` jobs, side by side in two scenarios:

    steady  nobody fails; a fourth member (tiny-s's config under the name tiny-s2) joins at step 25
    churn   the same, and tiny-m-lora is killed with kill -9 at its step 10 and comes back with --resume --join
            when tiny-s reaches step 20

    python benchmarks/open_swarm.py              # 40 steps of 0.5 s more, 10 ms links, 2 repeats, alternating
    python benchmarks/open_swarm.py --quick      # 10 steps of 0.1 s more, kill at 3, back at 5, join at 6
    python benchmarks/open_swarm.py --quick --scenario churn     # churn only (the test suite's smoke run)

Each member's generation sleeps `--step-seconds` more (no CPU; a tiny step takes a tenth of a second, a real
model's seconds, and a member's start-up several: without it a newcomer would find the others done). Needs root
(network namespaces). A metronome (a client of this process that sends nothing) holds the members at
step 2 until all three have joined, so their start-up times do not skew the start; it leaves then. Per member,
from its metrics.jsonl: steps trained (a resumed member counts the steps it redoes), steps/s = steps / the sum of
its step_seconds (generation, exchange with its waiting, update; start-up excluded), waited = exchange_wait_seconds
per step (the lead bound: the live peers within swarm.max_lead), the share of steps with peer rollouts, the mean
staleness of the peer rollouts trained on, and what was lost: parcels its client could not send (outbox_dropped),
peer sequences dropped stale or surplus (dropped_sequences, and stale_dropped and surplus_dropped apart), and steps
redone after the kill (its step at the kill less its checkpoint's). From the coordinator: parcels relayed and
undeliverable (to a member that is gone).
Prints a table and writes benchmarks/results/open_swarm.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

MEMBERS = ("tiny-s", "tiny-m-lora", "tiny-l")
NEWCOMER = "tiny-s2"
PORT = 5555
ROLLOUT = ("rollout.group_size=4", "rollout.prompts_per_step=2")


def _records(run: pathlib.Path, name: str) -> list[dict]:
    """A member's train records, read while it runs (or after a kill -9): the line it is writing is left out."""
    from ftis_engine.report.metrics import read_metrics

    return read_metrics(run / "members" / name / "metrics.jsonl", kinds="train")


def member(step_seconds: float, args: list[str]) -> None:
    """One member job whose generation takes `step_seconds` longer (a sleep: no CPU; a step of a real model)."""
    if step_seconds > 0:
        from ftis_engine.run import sampling as sample

        honest = sample.generate_rollouts

        def slower(*a, **kw):
            time.sleep(step_seconds)
            return honest(*a, **kw)

        sample.generate_rollouts = slower
    from ftis_engine.app.cli import main as cli_main

    cli_main(args)


def _member_argv(run: pathlib.Path, name: str, address: str, steps: int, resume: bool, step_seconds: float
                 ) -> list[str]:
    config = "tiny-s" if name == NEWCOMER else name
    argv = [sys.executable, __file__, "--member", str(step_seconds), "train", "--config",
            str(ROOT / "configs/swarm" / f"{config}.yaml"), "--join", address, "--output-dir", str(run / "members")]
    for override in (f"train.steps={steps}", *ROLLOUT, "eval.every=0", "eval.max_samples=16", "checkpoint.every=2",
                     "swarm.timeout_s=120", *([f"members.0.name={NEWCOMER}", f"run_name={NEWCOMER}"]
                                                                       if name == NEWCOMER else [])):
        argv += ["--set", override]
    return argv + (["--resume"] if resume else [])


def run_scenario(scenario: str, run: pathlib.Path, steps: int, kill_at: int, back_at: int, join_at: int,
                 delay_ms: float, step_seconds: float) -> dict:
    from ftis_engine.openswarm.client import SwarmClient
    from tests.netlab import Link, NetLab
    from tests.test_openswarm import _member_hashes

    hosts = {"coord": Link(), **{name: Link(delay_ms=delay_ms) for name in (*MEMBERS, NEWCOMER)}}
    events: dict = {}
    with NetLab(hosts) as lab:
        address = f"tcp://{lab.address('coord')}:{PORT}"
        serve_argv = [sys.executable, "-m", "ftis_engine", "swarm", "serve", "--config",
                      str(ROOT / "configs/swarm/swarm.yaml"), "--bind", address, "--output-dir", str(run / "coord")]
        for override in (f"train.steps={steps}", *ROLLOUT, "swarm.lease_s=3"):
            serve_argv += ["--set", override]
        coordinator = lab.popen("coord", serve_argv, stderr=subprocess.PIPE, text=True)
        assert coordinator.stderr.readline().startswith("coordinator listening"), "the coordinator did not start"
        metronome = SwarmClient(address, "metronome", *_member_hashes(steps), 1 << 22, lambda *args: None)
        metronome.start(timeout=60)
        procs: dict[str, subprocess.Popen] = {}
        logs = []

        def start(name, resume=False):
            log = open(run / f"{name}.{len(logs)}.log", "w")
            logs.append(log)
            procs[name] = lab.popen(name, _member_argv(run, name, address, steps, resume, step_seconds), stdout=log,
                                    stderr=subprocess.STDOUT)

        def step_of(name):
            return len(_records(run, name))

        def wait_for(condition, what, timeout=600):
            deadline = time.monotonic() + timeout
            while not condition():
                if time.monotonic() > deadline:
                    raise TimeoutError(what)
                failed = [n for n, p in procs.items() if p.poll() not in (None, 0)]
                if failed:
                    tail = sorted(run.glob(f"{failed[0]}.*.log"))[-1].read_text()[-1500:]
                    raise RuntimeError(f"{failed} failed:\n{tail}")
                time.sleep(0.02)

        for name in MEMBERS:
            start(name)
        wait_for(lambda: set(MEMBERS) <= set(metronome.members()), "the members to join")
        metronome.close()
        started = time.time()
        if scenario == "churn":
            wait_for(lambda: step_of("tiny-m-lora") >= kill_at, "the victim's kill step")
            victim = procs.pop("tiny-m-lora")
            victim.kill()
            victim.wait(10)
            events["killed_at"] = step_of("tiny-m-lora")
            checkpoints = sorted(int(p.name.split("-")[-1]) for p in
                                 (run / "members" / "tiny-m-lora" / "checkpoints").glob("step-*") if p.is_dir())
            events["checkpoint"] = checkpoints[-1] if checkpoints else 0
            wait_for(lambda: step_of("tiny-s") >= back_at, "tiny-s's step for the return")
            events["back_when_tiny_s_at"] = step_of("tiny-s")
            start("tiny-m-lora", resume=True)
        wait_for(lambda: step_of("tiny-s") >= join_at, "tiny-s's step for the newcomer")
        events["newcomer_when_tiny_s_at"] = step_of("tiny-s")
        start(NEWCOMER)
        for name, p in procs.items():
            if p.wait(1800) != 0:
                tail = sorted(run.glob(f"{name}.*.log"))[-1].read_text()[-1500:]
                raise RuntimeError(f"{name} exited {p.returncode}:\n{tail}")
        events["wall_seconds"] = time.time() - started
        coordinator.send_signal(signal.SIGTERM)
        summary = coordinator.communicate(timeout=60)[1].strip().splitlines()
        line = next((s for s in summary if s.startswith("coordinator stopped")), "")
        words = line.replace(",", "").split()
        events["relayed"] = int(words[2]) if line else None
        events["undeliverable"] = int(words[5]) if line else None
        for log in logs:
            log.close()
    members = {}
    for name in (*MEMBERS, NEWCOMER):
        records = _records(run, name)
        redone = events.get("killed_at", 0) - events.get("checkpoint", 0) if name == "tiny-m-lora" else 0
        seconds = sum(r["step_seconds"] for r in records)
        staleness = [r["staleness_mean"] for r in records if r.get("staleness_mean") is not None]
        members[name] = {
            "steps": len(records), "redone": redone,
            "steps_per_s": len(records) / seconds if seconds else None,
            "waited_per_step": statistics.fmean(r["exchange_wait_seconds"] for r in records) if records else None,
            "with_peer_rollouts": sum(bool(r["received_sha256"]) for r in records) / max(1, len(records)),
            "staleness_mean": statistics.fmean(staleness) if staleness else None,
            "outbox_dropped": sum(r.get("outbox_dropped", 0) for r in records),
            "dropped_sequences": sum(r.get("stale_dropped", 0) + r.get("surplus_dropped", 0) for r in records),
            "stale_dropped": sum(r.get("stale_dropped", 0) for r in records),
            "surplus_dropped": sum(r.get("surplus_dropped", 0) for r in records),
            "rejected_batches": sum(r.get("rejected_batches", 0) for r in records),
        }
    return {"scenario": scenario, "events": events, "members": members}


def table(results: list[dict]) -> str:
    lines = [("| scenario | member | steps (redone) | steps/s | waited s/step | steps with peer rollouts | staleness | "
              "unsent parcels | peer sequences dropped (stale or surplus) | rejected |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    for scenario in ("steady", "churn"):
        runs = [r for r in results if r["scenario"] == scenario]
        if not runs:
            continue
        for name in (*MEMBERS, NEWCOMER):
            rows = [r["members"][name] for r in runs]

            def mean(key, rows=rows):
                values = [row[key] for row in rows if row[key] is not None]
                return statistics.fmean(values) if values else float("nan")

            lines.append(f"| {scenario} | {name} | {mean('steps'):.0f} ({mean('redone'):.0f}) | "
                         f"{mean('steps_per_s'):.2f} | {mean('waited_per_step'):.3f} | "
                         f"{100 * mean('with_peer_rollouts'):.0f}% | {mean('staleness_mean'):.2f} | "
                         f"{mean('outbox_dropped'):.0f} | {mean('dropped_sequences'):.0f} | "
                         f"{mean('rejected_batches'):.0f} |")
    lines.append("")
    for r in results:
        e = r["events"]
        lines.append(f"- {r['scenario']} (repeat {r['repeat']}): wall {e['wall_seconds']:.1f} s; coordinator relayed "
                     f"{e['relayed']} parcels, {e['undeliverable']} undeliverable"
                     + (f"; tiny-m-lora killed at step {e['killed_at']} (checkpoint {e['checkpoint']}), back when "
                        f"tiny-s was at {e['back_when_tiny_s_at']}" if "killed_at" in e else "")
                     + f"; {NEWCOMER} joined when tiny-s was at {e['newcomer_when_tiny_s_at']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--delay-ms", type=float, default=10.0)
    parser.add_argument("--step-seconds", type=float, default=0.5,
                        help="added to each member's generation (a sleep): steps of a real model's length")
    parser.add_argument("--scenario", choices=("steady", "churn"), action="append",
                        help="run only this scenario (repeatable; default: both, side by side)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "open_swarm")
    args = parser.parse_args(argv)
    from tests.netlab import NetLab

    reason = NetLab.unavailable()
    if reason is not None:
        raise SystemExit(f"open_swarm.py: network namespaces: {reason}")
    steps, kill_at, back_at, join_at, repeats = args.steps, 10, 20, 25, args.repeats
    if args.quick:
        steps, kill_at, back_at, join_at, repeats = 10, 3, 5, 6, 1
        args.step_seconds = min(args.step_seconds, 0.1)
    results = []
    with tempfile.TemporaryDirectory(prefix="open-swarm-") as tmp:
        for repeat in range(repeats):
            for scenario in [s for s in ("steady", "churn") if not args.scenario or s in args.scenario]:
                run = pathlib.Path(tmp) / f"{scenario}-{repeat}"
                run.mkdir()
                print(f"{scenario}, repeat {repeat + 1}/{repeats} ...", flush=True)
                result = run_scenario(scenario, run, steps, kill_at, back_at, join_at, args.delay_ms,
                                      args.step_seconds)
                results.append({**result, "repeat": repeat})
    text = table(results)
    header = (f"# The open swarm under churn (benchmarks/open_swarm.py{' --quick' if args.quick else ''})\n\n"
              f"{steps} steps, each member's generation {args.step_seconds:g} s longer (a sleep); links {args.delay_ms:g} ms each way (shaped: {_shaping()}); {platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} CPUs; means over {repeats} repeat(s)\n\n")
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(header + text + "\n")
    args.out.with_suffix(".json").write_text(json.dumps({"steps": steps, "delay_ms": args.delay_ms,
                                                         "results": results}, indent=1) + "\n")
    return results


def _shaping() -> str:
    from tests.netlab import netem_available

    return "tc netem" if netem_available() else "TUN shaper (no netem in this kernel)"


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--member":
        member(float(sys.argv[2]), sys.argv[3:])
    else:
        main()
