"""The numbers of issue 28's GPU sitting: the paper's pair (sync and async) and one member alone with ftis-engine,
and TRL's GRPOTrainer on that member's shape: seconds per step by phase, tokens/s, peak GPU memory, own
rollouts' importance weights, and TRL's seconds per step over ours.

It reads a results folder as benchmarks/run_pair_gpu.sh leaves it (any file may be missing):

    <run>.metrics.jsonl   an ftis-engine run's metrics (run: pair-sync, pair-async, alone, or any other name)
    trl.json              benchmarks/trl_grpo.py's result
    <stage>.gpumem        nvidia-smi's memory.used (MiB), one sample a line, taken while that stage ran
    <run>.settings.json   what an ftis-engine run ran with, per member (`--settings RUN_DIR`, where the run ran)
    trl.settings.json     what TRL ran with, for a trl.json written before trl_grpo.py recorded it
    device.txt            the GPU's name

and writes <output>.json and <output>.md:

    python benchmarks/pair_summary.py --results /tmp/pair-results --output benchmarks/results/pair_h100

Medians are over the steps after the first `--skip` (default 1: the first step carries the engines' warm-up).
Phases: ours `gen_seconds` (generation), `sync_seconds` (weight sync: the engine's load of the new weights as it
wakes, and pushes to samplers), exchange (sending and waiting for peers, async's lead wait included, which is also
reported apart) and `train_seconds` (the update); TRL's generation, weight sync, scoring (decoding, reward, the
old-log-prob forward) and update. A member's step is the sum of its phases (step_seconds); a pair's step is the
slower member's, and `wall_step_seconds` the time between the ends of consecutive steps (ended_at), which also
holds what the phases leave out (logging, the loop).
`is_weight_mean` is over the tokens a member trained on: alone, its own rollouts only; in the pair, its own and
its peer's (off-policy), so there it is not the own-rollout parity check: `own_ratio_mean` is (exp(l - g) over
the member's own tokens). Peak memory: nvidia-smi's samples of the whole device during the stage, and the train
records' `gpu_peak_gib` (torch's peak in the member's process) and `gpu_used_gib` (the device, engines included).

Like for like: each side's settings (SETTINGS: compute precision, master dtype, attention, compiled layers,
vocabulary size, completions a step and their length) go into the JSON, ours from <run>.settings.json, TRL's from
its own JSON. TRL over ours is never given alone: the table beside it lists each side's settings, and the ratio
carries `unlike: ...` with every setting that differs or is unknown (the 2x goal is judged only like for like).
Ratios by the medians and by the means of the steps after the first `--skip`. The engines' LEVERS (sleep level,
seeds, KV cache, GPU share) are listed beside the settings, and count where both sides record them.

The pair against TRL training the same two shapes one after the other (the paper's claim that one collaborative
run replaces sequential ones): where trl.json (the 1.5B shape) and trl-3b.json (the 3B shape) lie beside the pair's
metrics, the pair's step against the sum of TRL's two steps (`pair_vs_trl_sequential`).

    python benchmarks/pair_summary.py --settings /tmp/pair-runs/alone > alone.settings.json   # where the run ran
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics

GIB = 2**30
SETTINGS = ("precision", "master_dtype", "attention", "compile", "vocab_size", "batch", "length")
# the engine's levers (issue 67), where a side records them: its sleep level during the update (0: awake), its
# sampling seeds (a seed per request, or one seeded stream a generation), its KV cache (GiB, or "share": a share of
# the GPU) and that share (gpu_memory_utilization). A lever both sides record and set differently makes the ratio
# unlike; one a side does not record (results from before 2026-11-28) is shown as "-" and judged by SETTINGS alone.
LEVERS = ("sleep_level", "seeds", "kv_cache_gib", "gpu_memory_utilization")
EXCHANGE_KEYS = ("exchange_seconds", "exchange_wait_seconds")  # the exchange's share of step_seconds


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def read_train_records(path: pathlib.Path) -> list[dict]:
    """The `kind: train` records of a metrics.jsonl, in file order."""
    from ftis_engine.report.metrics import read_metrics

    return [r for r in read_metrics(path) if r.get("kind") == "train"]


def generated_tokens(record: dict) -> float:
    """Tokens the member generated in the step (its own rollouts; `tokens` counts what it trained on)."""
    return record["own_sequences"] * record["completion_len_mean"]


def member_summary(records: list[dict], skip: int) -> dict:
    """One member's train records after step `skip`: median seconds by phase, tokens/s, parity and lengths."""
    kept = [r for r in records if r["step"] > skip]
    gen_tokens = sum(generated_tokens(r) for r in kept)
    return {
        "steps": len(kept),
        "step_seconds": median(r["step_seconds"] for r in kept),
        "gen_seconds": median(r["gen_seconds"] for r in kept),
        "exchange_seconds": median(sum(r.get(k, 0.0) for k in EXCHANGE_KEYS) for r in kept),
        "train_seconds": median(r["train_seconds"] for r in kept),
        "sync_seconds": median(r.get("sync_seconds") for r in kept),
        # async: the part of exchange_wait_seconds spent on a peer more than swarm.max_lead steps behind
        "lead_wait_seconds": median(r.get("lead_wait_seconds", 0.0) for r in kept),
        "generated_tokens_per_step": gen_tokens / len(kept) if kept else None,
        "trained_tokens_per_step": mean(r["tokens"] for r in kept),
        "gen_tokens_per_s": ratio(gen_tokens, sum(r["gen_seconds"] for r in kept)),
        "train_tokens_per_s": ratio(sum(r["tokens"] for r in kept), sum(r["train_seconds"] for r in kept)),
        "step_tokens_per_s": ratio(gen_tokens, sum(r["step_seconds"] for r in kept)),
        "is_weight_mean": mean(r.get("is_weight_mean") for r in kept),
        "own_ratio_mean": mean(r.get("own_ratio_mean") for r in kept),
        "gpu_peak_gib": max((r["gpu_peak_gib"] for r in records if r.get("gpu_peak_gib") is not None), default=None),
        "gpu_used_gib": max((r["gpu_used_gib"] for r in records if r.get("gpu_used_gib") is not None), default=None),
        "kl_mean": mean(r.get("kl_mean") for r in kept),
        "peer_sequences": mean(r.get("peer_sequences", 0) for r in kept),
        "completion_len_mean": mean(r["completion_len_mean"] for r in kept),
        "truncated_frac": mean(r.get("truncated_frac") for r in kept),
    }


