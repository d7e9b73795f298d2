"""What crosses the open swarm's sockets: multipart messages [MAGIC, kind, header, body].

The header is a JSON object of at most MAX_HEADER bytes whose fields are checked against the kind's schema (names
and types, nothing else accepted); the body is raw bytes (a parcel's int32 rollout words), capped by the receiver.
Nothing is unpickled: a peer is untrusted input, and the coordinator is untrusted by members alike. Integers are
non-negative and below 2^31 (a step, a version, a word count: what an honest member can send), so no field can
grow a member list or a log line by its digits.

A member's sampler signs its parcels (`mac`: HMAC-SHA256 under a key its learner shared with it in their own process
group, never on the wire), so that its learner takes as its own only what its own samplers made: a peer, or the
coordinator, can send under a sampler's name but cannot sign.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import struct

MAGIC = b"ftis-swarm/1"
SAMPLER_MARK = "/sampler-"  # a member's sampler joins as <member>/sampler-<k>: it sends parcels, receives none
SAMPLER_INDEX = re.compile(r"0|[1-9][0-9]{0,5}")  # its k as written: ASCII, no leading 0 (one sampler, one name)
MAX_HEADER = 1 << 16  # a join carries the shared settings: a few KiB
MAX_INT = (1 << 31) - 1  # the largest integer in a header: a step, a version or a word count fits int32
MAC = re.compile(r"[0-9a-f]{64}")  # a parcel's mac: hex of an HMAC-SHA256
CURVE_KEY = re.compile(r"[0-9A-Za-z.:+=^!/*?&<>()\[\]{}@%$#-]{40}")  # a CurveZMQ public key in Z85

# kind -> {field: type}; every field is required, no other is accepted
SCHEMAS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "join": {"name": str, "tokenizer": str, "source": str, "shared": dict, "dataset": str, "step": int},
    "welcome": {"lease_s": (int, float), "members": dict},
    "refuse": {"reason": str},
    "beat": {"name": str, "step": int},
    "rejoin": {"reason": str},
    "members": {"members": dict},
    "changes": {"joined": dict, "left": list, "steps": dict},
    "parcel": {"name": str, "step": int, "version": int, "words": int},
    "leave": {"name": str},
}
# kind -> {field: type} a message may leave out: a sampler's parcels carry a mac, a learner's none
# a join: where its member listens for its peers and its link key (swarm.peers_per_step; "" or absent: none)
# a member list in parts (rules.list_parts): its part's index, how many parts and which list (all three, or none)
LIST_PART = {"part": int, "parts": int, "list": int}
OPTIONAL: dict[str, dict[str, type]] = {"parcel": {"mac": str}, "join": {"address": str, "key": str},
                                        "welcome": LIST_PART, "members": LIST_PART}


class WireError(ValueError):
    """A message that is not one of ours, or breaks its kind's schema or a size cap."""


def pack(kind: str, header: dict, body: bytes = b"") -> list[bytes]:
    if kind not in SCHEMAS:
        raise WireError(f"unknown kind {kind!r}")
    check_header(kind, header)
    frames = [MAGIC, kind.encode(), json.dumps(header, separators=(",", ":")).encode()]
    if body:
        frames.append(bytes(body))
    return frames


def unpack(frames: list[bytes], max_body: int) -> tuple[str, dict, bytes]:
    """(kind, header, body) of a received message; raises WireError on anything else."""
    if len(frames) not in (3, 4) or frames[0] != MAGIC:
        raise WireError("not a swarm message")
    try:
        kind = frames[1].decode("ascii")
    except UnicodeDecodeError:
        # from None: a remote's bad bytes, refused in one line; the cause adds nothing to it
        raise WireError("kind is not ASCII") from None
    if kind not in SCHEMAS:
        raise WireError(f"unknown kind {kind[:20]!r}")
    if len(frames[2]) > MAX_HEADER:
        raise WireError(f"{kind}: header of {len(frames[2])} bytes, more than {MAX_HEADER}")
    try:
        header = json.loads(frames[2])
    except (UnicodeDecodeError, ValueError, RecursionError):
        # from None: a remote's bad bytes, refused in one line; the cause adds nothing to it
        raise WireError(f"{kind}: header is not JSON") from None
    check_header(kind, header)
    body = frames[3] if len(frames) == 4 else b""
    if len(body) > max_body:
        raise WireError(f"{kind}: body of {len(body)} bytes, more than {max_body}")
    return kind, header, body


