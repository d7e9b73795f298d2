"""What goes over a link (links.py): the messages' kinds, their frames on the wire, and each peer's Outbox of what
this rank still has to send it.

A message is [MAGIC, header, body?]: the header is four little-endian int64 (kind, step, version, body words), the
body raw int32 words; nothing is unpickled. The ROUTER prefixes the sender's routing id (its endpoint number, exactly
as str() writes it); a message from an unknown id, of a wrong shape or of a body that disagrees with its header is
refused and counted. Kinds:

    DATA     a parcel of rollouts (step: the sender's step or round; version: their policy version)
    WEIGHTS  a learner's trainable weights for its sampler (version: the learner's step)
    TAKEN    a learner tells its sampler the newest round it has taken (step: that round; no body)
    DONE     the sender has finished and sends nothing more
"""

from __future__ import annotations

import collections
import struct
import threading

import torch

DATA, DONE, WEIGHTS, TAKEN = 0, 1, 2, 4
KIND_NAMES = {DATA: "DATA", DONE: "DONE", WEIGHTS: "WEIGHTS", TAKEN: "TAKEN"}
MAGIC = b"ftis-links/1"
HEADER = struct.Struct("<4q")  # kind, step, version, body words
SLOT_ORDER = (TAKEN, WEIGHTS)  # the round taken (no body) never waits behind a weights transfer


class Outbox:
    """What this rank still has to send one peer: rollout parcels, of which at most `capacity` wait (a newer one
    replaces the oldest, counted in `dropped_sequences`: a receiver prefers fresh rollouts), slots in which only
    the newest value matters (the round taken, then weights), and DONE, which goes after everything else."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._parcels: collections.deque = collections.deque()
        self._slots: dict[int, tuple[int, int, torch.Tensor | None]] = {}
        self._done = False
        self._lock = threading.Lock()
        self.dropped_sequences = 0

    def put_parcel(self, step: int, version: int, buffer: torch.Tensor) -> None:
        with self._lock:
            if len(self._parcels) >= self.capacity:
                _, _, oldest = self._parcels.popleft()
                self.dropped_sequences += int(oldest[0]) if oldest.numel() else 0
            self._parcels.append((step, version, buffer))

    def put_slot(self, kind: int, step: int, version: int, buffer: torch.Tensor | None) -> None:
        with self._lock:
            self._slots[kind] = (step, version, buffer)

    def put_done(self) -> None:
        with self._lock:
            self._done = True

    def take(self) -> tuple[int, int, int, torch.Tensor | None] | None:
        """The next message (kind, step, version, body), or None when nothing waits."""
        with self._lock:
            if self._slots:
                kind = next(k for k in SLOT_ORDER if k in self._slots)
                return (kind, *self._slots.pop(kind))
            if self._parcels:
                return (DATA, *self._parcels.popleft())
            if self._done:
                return DONE, 0, 0, None
            return None

    def clear_parcels(self) -> None:
        """The peer has left: what still waits for it is dropped (counted), so its DONE answer goes at once."""
        with self._lock:
            self.dropped_sequences += sum(int(b[0]) for _, _, b in self._parcels if b.numel())
            self._parcels.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._parcels)


def frames(kind: int, step: int, version: int, body: torch.Tensor | None) -> list:
    """A message's frames (the body's words without a copy)."""
    words = 0 if body is None else body.numel()
    out = [MAGIC, HEADER.pack(kind, step, version, words)]
    if words:
        out.append(memoryview(body.to(torch.int32).contiguous().numpy()).cast("B"))
    return out


def parse(message: list[bytes]) -> tuple[int, int, int, bytes]:
    """(kind, step, version, body) of a received message (its sender's id removed); ValueError naming what is
    wrong with anything else."""
    if len(message) not in (2, 3) or message[0] != MAGIC:
        raise ValueError("not a links message")
    if len(message[1]) != HEADER.size:
        raise ValueError(f"a header of {len(message[1])} bytes, not {HEADER.size}")
    kind, step, version, words = HEADER.unpack(message[1])
    body = message[2] if len(message) == 3 else b""
    if kind not in KIND_NAMES:
        raise ValueError(f"an unknown kind {kind}")
    if min(step, version, words) < 0 or len(body) != 4 * words:
        raise ValueError(f"a header that does not match its body ({words} words announced, {len(body)} bytes)")
    return kind, step, version, body
