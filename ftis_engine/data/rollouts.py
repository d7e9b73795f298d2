"""Rollouts: what members generate and exchange, and the wire format (8 bytes a token).

The wire format of one member's rollouts is one int32 buffer:
    [S] [S x 8 header words] [N token ids] [N generation log-probs as float32 bits]
with header words (prompt index, length, reward as float32 bits, member, policy version, finish reason, and the
time it was made in milliseconds since the epoch as two words, low then high), so a step's exchange costs
4 + 32 S + 8 N bytes for S sequences of N tokens in all. No padding goes on the wire. `decode` checks that a
buffer is well formed; what its values may be is the receiver's business (exchange/verify.py, exchange/admission.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from ..core.limits import HEADER_BYTES, HEADER_WORDS, max_buffer_words, wire_bytes  # noqa: F401  (the format's sizes)

FINISH_REASONS = ("stop", "length")


@dataclass
class Rollout:
    """One completion. completion_ids: int32 [L]; gen_logprobs: float32 [L], the generating policy's log-prob of
    each token at the sampling temperature; reward: as scored by the receiver (peers' claims are re-checked);
    policy_version: the sender's optimizer steps when it generated (its step - 1); made_at: seconds since the epoch
    when it was scored (the sender's clock; millisecond resolution on the wire). A NaN reward is "unscored": the
    sender's scoring had no verdict (math-verify timed out), and no member trains on that prompt's group."""

    member: int
    prompt_index: int
    completion_ids: torch.Tensor
    gen_logprobs: torch.Tensor
    reward: float
    finish_reason: str
    policy_version: int
    made_at: float = 0.0
    seq_logprob: float | None = None  # a foreign peer's (another tokenizer): the sequence's generation log-prob,
    # its per-token ones unknown (completion_ids are the receiver's re-encoding); never on the wire
    seq_tokens: int | None = None  # a foreign peer's: how many of its own tokens seq_logprob is over (the length
    # word of the header its rollout came in: the wire's 4 bytes a sequence)
    seq_eos_logprob: float | None = None  # a foreign peer's that stopped: its log-prob of its final EOS, which
    # seq_logprob includes and HACPO leaves out (batch.without_final_eos)

    @property
    def num_tokens(self) -> int:
        return int(self.completion_ids.numel())


class RolloutError(ValueError):
    """A rollout buffer or rollout that fails validation (peers' rollouts are untrusted input)."""


def reencoded(rollout: Rollout, ids: list[int]) -> Rollout:
    """A foreign peer's rollout, as its sender's tokens decoded in `rollout`, carried in the receiver's tokens `ids`
    (its text re-encoded, the receiver's EOS appended when it stopped): the per-token log-probs unknown (zeros),
    the sequence's log-prob (the sum of the sender's per-token ones), their count (the sender's length: what the
    header said) and, when it stopped, the sender's log-prob of its final EOS."""
    stopped = rollout.finish_reason == "stop"
    return Rollout(member=rollout.member, prompt_index=rollout.prompt_index,
                   completion_ids=torch.tensor(ids, dtype=torch.int32), gen_logprobs=torch.zeros(len(ids)),
                   reward=rollout.reward, finish_reason=rollout.finish_reason, policy_version=rollout.policy_version,
                   made_at=rollout.made_at, seq_logprob=float(rollout.gen_logprobs.double().sum()),
                   seq_tokens=rollout.num_tokens,
                   seq_eos_logprob=float(rollout.gen_logprobs[-1]) if stopped else None)


def encode(rollouts: list[Rollout]) -> torch.Tensor:
    """One member's rollouts as a flat int32 buffer (see the module docstring)."""
    n_seq = len(rollouts)
    header = torch.zeros((n_seq, HEADER_WORDS), dtype=torch.int32)
    for i, r in enumerate(rollouts):
        header[i, 0] = r.prompt_index
        header[i, 1] = r.num_tokens
        header[i, 2] = _float_bits(r.reward)
        header[i, 3] = r.member
        header[i, 4] = r.policy_version
        header[i, 5] = FINISH_REASONS.index(r.finish_reason)
        millis = int(round(r.made_at * 1000))
        header[i, 6] = _int32(millis & 0xFFFFFFFF)
        header[i, 7] = _int32(millis >> 32)
    ids = [r.completion_ids.to(torch.int32) for r in rollouts]
    logprobs = [r.gen_logprobs.to(torch.float32).view(torch.int32) for r in rollouts]
    return torch.cat([torch.tensor([n_seq], dtype=torch.int32), header.flatten(), *ids, *logprobs])


def _int32(unsigned: int) -> int:
    return unsigned - (1 << 32) if unsigned >= 1 << 31 else unsigned


def _float_bits(value: float) -> int:
    return int(torch.tensor([value], dtype=torch.float32).view(torch.int32)[0])


def decode(buffer: torch.Tensor) -> list[Rollout]:
    """Parse a buffer made by `encode`. Raises RolloutError when its sizes are inconsistent (truncated, padded,
    negative lengths, unknown finish reason). Says nothing yet about the values: see `validate`."""
    buffer = buffer.to("cpu", torch.int32).flatten()
    if buffer.numel() < 1:
        raise RolloutError("empty buffer")
    n_seq = int(buffer[0])
    if n_seq < 0 or 1 + HEADER_WORDS * n_seq > buffer.numel():
        raise RolloutError(f"header claims {n_seq} sequences but the buffer holds {buffer.numel()} words")
    header = buffer[1 : 1 + HEADER_WORDS * n_seq].view(n_seq, HEADER_WORDS)
    lengths = header[:, 1].long()
    if bool((lengths < 1).any()):
        raise RolloutError("a sequence length in the header is < 1")
    n_tok = int(lengths.sum())
    expected = 1 + HEADER_WORDS * n_seq + 2 * n_tok
    if buffer.numel() != expected:
        raise RolloutError(f"buffer holds {buffer.numel()} words, its header implies {expected}")
    start = 1 + HEADER_WORDS * n_seq
    ids = buffer[start : start + n_tok]
    logprobs = buffer[start + n_tok :].view(torch.float32)
    rewards = header[:, 2].contiguous().view(torch.float32)
    millis = (header[:, 6].long() & 0xFFFFFFFF) | (header[:, 7].long() << 32)
    out, offset = [], 0
    for i in range(n_seq):
        length = int(lengths[i])
        reason = int(header[i, 5])
        if not 0 <= reason < len(FINISH_REASONS):
            raise RolloutError(f"sequence {i}: unknown finish reason code {reason}")
        out.append(Rollout(
            member=int(header[i, 3]), prompt_index=int(header[i, 0]),
            completion_ids=ids[offset : offset + length].clone(), gen_logprobs=logprobs[offset : offset + length].clone(),
            reward=float(rewards[i]), finish_reason=FINISH_REASONS[reason], policy_version=int(header[i, 4]),
            made_at=int(millis[i]) / 1000.0,
        ))
        offset += length
    return out


def claimed_sequences(buffer: torch.Tensor | bytes) -> int:
    """The sequences a buffer claims to hold (its first word, bounded by what its size allows): for counting
    what a receiver dropped unread, or a sender could not send. Raw bytes (a parcel's body as it travels) count as
    the int32 words they hold; bytes that are not whole words claim none."""
    if isinstance(buffer, (bytes, bytearray)):
        if len(buffer) < 4 or len(buffer) % 4:
            return 0
        first, words = int.from_bytes(buffer[:4], "little", signed=True), len(buffer) // 4
    else:
        if buffer.numel() < 1:
            return 0
        first, words = int(buffer[0]), buffer.numel()
    return max(0, min(first, (words - 1) // HEADER_WORDS))


def buffer_digest(buffer: torch.Tensor) -> str:
    """Fingerprint of a wire buffer (sender and receivers log it: equal digests mean bit-exact delivery of
    everything but the times the rollouts were made, which are left out so that runs compare across processes)."""
    words = buffer.to(torch.int32).flatten().clone()
    n_seq = int(words[0]) if words.numel() else 0
    if 0 < n_seq and 1 + HEADER_WORDS * n_seq <= words.numel():
        words[1 : 1 + HEADER_WORDS * n_seq].view(n_seq, HEADER_WORDS)[:, 6:8] = 0
    return hashlib.sha256(words.numpy().tobytes()).hexdigest()[:16]
