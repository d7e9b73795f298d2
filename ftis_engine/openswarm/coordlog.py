"""The coordinator's log read back (coordinator.jsonl): what a coordinator restarted on the log of the one before it
restores, each line read bounded."""

from __future__ import annotations

import json
import pathlib

from ..core.safefile import open_bounded
from .rules import DIGEST, MAX_LIVE, join_problem
from .wire import MAX_HEADER

# a line of coordinator.jsonl: an event with the live names, or a restart's restored members (MAX_LIVE entries of
# under 500 bytes: ~8 headers), and its fields
MAX_LOG_LINE = 16 * MAX_HEADER


def _identity(value) -> bytes:
    """A logged connection identity (hex) as bytes; b"" for none or one that is not hex."""
    try:
        return bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        return b""


def restore(log_path: pathlib.Path) -> tuple[dict[str, tuple[str, int, str, bytes, str, str]], str | None,
                                              dict | None, bool]:
    """The members live when the previous coordinator of this log stopped, killed or not (name -> (tokenizer,
    newest step logged, tokenizer source, the connection identity it joined from, its listening address and link
    key)), the training set's hash
    its newest `start` record holds (a coordinator's own; a join's, a stranger's word, never counts), the shared
    settings that record holds and whether the log holds any record; ({}, None, None, False) for a new log. A
    member that is gone holds its place for one lease at most. Read a line at a time: the log grows with the run. Every coordinator
    that wrote to a log had its settings (each was refused at start otherwise) and held its directory's lock
    (swarm serve's RunLock), so all of it is one swarm's."""
    if not log_path.is_file():
        return {}, None, None, False
    recorded: dict | None = None
    logged = False
    tokenizers: dict[str, str] = {}
    sources: dict[str, str] = {}
    links: dict[str, tuple[str, str]] = {}  # name -> (address, key) of its join
    identities: dict[str, bytes] = {}
    steps: dict[str, int] = {}
    live: list[str] = []
    dataset = None
    with open_bounded(log_path, 1 << 62, "coordinator.jsonl") as log:  # a regular file, read a line at a time
        for line in iter(lambda: log.readline(MAX_LOG_LINE), b""):  # each line bounded: a longer one is cut
            try:  # into parts that are no record
                record = json.loads(line)
            except ValueError:  # a line the killed coordinator did not finish (or not UTF-8)
                continue
            if not isinstance(record, dict):
                continue
            logged = True
            if record.get("event") == "start" and isinstance(record.get("shared"), dict):
                recorded = record["shared"]
                said = record.get("dataset")  # a start record of before this was logged: nothing to compare
                dataset = said if isinstance(said, str) and DIGEST.fullmatch(said) else None
            name = record.get("member")
            if isinstance(record.get("tokenizer"), str) and isinstance(name, str):
                tokenizers[name] = record["tokenizer"]
                sources[name] = str(record.get("source", ""))
                links[name] = (str(record.get("address", "")), str(record.get("key", "")))
                identities[name] = _identity(record.get("identity"))
            if isinstance(record.get("step"), int) and isinstance(name, str):
                steps[name] = record["step"]
            if isinstance(record.get("live"), list):
                live = record["live"]
    # what a join would be refused for is not restored either (a log written before these caps)
    members = {name: (tokenizers[name], steps.get(name, 0), sources[name], identities[name], *links[name])
               for name in live if isinstance(name, str) and name in tokenizers and join_problem(
                   {"name": name, "tokenizer": tokenizers[name], "source": sources[name], "dataset": "0" * 64,
                    "address": links[name][0], "key": links[name][1]}) is None}
    return dict(list(members.items())[:MAX_LIVE]), dataset, recorded, logged
