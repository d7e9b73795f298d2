"""metrics.jsonl and the step's record (metrics.py): what a record says, how the log is appended, cut back on
resume and read back (a torn last line silently, a broken middle line with a warning)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from ftis_engine.report import metrics as metrics_module
from ftis_engine.report.metrics import (MetricsError, MetricsLogger, Stopwatch, read_metrics, resident_mib, resume_records,
                                 train_record, truncate_metrics)
from ftis_engine.data.rollouts import Rollout


def _rollout(tokens: int, reward: float, reason: str = "stop") -> Rollout:
    return Rollout(0, 1, torch.ones(tokens, dtype=torch.int32), -torch.ones(tokens), reward, reason, 0)


def test_a_stopwatch_adds_up_each_phase(monkeypatch):
    ticks = iter([10.0, 10.25, 20.0, 20.5])  # a clock of our own: the test asserts sums, not this machine's speed
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: next(ticks))
    watch = Stopwatch()
    for _ in range(2):
        with watch("gen_seconds"):
            pass
    assert watch.seconds["gen_seconds"] == 0.75 and watch.seconds["train_seconds"] == 0.0


def test_a_train_record_counts_what_was_made_sent_and_trained_on():
    own = [_rollout(3, 1.0), _rollout(5, 0.0, "length")]
    trained = own + [_rollout(4, 1.0)]
    watch = Stopwatch()
    watch.seconds.update(gen_seconds=1.0, train_seconds=2.0, exchange_wait_seconds=0.5, exchange_seconds=0.25,
                         sync_seconds=0.125)
    record = train_record(3, "tiny-s", own, trained, {"loss": 0.1}, watch, 1e-3, sent_bytes=100, own_digest="ab")
    assert (record["step"], record["member"], record["kind"], record["loss"]) == (3, "tiny-s", "train", 0.1)
    assert (record["reward_mean"], record["swarm_reward_mean"]) == (0.5, 2 / 3)
    assert (record["tokens"], record["sequences"], record["own_sequences"]) == (12, 3, 2)
    assert (record["completion_len_mean"], record["truncated_frac"]) == (4.0, 0.5)
    assert (record["exchange_bytes"], record["exchange_tokens"], record["exchange_sequences"]) == (100, 8, 2)
    assert record["step_seconds"] == 3.875 and record["sync_seconds"] == 0.125 and record["rollouts_sha256"] == "ab"
    alone = train_record(3, "tiny-s", own, own, {}, Stopwatch(), 1e-3, sent_bytes=0, own_digest="ab")
    assert (alone["exchange_bytes"], alone["exchange_tokens"], alone["exchange_sequences"]) == (0, 0, 0)


def test_shared_loggers_append_whole_lines_and_non_finite_numbers_become_null(tmp_path):
    a = MetricsLogger(tmp_path, tensorboard=False, shared=True)
    b = MetricsLogger(tmp_path, tensorboard=False, shared=True)
    for step in range(1, 4):
        a.log({"step": step, "member": "a", "kind": "train", "loss": float("nan")})
        b.log({"step": step, "member": "b", "kind": "train", "loss": 1.0})
    a.close()
    b.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["member"], r["step"]) for r in records] == [(m, s) for s in (1, 2, 3) for m in "ab"]
    assert all(r["loss"] is None for r in records if r["member"] == "a")


def test_resume_cuts_the_log_back_and_says_what_was_lost(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": s, "member": m, "kind": "train", "own_sequences": 8} for s in (1, 2, 3) for m in ("a", "b")]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    dropped = truncate_metrics(path, 1)
    assert [r["step"] for r in read_metrics(path)] == [1, 1] and len(dropped) == 4
    assert resume_records(1, ["a", "b"], dropped) == [
        {"step": 1, "member": "a", "kind": "resume", "lost_steps": 2, "lost_rollouts": 16},
        {"step": 1, "member": "b", "kind": "resume", "lost_steps": 2, "lost_rollouts": 16}]


def test_a_torn_last_line_is_left_out_silently_and_a_broken_middle_line_with_a_warning(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    good = json.dumps({"step": 1, "member": "a", "kind": "train"})
    path.write_text(good + "\n" + good[:10] + "\n")  # a crash in the middle of a write
    with caplog.at_level(logging.WARNING, logger="ftis_engine.report.metrics"):
        assert len(read_metrics(path)) == 1
    assert not caplog.messages
    path.write_text(good + "\n" + "[1, 2]\n" + good + "\n" + good + "\n")  # valid JSON, but no record
    with caplog.at_level(logging.WARNING, logger="ftis_engine.report.metrics"):
        assert len(read_metrics(path)) == 3  # the records after it still count
    assert "line(s) 2 are not records" in caplog.text


def test_a_half_written_last_line_is_left_out_in_both_modes_until_its_newline_comes(tmp_path, caplog):
    """A reader following a live run sees the line a writer is in the middle of: no record, no warning, no error,
    strict or not; once the writer has finished it, the same read has it."""
    path = tmp_path / "metrics.jsonl"
    first, second = (json.dumps({"step": s, "member": "a", "kind": "train"}) for s in (1, 2))
    path.write_text(first + "\n" + second[:17])
    for strict in (False, True):
        with caplog.at_level(logging.WARNING, logger="ftis_engine.report.metrics"):
            assert [r["step"] for r in read_metrics(path, strict=strict)] == [1]
    assert not caplog.messages
    with open(path, "a") as f:
        f.write(second[17:] + "\n")
    for strict in (False, True):
        assert [r["step"] for r in read_metrics(path, strict=strict)] == [1, 2]


def test_read_strictly_every_complete_line_is_a_record(tmp_path):
    """strict=True (tests, benchmarks reading runs they finished): a line that is no record, a blank line, a torn
    line that is not the last, or no file at all is a MetricsError naming it; a whole last record without its
    newline counts."""
    path = tmp_path / "metrics.jsonl"
    good = json.dumps({"step": 1, "member": "a", "kind": "train"})
    path.write_text(good)
    assert len(read_metrics(path, strict=True)) == 1
    for text, lines in [(good + "\n[1, 2]\n" + good + "\n", "2"), (good + "\n\n" + good + "\n", "2"),
                        (good[:10] + "\n" + good + "\n", "1"), (good + "\n" + good[:10] + "\n", "2")]:
        path.write_text(text)
        with pytest.raises(MetricsError, match=rf"metrics.jsonl: line\(s\) {lines} are not records"):
            read_metrics(path, strict=True)
        assert len(read_metrics(path)) == 1 + (text.count(good) == 2)  # not strict: skipped
    with pytest.raises(MetricsError, match="no such file"):
        read_metrics(tmp_path / "nothing.jsonl", strict=True)
    assert read_metrics(tmp_path / "nothing.jsonl") == []


def test_kinds_keeps_the_records_of_those_kinds_in_order(tmp_path):
    path = tmp_path / "metrics.jsonl"
    kinds = ["eval", "train", "resume", "train", "eval"]
    path.write_text("".join(json.dumps({"step": s, "member": "a", "kind": k}) + "\n" for s, k in enumerate(kinds)))
    assert [r["step"] for r in read_metrics(path, kinds="train")] == [1, 3]
    assert [r["step"] for r in read_metrics(path, kinds=("eval", "resume"), strict=True)] == [0, 2, 4]


def test_a_resume_never_drops_a_valid_record_and_keeps_the_unreadable_lines_aside(tmp_path):
    """One malformed line among 26 (steps 1-10 of two members, evals every 5; checkpoint at 5): every valid record
    up to the checkpoint stays, the records after it go, the bad line (and a record without member, one with a
    text step) is moved to metrics.jsonl.bad with its line number."""
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "member": m, "kind": "train", "own_sequences": 8})
             for s in range(1, 11) for m in ("a", "b")]
    lines[2] = "GARBAGE"  # step 2 of member a
    lines += [json.dumps({"step": 3, "kind": "train"}), json.dumps({"step": "4", "member": "a", "kind": "eval"})]
    path.write_text("\n".join(lines) + "\n")
    dropped = truncate_metrics(path, 5)
    kept = read_metrics(path)
    assert [(r["step"], r["member"]) for r in kept] == [(s, m) for s in range(1, 6) for m in ("a", "b")
                                                        if (s, m) != (2, "a")]
    assert len(dropped) == 10 and all(r["step"] > 5 for r in dropped)
    aside = (tmp_path / "metrics.jsonl.bad").read_text().splitlines()
    assert aside == ["3\tGARBAGE", f"21\t{lines[20]}", f"22\t{lines[21]}"]


def test_resident_memory_is_reported_in_mib():
    mib = resident_mib()
    assert mib is None or 10 < mib < 100_000


def test_gpu_memory_is_reported_only_for_a_cuda_member():
    cpu = metrics_module.GpuMemory(torch.device("cpu"))
    cpu.note()
    assert cpu.record() == {}
    if torch.cuda.is_available():
        gpu = metrics_module.GpuMemory(torch.device("cuda", 0))
        block = torch.empty(2**28, dtype=torch.uint8, device="cuda")  # 0.25 GiB
        gpu.note()
        del block
        record = gpu.record()
        assert record["gpu_peak_gib"] >= 0.25 and record["gpu_used_gib"] >= 0.25


def test_an_eval_record_carries_which_questions_were_solved_in_their_order():
    from ftis_engine.report.metrics import decode_correct, encode_correct, eval_record

    record = eval_record(10, "a", "arith", 0.5, 4, [True, False, False, True])
    assert record["correct"] == "1001" and decode_correct(record["correct"]) == [True, False, False, True]
    assert "correct" not in eval_record(10, "a", "arith", 0.5, 4)
    assert encode_correct([]) == "" and decode_correct("") == []
    with pytest.raises(ValueError, match="correct: 3 questions for 4 samples"):
        eval_record(10, "a", "arith", 0.5, 4, [True, False, True])
    with pytest.raises(ValueError, match="only 0 and 1"):
        decode_correct("10x1")


def test_eval_gives_each_questions_correctness_also_when_a_member_is_sharded(tmp_path):
    """Per question, in the eval set's order; a member on two ranks evaluates every second question on each and
    the gathered flags land where their questions are."""
    import types

    from ftis_engine.run.evaluate import evaluate_questions

    from .test_evaluate import RIGHT, WRONG, _task, fake_member

    task = _task(tmp_path)
    examples = task.evals["held"] * 3  # 2+2, 3+3, 2+2, 3+3, 2+2, 3+3
    member = fake_member({"What is 2+2?": RIGHT, "What is 3+3?": WRONG})
    accuracy, attacked, correct = evaluate_questions(member, task, examples, 16)
    assert (accuracy, attacked, correct) == (0.5, None, [True, False] * 3)

    parts = {}

    class Shard:  # shard `index` of two; the second to gather gets both parts, as all_gather would
        def __init__(self, index):
            self.index = index

        def share(self, count):
            return range(self.index, count, 2)

        def all_gather(self, value):
            parts[self.index] = value
            return [parts[i] for i in sorted(parts)]

    for index in (1, 0):
        sharded = types.SimpleNamespace(tokenizer=member.tokenizer, generator=member.generator, shard=Shard(index))
        got = evaluate_questions(sharded, task, examples, 16)
    assert got == (0.5, None, [True, False] * 3)


def _tensorboard_points(run_dir) -> dict[str, int]:
    """tag -> points, as TensorBoard's Python loader reads run_dir/tensorboard (every run folder under it)."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    events = EventMultiplexer().AddRunsFromDirectory(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: len(events.Scalars(run, tag)) for run, tags in events.Runs().items() for tag in tags["scalars"]}


