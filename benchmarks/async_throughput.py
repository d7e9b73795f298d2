"""Sync against async with members of very different speeds: the fast member's steps per second and the time it
waits for its peer, side by side in one run (two processes over gloo, the tiny default's members).

    python benchmarks/async_throughput.py                # 12 steps, the slow member 1.0 s slower a step
    python benchmarks/async_throughput.py --quick        # 3 steps, 0.3 s (CI)

The slowdown is a knob of this benchmark only: rank 1's generation sleeps `--slowdown` seconds each step (a
member on a slower GPU, or with a longer generation), which costs no CPU, so the measurement is not distorted on
a small machine. Each mode runs --repeats times, alternating. Metrics come from the runs' metrics.jsonl:
steps/s = steps / the sum of the member's step_seconds (generation, exchange with its waiting, update; eval and
start-up excluded). Prints a table and writes benchmarks/results/async_throughput.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))


def worker(slowdown: float, args: list[str]) -> None:
    """One rank (RANK etc. in the environment); rank 1 is the slow member."""
    if int(os.environ["RANK"]) == 1 and slowdown > 0:
        from ftis_engine import run

        honest = run.generate_rollouts

        def slow_generate(*a, **k):
            time.sleep(slowdown)
            return honest(*a, **k)

        run.generate_rollouts = slow_generate
    from ftis_engine.cli import main as cli_main

    cli_main(args)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_swarm(mode: str, steps: int, slowdown: float, out: pathlib.Path) -> dict:
    args = ["train", "--config", str(ROOT / "configs" / "tiny.yaml"), "--output-dir", str(out)]
    for o in [f"run_name={mode}", f"train.steps={steps}", "swarm.mode=" + mode, "eval.at_start=false",
              "eval.every=0", "eval.max_samples=16", "checkpoint.every=0", "train.threads=1"]:
        args += ["--set", o]
    port, procs = _free_port(), []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONWARNINGS": "ignore",
               "HF_HUB_OFFLINE": "1"}
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", str(slowdown), *args], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=900)
        if p.returncode != 0:
            raise RuntimeError(f"{mode} run failed: {err.strip().splitlines()[-1] if err.strip() else p.returncode}")
    records = [json.loads(x) for x in (out / mode / "metrics.jsonl").read_text().splitlines()]
    by_member = {}
    for name in ("tiny-s", "tiny-m-lora"):
        train = [r for r in records if r["kind"] == "train" and r["member"] == name]
        seconds = sum(r["step_seconds"] for r in train)
        by_member[name] = {"steps": len(train), "steps_per_second": len(train) / seconds,
                           "wait_seconds_per_step": sum(r["exchange_wait_seconds"] for r in train) / len(train),
                           "peer_sequences_per_step": sum(r["sequences"] - r["own_sequences"] for r in train) / len(train),
                           "staleness_mean": _mean([r.get("staleness_mean") for r in train])}
    return by_member


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--slowdown", type=float, default=1.0, help="seconds rank 1 sleeps per generation")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--output", type=pathlib.Path, default=RESULTS / "async_throughput.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.slowdown, args.repeats = 3, 0.3, 1
    runs: dict[str, list[dict]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for mode in ("sync", "async"):  # alternating: drift on the machine hits both alike
                runs[mode].append(run_swarm(mode, args.steps, args.slowdown, pathlib.Path(tmp) / f"r{repeat}"))
    table = {}
    for mode, measured in runs.items():
        table[mode] = {name: {key: _mean([m[name][key] for m in measured]) for key in measured[0][name]}
                       for name in measured[0]}
    fast_ratio = table["async"]["tiny-s"]["steps_per_second"] / table["sync"]["tiny-s"]["steps_per_second"]
    result = {"steps": args.steps, "slowdown_seconds": args.slowdown, "repeats": args.repeats, "modes": table,
              "runs": runs, "fast_member_speedup": fast_ratio, "machine": platform.platform(),
              "cpus": os.cpu_count(), "command": "python benchmarks/async_throughput.py" + (
                  " --quick" if args.quick else "")}
    lines = [f"# Sync against async, a member {args.slowdown:g} s slower a step ({args.steps} steps, "
             f"{args.repeats} repeats, means)", "", f"    {result['command']}", "",
             "| mode | member | steps/s | waited per step (s) | peer rollouts per step | staleness mean (steps) |",
             "|---|---|---|---|---|---|"]
    for mode, members in table.items():
        for name, m in members.items():
            stale = "–" if m["staleness_mean"] is None else f"{m['staleness_mean']:.2f}"
            lines.append(f"| {mode} | {name} | {m['steps_per_second']:.2f} | {m['wait_seconds_per_step']:.3f} | "
                         f"{m['peer_sequences_per_step']:.1f} | {stale} |")
    lines += ["", f"The fast member (tiny-s) takes {fast_ratio:.1f}x as many steps per second in async mode."]
    print("\n".join(lines))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    args.output.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(float(sys.argv[2]), sys.argv[3:])
    else:
        main()