def check_header(kind: str, header: object) -> None:
    schema, optional = SCHEMAS[kind], OPTIONAL.get(kind, {})
    if not isinstance(header, dict):
        raise WireError(f"{kind}: header is not an object")
    missing, extra = sorted(set(schema) - set(header)), sorted(set(header) - set(schema) - set(optional))
    if missing or extra:
        raise WireError(f"{kind}: header fields {'missing ' + str(missing) if missing else 'unexpected ' + str(extra)}")
    for field, expected in {**schema, **optional}.items():
        if field not in header:
            continue
        value = header[field]
        if isinstance(value, bool) or not isinstance(value, expected):
            raise WireError(f"{kind}: {field} is {type(value).__name__}, not {_names(expected)}")
        if isinstance(value, int) and value < 0:
            raise WireError(f"{kind}: {field} is negative")
        if isinstance(value, int) and value > MAX_INT:
            raise WireError(f"{kind}: {field} is larger than 2^31 - 1")
        if isinstance(value, float) and not 0 < value < float("inf"):
            raise WireError(f"{kind}: {field} is not a positive finite number")


def _names(expected) -> str:
    return " or ".join(t.__name__ for t in (expected if isinstance(expected, tuple) else (expected,)))


def parcel_mac(key: bytes, name: str, step: int, version: int, body: bytes) -> str:
    """A sampler's signature of its parcel: hex HMAC-SHA256 under its learner's key of (name, step, version, body),
    each field delimited so that no two parcels sign alike."""
    message = name.encode() + b"\x00" + struct.pack("<qq", step, version) + bytes(body)
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def mac_matches(key: bytes, name: str, step: int, version: int, body: bytes, mac: str) -> bool:
    """Whether `mac` (as received: any string) is this parcel's signature under `key`; compared in constant time."""
    return bool(MAC.fullmatch(mac)) and hmac.compare_digest(parcel_mac(key, name, step, version, body).encode(),
                                                           mac.encode())


HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")  # a host name, an IPv4 address or an interface
IPC_PATH_BYTES = 107  # what a Unix socket's path holds (sun_path, 108 bytes with its NUL)


def address_problem(address: str, bind: bool) -> str | None:
    """Why `address` is not one the coordinator binds (bind: `swarm serve --bind`) or a member dials (`train
    --join`), as the rest of a sentence that starts with the address; None when it is one. tcp://HOST:PORT with a
    host name, an IPv4 address or an [IPv6] one and a port of 1-65535 (binding: also 0 or *, a free port, and the
    host * for every interface); ipc://PATH with a path a Unix socket holds. ZeroMQ itself takes ports past 65535,
    negative ones or with letters after them (it bound :99999 to a random port, :5555x to 5555)."""
    if address.startswith("ipc://"):
        path = address[len("ipc://"):]
        if not path:
            return "has no path (ipc:///tmp/swarm.sock)"
        if len(path.encode(errors="replace")) > IPC_PATH_BYTES:
            return f"has a path of more than the {IPC_PATH_BYTES} bytes a Unix socket's path holds"
        return None
    if not address.startswith("tcp://"):
        return "is not an address like tcp://HOST:PORT (or ipc://PATH)"
    rest = address[len("tcp://"):]
    host, colon, port = rest.rpartition(":")
    if not colon or (rest.startswith("[") and rest.endswith("]")):
        return "has no port: tcp://HOST:PORT"
    if not host:
        return "has no host: tcp://HOST:PORT"
    if host.startswith("[") and host.endswith("]"):
        import ipaddress

        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return f"has {host[:60]!r} in brackets, which is no IPv6 address"
    elif not (HOST.fullmatch(host) or (bind and host == "*")):
        return (f"has {host[:60]!r} for its host: a name, an IPv4 address or an [IPv6] one"
                + (" (or * for every interface)" if bind else ""))
    if bind and port in ("*", "0"):
        return None
    if not re.fullmatch(r"[1-9][0-9]{0,4}", port) or int(port) > 65535:
        return (f"has {port[:20]!r} for its port: a number of 1-65535"
                + (" (or 0 or * for a free one)" if bind else ""))
    return None


def ipv6(address: str) -> bool:
    """Whether a tcp address names an [IPv6] host (its socket needs ZMQ_IPV6)."""
    return address.startswith("tcp://[")


def host_problem(address: str) -> str | None:
    """Why a tcp address's host name resolves to no address here (ZeroMQ would dial it, unresolved, until
    swarm.timeout_s), as the rest of a sentence; None when it resolves or is an address itself."""
    import ipaddress
    import socket

    host = address[len("tcp://"):].rpartition(":")[0].strip("[]")
    if not address.startswith("tcp://") or host == "*":
        return None
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError) as exc:
        return f"names a host that does not resolve here ({getattr(exc, 'strerror', None) or exc})"
    return None
