"""An open swarm's rules, which the coordinator enforces and its members and clients check before they ask: the shared
settings every member must agree on (SHARED) and the swarm's config (load_swarm_config), what a join's own fields may
be (join_problem: the caps keep each part of a member list within one header, wire.MAX_HEADER) and what a parcel may
be (parcel_problem, max_parcel_bytes). What a coordinator announces is held to the same rules its own config obeys
(lease_problem, view_problem): a member takes no setting from a coordinator that no coordinator's config could have."""

from __future__ import annotations

import pathlib
import re

from ..config import (
    SAFE_NAME,
    ConfigError,
    RunConfig,
    SwarmSettings,
    apply_override,
    read_yaml_mapping,
    validate_config,
    value_differences,
)
from ..core.errors import shown
from ..core.limits import max_buffer_words
from .wire import CURVE_KEY, MAC, MAX_HEADER, SAMPLER_INDEX, SAMPLER_MARK, address_problem

# What every member of one open swarm must agree on (the rest of a member's config is its own: its model, LoRA,
# optimizer, loss, ranks). Vertical collaboration only: each member generates whole groups of its own prompts.
SHARED = ("seed", "collaboration", "rollout.group_size", "rollout.prompts_per_step", "rollout.max_new_tokens",
          "rollout.temperature", "rollout.top_p", "rollout.top_k", "data", "train.steps", "swarm.max_lead",
          "swarm.max_staleness", "swarm.max_delay_s", "swarm.peers_per_step")