def run_summary(records: list[dict], skip: int) -> dict:
    """A run's members, and the run's step: the slower member's step_seconds per step (the pair runs its members
    side by side, one process each) and the wall time between the ends of consecutive steps, medians after
    `skip`; generated tokens/s of all members over the slower member's seconds."""
    members: dict[str, list[dict]] = {}
    for r in records:
        members.setdefault(r["member"], []).append(r)
    by_step: dict[int, list[dict]] = {}
    for r in records:
        by_step.setdefault(r["step"], []).append(r)
    slowest = {s: max(r["step_seconds"] for r in rs) for s, rs in by_step.items()}
    ended = {s: max(r["ended_at"] for r in rs) for s, rs in by_step.items() if all("ended_at" in r for r in rs)}
    kept = [s for s in sorted(by_step) if s > skip]
    gen_tokens = sum(generated_tokens(r) for s in kept for r in by_step[s])
    return {
        "members": {name: member_summary(rs, skip) for name, rs in members.items()},
        "steps": len(kept),
        "step_seconds": median(slowest[s] for s in kept),
        "step_seconds_mean": mean(slowest[s] for s in kept),
        "wall_step_seconds": median(ended[s] - ended[s - 1] for s in kept if s in ended and s - 1 in ended),
        "step_tokens_per_s": ratio(gen_tokens, sum(slowest[s] for s in kept)),
    }


def trl_summary(result: dict, skip: int) -> dict:
    """benchmarks/trl_grpo.py's per-step records after step `skip`: median seconds by phase, tokens/s, peaks."""
    kept = [s for s in result["steps"] if s["step"] > skip]
    tokens = sum(s["tokens"] for s in kept)
    own = result.get("summary", {})
    return {
        "device": result.get("device"), "versions": result.get("versions"), "config": result.get("config"),
        "steps": len(kept),
        "step_seconds": median(s["seconds"] for s in kept),
        "step_seconds_mean": mean(s["seconds"] for s in kept),
        "gen_seconds": median(s["gen_seconds"] for s in kept),
        "weight_sync_seconds": median(s["weight_sync_seconds"] for s in kept),
        "score_seconds": median(s["score_seconds"] for s in kept),
        "update_seconds": median(s["update_seconds"] for s in kept),
        "generated_tokens_per_step": tokens / len(kept) if kept else None,
        "gen_tokens_per_s": ratio(tokens, sum(s["gen_seconds"] for s in kept)),
        "step_tokens_per_s": ratio(tokens, sum(s["seconds"] for s in kept)),
        "peak_allocated_gib": max((s["peak_allocated_gib"] for s in result["steps"] if "peak_allocated_gib" in s),
                                  default=None),
        "is_weight_mean": own.get("is_weight_mean"),
        "completion_len_mean": own.get("completion_len_mean"),
        "truncated_frac": own.get("truncated_frac"),
        "settings": result.get("settings"),
    }


