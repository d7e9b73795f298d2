"""One rank of a hand-launched swarm (as torchrun would start it), for the tests: `python swarm_worker.py MODE
ARGS...` runs `ftis-engine ARGS` in this process; MODE other than `none` corrupts what this rank puts on the wire (sync: the
corruption's name; async: async-<name>; async-junk: malformed control messages between the honest ones), slows
its member down (slow:<seconds per step>), or makes its receiving thread's own code fail (handler-error)."""

from __future__ import annotations

import struct
import sys

import torch

from ftis_engine.exchange import async_, sync
from ftis_engine.data.rollouts import HEADER_WORDS


def corrupt(buffer: torch.Tensor, mode: str) -> torch.Tensor:
    buffer = buffer.clone()
    n_seq = int(buffer[0])
    first_token = 1 + HEADER_WORDS * n_seq
    n_tok = (buffer.numel() - first_token) // 2
    if mode == "ids":  # a token id outside the vocabulary
        buffer[first_token] = 10_000_000
    elif mode == "nan":  # a NaN generation log-prob
        buffer[first_token + n_tok] = struct.unpack("<i", struct.pack("<f", float("nan")))[0]
    elif mode == "reward":  # claim the opposite reward for the first sequence
        claimed = struct.unpack("<f", struct.pack("<i", int(buffer[1 + 2])))[0]
        buffer[1 + 2] = struct.unpack("<i", struct.pack("<f", 1.0 - claimed))[0]
    elif mode == "truncated":
        buffer = buffer[:-3]
    elif mode == "oversized":  # announces more than any honest buffer this step could hold
        buffer = torch.cat([buffer, torch.zeros(1_000_000, dtype=torch.int32)])
    elif mode == "extra":  # one more completion of the first prompt than was dealt (a re-encoded copy)
        from ftis_engine.data.rollouts import decode, encode

        rollouts = decode(buffer)
        buffer = encode(rollouts + rollouts[:1])
    return buffer


def main() -> None:
    mode, args = sys.argv[1], sys.argv[2:]
    if mode.startswith("slow:"):  # this rank's member generates `seconds` slower each step (a slow peer)
        import time

        from ftis_engine.run import sampling as sample

        seconds, honest_generate = float(mode.split(":")[1]), sample.generate_rollouts

        def generate_rollouts(*a, **k):
            time.sleep(seconds)
            return honest_generate(*a, **k)

        sample.generate_rollouts = generate_rollouts
    elif mode == "async-junk":  # async mode: between its honest messages, TAKENs with a body and unknown kinds
        from ftis_engine.exchange import links

        honest_take, calls = links.Outbox.take, [0]

        def take(self):
            calls[0] += 1
            if calls[0] % 2 == 0:
                return (links.TAKEN if calls[0] % 4 == 0 else 9), 1, 0, torch.arange(50, dtype=torch.int32)
            return honest_take(self)

        links.Outbox.take = take
    elif mode == "handler-error":  # async mode: the receiving side's own code fails on the first parcel
        honest_deliver = async_.DistributedAsync.deliver

        def deliver(self, peer, kind, *rest):
            if kind == 0:
                raise ValueError("injected fault in deliver")
            return honest_deliver(self, peer, kind, *rest)

        async_.DistributedAsync.deliver = deliver
    elif mode != "none":  # corrupt what this rank sends (async-<name>: in async mode)
        transport = async_.DistributedAsync if mode.startswith("async-") else sync.DistributedSync
        honest_send, how = transport.send, mode.removeprefix("async-")

        def send(self, buffers, step):
            return honest_send(self, {self.rank: corrupt(buffers[self.rank], how)}, step)

        transport.send = send
    from ftis_engine.app.cli import main as cli_main

    cli_main(args)


if __name__ == "__main__":
    main()
