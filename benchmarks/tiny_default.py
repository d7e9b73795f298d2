"""Wall time of the embedded default (`ftis-engine train --config configs/tiny.yaml`) on this machine, by torch
thread count and background load, with the machine's load average recorded. Speed lives here, not in the tests.

    python benchmarks/tiny_default.py                                  # the whole default, as configured
    python benchmarks/tiny_default.py --steps 40 --threads 1 2 --load 0 1 --repeats 2

--load K starts K busy-looping processes beside the run (another job on a shared machine). Each run goes to a
fresh temporary directory; the table reports wall time, load averages and the final greedy accuracy per member.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TINY = ROOT / "configs" / "tiny.yaml"
BUSY = "while True: pass"


def run_once(steps: int | None, threads: int | None, load: int, seed: int | None = None) -> dict:
    hogs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(load)]
    try:
        with tempfile.TemporaryDirectory() as out:
            cmd = [sys.executable, "-m", "ftis_engine", "train", "--config", str(TINY), "--output-dir", out]
            if steps is not None:
                cmd += ["--set", f"train.steps={steps}"]
            if threads:
                cmd += ["--set", f"train.threads={threads}"]
            if seed is not None:
                cmd += ["--set", f"seed={seed}"]
            load_before = os.getloadavg()[0]
            start = time.perf_counter()
            result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            seconds = time.perf_counter() - start
            row = {"steps": steps, "threads": threads, "seed": seed, "load_processes": load, "seconds": seconds,
                   "loadavg_1min_before": load_before, "loadavg_1min_after": os.getloadavg()[0],
                   "exit_code": result.returncode}
            if result.returncode != 0:
                row["error"] = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ""
                return row
            from ftis_engine.report.metrics import read_metrics

            evals = read_metrics(pathlib.Path(out) / "tiny" / "metrics.jsonl", kinds="eval", strict=True)
            last = max(r["step"] for r in evals)
            row["accuracy"] = {r["member"]: r["accuracy"] for r in evals if r["step"] == last}
            row["accuracy_step0"] = {r["member"]: r["accuracy"] for r in evals if r["step"] == 0}
            return row
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="train.steps (default: the config's)")
    parser.add_argument("--threads", type=int, nargs="*", default=[0], help="train.threads values; 0 = the config's")
    parser.add_argument("--load", type=int, nargs="*", default=[0], help="busy background processes")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seeds", type=int, nargs="*", default=[None], help="seed values (default: the config's)")
    parser.add_argument("--output", type=pathlib.Path, default=RESULTS / "tiny_default")
    args = parser.parse_args(argv)
    rows = []
    for repeat in range(args.repeats):
        for load in args.load:
            for threads in args.threads:
                for seed in args.seeds:
                    row = run_once(args.steps, threads or None, load, seed)
                    row["repeat"] = repeat
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    lines = ["| steps | threads | seed | busy processes beside | wall s | load avg before -> after "
             "| accuracy at step 0 | final accuracy |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = ", ".join(f"{k} {v:.3f}" for k, v in sorted(r.get("accuracy", {}).items())) or r.get("error", "")
        acc0 = ", ".join(f"{k} {v:.3f}" for k, v in sorted(r.get("accuracy_step0", {}).items()))
        seed = "config" if r["seed"] is None else r["seed"]
        lines.append(f"| {r['steps'] or 'config'} | {r['threads'] or 'config'} | {seed} | {r['load_processes']} | "
                     f"{r['seconds']:.1f} | {r['loadavg_1min_before']:.2f} -> {r['loadavg_1min_after']:.2f} | {acc0} "
                     f"| {acc} |")
    table = "\n".join(lines)
    print(table)
    meta = {"command": "python benchmarks/tiny_default.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    args.output.with_suffix(".md").write_text(f"`{meta['command']}` ({meta['cpus']} CPUs)\n\n{table}\n")
    return rows


if __name__ == "__main__":
    main()