MAX_NAME = 100  # a member's name (config.SAFE_NAME); a sampler's adds SAMPLER_MARK and its index
DIGEST = re.compile(r"[0-9a-f]{64}")  # a tokenizer's or training set's sha256 (models.vocabulary_hash, dataset_hash)
MAX_SOURCE = 120  # a tokenizer's source: builtin:, packaged: or a hub id (at most 96 characters)
SOURCE = re.compile(rf"(?:[A-Za-z0-9][A-Za-z0-9:/_.@+=-]{{0,{MAX_SOURCE - 1}}})?")  # nothing JSON escapes
MAX_ADDRESS = 64  # where a member listens for its peers (swarm.peers_per_step): tcp://HOST:PORT
# live names at most. With the caps above a list entry is under 500 bytes: a whole list of more than ~120 names goes
# out in parts of at most PART_BYTES each (list_parts), each within one header; a member takes the list once it holds
# every part (client.SwarmClient). MAX_LIVE bounds what a coordinator holds and sends, not the wire.
MAX_LIVE = 1024
PART_BYTES = MAX_HEADER - 1024  # a part's entries, as JSON, within one header with its other fields
MAX_PARTS = -(-MAX_LIVE * 500 // PART_BYTES) + 1  # the most parts a list of MAX_LIVE entries takes (a member's bound)


def list_parts(view: dict[str, dict]) -> list[dict[str, dict]]:
    """A member list cut into parts, in its order, each part's entries at most PART_BYTES of JSON: [view] when it
    fits one. Each entry is under 500 bytes (the join's caps), so no part is empty and MAX_LIVE entries take at
    most MAX_PARTS."""
    import json

    parts: list[dict[str, dict]] = [{}]
    size = 2  # {}
    for name, entry in view.items():
        cost = len(json.dumps({name: entry}, separators=(",", ":")))  # its "name":{...} and a comma
        if parts[-1] and size + cost > PART_BYTES:
            parts.append({})
            size = 2
        parts[-1][name] = entry
        size += cost
    return parts


def shared_settings(config: RunConfig) -> dict:
    """The SHARED fields of a config, as a nested dict of JSON values."""
    dumped = config.model_dump(mode="json")
    out: dict = {}
    for path in SHARED:
        *parents, leaf = path.split(".")
        source, target = dumped, out
        for part in parents:
            source, target = source[part], target.setdefault(part, {})
        target[leaf] = source[leaf]
    return out


def first_difference(swarm: dict, member: dict) -> str | None:
    """'field: the swarm says X, this member Y' for the first shared field that differs, or None. Each value is
    cut to 100 characters: the member's is untrusted and the line goes back in one header and into the log."""
    differences = value_differences(swarm, member)
    if not differences:
        return None
    field, ours, theirs = differences[0]
    return f"{_shown(str(field))}: the swarm says {_shown(repr(ours))}, this member {_shown(repr(theirs))}"


def join_problem(header: dict) -> str | None:
    """What is wrong with a join's own fields (its name, hashes and source), in one line naming the field; None
    when nothing is. The caps keep every member list within one header (module docstring)."""
    name, owner, _, index = header["name"], *header["name"].rpartition(SAMPLER_MARK)
    if not (SAFE_NAME.fullmatch(name) or (SAFE_NAME.fullmatch(owner) and SAMPLER_INDEX.fullmatch(index))):
        return (f"name: {_shown(repr(name))} is neither a member's name (1-{MAX_NAME} letters, digits and _ . + = @ -) "
                f"nor one of its samplers' (<member>{SAMPLER_MARK}<k>)")
    for field in ("tokenizer", "dataset"):
        if not DIGEST.fullmatch(header[field]):
            return f"{field}: {_shown(repr(header[field]))} is not a sha256 hex digest (64 of 0-9a-f)"
    if not SOURCE.fullmatch(header["source"]):
        return (f"source: {_shown(repr(header['source']))} is not a tokenizer source (at most {MAX_SOURCE} letters, "
                "digits and : / _ . @ + = -)")
    address, key = header.get("address", ""), header.get("key", "")
    if address and (len(address) > MAX_ADDRESS or not address.startswith("tcp://")
                    or address_problem(address, bind=False) is not None):
        return (f"address: {_shown(repr(address))} is not where a member listens (tcp://HOST:PORT, at most "
                f"{MAX_ADDRESS} characters)")
    if address.startswith("tcp://["):
        return f"address: {_shown(repr(address))}: an IPv6 host is not supported for direct exchange"
    if key and not curve_key(key):
        return f"key: {_shown(repr(key))} is not a CurveZMQ public key (40 characters of Z85 of 32 bytes)"
    if address and not key:
        return "key: a member that listens announces the public key its links admit with"
    return None


def curve_key(key: str) -> bool:
    """Whether `key` is a CurveZMQ public key libzmq takes: Z85 of 32 bytes, written as Z85 writes it (40 characters
    of its alphabet can still decode past 2^32 a chunk, which libzmq refuses: a socket given one raises)."""
    import struct

    from zmq.utils import z85

    if not CURVE_KEY.fullmatch(key):
        return False
    try:
        raw = z85.decode(key.encode("ascii"))
    except (ValueError, struct.error):
        return False
    return len(raw) == 32 and z85.encode(raw) == key.encode("ascii")


def lease_problem(lease_s: float) -> str | None:
    """Why a lease a coordinator announced (its welcome) is not one a coordinator's config allows, by that
    field's own rules (swarm.lease_s: config.MIN_LEASE_S up to a day, finite): one line naming the field; None
    when it is one. A lease of 1e-300 s had a member beat as fast as its loop turns."""
    from pydantic import ValidationError

    try:
        SwarmSettings(lease_s=lease_s)
    except ValidationError as exc:
        return f"swarm.lease_s={lease_s!r}: {exc.errors()[0]['msg'].removeprefix('Value error, ')}"
    return None


def view_problem(members: dict, steps: int | None) -> str | None:
    """Why a member list a coordinator sent is not one it can send (beyond each entry's format, which the client
    checks): more than MAX_LIVE names (it admits no more), or a member (not a sampler: its rounds are its own
    count) at a step past train.steps (it refuses such a step in a join, a beat and a parcel). None when it is one."""
    if len(members) > MAX_LIVE:
        return f"{len(members)} live names, more than the {MAX_LIVE} a coordinator admits"
    past = [name for name, view in members.items() if SAMPLER_MARK not in name and steps is not None
            and isinstance(view, dict) and isinstance(view.get("step"), int) and view["step"] > steps]
    return f"{_shown(repr(past[0]))} at a step past train.steps={steps}" if past else None


def _shown(text: str) -> str:
    """A stranger's text in a refusal, the log or the echo: escaped and cut to 100 characters (errors.shown)."""
    return shown(text, 100)


def parcel_problem(header: dict, body: bytes) -> str | None:
    """What makes a parcel not one an honest member sends (its body's size against its header, an empty one: an
    honest member's empty step is one word, a buffer of 0 sequences; a mac that is not one); None if nothing."""
    if header["words"] < 1:
        return f"words: {header['words']}; a parcel holds at least one word (its count of sequences)"
    if len(body) != 4 * header["words"]:
        return f"parcel of {len(body)} bytes announced as {header['words']} words"
    if "mac" in header and not MAC.fullmatch(header["mac"]):
        return "mac: not a hex HMAC-SHA256 (64 of 0-9a-f)"
    return None


def load_swarm_config(path: pathlib.Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """A coordinator's config: the swarm's shared settings (SHARED) and swarm.lease_s, in a run config's format
    without `members` (each member brings its own). Checked as a run config is; a ConfigError names the field."""
    raw = read_yaml_mapping(path)
    for assignment in overrides:
        apply_override(raw, assignment)
    if "members" in raw:
        raise ConfigError(f"members: a swarm config has none (each member joins with its own config): {path}")
    if raw.get("collaboration", "vertical") != "vertical":
        raise ConfigError(f"collaboration: an open swarm is vertical (each member generates whole groups of its "
                          f"own prompts), not {raw['collaboration']!r}")
    # a run config needs a member: a stand-in, never used (nothing of a member is shared)
    return validate_config({**raw, "members": [{"name": "coordinator", "model": "builtin:tiny-s"}]})


def max_parcel_bytes(config: RunConfig) -> int:
    """The largest parcel an honest member sends: one step's whole groups of rollout.prompts_per_step prompts."""
    sequences = config.rollout.prompts_per_step * config.rollout.group_size
    return 4 * max_buffer_words(sequences, config.rollout.max_new_tokens)
