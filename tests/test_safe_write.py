"""The one writer of the files the commands write (ftis_engine/core/safefile.py, issue 78): atomic, never through a
symbolic link (at the file's name, or in place of a folder of the directory it writes in), nothing half-written, no
temp file left however a write fails."""

from __future__ import annotations

import errno
import json
import math
import os

import pytest

from ftis_engine.core import safefile
from ftis_engine.core.safefile import LinkRefused, open_append, save_figure, write_bytes, write_json, write_text


def listing(folder) -> set[str]:
    return {p.name for p in folder.iterdir()}


def test_a_link_at_the_files_name_is_replaced_by_the_file_and_its_target_is_untouched(tmp_path, outside):
    run = tmp_path / "run"
    run.mkdir()
    (run / "report.md").symlink_to(outside / "precious")
    assert write_text(run / "report.md", "new", run) == run / "report.md"
    assert not (run / "report.md").is_symlink() and (run / "report.md").read_text() == "new"
    assert (outside / "precious").read_text() == "kept" and listing(run) == {"report.md"}


@pytest.mark.parametrize("planted", ["link", "file"])
def test_a_link_or_a_file_where_a_folder_goes_is_refused_and_nothing_is_written_through_it(tmp_path, outside,
                                                                                           planted):
    run = tmp_path / "run"
    run.mkdir()
    if planted == "link":
        (run / "plots").symlink_to(outside)
    else:
        (run / "plots").write_text("a file")
    with pytest.raises(LinkRefused) as told:
        write_bytes(run / "plots" / "eval.png", b"png", run)
    assert told.value.errno == errno.ENOTDIR and told.value.filename == str(run / "plots")
    kind = "a symbolic link" if planted == "link" else "not a folder"
    assert told.value.strerror.startswith(f"{kind} where a folder the command writes goes")
    assert listing(outside) == {"precious"} and (outside / "precious").read_text() == "kept"


def test_a_link_deeper_down_is_refused_but_the_root_itself_is_the_users_path(tmp_path, outside):
    (tmp_path / "via").symlink_to(outside)  # the directory the user named may be a link: followed
    write_text(tmp_path / "via" / "figures" / "a.png", "x", tmp_path / "via")
    assert (outside / "figures" / "a.png").read_text() == "x"
    (outside / "figures" / "deeper").symlink_to(tmp_path)
    with pytest.raises(LinkRefused):
        write_text(tmp_path / "via" / "figures" / "deeper" / "b.png", "x", tmp_path / "via")
    assert not (tmp_path / "b.png").exists()


def test_folders_are_made_and_a_file_outside_the_root_is_a_programming_error(tmp_path):
    write_text(tmp_path / "a" / "b" / "c.txt", "x", tmp_path)
    assert (tmp_path / "a" / "b" / "c.txt").read_text() == "x"
    with pytest.raises(ValueError, match="not a file inside"):
        write_text(tmp_path / ".." / "escape.txt", "x", tmp_path)
    with pytest.raises(ValueError):
        write_text(tmp_path.parent / "elsewhere.txt", "x", tmp_path)


def test_the_file_is_replaced_whole_a_reader_of_the_old_one_keeps_reading_it(tmp_path):
    """Atomic: a new file takes the name in one rename; the old one is never truncated and rewritten in place."""
    path = tmp_path / "summary.json"
    path.write_text("old contents")
    with open(path) as reader:
        write_text(path, "new", tmp_path)
        assert reader.read() == "old contents"
    assert path.read_text() == "new" and listing(tmp_path) == {"summary.json"}


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()])
def test_a_write_that_fails_keeps_the_old_file_and_leaves_no_temp_file(tmp_path, monkeypatch, failure):
    path = tmp_path / "report.md"
    path.write_text("old")

    def fsync(fd):
        raise failure

    monkeypatch.setattr(safefile.os, "fsync", fsync)
    with pytest.raises(type(failure)):
        write_text(path, "new", tmp_path)
    assert path.read_text() == "old" and listing(tmp_path) == {"report.md"}


def test_write_json_writes_strict_json_and_refuses_a_nan_writing_nothing(tmp_path):
    path = tmp_path / "summary.json"
    write_json(path, {"a": [1, 0.5]}, tmp_path, indent=1)
    assert json.loads(path.read_text()) == {"a": [1, 0.5]}
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
            write_json(path, {"a": bad}, tmp_path)
    assert json.loads(path.read_text()) == {"a": [1, 0.5]} and listing(tmp_path) == {"summary.json"}


