"""Wall time of a short `--nproc` run with its workers forked from the launcher's fork server against spawned
workers (FTIS_START_METHOD), the two alternated run by run on this machine: what the fork server saves a launch.

    python benchmarks/launch_start.py                       # 2 and 3 processes, 3 runs of each method
    python benchmarks/launch_start.py --processes 2 --repeats 5 --load 1

Each run is the embedded default cut to --steps steps without evals in sync mode (3 processes: tiny-s on 2 ranks),
into a fresh temporary directory, timed from the command to its exit. --load K starts K busy-looping processes
beside the runs. Writes benchmarks/results/launch_start.{json,md}: every run, and per process count the median
seconds of each method and spawn's median over the fork server's.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TINY = ROOT / "configs" / "tiny.yaml"
METHODS = ("spawn", "forkserver")
LAYOUTS = {2: [], 3: ["members.0.ranks=2"]}  # process count -> --set options that make it


def run_once(processes: int, method: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "ftis_engine", "train", "--config", str(TINY), "--output-dir", out,
               "--nproc", str(processes)]
        for option in [f"train.steps={steps}", "eval.every=0", "eval.at_start=false", "swarm.mode=sync",
                       *LAYOUTS[processes]]:
            cmd += ["--set", option]
        env = {**os.environ, "FTIS_START_METHOD": method, "PYTHONWARNINGS": "ignore"}
        start = time.perf_counter()
        result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
        row = {"processes": processes, "method": method, "seconds": round(time.perf_counter() - start, 2),
               "exit_code": result.returncode, "loadavg_1min_after": os.getloadavg()[0]}
        if result.returncode != 0:
            row["error"] = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ""
        return row


def summarize(rows: list[dict]) -> list[dict]:
    """Per process count: each method's median seconds over its successful runs, and spawn's over the fork
    server's (above 1: the fork server is faster)."""
    out = []
    for processes in sorted({r["processes"] for r in rows}):
        medians = {}
        for method in METHODS:
            times = [r["seconds"] for r in rows if r["processes"] == processes and r["method"] == method
                     and r["exit_code"] == 0]
            medians[method] = statistics.median(times) if times else None
        ratio = (medians["spawn"] / medians["forkserver"]) if None not in medians.values() else None
        out.append({"processes": processes, "runs": sum(r["processes"] == processes for r in rows),
                    "spawn_s": medians["spawn"], "forkserver_s": medians["forkserver"], "spawn_over_forkserver": ratio})
    return out


def markdown(summary: list[dict], meta: dict) -> str:
    lines = [f"# `--nproc` launch: fork server against spawned workers ({meta['machine']}, {meta['cpus']} CPUs, "
             f"load {meta['load']}, {meta['steps']} steps)", "",
             "| processes | runs | spawn median (s) | fork server median (s) | spawn / fork server |",
             "|---|---|---|---|---|"]
    for s in summary:
        def fmt(x, unit=""):
            return "failed" if x is None else f"{x:.2f}{unit}"
        ratio = "n/a" if s["spawn_over_forkserver"] is None else fmt(s["spawn_over_forkserver"], "x")
        lines.append(f"| {s['processes']} | {s['runs']} | {fmt(s['spawn_s'])} | {fmt(s['forkserver_s'])} | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 3], choices=sorted(LAYOUTS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--load", type=int, default=0, help="busy-looping processes beside the runs")
    parser.add_argument("--output", type=pathlib.Path, default=RESULTS / "launch_start.json")
    args = parser.parse_args(argv)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    rows = []
    try:
        for processes in args.processes:
            for repeat in range(args.repeats):
                for method in (METHODS if repeat % 2 == 0 else METHODS[::-1]):  # alternated, each first in turn
                    rows.append(run_once(processes, method, args.steps))
                    print(json.dumps(rows[-1]), flush=True)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    meta = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "load": args.load,
            "steps": args.steps, "python": platform.python_version()}
    result = {"meta": meta, "runs": rows, "summary": summarize(rows)}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    args.output.with_suffix(".md").write_text(markdown(result["summary"], meta))
    print(markdown(result["summary"], meta))
    return result


if __name__ == "__main__":
    main()