@pytest.mark.parametrize("writers_before", [0, 9])
def test_two_async_ranks_writing_tensorboard_keep_both_ranks_steps_fresh_and_on_resume(tmp_path, monkeypatch,
                                                                                       writers_before):
    """Async ranks log their own members to TensorBoard at once. One folder for both made the second writer's
    purge (step 0 on a fresh run) drop every step of the first as TensorBoard read it; each rank writes a folder of
    its own, and a fresh run purges nothing. A resume at step 2 drops steps 3 and on, every rank's alike.
    writers_before: how many SummaryWriters the process made before (their count is in each file's name: with 9,
    the resume's files end in .11 and .12 against the first run's .9 and .10, and in the same second ".11" sorted
    before ".9", so TensorBoard met the purge first and kept steps 3 and 4 twice; seen under pytest-xdist)."""
    from tensorboard.summary.writer import event_file_writer

    from ftis_engine.report.metrics import MetricsLogger

    monkeypatch.setattr(event_file_writer._global_uid, "_value", writers_before)

    def run(purge, steps):
        loggers = [MetricsLogger(tmp_path, purge_step=purge, shared=True, tensorboard_suffix=f".rank{k}",
                                 tensorboard_subdir=f"rank{k}") for k in range(2)]
        for step in steps:
            for k, logger in enumerate(loggers):
                logger.log({"step": step, "member": f"m{k}", "kind": "train", "loss": float(step)})
        for logger in loggers:
            logger.close()

    run(None, range(1, 5))
    assert _tensorboard_points(tmp_path) == {"m0/train/loss": 4, "m1/train/loss": 4}
    run(3, range(3, 6))  # resumed from the checkpoint of step 2: steps 3 and 4 again, then 5
    assert _tensorboard_points(tmp_path) == {"m0/train/loss": 5, "m1/train/loss": 5}