def ours_settings(run_dir: pathlib.Path) -> dict[str, dict]:
    """What each member of an ftis-engine run ran with, from its resolved config.yaml, `auto` resolved by the
    engine's own rules for the member's device on this machine (run it where the run ran: attention's `auto` depends
    on the GPU's torch): {member: {SETTINGS}}; `compile` is the decoder layers' mode (train.layers)."""
    from ftis_engine.model import layers, precision
    from ftis_engine.config import load_config
    from ftis_engine.member.members import attention_implementation
    from ftis_engine.run.preflight import member_device

    config = load_config(run_dir / "config.yaml")
    out = {}
    for index, member in enumerate(config.members):
        device = member_device(config, index, None)
        out[member.name] = {
            "precision": str(precision.compute_dtype(member.dtype, device)).removeprefix("torch."),
            "master_dtype": member.master_dtype,
            "attention": attention_implementation(config.train.attn_implementation, device),
            "compile": layers.resolve(config.train.layers, device),
            "vocab_size": vocab_size(member.model),
            "batch": config.rollout.prompts_per_step * config.rollout.group_size,
            "length": config.rollout.max_new_tokens,
        }
        if member.generator == "vllm":  # the engine's levers as configured (on a GPU: docs/vllm.md)
            engine = member.vllm
            out[member.name].update(
                sleep_level=engine.sleep_level, seeds="per request" if engine.per_request_seed else "one stream",
                kv_cache_gib=engine.kv_cache_gib if engine.kv_cache_gib is not None else "share",
                gpu_memory_utilization=engine.gpu_memory_utilization)
    return out


def vocab_size(spec: str) -> int:
    """The rows of a model's embedding: a built-in's are its tokenizer's ids, any other model's its config's."""
    from ftis_engine.model.models import is_builtin, load_tokenizer, source

    if is_builtin(spec):
        return len(load_tokenizer(spec))
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(source(spec)).vocab_size)


def unlike(ours: dict | None, theirs: dict | None) -> list[str]:
    """The SETTINGS in which two sides differ, or that one side does not record ("attention (unknown)"), and the
    LEVERS both sides record and set differently."""
    out = []
    for key in SETTINGS:
        a, b = (ours or {}).get(key), (theirs or {}).get(key)
        if a is None or b is None:
            out.append(f"{key} (unknown)")
        elif a != b:
            out.append(key)
    for key in LEVERS:
        a, b = (ours or {}).get(key), (theirs or {}).get(key)
        if a is not None and b is not None and a != b:
            out.append(key)
    return out


def gpu_memory_peak_gib(path: pathlib.Path) -> float | None:
    """The largest of nvidia-smi's memory.used samples (MiB, one a line), in GiB; None without a sample."""
    if not path.exists():
        return None
    samples = []
    for line in path.read_text().splitlines():
        try:
            samples.append(float(line.strip()))
        except ValueError:
            continue  # a header or an error line
    return max(samples) * 2**20 / GIB if samples else None


