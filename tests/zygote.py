"""`python -m ftis_engine ...` and `python tests/SCRIPT.py ...` for the tests, without a new interpreter's imports.

A command started by a test spends most of its time importing (torch, transformers' model code, matplotlib: about
11 CPU-seconds here, against a second or two of training in a short run). A zygote is a Python that imported all of
it once, ran nothing else and started no thread; each command is a process forked from it that runs the module as
`python -m ftis_engine` would (runpy: the same `__main__`, argv, current directory, environment, standard streams,
signal dispositions, exit status and uncaught-exception handling, atexit at the end), so a command that the zygote
runs is the command, less the imports. A script (`[sys.executable, "tests/x.py", ...]`) runs the same way, as
`python tests/x.py` would (runpy.run_path, its directory first on sys.path).

`run` and `Popen` take what subprocess's do. A command line that is neither of those, a start that changes the
child's session, group or descriptors, or an environment that differs from the zygote's in anything a module might
have read while it was imported (all but the keys in RUNTIME_KEYS), is run as a plain subprocess: what a test of
the interpreter's start needs, it gets. The forked command is the zygote's child, not
this process's: its exit status comes over a socket, and `psutil.Process().children()` here does not list it.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading

# read at run time, never while a module is imported: they may differ between the zygote and a command it runs
RUNTIME_KEYS = ("PYTEST_CURRENT_TEST", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "MASTER_ADDR", "MASTER_PORT", "FTIS_")
# what the zygote imports: ftis_engine.preload, which imports every module a worker needs (the list the launcher's
# fork server imports; its own records, SERVER_ENVIRON and IMPORTED_BY, are read only in a worker forked from that
# server), and what a run's end and the other commands use
IMPORTS = ("ftis_engine.preload", "matplotlib", "matplotlib.pyplot", "ftis_engine.cli", "ftis_engine.plots",
           "ftis_engine.study")
_HEADER = struct.Struct("!I")
_MAX_ZYGOTES = 3  # one per environment in use: a fourth stops the one used least recently (each holds ~0.5 GB)


def _runtime(key: str) -> bool:
    return any(key == k or (k.endswith("_") and key.startswith(k)) for k in RUNTIME_KEYS)


def _import_environment(env: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if not _runtime(k)))


# ---------------------------------------------------------------------------------------------- the zygote itself

def _serve(listener: socket.socket) -> dict:
    """Fork a child per request; report each child's wait status to its requester. Returns only in a child, with the
    request it is to run. Single-threaded (forking a process with threads is not safe): children are reaped by
    polling. When its standard input closes (the test session has ended, or needs this zygote no more) it takes no
    more requests and ends once the commands it forked have."""
    live: dict[int, socket.socket] = {}
    watched = [listener, sys.stdin]
    while True:
        ready, _, _ = select.select(watched, [], [], 0.02)
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1024):
            watched = []
            path = listener.getsockname()
            listener.close()
            # its folder, as the test side's close() does, whose process may end without its atexit (an xdist worker)
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        if not watched and not live:
            os._exit(0)
        if listener in ready and watched:
            conn, _ = listener.accept()
            conn.settimeout(30)  # a requester that died before it wrote its request does not stop the zygote
            try:
                size = _HEADER.unpack(_recv_exact(conn, _HEADER.size))[0]
                message, fds, _, _ = socket.recv_fds(conn, size, 3)
                while len(message) < size:
                    message += _recv_exact(conn, size - len(message))
                request = json.loads(message)
            except (OSError, EOFError, ValueError):
                conn.close()
                continue
            conn.settimeout(None)
            request["fds"] = fds
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in live.values():
                    other.close()
                conn.close()
                return request
            for fd in fds:
                os.close(fd)
            conn.sendall(_HEADER.pack(pid))
            live[pid] = conn
        while live:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = live.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(struct.pack("!i", status))
                except OSError:
                    pass  # the test that started it has gone
                conn.close()


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise EOFError("the zygote's requester closed its connection")
        data += chunk
    return data


def _become(request: dict) -> None:
    """In the forked child: take the requested standard streams, directory, environment and argv."""
    for target, fd in enumerate(request["fds"]):
        os.dup2(fd, target)
    for fd in set(request["fds"]):
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if request["script"]:
        sys.path[0] = os.path.dirname(os.path.abspath(request["script"]))  # what `python SCRIPT` puts first
        sys.argv = [request["script"], *request["argv"]]
    else:
        sys.path[0] = os.getcwd()  # what `python -m` puts first
        sys.argv = ["-m", *request["argv"]]


def _main() -> None:
    for name in IMPORTS:
        __import__(name)
    path = sys.argv[1]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    if threading.active_count() != 1:  # (numpy's OpenBLAS starts its threads at import: it is made to be forked)
        sys.stderr.write(f"zygote: {threading.enumerate()} after its imports: not forking\n")
        sys.exit(1)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    request = _serve(listener)
    _become(request)
    import runpy

    if request["script"]:
        runpy.run_path(request["script"], run_name="__main__")
    else:
        runpy.run_module("ftis_engine", run_name="__main__", alter_sys=True)


# ---------------------------------------------------------------------------------------------- the test side

class _Zygote:
    def __init__(self, env: dict):
        self.dir = tempfile.mkdtemp(prefix="ftis-zygote-")
        self.path = os.path.join(self.dir, "socket")
        self.env = dict(env)
        self.proc = subprocess.Popen([sys.executable, __file__, self.path], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, cwd=os.path.dirname(os.path.dirname(__file__)))
        self.ready = False

    def wait_ready(self) -> bool:
        if not self.ready:
            line = self.proc.stdout.readline()
            self.ready = line == b"ready\n"
        return self.ready and self.proc.poll() is None

    def retire(self) -> None:
        """No more commands: it ends once those it forked have (their statuses still come back)."""
        if not self.proc.stdin.closed:
            self.proc.stdin.close()

    def close(self) -> None:
        self.retire()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # a command a test left running goes on, as a subprocess's would
        shutil.rmtree(self.dir, ignore_errors=True)


_zygotes: dict[tuple, _Zygote | None] = {}  # the most recently used last
_retired: list[_Zygote] = []
_lock = threading.Lock()


def _zygote_for(env: dict) -> _Zygote | None:
    key = _import_environment(env)
    with _lock:
        if key not in _zygotes:
            running = [k for k, z in _zygotes.items() if z is not None]
            if len(running) >= _MAX_ZYGOTES:
                retired = _zygotes.pop(running[0])
                retired.retire()  # the commands it forked go on, and their statuses still come back
                _retired.append(retired)
            _zygotes[key] = _Zygote(env)
        zygote = _zygotes[key] = _zygotes.pop(key)
        if zygote is not None and not zygote.wait_ready():
            zygote.close()
            _zygotes[key] = zygote = None  # it could not start: this environment's commands run as subprocesses
        return zygote


@atexit.register
def _close_all() -> None:
    for zygote in [*_retired, *_zygotes.values()]:
        if zygote is not None:
            zygote.close()


def _script(args) -> str | None:
    """The script `[sys.executable, SCRIPT.py, ...]` runs, or None."""
    if len(args) >= 2 and args[0] == sys.executable and os.fsdecode(args[1]).endswith(".py") \
            and os.path.isfile(args[1]):
        return os.path.abspath(os.fsdecode(args[1]))
    return None


def _forkable(args, kwargs) -> bool:
    if not isinstance(args, (list, tuple)) or (list(args[:3]) != [sys.executable, "-m", "ftis_engine"]
                                               and _script(args) is None):
        return False
    allowed = {"stdin", "stdout", "stderr", "capture_output", "text", "universal_newlines", "encoding", "errors",
               "cwd", "env", "timeout", "check", "input", "bufsize"}
    return set(kwargs) <= allowed


class _ForkedPopen(subprocess.Popen):
    """A subprocess.Popen whose child is forked by a zygote: pipes and text handling are Popen's own; starting,
    polling and waiting go through the zygote's socket."""

    def __init__(self, zygote: _Zygote, *args, **kwargs):
        self._zygote = zygote
        self._conn: socket.socket | None = None
        super().__init__(*args, **kwargs)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, *rest):
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1,
               errwrite if errwrite != -1 else 2]
        script = _script(args)
        request = {"script": script, "argv": [os.fsdecode(a) for a in args[2 if script else 3:]],
                   "cwd": os.fsdecode(cwd) if cwd else os.getcwd(), "env": dict(env if env is not None else os.environ)}
        message = json.dumps(request).encode()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self._zygote.path)
            conn.sendall(_HEADER.pack(len(message)))
            socket.send_fds(conn, [message], fds)
            self.pid = _HEADER.unpack(_recv_exact(conn, _HEADER.size))[0]
        except BaseException:
            conn.close()
            raise
        finally:  # the child's ends: the zygote has its own copies
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        self._conn = conn
        self._child_created = True

    def _status(self, timeout: float | None) -> bool:
        if self.returncode is not None:
            return True
        ready, _, _ = select.select([self._conn], [], [], timeout)
        if not ready:
            return False
        try:
            data = _recv_exact(self._conn, 4)
        except EOFError:  # the zygote died: the child's status is lost with it
            self.returncode = -9
            return True
        self.returncode = os.waitstatus_to_exitcode(struct.unpack("!i", data)[0])
        self._conn.close()
        return True

    def _internal_poll(self, _deadstate=None, **_):
        try:
            self._status(0)
        except (OSError, ValueError):
            if _deadstate is not None:
                self.returncode = _deadstate
        return self.returncode

    def _wait(self, timeout):
        if not self._status(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode


def Popen(args, **kwargs) -> subprocess.Popen:
    """subprocess.Popen(args, **kwargs), the command forked from a zygote where it can be (see the module's text)."""
    if _forkable(args, kwargs):
        zygote = _zygote_for(kwargs.get("env") or dict(os.environ))
        if zygote is not None:
            try:
                return _ForkedPopen(zygote, args, **kwargs)
            except (OSError, EOFError):  # the zygote has gone: this command, and the next, start as subprocesses
                with _lock:
                    _zygotes[_import_environment(zygote.env)] = None
                zygote.close()
    return subprocess.Popen(args, **kwargs)


def run(args, *, input=None, capture_output=False, timeout=None, check=False, **kwargs):
    """subprocess.run(args, ...), the command forked from a zygote where it can be (see the module's text)."""
    if not _forkable(args, kwargs):
        return subprocess.run(args, input=input, capture_output=capture_output, timeout=timeout, check=check,
                              **kwargs)
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    with Popen(args, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            process.kill()
            exc.stdout, exc.stderr = process.communicate()
            raise
        except BaseException:
            process.kill()
            raise
    result = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    if check:
        result.check_returncode()
    return result


if __name__ == "__main__":
    _main()
