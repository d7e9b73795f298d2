"""One rank of tests/test_placement.py's equivalence check (gloo, started like torchrun).

Every rank builds the same member and the same batch; rank 0 also steps an unsharded twin on the whole batch.
Then the member is sharded over all ranks (members.shard_member, over fsdp.py) and steps on the same batch; rank 0 writes the
largest difference between the two updated models (and the two steps' loss and stats) to the JSON file given.
"""

from __future__ import annotations

import functools
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ftis_engine.model import layers
from ftis_engine.member.members import build_member, shard_member
from ftis_engine.run.preflight import check_members
from ftis_engine.model.fsdp import Shard, full, full_state_dict
from ftis_engine.model.update import accumulate_gradients, update_member
from tests.helpers import random_items, short_config


def one_case(index: int, method: str, out: dict, layer_mode: str = "eager", dtype: str = "float32") -> None:
    """The sharded member runs its layers as `layer_mode` says (train.layers); the unsharded twin runs them eagerly.
    Both compute in `dtype` (bfloat16: autocast on the twin, FSDP2's MixedPrecisionPolicy on the shards)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = short_config(f"algorithm.method={method}", "train.micro_batch_tokens=40", f"members.{index}.dtype={dtype}")
    tokenizer = check_members(cfg, members=[index])[index]
    loss_config = cfg.algorithm.loss_config(cfg.rollout.temperature)
    group = dist.new_group(list(range(world)), backend="gloo")
    shard = Shard(rank, world, list(range(world)), group, group)
    member = build_member(index, cfg.model_copy(update={"train": cfg.train.model_copy(update={"layers": layer_mode})}),
                          tokenizer, torch.device("cpu"), sharded=True)
    items = random_items(member.vocab_size, n_groups=5, per_group=3, seed=7)  # uneven groups over the ranks
    budget = cfg.train.micro_batch_tokens
    twin = None
    if rank == 0:
        twin = build_member(index, cfg, tokenizer, torch.device("cpu"))
        accumulate_gradients(twin, items, loss_config, budget, "torch")
        twin_grads = {n: p.grad.clone() for n, p in twin.model.named_parameters() if p.requires_grad}
        before = {n: p.detach().clone() for n, p in twin.model.named_parameters() if p.requires_grad}
        twin_stats = update_member(twin, items, loss_config, budget, "torch")
    shard_member(member, shard, cfg)
    accumulate_gradients(member, items, loss_config, budget, "torch")
    grads = {n: full(p.grad).clone() for n, p in member.model.named_parameters() if p.requires_grad}
    stats = update_member(member, items, loss_config, budget, "torch")
    for seed in (8, 9):  # two more steps on other batches: the optimizer's state must carry over alike
        more = random_items(member.vocab_size, n_groups=4, per_group=3, seed=seed)
        update_member(member, more, loss_config, budget, "torch")
        if rank == 0:
            update_member(twin, more, loss_config, budget, "torch")
    state = full_state_dict(member.model, keep=rank == 0)
    if rank == 0:
        reference = twin.model.state_dict()
        scale = max(float(g.abs().max()) for g in twin_grads.values())
        name = f"{index}-{method}" + ("" if layer_mode == "eager" else f"-{layer_mode}")
        out[name + ("" if dtype == "float32" else "-bf16")] = {
            "compiled": layers.compiled(member.model),
            "grad_rel_diff": max(float((grads[n] - g).abs().max()) for n, g in twin_grads.items()) / scale,
            "master_dtypes": sorted({str(p.dtype) for p in member.trainable_parameters()}),
            "weight_diff": max(float((state[k] - reference[k]).abs().max()) for k in reference),
            "moved": max(float((reference[n] - before[n]).abs().max()) for n in before),
            "moved_rel_diff": float(torch.cat([(state[n] - reference[n]).flatten() for n in before]).norm()
                                    / torch.cat([(reference[n] - before[n]).flatten() for n in before]).norm()),
            "trained": len(twin_grads), "lr": cfg.members[index].lr,
            "stats": {k: [stats[k], twin_stats[k]] for k in ("loss", "grad_norm", "is_weight_mean", "filtered_frac")},
        }


def main() -> None:
    dist.init_process_group("gloo")
    out: dict = {}
    for index, method in [(0, "f-tis"), (1, "f-tis"), (0, "gepo")]:  # full, LoRA, whole groups (GEPO)
        one_case(index, method, out)
    for index in (0, 1):  # the GPU's precision: bf16 compute, float32 masters (a LoRA member's base in bf16)
        one_case(index, "f-tis", out, dtype="bfloat16")
    # compiled layers under FSDP2 (torch.compile's aot_eager backend: the same graph capture, no inductor codegen)
    layers._compiled = functools.cache(lambda forward: torch.compile(forward, backend="aot_eager"))
    one_case(0, "f-tis", out, "compile")
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
