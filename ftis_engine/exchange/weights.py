"""A learner's weights to its decoupled samplers as one broadcast in a group of their own (swarm.weights_transport):
NCCL between GPUs, in the parameters' bf16, straight from GPU memory to GPU memory, instead of float32 words over
the gloo links (6 GB a push for a full 1.5B model, through both hosts' memory).

A push is two broadcasts from the learner's leader: a header (the version; -1 at the end) and the flat trainable
parameters. Each sampler receives in a thread of its own, always waiting for the next push, so the learner's
broadcast finishes as soon as the data has moved; the thread puts what it received in the sampler's WeightSlot, which
keeps the newest. Only the learner's main thread and the samplers' receiving threads use the group, each in one
order, as collectives need. On a GPU the receiving thread's collectives run on a CUDA stream of their own: the
header it waits on would otherwise block the sampler's generation queued on the default stream behind it.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..core.threads import Worker
from . import TransportError, collective

END = -1


class WeightBroadcast:
    """One member's weight channel. `source` is the learner leader's rank in the default group, `device` where the
    buffers live (the rank's GPU under NCCL, the CPU under gloo); a sampler's buffers are its slot's length."""

    def __init__(self, group, source: int, device: torch.device, dtype: torch.dtype = torch.bfloat16):
        self.group, self.source, self.device, self.dtype = group, source, device, dtype
        self._worker = Worker(self._receive, name="weights-broadcast")  # its failure surfaces through check()

    # -- the learner's side

    def push(self, flat: torch.Tensor, version: int) -> None:
        self._header(version)
        with collective("the weights broadcast"):
            dist.broadcast(flat.to(device=self.device, dtype=self.dtype).contiguous(), src=self.source,
                           group=self.group)

    def close(self) -> None:
        """The learner has finished: its samplers' receiving threads end."""
        self._header(END)

    def _header(self, version: int) -> None:
        with collective("the weights broadcast's header"):
            dist.broadcast(torch.tensor([version], dtype=torch.int64, device=self.device), src=self.source,
                           group=self.group)

    # -- a sampler's side

    def start(self, slot) -> None:
        """Receive every push into `slot` (exchange.WeightSlot) until the learner closes the channel."""
        self._worker.start(slot)

    def _receive(self, slot) -> None:
        side = None
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            # the header broadcast is posted in advance and completes only at the learner's next push: on the
            # default stream it would hold back every kernel the sampler queues after it (its generation)
            side = torch.cuda.Stream(self.device)
        while True:
            header = torch.empty(1, dtype=torch.int64, device=self.device)
            flat = torch.empty(slot.words, dtype=self.dtype, device=self.device)
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                dist.broadcast(header, src=self.source, group=self.group)
                version = int(header.item())  # waits on this stream only
                if version == END:
                    return
                dist.broadcast(flat, src=self.source, group=self.group)
            if side is not None:
                side.synchronize()  # whole before the sampler's default stream may read it
            slot.put(version, flat)

    @property
    def done(self) -> bool:
        """A sampler's side: its learner closed the channel (it finished), and everything it pushed came."""
        return self._worker.started and not self._worker.is_alive() and self._worker.error is None

    def check(self) -> None:
        """Raise the receiving thread's failure as a TransportError, its cause the error itself."""
        self._worker.check(lambda exc: TransportError(f"the weights broadcast from rank {self.source} failed: "
                                                      f"{type(exc).__name__}: {exc}"))

    def join(self, timeout_s: float) -> None:
        """A sampler leaving: wait for the learner's END (it sends it when it finishes)."""
        self._worker.join(timeout_s)
        self.check()
