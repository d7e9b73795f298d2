"""Rollout exchange between members, and the receiving side's checks (peers' rollouts are untrusted input).

`share(buffers)` takes the wire buffers of the members this process holds and returns every member's buffer.
LocalExchange: all members in one process. DistributedExchange: one member per process over
torch.distributed. Whatever the transport, a receiver decodes, validates and re-scores each peer's rollouts; a
bad batch is dropped whole, with one warning naming the peer, and counted in the metrics.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from .rollouts import Rollout, RolloutError, decode, validate

log = logging.getLogger("ftis_engine.exchange")


class LocalExchange:
    """All members live in this process: every buffer is already here."""

    world_size = 1
    rank = 0

    def share(self, buffers: dict[int, torch.Tensor], limits: dict[int, int] | None = None) -> dict[int, torch.Tensor]:
        return dict(buffers)

    def barrier(self) -> None:
        """Nothing to wait for: every member is in this process."""

    def all_agree(self, value: int) -> int:
        return value

    def gather_records(self, records: list[dict]) -> list[dict]:
        return records

    def all_gather_object(self, value) -> list:
        return [value]

    def close(self) -> None:
        """No process group to tear down."""


@dataclass
class RolloutChecker:
    """What a receiver needs to check and re-score a peer's rollouts."""

    tokenizer: object
    reward: object  # (completion text, gold) -> float
    golds: list[str]  # gold answer of every training prompt, by prompt index
    vocab_size: int
    max_new_tokens: int
    dealt: dict[int, dict[int, int]] = field(default_factory=dict)  # member -> {prompt index: completions}

    def score(self, rollout: Rollout) -> float:
        try:
            text = self.tokenizer.decode(rollout.completion_ids.tolist(), skip_special_tokens=True)
        except Exception as exc:  # ids the tokenizer cannot decode
            raise RolloutError(f"cannot decode completion: {exc}") from None
        return float(self.reward(text, self.golds[rollout.prompt_index]))

    def accept(self, buffer: torch.Tensor, sender: int) -> list[Rollout]:
        """Decode and validate a peer's buffer, re-score every rollout; raise RolloutError on any problem."""
        rollouts = decode(buffer)
        validate(rollouts, sender=sender, vocab_size=self.vocab_size, max_new_tokens=self.max_new_tokens,
                 expected=self.dealt.get(sender), num_prompts=len(self.golds))
        for i, rollout in enumerate(rollouts):
            local = self.score(rollout)
            if abs(local - rollout.reward) > 1e-6:
                raise RolloutError(f"sequence {i}: claims reward {rollout.reward:g}, re-scored {local:g}")
        return rollouts


@dataclass
class Received:
    rollouts: list[Rollout]
    rejected: list[tuple[int, str]]  # (sender, reason)


def receive(buffers: dict[int, torch.Tensor], receiver: int, own: list[Rollout], checker: RolloutChecker,
            names: list[str]) -> Received:
    """The receiver's training rollouts: its own (trusted) plus every peer batch that passes the checks."""
    accepted = list(own)
    rejected = []
    for sender in sorted(buffers):
        if sender == receiver:
            continue
        try:
            accepted.extend(checker.accept(buffers[sender], sender))
        except RolloutError as exc:
            rejected.append((sender, str(exc)))
            log.warning("%s: dropped the rollouts of peer %s (member %d): %s", names[receiver], names[sender], sender,
                        exc)
    return Received(accepted, rejected)


class DistributedExchange:
    """One member per process over torch.distributed (NCCL between GPUs, gloo on CPU).

    share(): every rank's buffer size is all-gathered first (one int64 each), then each rank broadcasts its own
    packed buffer, exactly its size: no padding to a common length goes on the wire. Every collective runs
    under the process group's timeout (swarm.timeout_s), so a dead or hung peer raises instead of blocking.
    """

    def __init__(self, rank: int, world_size: int, device: torch.device, backend: str):
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        # NCCL moves device tensors only; gloo works on CPU tensors.
        self.device = device if backend == "nccl" else torch.device("cpu")

    def share(self, buffers: dict[int, torch.Tensor], limits: dict[int, int] | None = None) -> dict[int, torch.Tensor]:
        """limits: member -> the most words an honest buffer of theirs can hold this step. A size announced
        outside [1, limit] is never received (every rank sees the same sizes and skips that broadcast alike)
        and comes back as an empty buffer, which the receiver's checks reject."""
        import torch.distributed as dist

        own = buffers[self.rank].to(self.device, torch.int32).contiguous()
        sizes = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([own.numel()], dtype=torch.int64, device=self.device))
        received = {}
        for src, size in enumerate(int(s.item()) for s in sizes):
            limit = (limits or {}).get(src)
            if size < 1 or (limit is not None and size > limit):
                received[src] = torch.zeros(0, dtype=torch.int32)
                continue
            tensor = own if src == self.rank else torch.empty(size, dtype=torch.int32, device=self.device)
            dist.broadcast(tensor, src=src)
            received[src] = tensor.cpu()
        return received

    def barrier(self) -> None:
        import torch.distributed as dist

        if self.backend == "gloo":
            dist.monitored_barrier(wait_all_ranks=True)  # names the ranks that did not arrive
        else:
            dist.barrier()

    def all_agree(self, value: int) -> int:
        """The minimum of every rank's value (e.g. the newest checkpoint step that all ranks have)."""
        import torch.distributed as dist

        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor.item())

    def gather_records(self, records: list[dict]) -> list[dict]:
        import torch.distributed as dist

        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, records)
        return [r for part in gathered for r in part]

    def all_gather_object(self, value) -> list:
        import torch.distributed as dist

        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, value)
        return gathered

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
