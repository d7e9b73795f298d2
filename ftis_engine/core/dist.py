"""torch.distributed's failures named once: a collective of the engine's that fails is a lost peer (PeerLost), whatever
layer runs it (the transports, a sharded member's gathers)."""

from __future__ import annotations

import contextlib

import torch

from .errors import first_line


class PeerLost(RuntimeError):
    """A peer's connection closed before it said DONE, or a collective failed (killed, crashed, hung or
    unreachable)."""


@contextlib.contextmanager
def collective(op: str):
    """Run a torch.distributed collective of the engine's (`op` names it in the error): whatever the backend raises
    there is PeerLost, from the backend's error. gloo and NCCL raise a peer's closed connection, a hung peer's
    time-out (the group's, from swarm.timeout_s) and a monitored barrier's missing ranks as RuntimeError (torch's
    DistError subclasses in part), told apart from a misuse (a wrong device, mismatched sizes) by their message
    alone; here the call is known to be a collective, and the line quotes the backend's first line. This rank's own
    out of memory is raised as itself."""
    try:
        yield
    except (PeerLost, torch.OutOfMemoryError):  # already named (a collective inside another); this rank's memory
        raise
    except RuntimeError as exc:
        raise PeerLost(f"{op}: {first_line(exc)}") from exc