def summarize(results: pathlib.Path, skip: int = 1) -> dict:
    """Everything in a results folder (see the module docstring), with TRL's median step over ours alone."""
    out: dict = {"skip": skip, "runs": {}}
    device = results / "device.txt"
    out["device"] = device.read_text().strip().splitlines()[0] if device.exists() else None
    for path in sorted(results.glob("*.metrics.jsonl")):
        name = path.name.removesuffix(".metrics.jsonl")
        records = read_train_records(path)
        if records:
            settings = results / f"{name}.settings.json"
            out["runs"][name] = {**run_summary(records, skip), "gpu_memory_peak_gib":
                                 gpu_memory_peak_gib(results / f"{name}.gpumem"),
                                 "settings": json.loads(settings.read_text()) if settings.exists() else None}
    for stem, key in (("trl", "trl"), ("trl-3b", "trl_3b")):
        trl = results / f"{stem}.json"
        if trl.exists():
            result, settings = json.loads(trl.read_text()), results / f"{stem}.settings.json"
            if result.get("settings") is None and settings.exists():  # a run from before trl_grpo.py recorded them
                result["settings"] = json.loads(settings.read_text())
            out[key] = {**trl_summary(result, skip),
                        "gpu_memory_peak_gib": gpu_memory_peak_gib(results / f"{stem}.gpumem")}
            out["device"] = out["device"] or out[key]["device"]
    pair = out["runs"].get("pair-sync")
    if pair is not None and "trl" in out and "trl_3b" in out:
        sequential = (None if None in (out["trl"]["step_seconds"], out["trl_3b"]["step_seconds"])
                      else out["trl"]["step_seconds"] + out["trl_3b"]["step_seconds"])
        out["pair_vs_trl_sequential"] = {"pair_step_seconds": pair["step_seconds"],
                                         "trl_sequential_step_seconds": sequential,
                                         "trl_sequential_over_pair": ratio(sequential, pair["step_seconds"])}
    alone = out["runs"].get("alone")
    if alone is not None and "trl" in out:
        speedup = ratio(out["trl"]["step_seconds"], alone["step_seconds"])
        ours = next(iter((alone["settings"] or {}).values()), None)  # its one member's
        differ = unlike(ours, out["trl"]["settings"])
        out["trl_vs_alone"] = {"ours_step_seconds": alone["step_seconds"],
                               "trl_step_seconds": out["trl"]["step_seconds"], "trl_over_ours": speedup,
                               "ours_step_seconds_mean": alone["step_seconds_mean"],
                               "trl_step_seconds_mean": out["trl"]["step_seconds_mean"],
                               "trl_over_ours_mean": ratio(out["trl"]["step_seconds_mean"], alone["step_seconds_mean"]),
                               "ours_settings": ours, "trl_settings": out["trl"]["settings"],
                               "unlike": differ, "like_for_like": not differ,
                               # the goal is judged like for like only
                               "goal_2x_met": None if differ else speedup is not None and speedup >= 2.0}
    return out


