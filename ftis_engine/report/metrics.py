"""metrics.jsonl (one JSON object a line) and TensorBoard events, written as the run goes; the records of a step
and the stopwatch that times its phases (the README's "Run directory" lists every key)."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import json
import logging
import math
import os
import pathlib
import time
import zlib
from collections import defaultdict
from collections.abc import Collection
from typing import NamedTuple

import torch

from ..core import safefile
from ..data.rollouts import Rollout

log = logging.getLogger("ftis_engine.report.metrics")


class Stopwatch:
    """Seconds spent per phase: `with watch("gen_seconds"): ...` adds the block's wall time to that key."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, key: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[key] += time.perf_counter() - start


def _mean(values) -> float:
    values = list(values)
    return float(sum(values) / len(values)) if values else float("nan")


def mean_reward(rollouts: list[Rollout]) -> float:
    """Mean reward of the scored rollouts (an unscored one, NaN, has no reward to average); NaN when none is."""
    return _mean(r.reward for r in rollouts if not math.isnan(r.reward))


def train_record(step: int, name: str, own: list[Rollout], trained: list[Rollout], stats: dict[str, float],
                 watch: Stopwatch, lr: float, sent_bytes: int, own_digest: str) -> dict:
    """The `kind: train` record of one member's step (the exchange's own keys are added by the step: see
    exchange.admission.Received.metrics). own: the rollouts it generated; trained: what it trained on (its own
    and the peers' it took); watch: its seconds per phase (gen_seconds, train_seconds, sync_seconds,
    exchange_wait_seconds, lead_wait_seconds, exchange_seconds); sent_bytes: what its rollouts cost on the wire
    (0: nobody got them)."""
    seconds = watch.seconds
    sent = sent_bytes > 0
    return {
        "step": step, "member": name, "kind": "train",
        "reward_mean": mean_reward(own),
        "swarm_reward_mean": _mean(r.reward for r in trained),
        **stats,
        "tokens": sum(r.num_tokens for r in trained),
        "sequences": len(trained),
        "own_sequences": len(own),
        "completion_len_mean": _mean(r.num_tokens for r in own),
        "truncated_frac": _mean(r.finish_reason == "length" for r in own),
        "gen_seconds": seconds["gen_seconds"],
        "train_seconds": seconds["train_seconds"],
        "sync_seconds": seconds["sync_seconds"],
        "exchange_bytes": sent_bytes,
        "exchange_tokens": sum(r.num_tokens for r in own) if sent else 0,
        "exchange_sequences": len(own) if sent else 0,
        "exchange_seconds": seconds["exchange_seconds"],
        "exchange_wait_seconds": seconds["exchange_wait_seconds"],
        "lead_wait_seconds": seconds["lead_wait_seconds"],
        # the member's own step: generating, exchanging (waiting included), updating and moving the new weights
        # into its generator and samplers; eval excluded
        "step_seconds": seconds["gen_seconds"] + seconds["train_seconds"] + seconds["exchange_wait_seconds"]
        + seconds["exchange_seconds"] + seconds["sync_seconds"],
        "rollouts_sha256": own_digest,
        "lr": lr,
        "ended_at": time.time(),  # seconds since the epoch: orders async members' steps (and sampler rounds)
    }


class GpuMemory:
    """A CUDA member's memory over one step: torch's peak allocation in this process (`gpu_peak_gib`; a vLLM
    engine's pool may sit outside it) and the most the whole device had in use at the moments noted (`gpu_used_gib`:
    every process on the GPU, engines included; noted after generation, while the engine is awake, and after the
    update). Nothing on another device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device if device.type == "cuda" else None
        self.used = 0
        if self.device is not None:
            torch.cuda.reset_peak_memory_stats(self.device)

    def note(self) -> None:
        if self.device is not None:
            free, total = torch.cuda.mem_get_info(self.device)
            self.used = max(self.used, total - free)

    def record(self) -> dict:
        if self.device is None:
            return {}
        self.note()
        return {"gpu_peak_gib": torch.cuda.max_memory_allocated(self.device) / 2**30, "gpu_used_gib": self.used / 2**30}


def resident_mib() -> float | None:
    """This process's resident memory in MiB (Linux; None elsewhere): a long run's should stay flat."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


@functools.cache
def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl): nothing to trim
        return None


