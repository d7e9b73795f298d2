"""One DHT peer of the membership test: joins (initial_peers), holds a lease on its member record (a subkey of one
shared key, renewed every lease/4 like the open swarm's heartbeats) and polls the member list, logging JSON lines.

    python peer.py NAME OUTDIR [--initial MADDR ...] [--lease 10] [--poll 1.0] [--run 60]

Writes OUTDIR/NAME.maddr (its visible multiaddrs, one a line) once joined and OUTDIR/NAME.jsonl (events).
Only loopback: host_maddrs 127.0.0.1, NAT port mapping, AutoNAT and relays off (nothing leaves the machine).
"""
import argparse
import json
import os
import sys
import time

T_PROC = time.time()
import hivemind  # noqa: E402  (imports torch too)
from hivemind.utils.timed_storage import get_dht_time  # noqa: E402

T_IMPORT = time.time()

KEY = "ftis/swarm/members"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("name")
    p.add_argument("outdir")
    p.add_argument("--initial", nargs="*", default=[])
    p.add_argument("--lease", type=float, default=10.0)
    p.add_argument("--poll", type=float, default=1.0)
    p.add_argument("--run", type=float, default=60.0)
    p.add_argument("--no-beat", action="store_true", help="store once, never renew (the lease runs out)")
    a = p.parse_args()
    log = open(os.path.join(a.outdir, f"{a.name}.jsonl"), "a", buffering=1)

    def emit(**kw):
        kw.setdefault("t", time.time())
        log.write(json.dumps(kw) + "\n")

    emit(ev="imported", import_s=T_IMPORT - T_PROC, pid=os.getpid())
    t0 = time.time()
    try:
        dht = hivemind.DHT(initial_peers=a.initial or None, start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                           nat_port_map=False, auto_nat=False, use_relay=False)
    except BaseException as exc:  # noqa: BLE001 (recorded)
        emit(ev="start_failed", after_s=time.time() - t0, error=f"{type(exc).__name__}: {exc}")
        raise
    t_up = time.time()
    maddrs = [str(m) for m in dht.get_visible_maddrs()]
    emit(ev="joined", join_s=t_up - t0, maddrs=maddrs, dht_pid=dht.pid)
    with open(os.path.join(a.outdir, f"{a.name}.maddr.tmp"), "w") as f:
        f.write("\n".join(maddrs) + "\n")
    os.replace(os.path.join(a.outdir, f"{a.name}.maddr.tmp"), os.path.join(a.outdir, f"{a.name}.maddr"))

    seen = {}  # name -> newest beat seen
    beat = 0
    next_beat = 0.0
    end = time.time() + a.run
    while time.time() < end:
        now = time.time()
        if now >= next_beat and not (a.no_beat and beat > 0):
            beat += 1
            value = {"beat": beat, "stored_at": now, "addr": maddrs[0] if maddrs else ""}
            ts = time.time()
            ok = dht.store(KEY, subkey=a.name, value=value, expiration_time=get_dht_time() + a.lease)
            emit(ev="store", beat=beat, ok=bool(ok), store_s=time.time() - ts)
            next_beat = now + a.lease / 4
        tg = time.time()
        try:
            got = dht.get(KEY, latest=True)
        except BaseException as exc:  # noqa: BLE001
            emit(ev="get_failed", error=f"{type(exc).__name__}: {exc}")
            got = None
        t_got = time.time()
        members = {}
        if got is not None and isinstance(got.value, dict):
            for sub, vwe in got.value.items():
                v = vwe.value
                members[sub] = v
                if sub != a.name and seen.get(sub, 0) < v["beat"]:
                    emit(ev="seen", who=sub, beat=v["beat"], latency_s=t_got - v["stored_at"], t=t_got)
                    seen[sub] = v["beat"]
        gone = set(seen) - set(members) - {a.name}
        for g in gone:
            emit(ev="gone", who=g, t=t_got)
            seen.pop(g)
        emit(ev="view", live=sorted(members), get_s=t_got - tg)
        time.sleep(max(0.0, a.poll - (time.time() - now)))
    emit(ev="exit")
    dht.shutdown()


if __name__ == "__main__":
    sys.exit(main())