def _f(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def markdown(summary: dict) -> str:
    lines = [f"# The pair and TRL on one GPU (issue 28): {summary['device'] or 'device unknown'}", "",
             (f"Medians over the steps after step {summary['skip']}; seconds per step. Ours: weight sync is the "
             "engine's load of new weights at wake-up; exchange is sending and waiting for the peer. A pair's step "
             "is its slower member's. Peak GPU: nvidia-smi's device-wide peak during the run; torch: the member "
             "process's own peak allocation."), ""]
    trl = summary.get("trl")
    if summary["runs"] or trl is not None:
        lines += [("| run | member | step s | generation s | weight sync s | exchange s | update s | "
                   "generated tok/s (gen) | generated tok/s (step) | is_weight_mean | own ratio | completion len | "
                   "peak GPU GiB | torch peak GiB |"),
                  "| --- | --- |" + " ---: |" * 12]
        for name, run in summary["runs"].items():
            for member, m in run["members"].items():
                lines.append(f"| {name} | {member} | {_f(m['step_seconds'])} | {_f(m['gen_seconds'])} | "
                             f"{_f(m.get('sync_seconds'))} | {_f(m['exchange_seconds'])} | {_f(m['train_seconds'])} | "
                             f"{_f(m['gen_tokens_per_s'], 0)} | {_f(m['step_tokens_per_s'], 0)} | "
                             f"{_f(m['is_weight_mean'], 4)} | {_f(m.get('own_ratio_mean'), 4)} | "
                             f"{_f(m['completion_len_mean'], 0)} | {_f(run['gpu_memory_peak_gib'], 1)} | "
                             f"{_f(m.get('gpu_peak_gib'), 1)} |")
            if len(run["members"]) > 1:
                lines.append(f"| {name} | (pair: slower member; wall {_f(run['wall_step_seconds'])} s) | "
                             f"{_f(run['step_seconds'])} | | | | | | {_f(run['step_tokens_per_s'], 0)} | | | | "
                             f"{_f(run['gpu_memory_peak_gib'], 1)} | |")
        for key in ("trl", "trl_3b"):  # generation with its weight sync, update with its scoring: ours' phases
            run = summary.get(key)
            if run is None:
                continue
            model = (run["config"] or {}).get("model", "")
            update = sum(run[k] or 0.0 for k in ("score_seconds", "update_seconds"))
            lines.append(f"| {key.replace('_', '-')} | {model} | {_f(run['step_seconds'])} | "
                         f"{_f(run['gen_seconds'])} | {_f(run['weight_sync_seconds'])} | - | {_f(update)} | "
                         f"{_f(run['gen_tokens_per_s'], 0)} | {_f(run['step_tokens_per_s'], 0)} | "
                         f"{_f(run['is_weight_mean'], 4)} | - | "
                         f"{_f(run['completion_len_mean'], 0)} | {_f(run['gpu_memory_peak_gib'], 1)} | "
                         f"{_f(run['peak_allocated_gib'], 1)} |")
        lines += ["", ("is_weight_mean: over the tokens a member trained on (alone: its own rollouts; in the pair "
                       "also its peer's); own ratio: exp(l - g) over its own tokens only (~1: trainer and engine "
                       "agree); TRL's is_weight_mean: its logged mean vLLM importance ratio, after its cap at 2. "
                       "TRL's update holds its scoring (the old-log-prob forward)."), ""]
    if trl is not None:
        versions = ", ".join(f"{k} {v}" for k, v in (trl["versions"] or {}).items() if v)
        lines += [(f"TRL's GRPOTrainer ({versions}): {_f(trl['step_seconds'])} s/step (generation "
                  f"{_f(trl['gen_seconds'])}, weight sync {_f(trl['weight_sync_seconds'])}, scoring "
                  f"{_f(trl['score_seconds'])}, update {_f(trl['update_seconds'])}), "
                  f"{_f(trl['step_tokens_per_s'], 0)} generated tokens/s over the step, "
                  f"{_f(trl['gen_tokens_per_s'], 0)} while generating; mean importance ratio "
                  f"{_f(trl['is_weight_mean'], 4)}; torch peak {_f(trl['peak_allocated_gib'], 1)} GiB, device "
                  f"peak {_f(trl['gpu_memory_peak_gib'], 1)} GiB."), ""]
    versus = summary.get("trl_vs_alone")
    if versus is not None:
        lines += settings_table(versus)
        like = "like for like" if versus["like_for_like"] else f"unlike: {', '.join(versus['unlike'])}"
        goal = ("not judged: the runs differ" if versus["goal_2x_met"] is None
                else "met" if versus["goal_2x_met"] else "not met")
        lines += [(f"**TRL / ours alone, seconds per step: {_f(versus['trl_step_seconds'])} / "
                  f"{_f(versus['ours_step_seconds'])} = {_f(versus['trl_over_ours'])}x ({like})** by the medians; "
                  f"{_f(versus['trl_step_seconds_mean'])} / {_f(versus['ours_step_seconds_mean'])} = "
                  f"{_f(versus['trl_over_ours_mean'])}x by the means (goal: >= 2x; {goal})."), ""]
    sequential = summary.get("pair_vs_trl_sequential")
    if sequential is not None:
        lines += [(f"**The pair against TRL training its two shapes one after the other: TRL's "
                   f"{_f(summary['trl']['step_seconds'])} + {_f(summary['trl_3b']['step_seconds'])} = "
                   f"{_f(sequential['trl_sequential_step_seconds'])} s against the pair's "
                   f"{_f(sequential['pair_step_seconds'])} s a step: "
                   f"{_f(sequential['trl_sequential_over_pair'])}x.** Each TRL run trains its member on its own 144 "
                   "completions; the pair trains each on its own and its peer's (288). The pair's settings are in "
                   "the JSON (runs.pair-sync.settings), TRL's in trl.settings and trl_3b.settings."), ""]
    return "\n".join(lines)


def settings_table(versus: dict) -> list[str]:
    """Each side's SETTINGS and LEVERS, those that differ or are unknown marked."""
    differ = {item.split(" ")[0] for item in versus["unlike"]}
    lines = ["| setting | ours alone | TRL | |", "| --- | --- | --- | --- |"]
    for key in SETTINGS + LEVERS:
        a, b = ((versus[side] or {}).get(key) for side in ("ours_settings", "trl_settings"))
        lines.append(f"| {key} | {'-' if a is None else a} | {'-' if b is None else b} | "
                     f"{'**differs**' if key in differ else ''} |")
    return lines + [""]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", help="the folder benchmarks/run_pair_gpu.sh wrote")
    parser.add_argument("--output", help="path prefix: writes <output>.json and <output>.md")
    parser.add_argument("--skip", type=int, default=1, help="leave the first SKIP steps out of the medians")
    parser.add_argument("--settings", type=pathlib.Path, metavar="RUN_DIR",
                        help="print what the ftis-engine run in RUN_DIR ran with (JSON), and nothing else")
    args = parser.parse_args(argv)
    if args.settings is not None:
        print(json.dumps(ours_settings(args.settings), indent=2))
        return 0
    if not args.results or not args.output:
        parser.error("--results and --output are required (or --settings RUN_DIR)")
    summary = summarize(pathlib.Path(args.results), args.skip)
    out = pathlib.Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(f"{out}.json").write_text(json.dumps(summary, indent=2) + "\n")
    text = markdown(summary)
    pathlib.Path(f"{out}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
