"""How hivemind.DHT fails when its initial_peers never answer: for each case, start peer.py with that bootstrap and
time until it raises (or is stopped at the cap, i.e. hangs). Cases:
  closed_port_with_id   /ip4/127.0.0.1/tcp/<closed>/p2p/<a real peer id>
  closed_port_no_id     /ip4/127.0.0.1/tcp/<closed>            (no /p2p/ part)
  silent_listener       a TCP port on 127.0.0.1 that accepts and never speaks (a hung process), with a peer id
  frozen_peer           a real DHT peer stopped with SIGSTOP (the kernel still completes TCP handshakes)
  blackhole             /ip4/10.255.255.1/tcp/31337/p2p/<id>, run inside a network namespace of our own
                        (unshare -n) whose only route to 10.255.255.0/24 is a TUN device nobody reads: SYNs vanish,
                        nothing leaves the machine
  malformed             "127.0.0.1:31337" (not a multiaddr)

    python3 bad_bootstrap.py OUTDIR [CASE ...] [--cap 240]
"""
import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PY = "/work/venvs/hivemind/bin/python"
PEER_ID = "12D3KooWRdto3nawwLmZBimhqr1xFjSshB3pfWAHkjynyzwasrCs"  # a real (now gone) peer's id from an earlier run
NETNS = ("ip link set lo up && ip tuntap add dev tun0 mode tun && ip link set tun0 up && "
         "ip addr add 192.0.2.1/24 dev tun0 && ip route add 10.255.255.0/24 dev tun0 && exec \"$@\"")


def closed_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    return port


def run_peer(name, outdir, initial, cap, netns=False):
    cmd = [PY, os.path.join(HERE, "peer.py"), name, outdir, "--run", "20", "--initial", initial]
    if netns:
        cmd = ["unshare", "-n", "sh", "-c", NETNS, "sh", *cmd]
    out = open(os.path.join(outdir, f"{name}.out"), "w")
    t = time.time()
    p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rc = p.wait(timeout=cap)
        hung = False
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        rc = p.wait()
        hung = True
    wall = time.time() - t
    events = []
    try:
        with open(os.path.join(outdir, f"{name}.jsonl")) as f:
            events = [json.loads(x) for x in f if x.strip()]
    except OSError:
        pass
    with open(os.path.join(outdir, f"{name}.out")) as f:
        tail = f.read()[-600:]
    ev = {e["ev"]: e for e in events}
    return {"initial": initial, "rc": rc, "hung_until_cap": hung, "wall_s": round(wall, 2),
            "dht_start_to_error_s": round(ev["start_failed"]["after_s"], 2) if "start_failed" in ev else None,
            "error": ev.get("start_failed", {}).get("error"),
            "joined_anyway": "joined" in ev, "output_tail": tail}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("cases", nargs="*")
    ap.add_argument("--cap", type=float, default=240)
    a = ap.parse_args()
    os.makedirs(a.outdir, exist_ok=True)
    cases = a.cases or ["closed_port_with_id", "closed_port_no_id", "malformed", "silent_listener", "frozen_peer",
                        "blackhole"]
    R = {}
    for case in cases:
        print("case", case, flush=True)
        if case == "closed_port_with_id":
            R[case] = run_peer(case, a.outdir, f"/ip4/127.0.0.1/tcp/{closed_port()}/p2p/{PEER_ID}", a.cap)
        elif case == "closed_port_no_id":
            R[case] = run_peer(case, a.outdir, f"/ip4/127.0.0.1/tcp/{closed_port()}", a.cap)
        elif case == "malformed":
            R[case] = run_peer(case, a.outdir, "127.0.0.1:31337", a.cap)
        elif case == "silent_listener":
            srv = socket.socket()
            srv.bind(("127.0.0.1", 0))
            srv.listen(16)
            port = srv.getsockname()[1]
            held = []
            stop = threading.Event()

            def accept():
                srv.settimeout(0.5)
                while not stop.is_set():
                    try:
                        held.append(srv.accept()[0])  # accepted, never read nor written
                    except OSError:
                        pass
            th = threading.Thread(target=accept, daemon=True)
            th.start()
            R[case] = run_peer(case, a.outdir, f"/ip4/127.0.0.1/tcp/{port}/p2p/{PEER_ID}", a.cap)
            R[case]["connections_accepted"] = len(held)
            stop.set()
            th.join()
            for c in held:
                c.close()
            srv.close()
        elif case == "frozen_peer":
            boot = subprocess.Popen([PY, os.path.join(HERE, "peer.py"), "frozen_boot", a.outdir, "--run", "400"],
                                    stdout=open(os.path.join(a.outdir, "frozen_boot.out"), "w"),
                                    stderr=subprocess.STDOUT, start_new_session=True)
            path = os.path.join(a.outdir, "frozen_boot.maddr")
            while not os.path.exists(path):
                time.sleep(0.2)
            maddr = open(path).readline().strip()
            os.killpg(boot.pid, signal.SIGSTOP)  # the script, its DHT process and p2pd: frozen
            try:
                R[case] = run_peer(case, a.outdir, maddr, a.cap)
            finally:
                os.killpg(boot.pid, signal.SIGKILL)
                os.killpg(boot.pid, signal.SIGCONT)
                boot.wait()
        elif case == "blackhole":
            R[case] = run_peer(case, a.outdir, f"/ip4/10.255.255.1/tcp/31337/p2p/{PEER_ID}", a.cap, netns=True)
        print(json.dumps(R[case])[:400], flush=True)
    with open(os.path.join(a.outdir, "summary.json"), "w") as f:
        json.dump(R, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
