"""One full F-TIS update (forward, loss, backward, AdamW step) of a model with Qwen2.5 shapes and random weights:
the fused path (hidden states + fused_linear_ftis_loss on the lm_head) against the logits path (the model's
logits + log_softmax + the same loss). Reports tokens/s, MFU and peak memory.

    python benchmarks/update.py                    # GPU: Qwen2.5-1.5B and -3B shapes, 16 x 1024-token sequences
    python benchmarks/update.py --models 1.5b --sequences 32
    python benchmarks/update.py --quick            # CPU, a tiny model (CI keeps this from rotting)
    python benchmarks/update.py --models 1.5b 3b --paths fused --attn flex_attention varlen \
        --layers eager liger compile liger+compile   # the grid of issue 27: every attention x layers pair

On a GPU each measured run is also merged into update_step.json beside --output (--update-step names another file;
one object per run, keyed by device, model, attention, layers, path and batch shape). run_gpu.sh's stages leave it
in their results folder; benchmarks/results/update_step.json, the file the README quotes, is that file brought back.
MFU counts model FLOPs only (model_flops): 6 x the body's parameters x input tokens (the embedding lookup is not a
matmul), 6 x V x d for each row the head runs on, and causal attention (12 x layers x d x mean context per token);
the recompute of gradient checkpointing is not counted. The head runs on the completion tokens on the fused path
(16 x 768 of the 16 x 1,023 input tokens by default) and on every input token on the logits path (the model's own
logits). Records counted before 2026-11-28 credited the fused path with the head over every input token (MFU about
4% high at 256 + 768 tokens): `--recount FILE` recounts an update_step.json from its timings with this count.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import platform
import statistics
import sys
import time
import typing

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from ftis_engine.model import layers, precision  # noqa: E402
from ftis_engine.config import MemberSettings, TrainSettings  # noqa: E402
from ftis_engine.core.errors import first_line  # noqa: E402
from ftis_engine.member.members import Member, attention_implementation, enable_checkpointing  # noqa: E402
from ftis_engine.model.batch import TrainItem, pack  # noqa: E402
from ftis_engine.data.rollouts import Rollout  # noqa: E402
from ftis_engine.model.update import batch_loss  # noqa: E402
from ftis_kernels import LossConfig, LossInputs  # noqa: E402
from ftis_kernels.epilogue import ftis_objective  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"

# Qwen2.5 shapes (config.json of the hub models); weights are random.
SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=True),
}
CONFIG = LossConfig(method="f-tis")
ATTENTION = typing.get_args(TrainSettings.model_fields["attn_implementation"].annotation)  # the trainer's choices
LAYERS = [mode for mode in layers.CHOICES if mode != "auto"]


def build(shape: str, device: torch.device, dtype: torch.dtype, attn: str, checkpointing: bool = False,
          layer_mode: str = "eager", master: str = "float32"):
    """A member as the trainer builds one: parameters in the master dtype (float32 masters under bf16 autocast, the
    landed mixed precision; or bfloat16 parameters stepped by torchao's stochastic-rounding AdamW, the
    memory-saving mode), computing in `dtype`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    attn = attention_implementation(attn, device)  # registers varlen with transformers
    layer_mode = layers.resolve(layer_mode, device)
    master_dtype = precision.master_dtype(master) if dtype != torch.float32 else torch.float32
    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, rope_theta=1e6, attn_implementation=attn)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(master_dtype)
    model.train()
    layers.fuse(model, layer_mode)  # as the trainer does: Liger first, then recompute, then compilation
    if checkpointing:  # activations of one layer at a time: what RL trainers run 1.5B+ models with
        enable_checkpointing(model)
    layers.compile_layers(model, layer_mode)
    optimizer = precision.make_optimizer(list(model.parameters()), "adamw", 1e-6, (0.9, 0.999), 0.0, master_dtype)
    settings = MemberSettings(name=f"qwen2.5-{shape}", model="benchmark")
    return Member(0, settings, model, None, optimizer, None, device, dtype)


