"""The in-process bus: every member of the run in this one process (train without --nproc, eval), in sync and
async mode alike.

The members step together, so a parcel goes straight into each peer's mailbox: due at once (sync, and an eval,
which exchanges nothing) or after its swarm.latency draw (async). Nobody is ahead of anybody, so the lead bound
never binds here; what it and the samplers' backpressure do across processes is exchange/pacer.py's.
"""

from __future__ import annotations

import time

import torch

from ..topology.schedule import learner_version
from . import Arrivals, Limit, Parcel, WeightSlot, WithoutSamplers, wire_bytes_sent
from .async_ import Latency, Mailbox
from .sync import LocalCollectives


class InProcess(WithoutSamplers):
    """Every member in this process (see the module). latency: async mode's simulated delay (None: due at once)."""

    world_size = 1
    rank = 0

    def __init__(self, members: list[int], capacity: int, latency: Latency | None = None):
        self.collectives = LocalCollectives()
        self.latency = latency
        self.mailboxes = {m: Mailbox(capacity) for m in members}

    def start(self, limit: Limit, start_step: int = 0, weights: WeightSlot | None = None) -> None:
        """Nothing to allocate for: the buffers are this process's own."""

    def send(self, buffers: dict[int, torch.Tensor], step: int) -> dict[int, int]:
        for sender, buffer in buffers.items():
            for receiver, box in self.mailboxes.items():
                if receiver != sender:
                    parcel = Parcel(sender, step, learner_version(step), buffer)
                    box.put(parcel if self.latency is None else self.latency.schedule(parcel, receiver))
        return {m: wire_bytes_sent(b, len(self.mailboxes) - 1) for m, b in buffers.items()}

    def receive(self, receiver: int, step: int) -> Arrivals:
        start = time.perf_counter()
        box = self.mailboxes[receiver]
        parcels = box.take_due(step, time.time())
        return Arrivals(parcels, wait_seconds=time.perf_counter() - start, waiting=len(box),
                        dropped_sequences=box.take_dropped())

    def finish(self) -> None:
        """Nothing crosses a process: what is still in a mailbox is simply not used."""