# ------------------------------------------------------------------------------------------------ bounded reading


def _records(n: int) -> bytes:
    return "".join(json.dumps({"step": s, "member": "a", "kind": "train"}) + "\n" for s in range(n)).encode()


def test_a_kept_record_of_several_gzip_members_reads_as_gzip_reads_it(tmp_path):
    import gzip

    data = gzip.compress(_records(3), mtime=0) + gzip.compress(_records(2), mtime=0)
    (tmp_path / "r.metrics.jsonl.gz").write_bytes(data)
    lines = metrics_module.read_lines(tmp_path / "r.metrics.jsonl.gz")
    assert [json.dumps(r) + "\n" for r in lines.records] == gzip.decompress(data).decode().splitlines(keepends=True)
    assert lines.numbers == tuple(range(1, len(lines.records) + 1))


def test_a_record_that_inflates_past_the_bound_is_refused_unread(tmp_path, monkeypatch):
    """A kept record was read through gzip.decompress whole: a small file inflating to gigabytes filled memory."""
    import gzip

    monkeypatch.setattr(metrics_module, "MAX_LOG_BYTES", 4096)
    bomb = tmp_path / "r.metrics.jsonl.gz"
    bomb.write_bytes(gzip.compress(b"\n" * 100_000))
    assert bomb.stat().st_size < 4096
    with pytest.raises(MetricsError, match=rf"^{bomb}: holds more than 0 MiB of records .*: not read$"):
        read_metrics(bomb)
    plain = tmp_path / "metrics.jsonl"
    plain.write_bytes(_records(200))
    with pytest.raises(MetricsError, match="holds more than"):
        read_metrics(plain)
    plain.write_bytes(_records(10))
    assert len(read_metrics(plain)) == 10


@pytest.mark.parametrize("damage, said", [(lambda data: data[:-9], "not a whole gzip stream: cut short"),
                                          (lambda data: b"plain text\n", "not gzip data"),
                                          (lambda data: data + b"trailing", "not gzip data")])
def test_a_damaged_kept_record_is_one_error_naming_it(tmp_path, damage, said):
    import gzip

    path = tmp_path / "r.metrics.jsonl.gz"
    path.write_bytes(damage(gzip.compress(_records(3))))
    with pytest.raises(MetricsError) as told:
        read_metrics(path)
    assert str(told.value) == f"{path}: cannot read it ({said})"