def batch(vocab: int, sequences: int, prompt_len: int, completion_len: int, seed: int = 0) -> list[TrainItem]:
    g = torch.Generator().manual_seed(seed)
    items = []
    for i in range(sequences):
        prompt = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
        ids = torch.randint(0, vocab, (completion_len,), generator=g, dtype=torch.int32)
        rollout = Rollout(i % 2, i, ids, -torch.rand(completion_len, generator=g) * 5, float(i % 2), "length", 0)
        items.append(TrainItem(rollout, prompt, float(torch.randn(1, generator=g)), i // 4))
    return items


def logits_path_loss(member: Member, packed) -> torch.Tensor:
    """The model's own logits for the packed row, log_softmax, the same F-TIS objective."""
    device = member.device
    with member.autocast():
        out = member.model(input_ids=packed.input_ids[None].to(device),
                           position_ids=packed.position_ids[None].to(device), use_cache=False)
    logits = out.logits[0, packed.target_rows.to(device)].float() / CONFIG.temperature
    logp = torch.log_softmax(logits, -1)
    token = logp.gather(1, packed.targets[:, None].to(device)).squeeze(1)
    counted = torch.ones_like(token, dtype=torch.bool)
    inputs = LossInputs(packed.targets.to(device), packed.gen_logprobs.to(device), packed.advantages.to(device),
                        packed.cu_seqlens.to(device))
    loss, _, _ = ftis_objective(token, torch.zeros_like(token), counted, inputs, CONFIG)
    return loss


def update(member: Member, packed, path: str) -> None:
    member.optimizer.zero_grad(set_to_none=True)
    if path == "fused":
        loss = batch_loss(member, packed, CONFIG, backend="auto").loss
    else:
        loss = logits_path_loss(member, packed)
    loss.backward()
    member.optimizer.step()


MFU_COUNT = ("6 x the body's parameters x input tokens + 6 V d x the rows the head runs on (fused path: the completion "
             "tokens; logits path: every input token) + attention 12 L d x mean context per token")


def model_flops(hf_config, parameters: int, tokens: int, head_rows: int, context: int) -> float:
    """Model FLOPs of one update (forward and backward, 6 per parameter and row): the body's matmuls over the `tokens`
    input tokens (`parameters` less the embedding and the head: a lookup is not a matmul), the head's V x d matmul
    over the `head_rows` rows it runs on, and causal attention 12 L d `context` (the mean context) per token."""
    head = hf_config.vocab_size * hf_config.hidden_size
    body = parameters - head * (1 if hf_config.tie_word_embeddings else 2)  # the tied matrix is one parameter
    attention = 12 * hf_config.num_hidden_layers * hf_config.hidden_size * context
    return (6 * body + attention) * tokens + 6 * head * head_rows


def head_rows(path: str, tokens: int, completion_tokens: int) -> int:
    """Rows the lm_head runs on: the completion tokens on the fused path (the fused loss takes the hidden states
    of the rows that predict a completion token), every input token on the logits path (the model's logits)."""
    return completion_tokens if path == "fused" else tokens


def measure(shape: str, path: str, attn: str, layer_mode: str, args, device, dtype, peak_tflops: float | None,
            master: str = "float32") -> dict:
    row = {"model": shape, "attention": attn, "layers": layer_mode, "path": path, "sequences": args.sequences,
           "precision": f"{master} masters, {str(dtype).removeprefix('torch.')} compute",
           "prompt_len": args.prompt_len, "completion_len": args.completion_len, "checkpointing": args.checkpointing}
    try:
        member = build(shape, device, dtype, attn, args.checkpointing, layer_mode, master)
        packed = pack(batch(member.model.config.vocab_size, args.sequences, args.prompt_len, args.completion_len))
        tokens = packed.input_ids.numel()
        start = time.perf_counter()
        update(member, packed, path)  # warm-up (optimizer state; torch.compile compiles here)
        if device.type == "cuda":
            torch.cuda.synchronize()
        row["first_update_s"] = time.perf_counter() - start
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            update(member, packed, path)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        if args.profile and device.type == "cuda":  # where one update's GPU time goes, by kernel
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                update(member, packed, path)
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.profile)
            print(f"profile {shape} {path}:\n{table}", flush=True)
            row["profile"] = table
        row.update(tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds)
        parameters = sum(p.numel() for p in member.model.parameters())
        flops = model_flops(member.model.config, parameters, tokens, head_rows(path, tokens, packed.targets.numel()),
                            (args.prompt_len + args.completion_len) // 2)
        row["achieved_tflops"] = flops / seconds / 1e12
        row["mfu_count"] = MFU_COUNT
        if peak_tflops:
            row["mfu"] = row["achieved_tflops"] / peak_tflops
        if device.type == "cuda":
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    except torch.OutOfMemoryError:
        row["skipped"] = "out of memory"
    except Exception as exc:  # one configuration that cannot run (a missing package, a compile error) is reported
        if args.strict:
            raise
        row["skipped"] = f"{type(exc).__name__}: {first_line(exc)}"
    finally:
        member = packed = None  # free this model before the next one is built
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", nargs="*", default=["1.5b", "3b"], choices=list(SHAPES))
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--completion-len", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--attn", nargs="+", default=["sdpa"], choices=[a for a in ATTENTION if a != "auto"])
    parser.add_argument("--layers", nargs="+", default=["eager"], choices=LAYERS,
                        help="how the decoder layers run (train.layers): each one is measured")
    parser.add_argument("--paths", nargs="+", default=["fused", "logits"], choices=["fused", "logits"])
    parser.add_argument("--masters", nargs="+", default=["float32"], choices=["float32", "bfloat16"],
                        help="what the parameters are held in on a GPU: float32 masters under bf16 autocast (the "
                             "trainer's default) and/or bfloat16 (members.N.master_dtype=bfloat16: torchao's AdamW)")
    parser.add_argument("--strict", action="store_true", help="stop at the first configuration that fails")
    parser.add_argument("--update-step", type=pathlib.Path, default=None,
                        help="merge the runs into this JSON list (default on a GPU: update_step.json beside --output)")
    parser.add_argument("--profile", type=int, default=0, metavar="K",
                        help="also profile one update and print its K most expensive GPU kernels")
    parser.add_argument("--no-checkpointing", dest="checkpointing", action="store_false",
                        help="keep every layer's activations (default: gradient checkpointing, as RL trainers run)")
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="the device's dense bf16 peak for MFU (H100/H200 SXM: 989)")
    parser.add_argument("--output", type=pathlib.Path, default=RESULTS / "update")
    parser.add_argument("--recount", type=pathlib.Path, default=None, metavar="FILE",
                        help="measure nothing: recount the MFU of every record of an update_step.json FILE from its "
                             "timings with today's FLOP count (model_flops), in place")
    args = parser.parse_args(argv)
    if args.recount is not None:
        return recount_update_step(args.recount)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.quick:
        args.models, args.sequences, args.prompt_len, args.completion_len, args.repeats = ["tiny"], 4, 16, 24, 2
    peak = args.peak_tflops if device.type == "cuda" else None
    meta = {"command": "python benchmarks/update.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "cpus": os.cpu_count(), "peak_tflops": peak}
    target = args.update_step or (args.output.parent / "update_step.json" if device.type == "cuda" else None)
    rows = []
    masters = args.masters if device.type == "cuda" else ["float32"]
    for shape in args.models:
        for master in masters:
            for attn in args.attn:
                for layer_mode in args.layers:
                    for path in args.paths:
                        rows.append(measure(shape, path, attn, layer_mode, args, device, dtype, peak, master))
                        print(json.dumps({k: v for k, v in rows[-1].items() if k != "profile"}), flush=True)
                        if target is not None:  # after every run: a call stopped at its limit keeps what it measured
                            merge_update_step(target, rows[-1:], meta)
    lines = [("| model | precision | attention | layers | path | tokens | tokens/s | achieved TFLOP/s | MFU | peak GiB | "
              "first update s | speed vs logits | memory vs logits |"), "|---" * 13 + "|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['model']} | {r['precision']} | {r['attention']} | {r['layers']} | {r['path']} | "
                         f"skipped: {r['skipped']} | | | | | | | |")
            continue
        other = next((o for o in rows if o["model"] == r["model"] and o["attention"] == r["attention"]
                      and o["precision"] == r["precision"]
                      and o["layers"] == r["layers"] and o["path"] == "logits" and "seconds" in o), None)
        speed = f"{other['seconds'] / r['seconds']:.2f}x" if other else "n/a"
        mem = f"{r['peak_gib'] / other['peak_gib']:.2f}" if other and "peak_gib" in r else "n/a"
        mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "n/a"
        peak_gib = f"{r['peak_gib']:.1f}" if "peak_gib" in r else "n/a"
        lines.append(f"| {r['model']} | {r['precision']} | {r['attention']} | {r['layers']} | {r['path']} | {r['tokens']} | "
                     f"{r['tokens_per_s']:,.0f} | {r['achieved_tflops']:.2f} | {mfu} | {peak_gib} | "
                     f"{r['first_update_s']:.1f} | {speed} | {mem} |")
    table = "\n".join(lines)
    print(table)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    args.output.with_suffix(".md").write_text(f"`{meta['command']}` on {meta['device']}\n\n{table}\n")
    return rows


KEY = ("device", "model", "precision", "attention", "layers", "path", "sequences", "prompt_len", "completion_len",
       "checkpointing")


def merge_update_step(path: pathlib.Path, rows: list[dict], meta: dict) -> list[dict]:
    """Merge measured runs into the JSON list at `path`: one object per run with the device, torch version, peak
    TFLOP/s and command beside the row (profiles left out); a run with the same key replaces the older one."""
    records = json.loads(path.read_text()) if path.is_file() else []
    new = [{"device": meta["device"], "torch": meta["torch"], "peak_tflops": meta["peak_tflops"],
            "command": meta["command"], **{k: v for k, v in r.items() if k != "profile"}}
           for r in rows if "skipped" not in r]
    keys = {tuple(r.get(k) for k in KEY) for r in new}
    records = [r for r in records if tuple(r.get(k) for k in KEY) not in keys] + new
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, indent=2) + "\n")
    return records


