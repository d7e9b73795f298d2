"""HF generate against the vLLM engine on the CPU (vLLM's CPU build), side by side in one process (issue 66 item 5).

For each packaged model (SmolLM2-135M-Instruct, Qwen2.5-Coder-0.5B-Instruct), one process builds the member once per
side (the transformers generator in float32 and in bf16 compute; a vLLM engine in float32 and in bf16) and times a
step's generation on the same prompts (gsm8k-calc's chat prompts, the first `--prompts` of its training set), the
same group size and every completion run to the same length (`min_new_tokens` = `max_new_tokens`: the same tokens
to make on every side), the sides alternated `--rounds` times after one warm-up call each (the engine's first call
sets up its buffers); medians. Every side's settings (precision, threads, batch, length, engine settings) go into
the JSON beside its times. Run in the vLLM environment (docs/vllm.md), with the machine to itself:

    python benchmarks/generation_cpu.py --output benchmarks/results/generation_cpu
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import platform
import statistics
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAIR = ROOT / "configs" / "real" / "pair-vllm-cpu.yaml"
MODELS = {"smollm2-135m-instruct": "SmolLM2-135M", "qwen2.5-coder-0.5b-instruct": "Qwen2.5-Coder-0.5B"}
SIDES = (("hf", "float32"), ("hf", "bfloat16"), ("vllm", "float32"), ("vllm", "bfloat16"))


def build(model: str, generator: str, dtype: str, args):
    """One member of `model` generating with `generator` in `dtype` (HF: the member's compute dtype, bf16 under
    autocast; vLLM: the engine's), through the engine's own builder, and its task."""
    from ftis_engine.config import load_config
    from ftis_engine.member.members import build_member
    from ftis_engine.run.preflight import check_members
    from ftis_engine.data.tasks import load_task

    overrides = [f"members=[{{name: m, model: 'packaged:{model}', generator: {generator}, device: cpu}}]",
                 "collaboration=alone", f"rollout.max_new_tokens={args.max_new_tokens}",
                 f"rollout.group_size={args.n}", f"rollout.prompts_per_step={args.prompts}",
                 f"train.threads={args.threads}", f"rollout.generation_batch_size={args.prompts * args.n}"]
    overrides += [f"members.0.vllm.dtype={dtype}"] if generator == "vllm" else [f"members.0.dtype={dtype}"]
    config = load_config(PAIR, overrides)
    torch.set_num_threads(args.threads)  # before any engine: vLLM-CPU makes set_num_threads a no-op after its start
    member = build_member(0, config, check_members(config)[0], torch.device("cpu"))
    return member, config, load_task(config.data, 0, with_train=True)


def side_settings(generator: str, dtype: str, config, args) -> dict:
    settings = {"generator": generator, "precision": dtype, "threads": args.threads, "prompts": args.prompts,
                "completions_per_prompt": args.n, "tokens_per_completion": args.max_new_tokens,
                "temperature": config.rollout.temperature}
    if generator == "vllm":
        v = config.members[0].vllm
        settings.update(enforce_eager=True if v.enforce_eager is None else v.enforce_eager, prefix_caching=True,
                        kv_cache_gib=v.kv_cache_gib, per_request_seed=v.per_request_seed)
    else:
        settings.update(batch=config.rollout.generation_batch_size, kv_cache="transformers' dynamic cache")
    return settings


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--prompts", type=int, default=4, help="a member's prompts in configs/real/pair-vllm-cpu")
    parser.add_argument("--n", type=int, default=8, help="completions per prompt (the pair's group size)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", help="path prefix: writes <output>.json and <output>.md")
    parser.add_argument("--render", metavar="JSON", help="print the table of a result written before, and exit")
    args = parser.parse_args(argv)
    if args.render:
        print(render(json.loads(pathlib.Path(args.render).read_text())))
        return 0
    if not args.output:
        parser.error("--output is required")

    import transformers
    import vllm

    from ftis_engine.generation import SamplingSettings
    from ftis_engine.data.tasks import prompt_ids

    result = {"machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
              "cpu": _cpu_name(), "torch": torch.__version__, "vllm": vllm.__version__,
              "transformers": transformers.__version__, "python": platform.python_version(),
              "command": " ".join([sys.executable, *sys.argv]), "rounds": args.rounds, "models": {}}
    out = pathlib.Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    for model in args.models:
        built = {side: build(model, *side, args) for side in SIDES}
        _, config, task = built[SIDES[0]]
        sampling = SamplingSettings(n=args.n, max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens,
                                    temperature=config.rollout.temperature, seed=0)
        questions = [example.question for example in task.train[: args.prompts]]
        times = {side: [] for side in SIDES}
        tokens = {}
        for side, (member, _, _) in built.items():  # warm-up
            member.generator.generate([prompt_ids(member.tokenizer, task, q) for q in questions[:1]],
                                      dataclasses.replace(sampling, n=1))
        for r in range(args.rounds):
            order = SIDES if r % 2 == 0 else SIDES[::-1]
            for side in order:
                member = built[side][0]
                prompts = [prompt_ids(member.tokenizer, task, q) for q in questions]
                start = time.perf_counter()
                groups = member.generator.generate(prompts, dataclasses.replace(sampling, seed=r))
                times[side].append(time.perf_counter() - start)
                tokens[side] = sum(c.token_ids.numel() for g in groups for c in g)
                print(model, side, f"{times[side][-1]:.2f} s", tokens[side], "tokens", flush=True)
        rows = {}
        for side in SIDES:
            seconds = statistics.median(times[side])
            rows["-".join(side)] = {"settings": side_settings(*side, built[side][1], args), "seconds": times[side],
                                    "median_seconds": seconds, "tokens": tokens[side],
                                    "tokens_per_s": tokens[side] / seconds}
        for row in rows.values():  # like for like: over HF at the same precision
            row["speedup_over_hf_same_precision"] = (rows[f"hf-{row['settings']['precision']}"]["median_seconds"]
                                                     / row["median_seconds"])
        result["models"][model] = rows
        for member, _, _ in built.values():
            member.generator.close()
        pathlib.Path(f"{out}.json").write_text(json.dumps(result, indent=2) + "\n")

    pathlib.Path(f"{out}.md").write_text(render(result))
    print(render(result))
    return 0


def render(result: dict) -> str:
    """The table of a result (also: python benchmarks/generation_cpu.py --render RESULT.json)."""
    first = next(iter(next(iter(result["models"].values())).values()))["settings"]
    md = [f"# HF generate against the vLLM engine on the CPU ({result['cpu']})", "",
          f"vLLM {result['vllm']} (CPU build), torch {result['torch']}, transformers {result['transformers']}, "
          f"Python {result['python']}; {first['threads']} threads; {first['prompts']} gsm8k-calc chat prompts x "
          f"{first['completions_per_prompt']} completions, every one run to {first['tokens_per_completion']} tokens, "
          f"temperature {first['temperature']}; the four sides alternated {result['rounds']} times in one process "
          "after a warm-up call each, median seconds of a step's generation. vLLM: eager, prefix caching, a seed per "
          "request, its KV cache sized from the run; HF: the trainer's generator (transformers' generate, one batch "
          "of every completion; bf16 is compute under autocast over float32 weights, as the trainer runs it).", "",
          "| model | side | precision | seconds | tokens/s | over HF, same precision |", "|---|---|---|---:|---:|---:|"]
    for model, rows in result["models"].items():
        for row in rows.values():
            md.append(f"| {MODELS[model]} | {row['settings']['generator']} | {row['settings']['precision']} | "
                      f"{row['median_seconds']:.2f} | {row['tokens_per_s']:.0f} | "
                      f"{row['speedup_over_hf_same_precision']:.2f}x |")
    md += ["", f"Command: `{result['command']}`", ""]
    return "\n".join(md)


def _cpu_name() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


if __name__ == "__main__":
    raise SystemExit(main())
