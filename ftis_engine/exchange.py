"""Rollout exchange between members, and the receiving side's checks (peers' rollouts are untrusted input).

`share(buffers, limits)` takes the wire buffers of the members this process holds and returns each of them its
inbox: sender -> buffer, its own included. LocalExchange: all members in one process. DistributedExchange: one
member per process over torch.distributed. Alone: members train on their own rollouts only (the paper's
baseline): an exchange whose inbox holds one's own buffer. Whatever the transport, a receiver decodes, validates
and re-scores each peer's rollouts; a bad batch is dropped whole, with one warning naming the peer, and counted
in the metrics.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from .rollouts import Rollout, RolloutError, decode, validate
from .tasks import Task

log = logging.getLogger("ftis_engine.exchange")


@dataclass
class Delivery:
    """What one share() brought: each local member's inbox, and what it cost."""

    inbox: dict[int, dict[int, torch.Tensor]]  # receiver -> {sender: wire buffer}, the receiver's own included
    sent_bytes: dict[int, int]  # local member -> bytes of its buffer that went to peers (0: nobody received it)
    wait_seconds: float = 0.0  # waiting for the slowest peer to be ready (not the exchange's own cost)
    seconds: float = 0.0  # the transfer itself


class Exchange(Protocol):
    """How the members of a run talk: rollouts each step, and the few collectives the loop needs."""

    rank: int
    world_size: int

    def share(self, buffers: dict[int, torch.Tensor], limits: dict[int, int]) -> Delivery: ...

    def barrier(self) -> None: ...

    def all_agree(self, value: int) -> int: ...

    def gather_records(self, records: list[dict]) -> list[dict]: ...

    def all_gather_object(self, value: object) -> list: ...

    def close(self) -> None: ...


class LocalExchange:
    """All members live in this process: every buffer is already here."""

    world_size = 1
    rank = 0

    def share(self, buffers: dict[int, torch.Tensor], limits: dict[int, int]) -> Delivery:
        inbox = {receiver: dict(buffers) for receiver in buffers}
        sent = {m: 4 * b.numel() if len(buffers) > 1 else 0 for m, b in buffers.items()}
        return Delivery(inbox, sent)

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


class Alone:
    """collaboration: alone. Every member's inbox holds its own rollouts only; nothing goes on the wire, nobody
    waits. The other collectives (checkpoints, records) still go through the transport underneath."""

    def __init__(self, transport: Exchange):
        self.transport = transport
        self.rank = transport.rank
        self.world_size = transport.world_size

    def share(self, buffers: dict[int, torch.Tensor], limits: dict[int, int]) -> Delivery:
        return Delivery({m: {m: b} for m, b in buffers.items()}, {m: 0 for m in buffers})

    def barrier(self) -> None:
        self.transport.barrier()

    def all_agree(self, value: int) -> int:
        return self.transport.all_agree(value)

    def gather_records(self, records: list[dict]) -> list[dict]:
        return self.transport.gather_records(records)

    def all_gather_object(self, value) -> list:
        return self.transport.all_gather_object(value)

    def close(self) -> None:
        self.transport.close()


class RolloutChecker:
    """What a receiver needs to check and re-score a peer's rollouts (built once per member)."""

    def __init__(self, task: Task, tokenizer, vocab_size: int, max_new_tokens: int):
        self.task = task
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_new_tokens = max_new_tokens
        self.seen: set[tuple[int, int]] = set()  # async: (sender rank, step) of every parcel met (no replays)

    def accept(self, buffer: torch.Tensor, sender: int, dealt: dict[int, int] | None) -> list[Rollout]:
        """Decode and validate a peer's buffer, re-score every rollout; raise RolloutError on any problem.
        dealt: prompt index -> completions the sender was dealt this step (None: not checked)."""
        return self.check(decode(buffer), sender, dealt)

    def check(self, rollouts: list[Rollout], sender: int, dealt: dict[int, int] | None) -> list[Rollout]:
        """`accept` for rollouts already decoded."""
        validate(rollouts, sender=sender, vocab_size=self.vocab_size, max_new_tokens=self.max_new_tokens,
                 expected=dealt, num_prompts=len(self.task.train))
        try:
            local = self.task.score(self.tokenizer, [r.completion_ids for r in rollouts],
                                    [self.task.train[r.prompt_index] for r in rollouts])
        except Exception as exc:  # ids the tokenizer cannot decode, or a reward that fails on this text
            raise RolloutError(f"cannot score the completions: {exc}") from None
        for i, (rollout, reward) in enumerate(zip(rollouts, local)):
            if abs(reward - rollout.reward) > 1e-6:
                raise RolloutError(f"sequence {i}: claims reward {rollout.reward:g}, re-scored {reward:g}")
        return rollouts


@dataclass
class Received:
    rollouts: list[Rollout]
    rejected: list[tuple[int, str]]  # (sender, reason)


def receive(inbox: dict[int, torch.Tensor], receiver: int, own: list[Rollout], checker: RolloutChecker,
            dealt: dict[int, dict[int, int]], names: list[str]) -> Received:
    """The receiver's training rollouts: its own (trusted) plus every peer batch in its inbox that passes the
    checks. dealt: member -> {prompt index: completions} of this step."""
    accepted = list(own)
    rejected = []
    for sender in sorted(inbox):
        if sender == receiver:
            continue
        try:
            accepted.extend(checker.accept(inbox[sender], sender, dealt.get(sender)))
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

    def share(self, buffers: dict[int, torch.Tensor], limits: dict[int, int]) -> Delivery:
        """limits: member -> the most words an honest buffer of theirs can hold this step. A size announced
        outside [1, limit] is never received (every rank sees the same sizes and skips that broadcast alike)
        and comes back as an empty buffer, which the receiver's checks reject."""
        start = time.perf_counter()
        self.barrier()  # waiting for slower peers is not the exchange's cost: time it apart
        waited = time.perf_counter() - start
        received = self._transfer(buffers[self.rank], limits)
        seconds = time.perf_counter() - start - waited
        return Delivery({self.rank: received}, {self.rank: 4 * buffers[self.rank].numel()}, waited, seconds)

    def _transfer(self, buffer: torch.Tensor, limits: dict[int, int]) -> dict[int, torch.Tensor]:
        import torch.distributed as dist

        own = buffer.to(self.device, torch.int32).contiguous()
        sizes = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([own.numel()], dtype=torch.int64, device=self.device))
        received = {}
        for src, size in enumerate(int(s.item()) for s in sizes):
            limit = limits.get(src)
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
