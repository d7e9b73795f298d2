"""The GPU memory of issue 67's runs, worked out before a GPU is lent: what each member's training takes
(ftis_engine.run.preflight.training_bytes, the start-up memory plan's own estimate, plus a process's overhead) and what
its vLLM engine needs when its KV cache is sized from the run (members.N.vllm.kv_cache_gib: keys and values of the
member's completions of a step at the engine's full length, ftis_engine.generation.engine_weights.kv_cache_bytes),
against an H100's 80 GB and an H200's 141 GB, for the configs benchmarks/run_pair_gpu.sh runs.

    python benchmarks/pair_plan.py [--config C --set K=V ...]     # the table (default: the three runs below)
    python benchmarks/pair_plan.py --config C --kv                # each vLLM member's KV need, in GiB

An engine's need: its weights in the engine's dtype, the KV cache, and ENGINE_OVERHEAD (the profile run's
activations, CUDA graphs, the sampler's buffers: an assumption, not a measurement). Preflight's own check
(check_memory_plan) counts each engine as its gpu_memory_utilization share of the GPU instead, whatever
kv_cache_gib says: the table gives that count too, and whether preflight lets the run start.
"""

from __future__ import annotations

import argparse
import dataclasses
import types

import torch

GIB = 1 << 30
# what torch reports as the GPU's total memory: an H100 80GB HBM3 (79.2 GiB) and an H200 (143,771 MiB)
GPUS = {"H100 80GB": 79.2 * GIB, "H200 141GB": 143_771 * (1 << 20)}
ENGINE_OVERHEAD = 2 * GIB
# the runs of benchmarks/run_pair_gpu.sh (its stages pair-sync, alone; TRL's engine is sized as ours alone's)
RUNS = {
    "pair, bf16 masters (the config)": ("configs/gpu/pair-shapes.yaml", ()),
    "pair, float32 masters (run_pair_gpu.sh on >= 120 GiB)": (
        "configs/gpu/pair-shapes.yaml", ("members.0.master_dtype=float32", "members.1.master_dtype=float32")),
    "ours alone (and TRL's engine)": ("configs/gpu/alone-shape-1.5b.yaml", ()),
}


@dataclasses.dataclass(frozen=True)
class MemberPlan:
    name: str
    training: int  # bytes: training_bytes + a process's overhead
    engine_weights: int  # 0 without a vLLM engine
    kv_cache: int  # what the run needs (kv_cache_bytes), whatever kv_cache_gib says
    share: float  # the engine's gpu_memory_utilization (0 without one)

    @property
    def engine(self) -> int:
        return self.engine_weights + self.kv_cache + ENGINE_OVERHEAD if self.engine_weights else 0


def completions_a_step(config, index: int) -> int:
    """The completions member `index` generates in a step (its deal), or its eval's greedy ones if more."""
    from ftis_engine.topology.schedule import deal

    rollout = config.rollout
    dealt = deal(list(range(rollout.prompts_per_step)), index, len(config.members), config.collaboration,
                 rollout.group_size)
    return max(sum(dealt.values()), config.eval.max_samples or 0)


def kv_need(config, index: int) -> int:
    """Bytes of KV cache member `index`'s engine needs: kv_cache_bytes at the engine's length (data.max_prompt_tokens
    + the longest completion) for a step's completions."""
    from ftis_engine.data.context import engine_length
    from ftis_engine.generation.engine_weights import kv_cache_bytes
    from ftis_engine.generation.vllm import ENGINE_DTYPES
    from ftis_engine.run.preflight import model_shape

    member = config.members[index]
    shape = types.SimpleNamespace(**model_shape(member.model))
    return kv_cache_bytes(shape, ENGINE_DTYPES[member.vllm.dtype], engine_length(config, member),
                          completions_a_step(config, index))


def member_plan(config, index: int) -> MemberPlan:
    from ftis_engine.generation.vllm import ENGINE_DTYPES
    from ftis_engine.run.preflight import PROCESS_OVERHEAD_BYTES, model_shape, parameter_counts, training_bytes

    member = config.members[index]
    shape = model_shape(member.model)
    training = training_bytes(config, index, shape) + PROCESS_OVERHEAD_BYTES
    if member.generator != "vllm":
        return MemberPlan(member.name, training, 0, 0, 0.0)
    weights = parameter_counts(shape, None)[0] * ENGINE_DTYPES[member.vllm.dtype].itemsize
    return MemberPlan(member.name, training, weights, kv_need(config, index), member.vllm.gpu_memory_utilization)


def gib(n: float) -> str:
    return f"{n / GIB:.1f}"


def table(runs: dict[str, tuple[str, tuple[str, ...]]]) -> str:
    """One row per run and GPU: each member's training and engine need, their sum against the GPU, and preflight's
    count (engines as their gpu_memory_utilization share)."""
    from ftis_engine.config import load_config

    lines = [("| run | members: training + engine (weights + KV cache + overhead), GiB | GPU | need, GiB | fits | "
              "preflight counts, GiB | preflight lets it start |"), "| --- | --- | --- | ---: | --- | ---: | --- |"]
    for label, (path, sets) in runs.items():
        config = load_config(path, list(sets))
        plans = [member_plan(config, i) for i in range(len(config.members))]
        parts = "; ".join(f"{p.name} {gib(p.training)} + {gib(p.engine)} ({gib(p.engine_weights)} + "
                          f"{gib(p.kv_cache)} + {gib(ENGINE_OVERHEAD if p.engine else 0)})" for p in plans)
        for gpu, capacity in GPUS.items():
            need = sum(p.training + p.engine for p in plans)
            counted = sum(p.training + p.share * capacity for p in plans)
            lines.append(f"| {label} | {parts} | {gpu} | {gib(need)} | {'yes' if need <= capacity else '**no**'} | "
                         f"{gib(counted)} | {'yes' if counted <= capacity else 'no'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="one config (default: the runs of run_pair_gpu.sh)")
    parser.add_argument("--set", action="append", default=[], dest="sets", help="KEY=VALUE override")
    parser.add_argument("--kv", action="store_true", help="print each vLLM member's KV need in GiB, one a line")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.kv:
        from ftis_engine.config import load_config

        config = load_config(args.config, args.sets)
        for i, member in enumerate(config.members):
            if member.generator == "vllm":
                print(f"members.{i}.vllm.kv_cache_gib={kv_need(config, i) / GIB:g}")
        return 0
    print(table({args.config: (args.config, tuple(args.sets))} if args.config else RUNS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
