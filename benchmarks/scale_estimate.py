"""The open swarm past this machine, on paper (issue 80, item 3): what N members (1,000 by default) over links of
100 ms one way with 1% loss would need, from sizes the project's own code makes and the scale benchmark's
measurements.

    python benchmarks/scale_estimate.py                     # N = 16, 64, 1000; writes benchmarks/results/scale_estimate.*
    python benchmarks/scale_estimate.py --members 64 1000 --peers-per-step 4

Every input is measured or computed here, and the JSON says where each came from:
- a parcel's bytes: `data.rollouts.encode` of the profile's step (prompts x completions of the mean length), the
  wire format itself (8 bytes a token + 32 a sequence);
- the coordinator's member list: `openswarm.wire.pack("members", ...)` of N entries as the coordinator builds them
  (`Coordinator._view`: step, tokenizer hash, source, address, key), sent whole to every member once a lease, and
  `pack("changes", ...)` in between: every member's step moves once a step, so a member hears N moved steps a step,
  in a message every min(1 s, lease / 4) (before 2026-12-07 the whole list went every min(1 s, lease / 4): the
  JSON keeps that too); a beat: `pack("beat", ...)`, every lease / 4;
- a DHT record: a record signed by hivemind's RSASignatureValidator as `openswarm/dht.py` stores it (needs the
  `[dht]` extra; else the size measured on 2026-12-07, 984 bytes, is used and the JSON says so), every member reading
  the swarm's whole key every min(1 s, lease / 4), each read answered by each of the key's replicas with its whole
  copy (hivemind's num_replicas, 5; a get with latest=True visits the key's nearest nodes, a bucket of 20, and merges
  every holder's copy: hivemind/dht/node.py, read in 1.1.10), so a member takes in 5 copies a read; and one node's
  answer is one p2pd message, at most 4 MiB (hivemind/p2p/p2p_daemon_bindings/control.py, DEFAULT_MAX_MSG_SIZE):
  a key of more records than that holds cannot be read (read in the source, not measured);
- TCP under loss: the Mathis et al. (1997) bound on one connection's throughput, MSS / RTT x 1.22 / sqrt(p);
- a step's seconds: the profile's (the real-PEFT study's CPU member-step, the H200's step at the paper-like shape:
  benchmarks/results/pair_h200), and the scale benchmark's (benchmarks/results/swarm_scale*.json) where it has run.
The direct exchange: a member sends its parcel to the K peers it draws and to those that drew it (K expected: each
of the N - 1 others draws it with probability K / (N - 1)), and takes theirs: 2K parcels each way a step, whatever N.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

PROFILES = {  # prompts x completions a member a step, mean completion tokens, a step's seconds and its source
    "peft": {"prompts": 4, "group": 8, "mean_tokens": 22, "step_s": 40.0,
             "step_source": "the real-PEFT study's member-steps on this CPU (two members, ~20-60 s a step)"},
    "paper": {"prompts": 12, "group": 12, "mean_tokens": 300, "step_s": 8.0,
              "step_source": "estimated from the H200's 4.26 s step at 12 x 12 completions of 136 tokens "
                             "(benchmarks/results/pair_h200), scaled to 300 tokens"},
}
DHT_RECORD_MEASURED = 984  # bytes, 2026-12-07 (hivemind 1.1.12): subkey 402 (name + RSA public key), value 574 + 8
DHT_REPLICAS = 5  # hivemind.dht.node.DHTNode's num_replicas default: the copies a read takes in
DHT_MAX_MESSAGE = 4 << 20  # p2pd's message cap in hivemind (DEFAULT_MAX_MSG_SIZE): one holder's answer to a get


def parcel_bytes(profile: dict) -> int:
    import torch

    from ftis_engine.data.rollouts import Rollout, encode

    n = profile["prompts"] * profile["group"]
    rollouts = [Rollout(0, 0, torch.zeros(profile["mean_tokens"], dtype=torch.int32),
                        torch.zeros(profile["mean_tokens"]), 0.0, "length", 1, time.time()) for _ in range(n)]
    return 4 * encode(rollouts).numel()


def view_entry_bytes() -> tuple[float, int, float, int]:
    """(bytes a member entry adds to the coordinator's whole list, a beat's bytes, bytes a moved step adds to a
    `changes` message, the bytes of one with nothing in it), from the wire format."""
    from ftis_engine.openswarm.wire import pack

    def entry(i: int) -> dict:
        return {"step": 1234, "tokenizer": "f" * 64, "source": "packaged:smollm2-135m-instruct",
                "address": f"tcp://10.{i // 250}.{i % 250}.2:5556", "key": "x" * 40}

    def size(n: int) -> int:
        return sum(len(f) for f in pack("members", {"members": {f"member-{i:04d}": entry(i) for i in range(n)}}))

    def changes(n: int) -> int:
        return sum(len(f) for f in pack("changes", {"joined": {}, "left": [],
                                                    "steps": {f"member-{i:04d}": 1234 for i in range(n)}}))

    beat = sum(len(f) for f in pack("beat", {"name": "member-0001", "step": 1234}))
    return (size(100) - size(0)) / 100, beat, (changes(100) - changes(0)) / 100, changes(0)


def dht_record_bytes() -> tuple[int, str]:
    try:
        from hivemind.dht.crypto import RSASignatureValidator
        from hivemind.dht.validation import DHTRecord
        from hivemind.utils.crypto import RSAPrivateKey
        from hivemind.utils.serializer import MSGPackSerializer
    except ImportError:
        return DHT_RECORD_MEASURED, "measured 2026-12-07 with hivemind 1.1.12 (not installed here)"
    validator = RSASignatureValidator(RSAPrivateKey())
    subkey = MSGPackSerializer.dumps(b"member-0001" + validator.local_public_key)
    value = {"tokenizer": "f" * 64, "source": "packaged:smollm2-135m-instruct", "address": "tcp://10.3.4.2:5556",
             "key": "x" * 40, "step": 1234, "stamp": time.time(), "left": False}
    record = DHTRecord(key=MSGPackSerializer.dumps("ftis-swarm/" + "0" * 32), subkey=subkey,
                       value=MSGPackSerializer.dumps(value), expiration_time=time.time() + 10)
    return len(subkey) + len(validator.sign_value(record)) + 8, "signed here by hivemind's RSASignatureValidator"


def mathis_bytes_per_s(rtt_s: float, loss: float, mss: int = 1448) -> float:
    return mss / rtt_s * 1.22 / math.sqrt(loss)


def estimate(n: int, k: int, profile: dict, parcel: int, entry: float, beat: int, record: int, lease_s: float,
             rtt_s: float, loss: float, moved: float = 0.0, empty: int = 0) -> dict:
    step_s = profile["step_s"]
    view_s = min(1.0, lease_s / 4)  # how often changes come (coordinator) or the key is read (DHT)
    exchange = 2 * k * parcel  # a member's bytes a step each way, direct
    # a member takes in a step: the others' moved steps, the messages that carry them (at most one a tick, and one
    # a moved step at most), and the whole list once a lease
    coordinator_view = n * moved + min(step_s / view_s, n) * empty + n * entry * step_s / lease_s
    whole_every_tick = n * entry * step_s / view_s  # the list before 2026-12-07
    dht_reads = DHT_REPLICAS * n * record * step_s / view_s  # the whole key from each replica, every read
    per_connection = mathis_bytes_per_s(rtt_s, loss)
    return {
        "members": n, "peers_per_step": min(k, n - 1), "step_s": step_s, "parcel_bytes": parcel,
        "member_exchange_bytes_per_step": exchange,
        "member_in_kbit_s": {"coordinator": 8 * (exchange + coordinator_view) / step_s / 1e3,
                             "dht": 8 * (exchange + dht_reads) / step_s / 1e3},
        "share_of_membership_in_member_in": {"coordinator": coordinator_view / (exchange + coordinator_view),
                                             "dht": dht_reads / (exchange + dht_reads)},
        "member_in_kbit_s_whole_list_every_tick": 8 * (exchange + whole_every_tick) / step_s / 1e3,
        "relay_member_in_bytes_per_step": (n - 1) * parcel,  # today's relay: every other member's parcel
        "coordinator_out_mbit_s": {"relay": 8 * n * (n - 1) * parcel / step_s / 1e6 + 8 * n * coordinator_view
                                   / step_s / 1e6, "direct": 8 * n * coordinator_view / step_s / 1e6},
        "coordinator_in_beats_per_s": n / (lease_s / 4),
        "coordinator_in_bytes_per_s": n / (lease_s / 4) * beat,
        "dht_replica_out_mbit_s": 8 * n * n * record / view_s / 1e6,  # every reader's read answered by each replica
        "dht_key_bytes": n * record, "dht_key_readable": n * record < DHT_MAX_MESSAGE,
        "tcp_bytes_per_s_per_connection": per_connection,
        "parcel_transfer_s": rtt_s * 1.5 + parcel / per_connection,  # connection set up, then the bound
        "parcel_steps_late": (rtt_s * 1.5 + parcel / per_connection) / step_s,
    }


def report(rows: list[dict], settings: dict) -> str:
    head = (f"# The open swarm past this machine, on paper (benchmarks/scale_estimate.py)\n\n"
            f"Links {settings['one_way_delay_ms']:g} ms one way ({settings['rtt_s'] * 1e3:g} ms RTT), "
            f"{settings['loss']:.0%} loss; lease {settings['lease_s']:g} s; {settings['peers_per_step']} drawn peers "
            f"a step. Sizes from the project's wire format; DHT record {settings['dht_record_bytes']} bytes "
            f"({settings['dht_record_source']}); a member-list entry {settings['view_entry_bytes']:.0f} bytes, a "
            f"moved step in a change {settings['moved_step_bytes']:.0f}, a change message "
            f"{settings['changes_message_bytes']} + those, a beat {settings['beat_bytes']} bytes. One TCP connection under this loss: at most "
            f"{settings['tcp_kbyte_s']:.0f} KB/s (Mathis). A DHT read takes in the whole key from each of its "
            f"{settings['dht_replicas']} replicas; one replica's answer is one p2pd message of at most "
            f"{settings['dht_max_message_bytes'] >> 20} MiB, so a key of more than "
            f"{settings['dht_max_readable_records']:,} records (members, or a liar's subkeys) cannot be read.\n\n")
    lines = ["| profile | members | parcel KB | member in, kbit/s: direct + coordinator's list / direct + DHT reads "
             "| the list's / reads' share of it | (the whole list every second: kbit/s) | relay: member in KB a step "
             "| coordinator out Mbit/s: relay / direct | a DHT replica out Mbit/s | a parcel's transfer s (steps "
             "late) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['profile']} | {r['members']} | {r['parcel_bytes'] / 1e3:.1f} | "
            f"{r['member_in_kbit_s']['coordinator']:.0f} / {r['member_in_kbit_s']['dht']:.0f} | "
            f"{r['share_of_membership_in_member_in']['coordinator']:.0%} / "
            f"{r['share_of_membership_in_member_in']['dht']:.0%} | "
            f"({r['member_in_kbit_s_whole_list_every_tick']:.0f}) | {r['relay_member_in_bytes_per_step'] / 1e3:,.0f} | "
            f"{r['coordinator_out_mbit_s']['relay']:,.1f} / {r['coordinator_out_mbit_s']['direct']:,.1f} | "
            f"{r['dht_replica_out_mbit_s']:,.1f} | {r['parcel_transfer_s']:.1f} ({r['parcel_steps_late']:.2f}) |")
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--members", type=int, nargs="+", default=[16, 64, 1000])
    parser.add_argument("--peers-per-step", type=int, default=4)
    parser.add_argument("--one-way-delay-ms", type=float, default=100.0)
    parser.add_argument("--loss", type=float, default=0.01)
    parser.add_argument("--lease-s", type=float, default=10.0)
    parser.add_argument("--output", default=str(RESULTS / "scale_estimate"))
    args = parser.parse_args(argv)
    if any(n < 2 for n in args.members) or args.peers_per_step < 1 or not 0 < args.loss < 1:
        parser.error("--members at least 2 each, --peers-per-step at least 1, --loss in (0, 1)")
    entry, beat, moved, empty = view_entry_bytes()
    record, record_source = dht_record_bytes()
    rtt = 2 * args.one_way_delay_ms / 1e3
    parcels = {name: parcel_bytes(profile) for name, profile in PROFILES.items()}
    rows = [{"profile": name, **estimate(n, args.peers_per_step, profile, parcels[name], entry, beat, record,
                                         args.lease_s, rtt, args.loss, moved, empty)}
            for name, profile in PROFILES.items() for n in args.members]
    settings = {"one_way_delay_ms": args.one_way_delay_ms, "rtt_s": rtt, "loss": args.loss, "lease_s": args.lease_s,
                "peers_per_step": args.peers_per_step, "view_entry_bytes": entry, "beat_bytes": beat,
                "moved_step_bytes": moved, "changes_message_bytes": empty,
                "dht_record_bytes": record, "dht_record_source": record_source, "dht_replicas": DHT_REPLICAS,
                "dht_max_message_bytes": DHT_MAX_MESSAGE, "dht_max_readable_records": DHT_MAX_MESSAGE // record,
                "tcp_kbyte_s": mathis_bytes_per_s(rtt, args.loss) / 1e3,
                "profiles": {name: {**p, "parcel_bytes": parcels[name]} for name, p in PROFILES.items()}}
    output = pathlib.Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.with_suffix(".json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=1) + "\n")
    text = report(rows, settings)
    output.with_suffix(".md").write_text(text)
    print(text)
    return rows


if __name__ == "__main__":
    main()
