"""The price and the gain of bounded asynchrony: two members (two processes over gloo, the tiny default's members)
in sync mode and in async mode with swarm.max_lead 0, 1, 2, 4 and null, side by side, in two scenarios:

    slower   rank 1 is always `--slowdown` seconds slower a step (a member on a slower GPU, or a larger model)
    varying  each rank is `--jitter` seconds slower on a random half of its steps (drawn per rank and step, the
             same in every setting): speeds that vary, as generation lengths and shared machines make them

    python benchmarks/async_throughput.py                # 20 steps, slowdown 1.0 s, jitter 0.5 s, 2 repeats
    python benchmarks/async_throughput.py --quick        # 3 steps, slower by 0.3 s; sync, max_lead 2, null (CI)

The delays are a knob of this benchmark only: they sleep inside generation, which costs no CPU, so the
measurement is not distorted on a small machine. The settings run in turn, repeated, alternating (drift on the machine hits all alike). Metrics come
from the runs' metrics.jsonl: steps/s = steps / the sum of the member's step_seconds (generation, exchange with its
waiting, update; eval and start-up excluded); waited = exchange_wait_seconds per step (in async mode the wait for
a peer max_lead steps behind); peer rollouts per step and the share of steps with any; staleness of the peer
rollouts trained on (the receiver's steps minus the rollouts' policy version + 1: negative when the peer is ahead).
Prints a table, writes benchmarks/results/async_throughput.{json,md} and a figure (.png).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

from ftis_engine.report.metrics import read_metrics  # noqa: E402
from tests.ports import free_port  # noqa: E402  (a port a test beside this one cannot take meanwhile)

SETTINGS = ["sync", "0", "1", "2", "4", "null"]  # sync mode, then async mode by swarm.max_lead
QUICK_SETTINGS = ["sync", "2", "null"]
MEMBERS = ("tiny-s", "tiny-m-lora")  # rank 0 is the fast member, rank 1 the slow one


def worker(slowdown: float, jitter: float, args: list[str]) -> None:
    """One rank (RANK etc. in the environment): rank 1 sleeps `slowdown` s in every generation; every rank sleeps
    `jitter` s in the generation of a random half of its steps."""
    rank = int(os.environ["RANK"])
    if slowdown > 0 or jitter > 0:
        from ftis_engine.run import sampling as sample

        honest = sample.generate_rollouts

        def slow_generate(swarm, member, dealt, version, seed):
            slow = random.Random(f"jitter-{rank}-{version}").random() < 0.5
            time.sleep((slowdown if rank == 1 else 0.0) + (jitter if slow else 0.0))
            return honest(swarm, member, dealt, version, seed)

        sample.generate_rollouts = slow_generate
    from ftis_engine.app.cli import main as cli_main

    cli_main(args)


def label(setting: str) -> str:
    return "sync" if setting == "sync" else f"async, max_lead {setting}"


def run_swarm(setting: str, steps: int, slowdown: float, jitter: float, out: pathlib.Path) -> dict:
    mode = ["swarm.mode=sync"] if setting == "sync" else ["swarm.mode=async", f"swarm.max_lead={setting}"]
    name = f"lead-{setting}"
    args = ["train", "--config", str(ROOT / "configs" / "tiny.yaml"), "--output-dir", str(out)]
    for o in [f"run_name={name}", f"train.steps={steps}", *mode, "eval.at_start=false", "eval.every=0",
              "eval.max_samples=16", "checkpoint.every=0", "train.threads=1"]:
        args += ["--set", o]
    port, procs = free_port(), []
    started = time.perf_counter()
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONWARNINGS": "ignore",
               "HF_HUB_OFFLINE": "1"}
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", str(slowdown), str(jitter), *args], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=900)
        if p.returncode != 0:
            raise RuntimeError(f"{setting} run failed: {err.strip().splitlines()[-1] if err.strip() else p.returncode}")
    wall = time.perf_counter() - started
    records = read_metrics(out / name / "metrics.jsonl", kinds="train", strict=True)
    by_member = {"wall_seconds": wall}
    for member in MEMBERS:
        train = [r for r in records if r["member"] == member]
        seconds = sum(r["step_seconds"] for r in train)
        stale = [v for r in train for v in (r.get("staleness_min"), r.get("staleness_max")) if v is not None]
        by_member[member] = {
            "steps": len(train), "steps_per_second": len(train) / seconds,
            "wait_seconds_per_step": sum(r["exchange_wait_seconds"] for r in train) / len(train),
            "lead_wait_seconds_per_step": sum(r["lead_wait_seconds"] for r in train) / len(train),
            "steps_waited": sum(r["exchange_wait_seconds"] > 0.01 for r in train),
            "peer_sequences_per_step": sum(r["sequences"] - r["own_sequences"] for r in train) / len(train),
            "steps_with_peers": sum(r["sequences"] > r["own_sequences"] for r in train) / len(train),
            "staleness_mean": _mean([r.get("staleness_mean") for r in train if r.get("staleness_mean") is not None]),
            "staleness_min": min(stale) if stale else None, "staleness_max": max(stale) if stale else None,
            "peer_sequences_at_last_step": train[-1]["sequences"] - train[-1]["own_sequences"]}
    return by_member


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _average(measured: list[dict]) -> dict:
    """Means over repeats (staleness bounds: the extremes)."""
    table = {"wall_seconds": _mean([m["wall_seconds"] for m in measured])}
    for member in MEMBERS:
        rows = [m[member] for m in measured]
        table[member] = {key: _mean([r[key] for r in rows]) for key in rows[0]}
        lows, highs = [r["staleness_min"] for r in rows if r["staleness_min"] is not None], \
            [r["staleness_max"] for r in rows if r["staleness_max"] is not None]
        table[member]["staleness_min"] = min(lows) if lows else None
        table[member]["staleness_max"] = max(highs) if highs else None
    return table


def _fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def plot(scenarios: dict, path: pathlib.Path, steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, rows = plt.subplots(len(scenarios), 3, figsize=(13, 3.6 * len(scenarios)), squeeze=False)
    for axes, (scenario, info) in zip(rows, scenarios.items()):
        table = info["settings"]
        settings = list(table)
        names = settings  # "sync", then async mode's max_lead
        for member, colour in zip(MEMBERS, ("tab:blue", "tab:orange")):
            axes[0].plot(names, [table[s][member]["steps_per_second"] for s in settings], "o-", color=colour,
                         label=member)
            axes[1].plot(names, [table[s][member]["steps_with_peers"] for s in settings], "o-", color=colour)
            axes[2].plot(names, [table[s][member]["wait_seconds_per_step"] for s in settings], "o-", color=colour)
        axes[0].set_yscale("log")
        axes[0].set_ylabel("steps / s (log)")
        axes[1].set_ylabel("share of steps with peer rollouts")
        axes[1].set_ylim(-0.05, 1.05)
        axes[2].set_ylabel("waited per step (s)")
        axes[1].set_title(info["title"], fontsize=10)
        for ax in axes:
            ax.set_xlabel("sync, or async with max_lead")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
    fig.suptitle(f"Two members, {steps} steps: what bounding the lead costs and buys")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table_lines(table: dict) -> list[str]:
    lines = ["| setting | member | steps/s | waited per step (s) | steps that waited | peer rollouts per step | "
             "steps with peer rollouts | staleness mean [min, max] | both done (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for setting, row in table.items():
        for member in MEMBERS:
            m = row[member]
            stale = (f"{_fmt(m['staleness_mean'], '.2f')} [{_fmt(m['staleness_min'], 'd')}, "
                     f"{_fmt(m['staleness_max'], 'd')}]")
            lines.append(f"| {label(setting)} | {member} | {m['steps_per_second']:.2f} | "
                         f"{m['wait_seconds_per_step']:.3f} | {m['steps_waited']:.1f} | "
                         f"{m['peer_sequences_per_step']:.1f} | {m['steps_with_peers']:.0%} | {stale} | "
                         f"{row['wall_seconds']:.0f} |")
    return lines


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--slowdown", type=float, default=1.0, help="slower: seconds rank 1 sleeps per generation")
    parser.add_argument("--jitter", type=float, default=0.5, help="varying: seconds on a random half of the steps")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--settings", nargs="*", default=None, help=f"default: {' '.join(SETTINGS)}")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--output", type=pathlib.Path, default=RESULTS / "async_throughput.json")
    args = parser.parse_args(argv)
    scenarios = {"slower": {"slowdown": args.slowdown, "jitter": 0.0,
                            "title": f"tiny-m-lora always {args.slowdown:g} s slower a step"},
                 "varying": {"slowdown": 0.0, "jitter": args.jitter,
                             "title": f"each {args.jitter:g} s slower on a random half of its steps"}}
    if args.quick:
        args.steps, args.repeats = 3, 1
        scenarios = {"slower": {"slowdown": 0.3, "jitter": 0.0, "title": "tiny-m-lora always 0.3 s slower a step"}}
    settings = args.settings or (QUICK_SETTINGS if args.quick else SETTINGS)
    with tempfile.TemporaryDirectory() as tmp:
        for name, scenario in scenarios.items():
            runs: dict[str, list[dict]] = {s: [] for s in settings}
            for repeat in range(args.repeats):
                for setting in settings:  # alternating: drift on the machine hits every setting alike
                    out = pathlib.Path(tmp) / f"{name}-r{repeat}"
                    runs[setting].append(run_swarm(setting, args.steps, scenario["slowdown"], scenario["jitter"], out))
            scenario["runs"] = runs
            scenario["settings"] = {s: _average(measured) for s, measured in runs.items()}
    command = "python benchmarks/async_throughput.py" + (" " + " ".join(argv) if argv else "")
    result = {"steps": args.steps, "repeats": args.repeats, "scenarios": scenarios,
              "settings": scenarios["slower"]["settings"], "machine": platform.platform(), "cpus": os.cpu_count(),
              "command": command}
    lines = [f"# Bounded asynchrony: two members, {args.steps} steps, {args.repeats} repeats (means)", "",
             f"    {command}", ""]
    for name, scenario in scenarios.items():
        lines += [f"## {name}: {scenario['title']}", "", *table_lines(scenario["settings"]), ""]
    print("\n".join(lines))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    args.output.with_suffix(".md").write_text("\n".join(lines))
    plot(scenarios, args.output.with_suffix(".png"), args.steps)
    return result


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "--worker":
        worker(float(sys.argv[2]), float(sys.argv[3]), sys.argv[4:])
    else:
        main()
