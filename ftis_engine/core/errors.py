"""How an exception is told in one line (the command line's errors are one line each), and how text from outside
(a peer's or a coordinator's words) is shown to a person."""

from __future__ import annotations

MAX_SHOWN = 200  # characters of one piece of outside text in a line (a name, a reason, a source)


def shown(text: object, limit: int | None = MAX_SHOWN) -> str:
    """Text that may come from outside (a peer's or a coordinator's words: a refusal's reason, a name, a tokenizer's
    source, an exception's message quoting them) as it may reach a terminal or a log: every character that is not
    printable (ESC and the other controls, line breaks, bidirectional overrides, zero-width characters, lone
    surrogates) written as its escape (\\x1b, \\u202e), and at most `limit` characters of it (cut with "...";
    None: no bound). Escaped, it can neither clear the screen, move the cursor, ring the bell, forge a line of its
    own, nor reorder what is shown."""
    out, size = [], 0
    for char in str(text):
        piece = char if char.isprintable() else char.encode("unicode_escape").decode("ascii")
        if limit is not None and size + len(piece) > limit:
            out.append("...")
            break
        out.append(piece)
        size += len(piece)
    return "".join(out)


def error_line(message: str) -> str:
    """A command's error as the one line it prints: "error: " and the message, its whitespace runs one space and
    every character that is not printable escaped (shown): a message may quote a coordinator or a peer."""
    return f"error: {shown(' '.join(message.split()), limit=None)}\n"


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message (at most `limit` characters), or its type's name when it has none."""
    lines = str(exc).strip().splitlines()
    return lines[0][:limit] if lines else type(exc).__name__


def describe_load_error(exc: BaseException) -> str:
    """Why a file could not be loaded, for one line. torch.load(weights_only=True) refusing a pickle that holds more
    than tensors says so plainly: torch's own message suggests retrying with weights_only=False, the one thing not
    to do with a file from someone else."""
    import pickle

    if isinstance(exc, pickle.UnpicklingError):
        return ("UnpicklingError: it holds pickled objects other than tensors and plain values; refused unread "
                "(loading it would run code)")
    return f"{type(exc).__name__}: {first_line(exc)}"
