"""Rollout exchange: bytes per token and all-gather latency for 2-4 processes (gloo on CPU; NCCL with GPUs).

    python benchmarks/exchange.py                 # 2, 3, 4 processes; 24 sequences x 768 tokens per member
    python benchmarks/exchange.py --quick         # small, for CI

Each process encodes its member's rollouts in the wire format and runs the sync transport's send (sizes
all-gathered, then one broadcast per member, no padding; exchange/sync.py), as the trainer does every step. Prints a table and
writes benchmarks/results/exchange.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from ftis_engine.exchange.sync import Collectives, DistributedSync  # noqa: E402
from ftis_engine.data.rollouts import Rollout, encode, max_buffer_words, wire_bytes  # noqa: E402
from tests.ports import free_port  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def _rollouts(rank: int, sequences: int, tokens: int) -> list[Rollout]:
    g = torch.Generator().manual_seed(rank)
    return [Rollout(rank, i, torch.randint(0, 151_936, (tokens,), generator=g, dtype=torch.int32),
                    -torch.rand(tokens, generator=g) * 5, float(i % 2), "length", 0) for i in range(sequences)]


def _worker(rank: int, world: int, port: int, sequences: int, tokens: int, repeats: int, backend: str, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    exchange = DistributedSync(Collectives(rank, world, device, backend))
    exchange.start(lambda sender, step: max_buffer_words(sequences, tokens))
    buffer = encode(_rollouts(rank, sequences, tokens))
    times = []
    for i in range(repeats + 3):
        exchange.send({rank: buffer}, step=1)  # its own barrier first (wait_seconds, not timed)
        arrivals = exchange.receive(rank, step=1)
        if i >= 3:
            times.append(arrivals.seconds)
    received = arrivals.parcels
    assert all(p.buffer.numel() == buffer.numel() and p.refused is None for p in received)
    assert len(received) == world - 1
    if rank == 0:
        queue.put({"median_ms": 1e3 * statistics.median(times), "p90_ms": 1e3 * sorted(times)[int(0.9 * len(times))],
                   "bytes_per_member": buffer.numel() * 4})
    dist.destroy_process_group()


def measure(world: int, sequences: int, tokens: int, repeats: int, backend: str) -> dict:
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(world, free_port(), sequences, tokens, repeats, backend, queue), nprocs=world, join=True)
    result = queue.get()
    n_tok = sequences * tokens
    return {"processes": world, "backend": backend, "sequences_per_member": sequences, "tokens_per_member": n_tok,
            **result, "bytes_per_token": result["bytes_per_member"] / n_tok,
            "expected_bytes": wire_bytes(sequences, n_tok)}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 processes (CI)")
    parser.add_argument("--processes", type=int, nargs="*", default=[2, 3, 4])
    parser.add_argument("--sequences", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=768, help="tokens per sequence")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--output", type=pathlib.Path, default=RESULTS / "exchange.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.processes, args.sequences, args.tokens, args.repeats = [2], 4, 16, 3
    gpus = torch.cuda.device_count()
    rows = []
    for world in args.processes:
        backend = "nccl" if gpus >= world else "gloo"
        rows.append(measure(world, args.sequences, args.tokens, args.repeats, backend))
    print("| processes | backend | tokens/member | bytes/token | wire bytes/member | median ms | p90 ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['processes']} | {r['backend']} | {r['tokens_per_member']} | {r['bytes_per_token']:.3f} | "
              f"{r['bytes_per_member']} | {r['median_ms']:.2f} | {r['p90_ms']:.2f} |")
    if not args.quick or args.output != RESULTS / "exchange.json":
        args.output.parent.mkdir(parents=True, exist_ok=True)
        meta = {"command": "python benchmarks/exchange.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                "machine": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__}
        args.output.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return rows


if __name__ == "__main__":
    main()