def return_freed_memory() -> None:
    """Hand the host memory freed by the phase that just ended back to the OS (glibc's malloc_trim). glibc keeps
    freed blocks of the CPU allocator in its arenas: generation's KV cache, then the update's activations, then
    the next step's cache land in different places, and a 135 M-parameter member's resident memory climbed from
    2 GB to 6-7 GB over two steps on the CPU though what it held stayed at 2 GB. A few milliseconds a call."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def eval_record(step: int, member: str, dataset: str, accuracy: float, samples: int,
                correct: list[bool] | None = None) -> dict:
    """An eval line: greedy pass@1 on `samples` questions; with `correct` (whether each question was solved, in
    the eval set's order) also `correct`, a string of 0 and 1 a question (encode_correct): an analysis over
    questions (a bootstrap over the fixed eval set, a paired test per question) reads it back with decode_correct."""
    record = {"step": step, "member": member, "kind": "eval", "dataset": dataset, "accuracy": accuracy,
              "samples": samples}
    if correct is not None:
        if len(correct) != samples:
            raise ValueError(f"correct: {len(correct)} questions for {samples} samples")
        record["correct"] = encode_correct(correct)
    return record


def encode_correct(correct: list[bool]) -> str:
    """Per-question correctness as text, one character a question in order: "1" solved, "0" not ("0110")."""
    return "".join("1" if c else "0" for c in correct)


def decode_correct(text: str) -> list[bool]:
    """encode_correct's inverse; raises ValueError on any other character."""
    if set(text) - {"0", "1"}:
        raise ValueError(f"correct: only 0 and 1, got {sorted(set(text) - {'0', '1'})[0]!r}")
    return [c == "1" for c in text]


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _after_event_files(folder: pathlib.Path) -> None:
    """Wait, if need be, until the clock's second is past the newest TensorBoard event file's in `folder`.
    TensorBoard reads a folder's files in the order of their names, `events.out.tfevents.<second>.<host>.<pid>.<n>`,
    where n counts the writers a process has made: a resume's file made in the second of the file before it could
    sort first (n = 10 after 9, or a new process's 0 after 3), and its purge would act before the steps it drops
    were read: they would stay, twice. A resume starts seconds after what it resumes; a process that writes twice
    in one second (a test, a notebook) waits at most one. A file from the future (another machine's clock) is
    not waited for."""
    newest = -1
    with contextlib.suppress(OSError):
        for path in folder.glob("events.out.tfevents.*"):
            second = path.name.split(".")[3]
            if second.isdigit():
                newest = max(newest, int(second))
    if int(time.time()) == newest:
        time.sleep(max(0.0, newest + 1 - time.time()) + 1e-3)


class MetricsLogger:
    """Appends lines to run_dir/metrics.jsonl (flushed and fsynced per line) and mirrors numbers to TensorBoard
    under run_dir/tensorboard as `<member>/<kind>/<key>`."""

    def __init__(self, run_dir: pathlib.Path, purge_step: int | None = None, tensorboard: bool = True,
                 shared: bool = False, tensorboard_suffix: str = "", trackers: list | None = None,
                 tensorboard_subdir: str = "", marks: dict | None = None):
        """shared: several processes append to the same metrics.jsonl (async ranks): each line is written under
        an exclusive lock, so lines never interleave. trackers: wandb / trackio (trackers.py), given the numbers
        TensorBoard gets, under the same names. tensorboard_subdir: a writer's own folder under tensorboard/
        (async ranks: TensorBoard applies one file's purge to every file of its folder, so a second rank's purge
        would drop the first's steps); purge_step: the first step a resumed run logs again (None: a fresh run).
        marks: keys every record carries (data_changed_at: the step a resume went on on changed data)."""
        self._trackers = list(trackers or [])
        self._marks = dict(marks or {})
        self.path = run_dir / "metrics.jsonl"
        self._file = safefile.open_append(self.path, run_dir)  # never through a link planted at its name
        self._completions = None  # completions.jsonl, opened at the first sample (logging.completions)
        self._shared = shared
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            folder = run_dir / "tensorboard" / tensorboard_subdir
            os.close(safefile.open_folder(folder, run_dir))  # made here, never through a link planted in its place
            _after_event_files(folder)
            self._tb = SummaryWriter(log_dir=str(folder), purge_step=purge_step, filename_suffix=tensorboard_suffix)

    def log(self, record: dict) -> None:
        record = {k: _clean(v) for k, v in {**record, **self._marks}.items()}
        if record["kind"] == "completion":  # for a person to read: completions.jsonl and TensorBoard text
            self._log_completion(record)
            return
        self._append(self._file, record)
        if self._tb is None and not self._trackers:
            return
        prefix = f"{record['member']}/{record['kind']}"
        if record["kind"] == "eval":
            prefix += f"/{record['dataset']}"
        values = {f"{prefix}/{key}": value for key, value in record.items()
                  if key not in ("step", "member", "kind", "dataset", *self._marks) and isinstance(value, (int, float))}
        if self._tb is not None:
            for name, value in values.items():
                self._tb.add_scalar(name, value, record["step"])
        for tracker in self._trackers:
            tracker.log(values, record["step"])

    def _append(self, file, record: dict) -> None:
        if self._shared:
            fcntl.flock(file, fcntl.LOCK_EX)
        try:
            file.write(json.dumps(record) + "\n")
            file.flush()
            os.fsync(file.fileno())
        finally:
            if self._shared:
                fcntl.flock(file, fcntl.LOCK_UN)

    def _log_completion(self, record: dict) -> None:
        if self._completions is None:
            self._completions = safefile.open_append(self.path.with_name("completions.jsonl"))
        self._append(self._completions, record)
        if self._tb is not None:
            text = (f"**from {record['from']}** (v{record['policy_version']}), reward {record['reward']}, advantage "
                    f"{record['advantage']:.3f}, IS weight {record['is_weight']:.3f}, KL {record['kl']:.3g}"
                    f"{', filtered' if record['filtered'] else ''}\n\n    {record['prompt'][-300:]!r}\n\n    "
                    f"{record['completion'][:600]!r}")
            self._tb.add_text(f"{record['member']}/completions", text, record["step"])

    def close(self) -> None:
        self._file.close()
        if self._completions is not None:
            self._completions.close()
        if self._tb is not None:
            self._tb.close()
        for tracker in self._trackers:
            tracker.close()


class MetricsError(OSError):
    """A metrics.jsonl that cannot be read at all (a directory, unreadable), or, read strictly, one with a line that is
    no record: one line naming it."""


def is_record(record: object) -> bool:
    """A line the engine can use: a JSON object with a string kind and member and a whole-number step."""
    return (isinstance(record, dict) and isinstance(record.get("kind"), str) and isinstance(record.get("member"), str)
            and isinstance(record.get("step"), int) and not isinstance(record.get("step"), bool))


class Lines(NamedTuple):
    """A metrics.jsonl, read once (read_lines)."""

    records: list[dict]
    bad: list[tuple[int, str]]  # (line number, text) of each line that is neither a record nor blank
    blank: list[int]  # the numbers of the blank lines
    count: int  # its lines
    open_end: bool  # its last line has no newline: a writer is still writing it, or a crash tore it
    numbers: tuple[int, ...] = ()  # the line number of each record


# The most a metrics.jsonl (or a kept record, once decompressed) may hold to be read whole: a long run's is tens of MB.
MAX_LOG_BYTES = 1 << 30


def _read_bounded(path: pathlib.Path) -> bytes:
    """The bytes of a metrics.jsonl, or of a .gz record decompressed (its members one after another, as gzip
    does), never more than MAX_LOG_BYTES read or inflated: MetricsError naming the file otherwise."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_LOG_BYTES + 1)
    except OSError as exc:
        # from None: a one-line error for the user; the cause adds nothing to it
        raise MetricsError(f"{path}: cannot read it ({exc.strerror or type(exc).__name__})") from None
    too_big = MetricsError(f"{path}: holds more than {MAX_LOG_BYTES >> 20} MiB of records (a run's are far fewer): "
                           "not read")
    if len(data) > MAX_LOG_BYTES:
        raise too_big
    if not path.name.endswith(".gz"):
        return data
    out, size, rest = [], 0, data
    while rest:
        member = zlib.decompressobj(wbits=31)
        try:
            out.append(member.decompress(rest, MAX_LOG_BYTES + 1 - size))
        except zlib.error:
            # from None: a one-line error for the user; the cause adds nothing to it
            raise MetricsError(f"{path}: cannot read it (not gzip data)") from None
        size += len(out[-1])
        if size > MAX_LOG_BYTES or member.unconsumed_tail:
            raise too_big
        if not member.eof:
            raise MetricsError(f"{path}: cannot read it (not a whole gzip stream: cut short)")
        rest = member.unused_data
    return b"".join(out)


def read_lines(path: pathlib.Path) -> Lines:
    """Every line of a metrics.jsonl, sorted into records, lines that are not, and blank lines, from one read; a
    name ending in .gz is read through gzip (a study's records/). A file that is not there has no lines. Raises
    MetricsError when the file cannot be read, or holds (or inflates to) more than MAX_LOG_BYTES."""
    if not path.exists():
        return Lines([], [], [], 0, False)
    text = _read_bounded(path).decode("utf-8", errors="replace")
    records, bad, blank, numbers = [], [], [], []
    lines = text.splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            blank.append(number)
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            record = None
        if is_record(record):
            records.append(record)
            numbers.append(number)
        else:
            bad.append((number, line))
    return Lines(records, bad, blank, len(lines), bool(text) and not text.endswith("\n"), tuple(numbers))



def _numbers(numbers: list[int]) -> str:
    return ", ".join(str(n) for n in numbers[:5]) + (f" and {len(numbers) - 5} more" if len(numbers) > 5 else "")


def read_metrics(path: pathlib.Path, *, kinds: Collection[str] | str | None = None, strict: bool = False) -> list[dict]:
    """The records of a metrics.jsonl (every line that is one: is_record), in the file's order; with `kinds`, those
    of these kinds alone (a string: one kind). The one reader of metrics.jsonl: the engine's, the benchmarks' and
    the tests'.

    A last line without its newline is one a writer is still writing (a reader following a live run) or one a crash
    tore: it is left out silently, whatever `strict` says, unless it is already a whole record (a newline was all
    it missed: a part of a JSON object is never one). Any other line that is not a record (edited by hand, without
    member, a text step):

    - strict=False (the engine; anything that reads a run still going): skipped, and a warning says which; the others
      all count. A bad last line (torn by a crash) is skipped silently.
    - strict=True (tests, benchmarks reading the runs they finished): MetricsError naming its line, a blank line too:
      every complete line is a record. A file that is not there is a MetricsError too.

    Raises MetricsError when the file cannot be read."""
    if strict and not path.exists():
        raise MetricsError(f"{path}: no such file")
    lines = read_lines(path)
    if strict:
        torn = lines.count if lines.open_end else None
        bad = sorted(n for n in [*(n for n, _ in lines.bad), *lines.blank] if n != torn)
        if bad:
            raise MetricsError(f"{path}: line(s) {_numbers(bad)} are not records (a JSON object with a kind, a member "
                               "and a whole-number step)")
    else:
        bad = [n for n, _ in lines.bad if n < lines.count]  # a last line torn by a crash: left out silently
        if bad:
            log.warning("%s: line(s) %s are not records (a JSON object with a kind, a member and a whole-number "
                        "step); skipped", path, _numbers(bad))
    if kinds is None:
        return lines.records
    kinds = {kinds} if isinstance(kinds, str) else set(kinds)
    return [r for r in lines.records if r["kind"] in kinds]


def truncate_metrics(path: pathlib.Path, last_step: int) -> list[dict]:
    """Keep every record of a step <= last_step (the resumed run rewrites what came after), atomically; a line
    that is no record is moved to metrics.jsonl.bad beside it (appended, with its line number), never lost and
    never read again. Returns the records dropped."""
    records, bad = read_lines(path)[:2]
    kept = [r for r in records if r["step"] <= last_step]
    if bad:
        aside = path.with_name(path.name + ".bad")
        with safefile.open_append(aside) as out:
            out.writelines(f"{number}\t{line}\n" for number, line in bad)
        log.warning("%s: %d line(s) that are not records (first: line %d) moved to %s; the %d record(s) up to "
                    "step %d are kept", path, len(bad), bad[0][0], aside, len(kept), last_step)
    safefile.write_text(path, "".join(json.dumps(r) + "\n" for r in kept))  # whole, never through a link
    return [r for r in records if r["step"] > last_step]


def resume_records(step: int, names: list[str], dropped: list[dict]) -> list[dict]:
    """`kind: resume` records of a run resumed at `step`: per member, the steps it had logged after the checkpoint
    and the rollouts it had generated in them. Their updates are rolled back and what was in flight is gone: all
    are lost, never half-used (the resumed run generates its steps anew)."""
    out = []
    for name in names:
        lost = [r for r in dropped if r.get("kind") == "train" and r.get("member") == name]
        out.append({"step": step, "member": name, "kind": "resume", "lost_steps": len(lost),
                    "lost_rollouts": sum(int(r.get("own_sequences", 0)) for r in lost)})
    return out
