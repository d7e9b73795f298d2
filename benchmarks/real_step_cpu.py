"""The real pair's step on the CPU before and after the cheaper update (issue 77), side by side in one run.

The pair is configs/real/smollm2-peft-vllm-cpu.yaml (SmolLM2-135M-Instruct fully fine-tuned + the same model with
LoRA r 128, both generating with vLLM's CPU engine), run for a few steps with each side's settings, one process
(and one torch thread) a member (--nproc 2). The sides differ only in the update's settings:

    before: train.shared_prompt=false, members' dtype float32, gradient checkpointing on (the study of 2026-11)
    after:  train.shared_prompt=true,  members' dtype bfloat16 (float32 masters), no checkpointing

Run in the vLLM environment (docs/vllm.md), from the repository root, with nothing else on the machine:

    python benchmarks/real_step_cpu.py                      # 3 steps a side, sides alternated, 2 rounds
    python benchmarks/real_step_cpu.py --steps 2 --rounds 1

Step 1 (the engines' and kernels' first use) is reported but left out of the means. The table splits each member's
step into generation, update and push (the weights into its engine), from its metrics.jsonl; `speedup` is
before / after of the mean update and of the mean step. Writes benchmarks/results/real_step_cpu/{README.md,
real_step_cpu.json}.
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
CONFIG = ROOT / "configs" / "real" / "smollm2-peft-vllm-cpu.yaml"
OUT = ROOT / "benchmarks" / "results" / "real_step_cpu"

SIDES = {
    "before": ["train.shared_prompt=false", "members.0.dtype=float32", "members.1.dtype=float32",
               "train.gradient_checkpointing=true"],
    "after": ["train.shared_prompt=true", "members.0.dtype=bfloat16", "members.1.dtype=bfloat16",
              "train.gradient_checkpointing=false"],
}


def run_side(side: str, steps: int, seed: int) -> dict:
    """One run of the pair with `side`'s settings: its train records and wall time."""
    from ftis_engine.report.metrics import read_metrics

    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "ftis_engine", "train", "--config", str(CONFIG), "--output-dir", out,
                   "--nproc", "2", "--set", f"train.steps={steps}", "--set", "eval.every=0", "--set",
                   "eval.at_start=false", "--set", f"checkpoint.every={steps + 1}", "--set", f"seed={seed}"]
        for override in SIDES[side]:
            command += ["--set", override]
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
        seconds = time.perf_counter() - start
        if done.returncode != 0:
            raise SystemExit(f"{side}: exit {done.returncode}: {done.stderr.strip()[-2000:]}")
        records = read_metrics(pathlib.Path(out) / "smollm2-peft-vllm-cpu" / "metrics.jsonl", kinds="train",
                               strict=True)
        resolved = (pathlib.Path(out) / "smollm2-peft-vllm-cpu" / "config.yaml").read_text()
    keep = ("step", "member", "gen_seconds", "train_seconds", "sync_seconds", "step_seconds", "rss_mib", "tokens",
            "sequences", "peer_sequences", "micro_batches", "loss", "own_ratio_mean", "filtered_frac")
    return {"side": side, "seed": seed, "seconds": seconds, "overrides": SIDES[side], "config": resolved,
            "records": [{k: r.get(k) for k in keep} for r in records]}


def summarise(runs: list[dict]) -> dict:
    """Per side and member: mean generation, update, push and step seconds over steps 2+, the largest RSS."""
    out: dict = {}
    for side in SIDES:
        rows = [r for run in runs if run["side"] == side for r in run["records"] if r["step"] > 1]
        out[side] = {}
        for member in sorted({r["member"] for r in rows}):
            mine = [r for r in rows if r["member"] == member]
            out[side][member] = {key: statistics.mean(r[key] for r in mine)
                                 for key in ("gen_seconds", "train_seconds", "sync_seconds", "step_seconds")}
            out[side][member]["rss_mib_max"] = max(r["rss_mib"] for r in mine)
            out[side][member]["steps_measured"] = len(mine)
    speedup = {}
    for member in out["before"]:
        b, a = out["before"][member], out["after"][member]
        speedup[member] = {"update": b["train_seconds"] / a["train_seconds"], "step": b["step_seconds"] / a["step_seconds"]}
    return {"by_side": out, "speedup": speedup}


def markdown(summary: dict, meta: dict) -> str:
    lines = [f"`{meta['command']}` on {meta['machine']} ({meta['date']}), {meta['rounds']} round(s) of "
             f"{meta['steps']} steps a side, sides alternated; means over steps 2+ (step 1 is the engines' and "
             "kernels' first use). Each member one process and one torch thread (`--nproc 2`).", "",
             "| member | side | generate s | update s | push s | step s | peak RSS MiB |", "|---|---|---|---|---|---|---|"]
    for member in summary["by_side"]["before"]:
        for side in SIDES:
            s = summary["by_side"][side][member]
            lines.append(f"| {member} | {side} | {s['gen_seconds']:.1f} | {s['train_seconds']:.1f} | "
                         f"{s['sync_seconds']:.2f} | {s['step_seconds']:.1f} | {s['rss_mib_max']:.0f} |")
    lines += ["", "| member | update speedup (before / after) | step speedup |", "|---|---|---|"]
    for member, s in summary["speedup"].items():
        lines.append(f"| {member} | {s['update']:.2f}x | {s['step']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output", type=pathlib.Path, default=OUT)
    args = parser.parse_args(argv)
    runs = []
    for k in range(args.rounds):
        order = list(SIDES) if k % 2 == 0 else list(SIDES)[::-1]
        for side in order:
            print(f"round {k + 1}/{args.rounds}: {side} ...", flush=True)
            runs.append(run_side(side, args.steps, seed=k))
            print(f"  {runs[-1]['seconds']:.0f} s", flush=True)
    summary = summarise(runs)
    meta = {"command": "python benchmarks/real_step_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "date": time.strftime("%Y-%m-%d"), "steps": args.steps, "rounds": args.rounds,
            "settings": {side: {"overrides": SIDES[side], "precision": "float32" if side == "before" else
                                "bfloat16 autocast, float32 masters", "master_dtype": "float32",
                                "attention": "sdpa", "compile": False, "vocab_size": 49152,
                                "batch": "8 prompts x 8 completions a step (64 sequences a member's update)",
                                "length": "max_new_tokens 24, prompts 32-43 tokens",
                                "shared_prompt": side == "after",
                                "gradient_checkpointing": side == "before"} for side in SIDES}}
    result = {**meta, **summary, "runs": runs}
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "real_step_cpu.json").write_text(json.dumps(result, indent=1) + "\n")
    table = markdown(summary, meta)
    (args.output / "table.md").write_text(table)
    print(table)
    return result


if __name__ == "__main__":
    main()