@pytest.mark.parametrize("suffix, magic", [(".png", b"\x89PNG"), (".pdf", b"%PDF"), (".svg", b"<?xml")])
def test_a_figure_is_written_in_the_format_its_suffix_names(tmp_path, outside, suffix, magic):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    (tmp_path / f"fig{suffix}").symlink_to(outside / "precious")
    save_figure(fig, tmp_path / f"fig{suffix}", dpi=50)
    plt.close(fig)
    assert (tmp_path / f"fig{suffix}").read_bytes().startswith(magic)
    assert (outside / "precious").read_text() == "kept"


def test_a_log_is_appended_to_never_through_a_link_and_only_when_it_is_a_regular_file(tmp_path, outside):
    log = tmp_path / "coordinator.jsonl"
    for line in ("a\n", "b\n"):
        with open_append(log) as out:
            out.write(line)
    assert log.read_text() == "a\nb\n"
    (tmp_path / "linked.jsonl").symlink_to(outside / "precious")
    with pytest.raises(LinkRefused) as told:
        open_append(tmp_path / "linked.jsonl")
    assert told.value.errno == errno.EPERM and told.value.strerror.startswith("a symbolic link where a file")
    os.mkfifo(tmp_path / "fifo.jsonl")  # opened for writing with no reader it would block the command for good
    with pytest.raises(LinkRefused, match="not a regular file"):
        open_append(tmp_path / "fifo.jsonl")
    (tmp_path / "sub").symlink_to(outside)
    with pytest.raises(LinkRefused):
        open_append(tmp_path / "sub" / "x.log", tmp_path)
    assert (outside / "precious").read_text() == "kept" and listing(outside) == {"precious"}


def test_a_refused_link_ends_a_command_in_one_line_with_exit_code_2(tmp_path, outside):
    """The end of `train` draws its plots with the same writer: a link there ends it as a path to check does."""
    from ftis_engine.app.exits import outcome

    (tmp_path / "plots").symlink_to(outside)
    with pytest.raises(LinkRefused) as told:
        write_bytes(tmp_path / "plots" / "train.png", b"png", tmp_path)
    said = outcome(told.value)
    assert said.code == 2 and said.line == (
        f"{tmp_path / 'plots'}: a symbolic link where a folder the command writes goes: nothing is written through "
        "it; move it away (check --output-dir and the paths in the config)")


def test_open_write_streams_a_whole_file_and_a_failure_keeps_the_old_one(tmp_path, outside):
    """torch.save's file: the same temp file and rename as write_bytes; a link at the name is replaced, its target
    untouched."""
    import torch

    path = tmp_path / "optimizer.pt"
    path.symlink_to(outside / "precious")
    with safefile.open_write(path, tmp_path) as out:
        torch.save({"x": torch.arange(3)}, out)
    assert not path.is_symlink() and torch.equal(torch.load(path, weights_only=True)["x"], torch.arange(3))
    with pytest.raises(RuntimeError, match="cut short"):
        with safefile.open_write(path, tmp_path) as out:
            out.write(b"half")
            raise RuntimeError("cut short")
    assert torch.equal(torch.load(path, weights_only=True)["x"], torch.arange(3))
    assert listing(tmp_path) == {"optimizer.pt", "outside"} and (outside / "precious").read_text() == "kept"


def test_write_folder_renames_a_fresh_folder_into_place_and_replaces_an_older_one(tmp_path):
    def write(folder):
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(b"w")

    model = tmp_path / "members" / "a" / "model"
    assert safefile.write_folder(model, write, tmp_path) == model
    assert listing(model) == {"config.json", "model.safetensors"} and listing(model.parent) == {"model"}
    safefile.write_folder(model, lambda folder: (folder / "other.json").write_text("1"), tmp_path)
    assert listing(model) == {"other.json"} and listing(model.parent) == {"model"}  # the old one removed


@pytest.mark.parametrize("planted", ["link", "file"])
def test_write_folder_refuses_a_link_or_a_file_at_its_name_before_anything_is_written(tmp_path, outside, planted):
    model = tmp_path / "model"
    if planted == "link":
        model.symlink_to(outside)
    else:
        model.write_text("a file")
    called = []
    with pytest.raises(LinkRefused) as told:
        safefile.write_folder(model, called.append, tmp_path)
    assert told.value.filename == str(model) and not called
    assert listing(outside) == {"precious"} and listing(tmp_path) == {"model", "outside"}


def test_write_folder_refuses_a_link_planted_while_the_library_writes(tmp_path, outside):
    model = tmp_path / "model"

    def write(folder):
        (folder / "config.json").write_text("{}")
        model.symlink_to(outside)  # planted between the check and the rename

    with pytest.raises(LinkRefused):
        safefile.write_folder(model, write, tmp_path)
    assert listing(outside) == {"precious"} and listing(tmp_path) == {"model", "outside"} and model.is_symlink()


