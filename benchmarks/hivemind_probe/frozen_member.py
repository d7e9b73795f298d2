"""A live swarm of 4 peers; one (p2, not the bootstrap) is frozen with SIGSTOP (a member stalled: swapping, stopped
by a debugger) for longer than its lease, then resumed. Do the others' gets stall while it is frozen (their DHT
RPCs to it time out)? When do they drop it, and does it come back on SIGCONT without a rejoin? Then a peer joins
with initial_peers = [dead address, live address] (does one dead bootstrap among live ones hurt?).

    python3 frozen_member.py OUTDIR [--lease 10] [--freeze 25]
"""
import argparse
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from swarm_test import Peer  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--lease", type=float, default=10.0)
    ap.add_argument("--poll", type=float, default=0.5)
    ap.add_argument("--freeze", type=float, default=25.0)
    ap.add_argument("--run", type=float, default=150.0)
    a = ap.parse_args()
    os.makedirs(a.outdir, exist_ok=True)
    peers, S = {}, {}
    try:
        peers["p0"] = Peer("p0", a.outdir, [], a)
        boot = peers["p0"].maddr()
        for n in ("p1", "p2", "p3"):
            peers[n] = Peer(n, a.outdir, [boot], a)
            peers[n].maddr()
        time.sleep(6)
        t_stop = time.time()
        os.killpg(peers["p2"].proc.pid, signal.SIGSTOP)
        time.sleep(a.freeze)
        t_cont = time.time()
        os.killpg(peers["p2"].proc.pid, signal.SIGCONT)
        time.sleep(a.lease)
        S["t_stop"], S["t_cont"] = t_stop, t_cont
        for n in ("p0", "p1", "p3"):
            ev = peers[n].events()
            during = [e for e in ev if e["ev"] == "view" and t_stop <= e["t"] <= t_cont]
            after = [e for e in ev if e["ev"] == "view" and e["t"] > t_cont]
            gone = [e for e in ev if e["ev"] == "gone" and e["who"] == "p2" and e["t"] > t_stop]
            back = [e for e in ev if e["ev"] == "seen" and e["who"] == "p2" and e["t"] > t_cont]
            stores = [e for e in ev if e["ev"] == "store" and t_stop <= e["t"] <= t_cont + 5]
            S[n] = {"max_get_s_while_frozen": round(max((e["get_s"] for e in during), default=0), 3),
                    "gets_over_1s_while_frozen": sum(1 for e in during if e["get_s"] > 1),
                    "max_store_s_while_frozen": round(max((e["store_s"] for e in stores), default=0), 3),
                    "p2_gone_after_stop_s": round(gone[0]["t"] - t_stop, 2) if gone else None,
                    "p2_seen_again_after_cont_s": round(back[0]["t"] - t_cont, 2) if back else None,
                    "last_view": after[-1]["live"] if after else None}
        ev2 = peers["p2"].events()
        S["p2_after_cont"] = [{"ev": e["ev"], "dt": round(e["t"] - t_cont, 2), **{k: e[k] for k in ("live", "get_s", "store_s", "ok") if k in e}}
                              for e in ev2 if e["t"] > t_cont and e["ev"] in ("store", "view", "get_failed")][:6]
        # mixed bootstrap list: a dead address first, a live one second
        dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWRdto3nawwLmZBimhqr1xFjSshB3pfWAHkjynyzwasrCs"
        m = peers["mixed"] = Peer("mixed", a.outdir, [dead, peers["p1"].maddr()], a)
        t = time.time()
        addr = m.maddr(60)
        S["mixed_bootstrap"] = {"joined": addr is not None, "spawn_to_joined_s": round(time.time() - t, 2),
                                "events": [e for e in m.events() if e["ev"] in ("joined", "start_failed")]}
        time.sleep(3)
        S["mixed_bootstrap"]["view"] = next((e["live"] for e in reversed(m.events()) if e["ev"] == "view"), None)
    finally:
        for p in peers.values():
            p.kill(signal.SIGKILL)
    with open(os.path.join(a.outdir, "summary.json"), "w") as f:
        json.dump(S, f, indent=1)
    print(json.dumps(S, indent=1))


if __name__ == "__main__":
    sys.exit(main())
