"""Sync transports: every member waits for every member each step (the F-TIS paper's setting).

DistributedSync sends a step's buffers with collectives: every rank's buffer size is all-gathered first (one int64
each), then each rank broadcasts its own packed buffer, exactly its size (no padding on the wire). A size outside
[1, limit] is never received: every rank sees the same sizes and skips that broadcast alike, and the receiver
gets the parcel marked refused. Every collective runs under the process group's timeout (swarm.timeout_s), so a
dead or hung peer raises instead of blocking: PeerLost, named at the collective (exchange.collective).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..topology.schedule import learner_version
from . import Arrivals, Limit, Parcel, WeightSlot, WithoutSamplers, collective, wire_bytes_sent


class LocalCollectives:
    """Every member is in this process: nothing to wait for or gather."""

    rank = 0
    world_size = 1

    def barrier(self) -> None:
        """Nobody to wait for."""

    def all_agree(self, value: int) -> int:
        return value

    def gather_records(self, records: list[dict]) -> list[dict]:
        return records

    def all_gather_object(self, value) -> list:
        return [value]

    def close(self) -> None:
        """No process group to tear down."""


class Collectives:
    """The default process group's collectives that a run's start and its checkpoints need (both modes)."""

    def __init__(self, rank: int, world_size: int, device: torch.device, backend: str):
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.device = device if backend == "nccl" else torch.device("cpu")  # NCCL moves device tensors only

    def barrier(self) -> None:
        with collective("barrier"):
            if self.backend == "gloo":
                dist.monitored_barrier(wait_all_ranks=True)  # names the ranks that did not arrive
            else:
                dist.barrier()

    def all_agree(self, value: int) -> int:
        """The minimum of every rank's value (e.g. the newest checkpoint step that all ranks have)."""
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        with collective("all_reduce"):
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor.item())

    def gather_records(self, records: list[dict]) -> list[dict]:
        return [r for part in self.all_gather_object(records) for r in part]

    def all_gather_object(self, value) -> list:
        gathered: list = [None] * self.world_size
        with collective("all_gather_object"):
            dist.all_gather_object(gathered, value)
        return gathered

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class DistributedSync(WithoutSamplers):
    """One member per endpoint over torch.distributed (NCCL between GPUs, gloo on CPU). `group` holds just the
    endpoints, its ranks numbered as they are (layout.py), when members have further ranks (None: every process
    is an endpoint and its rank is its endpoint)."""


    def __init__(self, collectives: Collectives, endpoint: int | None = None, group=None,
                 endpoints: int | None = None):
        self.collectives = collectives
        self.rank = collectives.rank if endpoint is None else endpoint
        self.world_size = endpoints or collectives.world_size
        self.group = group
        self._limit: Limit | None = None
        self._arrivals = Arrivals()

    def start(self, limit: Limit, start_step: int = 0, weights: WeightSlot | None = None) -> None:
        self._limit = limit

    def send(self, buffers: dict[int, torch.Tensor], step: int) -> dict[int, int]:
        """Wait for every peer (timed apart: waiting for a slower peer is not the exchange's cost), then transfer."""
        start = time.perf_counter()
        if self.group is None:
            self.collectives.barrier()
        else:
            with collective("the endpoints' barrier"):
                if self.collectives.backend == "gloo":
                    dist.monitored_barrier(group=self.group, wait_all_ranks=True)
                else:
                    dist.barrier(group=self.group)
        waited = time.perf_counter() - start
        buffer = buffers[self.rank]
        parcels = self._transfer(buffer, step)
        self._arrivals = Arrivals(parcels, wait_seconds=waited, seconds=time.perf_counter() - start - waited)
        return {self.rank: wire_bytes_sent(buffer, self.world_size - 1)}

    def _transfer(self, buffer: torch.Tensor, step: int) -> list[Parcel]:
        device = self.collectives.device
        own = buffer.to(device, torch.int32).contiguous()
        sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(self.world_size)]
        with collective(f"step {step}: all_gather of the parcels' sizes"):
            dist.all_gather(sizes, torch.tensor([own.numel()], dtype=torch.int64, device=device), group=self.group)
        parcels = []
        for src, size in enumerate(int(s.item()) for s in sizes):
            limit = self._limit(src, step) if self._limit is not None else size
            if not 1 <= size <= limit:
                if src != self.rank:
                    parcels.append(Parcel(src, step, learner_version(step), torch.zeros(0, dtype=torch.int32),
                                          refused=f"{size} words announced, an honest parcel holds 1..{limit}"))
                continue
            tensor = own if src == self.rank else torch.empty(size, dtype=torch.int32, device=device)
            with collective(f"step {step}: broadcast of endpoint {src}'s parcel"):
                dist.broadcast(tensor, group=self.group, group_src=src)  # src: the endpoint, its rank in the group
            if src != self.rank:
                parcels.append(Parcel(src, step, learner_version(step), tensor.cpu()))
        return parcels

    def receive(self, receiver: int, step: int) -> Arrivals:
        return self._arrivals

    def finish(self) -> None:
        """Every step already waited for every peer."""