def test_write_folder_removes_its_temp_folder_however_the_library_fails(tmp_path):
    def write(folder):
        (folder / "half.safetensors").write_bytes(b"x")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        safefile.write_folder(tmp_path / "model", write, tmp_path)
    assert listing(tmp_path) == set()


def test_write_folder_gives_the_library_a_path_no_swapped_folder_above_it_redirects(tmp_path, outside):
    """The folder handed to the library is reached through this process's descriptor of its parent: a parent
    renamed away and replaced by a link while it writes takes nothing outside."""
    run = tmp_path / "run"
    (run / "members").mkdir(parents=True)

    def write(folder):
        (run / "members").rename(tmp_path / "moved")
        (run / "members").symlink_to(outside)
        (folder / "model.safetensors").write_bytes(b"w")

    safefile.write_folder(run / "members" / "model", write, run)
    assert listing(outside) == {"precious"} and (tmp_path / "moved" / "model" / "model.safetensors").is_file()


def test_a_lock_file_is_never_opened_through_a_link_nor_truncated(tmp_path, outside):
    fd = safefile.open_lock(tmp_path / ".lock", tmp_path)
    os.write(fd, b"pid 1")
    os.close(fd)
    fd = safefile.open_lock(tmp_path / ".lock", tmp_path)
    assert os.read(fd, 16) == b"pid 1"  # opened again: what its holder wrote is still there
    os.close(fd)
    (tmp_path / ".final.lock").symlink_to(outside / "precious")
    with pytest.raises(LinkRefused) as told:
        safefile.open_lock(tmp_path / ".final.lock", tmp_path)
    assert told.value.filename == str(tmp_path / ".final.lock")
    (tmp_path / ".dangling.lock").symlink_to(outside / "made-through-it")
    with pytest.raises(LinkRefused):
        safefile.open_lock(tmp_path / ".dangling.lock", tmp_path)
    os.mkfifo(tmp_path / ".fifo.lock")
    with pytest.raises(LinkRefused, match="not a regular file"):
        safefile.open_lock(tmp_path / ".fifo.lock", tmp_path)
    assert listing(outside) == {"precious"} and (outside / "precious").read_text() == "kept"


def test_a_bounded_read_reads_a_regular_file_up_to_its_limit_and_no_further(tmp_path):
    path = tmp_path / "final_eval.json"
    path.write_bytes(b"x" * 10)
    assert safefile.read_bytes(path, 10) == b"x" * 10
    with pytest.raises(safefile.TooLarge) as told:
        safefile.read_bytes(path, 9, "final_eval.json")
    assert told.value.errno == errno.EFBIG and told.value.filename == str(path)
    assert told.value.strerror.startswith("10 bytes, over the 9 bytes final_eval.json may hold: not read")


@pytest.mark.parametrize("kind", ["fifo", "folder", "device"])
def test_a_bounded_read_refuses_what_is_not_a_regular_file_without_blocking(tmp_path, kind):
    path = tmp_path / "wandb_id"
    if kind == "fifo":
        os.mkfifo(path)  # read whole with no writer, it would block the command for good
    elif kind == "folder":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")  # endless: a read of it whole never ends
    with pytest.raises(OSError) as told:
        safefile.read_bytes(path, 128, "a wandb id file")
    assert told.value.filename == str(path) and "where a wandb id file is read: not read" in told.value.strerror


def test_a_bounded_read_of_a_file_that_grows_while_it_is_read_stops_at_the_limit(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    path.write_bytes(b"x" * 4)
    real = safefile.open_bounded

    def growing(*args):
        handle = real(*args)
        path.write_bytes(b"x" * 100)  # grown after its size was checked
        return handle

    monkeypatch.setattr(safefile, "open_bounded", growing)
    with pytest.raises(safefile.TooLarge):
        safefile.read_bytes(path, 8)


def test_a_file_too_large_ends_a_command_in_one_line_with_exit_code_2(tmp_path):
    from ftis_engine.app.exits import outcome

    (tmp_path / "summary.json").write_bytes(b"x" * 100)
    with pytest.raises(safefile.TooLarge) as told:
        safefile.read_bytes(tmp_path / "summary.json", 10, "a study's summary.json")
    said = outcome(told.value)
    assert said.code == 2 and said.line == (
        f"{tmp_path / 'summary.json'}: 100 bytes, over the 10 bytes a study's summary.json may hold: not read "
        "(planted there, or grown by another program? move it away) (check --output-dir and the paths in the config)")