def shape_parameters(shape: str) -> int:
    """The parameter count of a SHAPES model (built on the meta device: no memory, no time)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in Qwen2ForCausalLM(Qwen2Config(**SHAPES[shape])).parameters())


def recount_update_step(path: pathlib.Path) -> list[dict]:
    """Recount achieved_tflops and mfu of every measured record of an update_step.json from its own timings (seconds)
    and batch (sequences, prompt_len, completion_len, path) with model_flops; a record counted another way keeps the
    value it was first published with as mfu_before_recount, and mfu_count says how the mfu now in it was counted."""
    from transformers import Qwen2Config

    records = json.loads(path.read_text())
    for r in records:
        if not r.get("seconds") or r.get("model") not in SHAPES:  # nothing timed, or a shape this file lacks
            continue
        config = Qwen2Config(**SHAPES[r["model"]])
        rows = head_rows(r["path"], r["tokens"], r["sequences"] * r["completion_len"])
        flops = model_flops(config, shape_parameters(r["model"]), r["tokens"], rows,
                            (r["prompt_len"] + r["completion_len"]) // 2)
        tflops = flops / r["seconds"] / 1e12
        mfu = tflops / r["peak_tflops"] if r.get("peak_tflops") else None
        if mfu is not None and "mfu" in r and abs(mfu - r["mfu"]) > 1e-9:
            r.setdefault("mfu_before_recount", r["mfu"])
        r["achieved_tflops"] = tflops
        if mfu is not None:
            r["mfu"] = mfu
        r["mfu_count"] = MFU_COUNT
    path.write_text(json.dumps(records, indent=2) + "\n")
    return records


if __name__ == "__main__":
    main()
