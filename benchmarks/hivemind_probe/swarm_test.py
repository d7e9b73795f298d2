"""Orchestrates N DHT peers (peer.py) on 127.0.0.1: join times, store->visible latency, RSS/PSS and idle CPU per
peer (its 3 processes: the script, hivemind's forked DHT process, p2pd), then kill -9 of the bootstrap peer's whole
process group, a new peer joining through a survivor, and one joining through the dead bootstrap only.

    python3 swarm_test.py OUTDIR [N] [--poll 1.0] [--lease 10] [--cpu-window 30]
Prints a JSON summary (also OUTDIR/summary.json). Needs only the standard library (reads /proc).
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PY = "/work/venvs/hivemind/bin/python"
TICK = os.sysconf("SC_CLK_TCK")


def tree(pid):
    """pid and all its descendants (from /proc)."""
    kids = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                kids.setdefault(ppid, []).append(int(d))
            except OSError:
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def cpu_ticks(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except OSError:
        return 0


def mem(pid):
    r = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                k, v = line.split(":", 1)
                if k in ("Rss", "Pss", "Private_Dirty", "Private_Clean"):
                    r[k] = int(v.split()[0])  # kB
        with open(f"/proc/{pid}/cmdline") as f:
            cmd = f.read().replace("\0", " ")
        r["what"] = "p2pd" if "p2pd" in cmd else "python"
    except OSError:
        pass
    return r


class Peer:
    def __init__(self, name, outdir, initial, args):
        self.name, self.outdir = name, outdir
        cmd = [PY, os.path.join(HERE, "peer.py"), name, outdir, "--lease", str(args.lease), "--poll", str(args.poll),
               "--run", str(args.run)]
        if initial:
            cmd += ["--initial", *initial]
        self.t_spawn = time.time()
        self.out = open(os.path.join(outdir, f"{name}.out"), "w")
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=subprocess.STDOUT, start_new_session=True)

    def maddr(self, timeout=120):
        path = os.path.join(self.outdir, f"{self.name}.maddr")
        end = time.time() + timeout
        while time.time() < end:
            if os.path.exists(path):
                with open(path) as f:
                    return f.readline().strip()
            if self.proc.poll() is not None:
                return None
            time.sleep(0.1)
        return None

    def events(self):
        try:
            with open(os.path.join(self.outdir, f"{self.name}.jsonl")) as f:
                return [json.loads(line) for line in f if line.strip()]
        except OSError:
            return []

    def kill(self, sig=signal.SIGKILL):
        try:
            os.killpg(self.proc.pid, sig)  # its own session: the script, the DHT process, p2pd
        except ProcessLookupError:
            pass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("n", type=int, nargs="?", default=8)
    ap.add_argument("--poll", type=float, default=1.0)
    ap.add_argument("--lease", type=float, default=10.0)
    ap.add_argument("--cpu-window", type=float, default=30.0)
    ap.add_argument("--run", type=float, default=240.0)
    a = ap.parse_args()
    os.makedirs(a.outdir, exist_ok=True)
    S = {"n": a.n, "poll_s": a.poll, "lease_s": a.lease}
    peers = {}
    try:
        boot = peers["p0"] = Peer("p0", a.outdir, [], a)
        boot_addr = boot.maddr()
        S["bootstrap_maddr"] = boot_addr
        for i in range(1, a.n):
            p = peers[f"p{i}"] = Peer(f"p{i}", a.outdir, [boot_addr], a)
            p.maddr()
        names = sorted(peers)
        # everyone sees everyone?
        end = time.time() + 30
        while time.time() < end:
            if all(set(names) <= set(next((e["live"] for e in reversed(peers[n].events()) if e["ev"] == "view"), []))
                   for n in names):
                break
            time.sleep(0.5)
        S["all_see_all_after_start_s"] = time.time() - peers[names[-1]].t_spawn
        joins = {}
        for n in names:
            ev = peers[n].events()
            imp = next(e for e in ev if e["ev"] == "imported")
            jn = next(e for e in ev if e["ev"] == "joined")
            joins[n] = {"spawn_to_joined_s": round(jn["t"] - peers[n].t_spawn, 3), "import_s": round(imp["import_s"], 3),
                        "dht_start_s": round(jn["join_s"], 3)}
        S["joins"] = joins
        time.sleep(5)
        # memory and idle CPU
        memory = {}
        for n in names:
            memory[n] = [dict(pid=p, **mem(p)) for p in tree(peers[n].proc.pid)]
        S["memory_kB"] = memory
        pids = {n: tree(peers[n].proc.pid) for n in names}
        t0 = time.time()
        c0 = {n: sum(cpu_ticks(p) for p in pids[n]) for n in names}
        c0_split = {n: {p: cpu_ticks(p) for p in pids[n]} for n in names}
        time.sleep(a.cpu_window)
        dt = time.time() - t0
        S["idle_cpu_percent"] = {n: round(100 * (sum(cpu_ticks(p) for p in pids[n]) - c0[n]) / TICK / dt, 2)
                                 for n in names}
        S["idle_cpu_percent_by_process"] = {
            n: {mem(p).get("what", "?") + f"-{p}": round(100 * (cpu_ticks(p) - c0_split[n][p]) / TICK / dt, 2)
                for p in pids[n]} for n in names}
        # kill -9 the bootstrap (the whole group: as a machine dying)
        t_kill = time.time()
        boot.kill()
        S["killed_bootstrap_at"] = t_kill
        time.sleep(a.lease + 3 * a.poll + 2)
        after = {}
        for n in names[1:]:
            ev = peers[n].events()
            gone = [e for e in ev if e["ev"] == "gone" and e["who"] == "p0"]
            views = [e for e in ev if e["ev"] == "view" and e["t"] > t_kill]
            fails = [e for e in ev if e["ev"] == "get_failed" and e["t"] > t_kill]
            after[n] = {"p0_gone_after_kill_s": round(gone[0]["t"] - t_kill, 2) if gone else None,
                        "last_view": views[-1]["live"] if views else None,
                        "views_after_kill_missing_survivors": sum(1 for v in views if not set(names[1:]) <= set(v["live"])),
                        "max_get_s_after_kill": round(max((v["get_s"] for v in views), default=0), 3),
                        "get_failed": len(fails)}
        S["after_bootstrap_kill"] = after
        # a new peer through a survivor
        surv = names[min(3, len(names) - 1)]
        S["survivor_used"] = surv
        survivor_addr = peers[surv].maddr()
        newp = peers["new_via_survivor"] = Peer("new_via_survivor", a.outdir, [survivor_addr], a)
        addr = newp.maddr(60)
        S["new_via_survivor_joined"] = addr is not None
        time.sleep(3 * a.poll + 2)
        S["new_via_survivor_view"] = next((e["live"] for e in reversed(newp.events()) if e["ev"] == "view"), None)
        S["survivors_see_new"] = {n: "new_via_survivor" in (next((e["live"] for e in reversed(peers[n].events())
                                                            if e["ev"] == "view"), [])) for n in names[1:]}
        S["new_via_survivor_events"] = [e for e in newp.events() if e["ev"] in ("imported", "joined", "start_failed")]
        # a new peer through the dead bootstrap only (its port now closed)
        dead = peers["new_via_dead"] = Peer("new_via_dead", a.outdir, [boot_addr], a)
        t = time.time()
        dead.proc.wait(timeout=180)
        S["new_via_dead_bootstrap"] = {"exit_s": round(time.time() - t, 2), "rc": dead.proc.returncode,
                                       "events": [e for e in dead.events() if e["ev"] != "view"]}
        with open(os.path.join(a.outdir, "new_via_dead.out")) as f:
            S["new_via_dead_bootstrap"]["output_tail"] = f.read()[-3000:]
    finally:
        for p in peers.values():
            p.kill(signal.SIGTERM)
        time.sleep(3)
        for p in peers.values():
            p.kill(signal.SIGKILL)
        leftovers = subprocess.run(["pgrep", "-f", "hivemind_cli/p2pd"], capture_output=True, text=True).stdout.split()
        S["leftover_p2pd_pids"] = leftovers
    with open(os.path.join(a.outdir, "summary.json"), "w") as f:
        json.dump(S, f, indent=1)
    print(json.dumps(S, indent=1))


if __name__ == "__main__":
    sys.exit(main())
