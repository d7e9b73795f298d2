"""The vLLM generator against the trainer and against the transformers generator, on one GPU (issue 16).

On a random model of a given built-in shape (default Qwen2.5-0.5B's layers, the shipped tokenizer, nothing
downloaded), one process:

1. builds the member with `generator: vllm` (colocated engine, bf16) and samples `--prompts` x `--n` completions;
2. recomputes every sampled token's log-prob with the trainer's fused op on the trainer's bf16 model: the
   absolute log-ratio |log p_train - log p_vllm| is the importance weight's distance from 1 on a member's own
   rollouts (mean, p99, max over tokens);
3. sleeps and wakes the engine (GPU memory released and taken back, seconds) and pushes the weights once (seconds);
4. times the same prompts with every completion run to the length limit, per-request seeds against one seeded
   stream for the batch (`members.N.vllm.per_request_seed`), alternated `--seed-rounds` times in the same engine;
   and the wake-up with a weight push after a sleep at level 1 and at level 2 (`members.N.vllm.sleep_level`);
5. builds the same member with `generator: hf` (same seed, same weights) and times the same generation;
   tokens/s of both, side by side, in the same process (`--no-hf` skips it: the slowest part).

    python benchmarks/vllm_generator.py --output benchmarks/results/vllm_h100
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import random
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"


def build(model: str, generator: str, max_new_tokens: int, utilization: float):
    from ftis_engine.config import load_config
    from ftis_engine.member.members import build_member
    from ftis_engine.run.preflight import check_members

    cfg = load_config(TINY, [f"members.0.model={model}", f"members.0.generator={generator}", "members.0.lora=null",
                             f"members.0.vllm.gpu_memory_utilization={utilization}", "train.device=cuda",
                             f"rollout.max_new_tokens={max_new_tokens}", "data.max_prompt_tokens=64"])
    tokenizers = check_members(cfg, members=[0])
    return build_member(0, cfg, tokenizers[0], torch.device("cuda"))


def timed_generation(member, prompts, sampling):
    member.generator.generate(prompts[:4], sampling)  # warm-up (compilation, CUDA graphs, allocator)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = member.generator.generate(prompts, sampling)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = sum(c.token_ids.numel() for group in out for c in group)
    return out, {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}


def logprob_gaps(member, prompts, outputs, temperature: float, limit: int) -> torch.Tensor:
    from ftis_kernels import fused_linear_token_logprobs

    body, head = member.body_and_head()
    gaps, done = [], 0
    for prompt, group in zip(prompts, outputs):
        for c in group:
            if done >= limit:
                return torch.cat(gaps)
            ids = torch.tensor(prompt + c.token_ids.tolist(), device="cuda")
            with torch.no_grad():
                hidden = body(input_ids=ids[None], use_cache=False).last_hidden_state[0]
                rows = hidden[len(prompt) - 1 : len(prompt) - 1 + c.token_ids.numel()]
                ours = fused_linear_token_logprobs(rows, head.weight, c.token_ids.long().cuda(),
                                                   temperature=temperature)
            gaps.append((ours.float().cpu() - c.logprobs).abs())
            done += 1
    return torch.cat(gaps)


def seeding_ab(generator, prompts, sampling, rounds: int) -> dict:
    """Seconds of one generation with per-request seeds and with one seeded stream, every completion run to the
    limit (the same tokens to make either way), alternated in the same engine (which goes first swaps each round)."""
    import dataclasses
    import statistics

    full = dataclasses.replace(sampling, min_new_tokens=sampling.max_new_tokens)
    times, tokens = {True: [], False: []}, {True: [], False: []}
    for r in range(rounds):
        for per_request in ((True, False) if r % 2 == 0 else (False, True)):
            generator.per_request_seed = per_request
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = generator.generate(prompts, full)
            torch.cuda.synchronize()
            times[per_request].append(time.perf_counter() - start)
            tokens[per_request].append([c.token_ids.tolist() for group in out for c in group])
    generator.per_request_seed = True
    per_request_s, one_stream_s = statistics.median(times[True]), statistics.median(times[False])
    return {"rounds": rounds, "tokens": len(prompts) * full.n * full.max_new_tokens,
            "per_request_seconds": times[True], "one_stream_seconds": times[False],
            "per_request_s": per_request_s, "one_stream_s": one_stream_s,
            "per_request_over_one_stream": per_request_s / one_stream_s,
            # the same step seed every round: each way must give the same completions every time (vLLM's V2 model
            # runner gives a request without a seed a random one of its own: there the one stream would not repeat)
            "per_request_repeats": all(t == tokens[True][0] for t in tokens[True]),
            "one_stream_repeats": all(t == tokens[False][0] for t in tokens[False])}


def sleep_levels(member) -> dict:
    """Sleep, then wake with a full weight push (what a step's generation starts with), at level 1 and level 2."""
    out = {}
    gen = member.generator
    for level in (1, 2):
        gen.sleep_level = level
        torch.cuda.synchronize()
        start = time.perf_counter()
        gen.sleep()
        sleep_s = time.perf_counter() - start
        gen.sync(member.model)
        start = time.perf_counter()
        gen.wake_up()
        torch.cuda.synchronize()
        out[str(level)] = {"sleep_seconds": sleep_s, "wake_and_push_seconds": time.perf_counter() - start}
    gen.sleep_level = 1
    return out


def free_memory() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:shape-0.5b")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--parity-sequences", type=int, default=128)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--seed-rounds", type=int, default=3,
                        help="rounds of the seeding A/B (each: both ways, in alternating order); 0 skips it")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers generator's comparison")
    parser.add_argument("--output", required=True, help="path prefix: writes <output>.json and <output>.md")
    args = parser.parse_args(argv)

    import transformers
    import triton
    import vllm

    from ftis_engine.generation import SamplingSettings

    rng = random.Random(0)
    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "triton": triton.__version__, "transformers": transformers.__version__, "vllm": vllm.__version__,
        "python": platform.python_version(), "command": " ".join([sys.executable, *sys.argv]),
        "model": args.model, "prompts": args.prompts, "n": args.n, "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
    }
    free_start = free_memory()
    member = build(args.model, "vllm", args.max_new_tokens, args.gpu_memory_utilization)
    texts = ["".join(rng.choice("0123456789") for _ in range(rng.randint(3, 12))) + "=" for _ in range(args.prompts)]
    prompts = [member.tokenizer(t)["input_ids"] for t in texts]
    sampling = SamplingSettings(n=args.n, max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=0)
    outputs, result["vllm_generation"] = timed_generation(member, prompts, sampling)
    print("vllm", result["vllm_generation"], flush=True)

    gaps = logprob_gaps(member, prompts, outputs, args.temperature, args.parity_sequences)
    result["own_rollout_abs_log_ratio"] = {
        "tokens": gaps.numel(), "mean": float(gaps.mean()), "p99": float(gaps.quantile(0.99)),
        "max": float(gaps.max()), "is_weight_mean": float(torch.exp(-gaps).mean()),
    }
    print("parity", result["own_rollout_abs_log_ratio"], flush=True)

    awake = free_memory()
    start = time.perf_counter()
    member.generator.sleep()
    sleep_s = time.perf_counter() - start
    asleep = free_memory()
    start = time.perf_counter()
    member.generator.sync(member.model)
    member.generator.wake_up()  # pushes all weights in place, then wakes the KV cache
    wake_push_s = time.perf_counter() - start
    woken = free_memory()
    start = time.perf_counter()
    member.generator.sync(member.model)  # awake: pushed at once
    torch.cuda.synchronize()
    push_s = time.perf_counter() - start
    gib = 2**30
    result["sleep_wake"] = {
        "engine_gib": (free_start - awake) / gib, "released_by_sleep_gib": (asleep - awake) / gib,
        "taken_back_by_wake_gib": (asleep - woken) / gib, "sleep_seconds": sleep_s,
        "wake_and_push_seconds": wake_push_s, "push_seconds": push_s,
        "parameters": sum(p.numel() for p in member.model.parameters()),
    }
    print("sleep/wake", result["sleep_wake"], flush=True)
    with torch.no_grad():  # an update: the engine (compiled, CUDA graphs) must now sample from the new weights
        for p in member.model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    member.generator.sleep()
    member.generator.sync(member.model)
    after = member.generator.generate(prompts[:16], sampling)
    gaps = logprob_gaps(member, prompts[:16], after, args.temperature, args.parity_sequences)
    before = logprob_gaps(member, prompts, outputs, args.temperature, 16)  # old rollouts under the new weights
    result["after_update"] = {"tokens": gaps.numel(), "mean": float(gaps.mean()), "max": float(gaps.max()),
                              "old_rollouts_mean": float(before.mean())}
    print("after update", result["after_update"], flush=True)
    out = pathlib.Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after each phase: a call stopped at its time limit keeps what was measured
        pathlib.Path(f"{out}.json").write_text(json.dumps(result, indent=2) + "\n")

    save()
    if args.seed_rounds:
        result["seeding"] = seeding_ab(member.generator, prompts, sampling, args.seed_rounds)
        print("seeding", result["seeding"], flush=True)
        save()
        result["sleep_levels"] = sleep_levels(member)
        print("sleep levels", result["sleep_levels"], flush=True)
        save()
    member.generator.sleep()  # out of the HF generator's way

    if not args.no_hf:
        hf_member = build(args.model, "hf", args.max_new_tokens, args.gpu_memory_utilization)
        _, result["hf_generation"] = timed_generation(hf_member, prompts, sampling)
        print("hf", result["hf_generation"], flush=True)
        result["vllm_over_hf_tokens_per_s"] = (result["vllm_generation"]["tokens_per_s"]
                                               / result["hf_generation"]["tokens_per_s"])

    save()
    g, s = result["own_rollout_abs_log_ratio"], result["sleep_wake"]
    md = [
        f"# vLLM generator on {result['device']}", "",
        f"vLLM {result['vllm']}, torch {result['torch']} (CUDA {result['cuda']}), Triton {result['triton']}, "
        f"transformers {result['transformers']}, Python {result['python']}.", "",
        f"Model `{args.model}` ({s['parameters'] / 1e6:.0f}M parameters, random, bf16), {args.prompts} prompts x "
        f"{args.n} completions, {args.max_new_tokens} new tokens at most, temperature {args.temperature}.", "",
    ]
    if "hf_generation" in result:
        md += [
            "| | vLLM | HF generate | vLLM / HF |", "| --- | ---: | ---: | ---: |",
            f"| generated tokens/s | {result['vllm_generation']['tokens_per_s']:,.0f} | "
            f"{result['hf_generation']['tokens_per_s']:,.0f} | {result['vllm_over_hf_tokens_per_s']:.1f}x |", "",
        ]
    else:
        md += [f"vLLM: {result['vllm_generation']['tokens_per_s']:,.0f} generated tokens/s (no HF comparison).", ""]
    md += [
        f"Own rollouts, per token, |log p_trainer - log p_vLLM| over {g['tokens']:,} tokens: mean {g['mean']:.4f}, "
        f"p99 {g['p99']:.4f}, max {g['max']:.4f}; mean importance weight exp(-|.|) {g['is_weight_mean']:.4f}.", "",
        f"Sleep (level 1) released {s['released_by_sleep_gib']:.2f} GiB of the engine's {s['engine_gib']:.2f} GiB "
        f"in {s['sleep_seconds']:.2f} s; wake with a full weight push took back {s['taken_back_by_wake_gib']:.2f} "
        f"GiB in {s['wake_and_push_seconds']:.2f} s; an in-place push while awake: {s['push_seconds']:.2f} s.", "",
        f"After an update (every weight + N(0, 0.01^2)) and a sync, new rollouts: mean |log-ratio| "
        f"{result['after_update']['mean']:.4f}, max {result['after_update']['max']:.4f} (the rollouts sampled before "
        f"the update, under the new weights: {result['after_update']['old_rollouts_mean']:.4f}).", "",
    ]
    if "seeding" in result:
        a, lv = result["seeding"], result["sleep_levels"]
        md += [
            f"Seeding, every completion run to {args.max_new_tokens} tokens, {a['rounds']} alternated rounds "
            f"(median seconds): per-request seeds {a['per_request_s']:.3f} s, one seeded stream "
            f"{a['one_stream_s']:.3f} s; per request / one stream = **{a['per_request_over_one_stream']:.3f}x**. "
            f"Completions the same every round with the same step seed: per request {a['per_request_repeats']}, one "
            f"stream {a['one_stream_repeats']}.", "",
            f"Wake-up with a full weight push after a sleep: level 1 {lv['1']['wake_and_push_seconds']:.2f} s (sleep "
            f"{lv['1']['sleep_seconds']:.2f} s), level 2 {lv['2']['wake_and_push_seconds']:.2f} s (sleep "
            f"{lv['2']['sleep_seconds']:.2f} s).", "",
        ]
    md += [f"Command: `{result['command']}`", ""]
    pathlib.Path(f"{out}.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
