"""benchmarks/pair_summary.py: the issue-28 numbers (medians after the warm-up step, tokens/s, the pair's step,
TRL over ours) from hand-made metrics, checked against values worked out by hand."""

from __future__ import annotations

import json

import pytest

from benchmarks import pair_summary


def train(member: str, step: int, step_s: float, gen_s: float, train_s: float, length: float, ended: float,
          wait: float = 0.0, sequences: int = 144, is_weight: float = 1.0, sync_s: float = 0.0, own: float = 1.0,
          peak: float = 20.0) -> dict:
    """A `kind: train` record with the keys the engine writes that the summary reads."""
    return {"step": step, "member": member, "kind": "train", "own_sequences": sequences, "sync_seconds": sync_s,
            "own_ratio_mean": own, "gpu_peak_gib": peak, "gpu_used_gib": peak + 30.0,
            "completion_len_mean": length, "tokens": int(sequences * length), "step_seconds": step_s,
            "gen_seconds": gen_s, "train_seconds": train_s, "exchange_seconds": 0.5 if wait else 0.0,
            "exchange_wait_seconds": wait, "lead_wait_seconds": 0.0, "is_weight_mean": is_weight,
            "kl_mean": 0.0, "truncated_frac": 1.0, "ended_at": ended}


ALONE = [train("m", 1, 20.0, 15.0, 5.0, 500, ended=100.0, peak=40.0),
         train("m", 2, 10.0, 6.0, 4.0, 500, ended=111.0, sync_s=0.5, own=1.002),
         train("m", 3, 12.0, 7.0, 5.0, 400, ended=124.0, is_weight=0.98, sync_s=1.5, own=0.998)]
PAIR = [train("a", 1, 30.0, 20.0, 4.0, 512, ended=50.0, wait=5.5), train("b", 1, 28.0, 20.0, 8.0, 512, ended=51.0),
        train("a", 2, 20.0, 10.0, 4.0, 512, ended=80.0, wait=5.5), train("b", 2, 25.0, 12.0, 13.0, 512, ended=78.0),
        train("a", 3, 22.0, 11.0, 5.0, 512, ended=101.0, wait=5.5), train("b", 3, 21.0, 9.0, 12.0, 512, ended=102.0)]


def trl_result(seconds: list[float]) -> dict:
    steps = [{"step": i + 1, "seconds": s, "gen_seconds": s / 2, "weight_sync_seconds": 1.0, "score_seconds": 2.0,
              "update_seconds": s / 2 - 3.0, "tokens": 72000, "completions": 144, "peak_allocated_gib": 30.0 + i}
             for i, s in enumerate(seconds)]
    return {"device": "NVIDIA H100 80GB HBM3", "versions": {"trl": "1.16.0", "vllm": "0.24.0"}, "config": {},
            "steps": steps, "summary": {"is_weight_mean": 0.99}}


def test_member_medians_leave_out_the_warm_up_step():
    m = pair_summary.member_summary(ALONE, skip=1)
    assert m["steps"] == 2
    assert m["step_seconds"] == pytest.approx(11.0)  # median(10, 12); step 1's 20 s left out
    assert m["gen_seconds"] == pytest.approx(6.5)
    assert m["train_seconds"] == pytest.approx(4.5)
    assert m["is_weight_mean"] == pytest.approx(0.99)
    assert m["sync_seconds"] == pytest.approx(1.0)  # median(0.5, 1.5)
    assert m["own_ratio_mean"] == pytest.approx(1.0)  # mean(1.002, 0.998)
    assert (m["gpu_peak_gib"], m["gpu_used_gib"]) == (40.0, 70.0)  # peaks over every step, the warm-up's included


def test_generated_tokens_per_second_count_the_members_own_rollouts():
    m = pair_summary.member_summary(ALONE, skip=1)
    generated = 144 * 500 + 144 * 400  # 129,600 tokens in steps 2 and 3
    assert m["generated_tokens_per_step"] == pytest.approx(generated / 2)
    assert m["gen_tokens_per_s"] == pytest.approx(generated / 13.0)  # over 6 + 7 s of generation
    assert m["step_tokens_per_s"] == pytest.approx(generated / 22.0)  # over 10 + 12 s of steps


def test_exchange_seconds_add_sending_and_waiting():
    m = pair_summary.member_summary([r for r in PAIR if r["member"] == "a"], skip=1)
    assert m["exchange_seconds"] == pytest.approx(6.0)  # 0.5 s sending + 5.5 s waiting


def test_a_pairs_step_is_its_slower_members():
    run = pair_summary.run_summary(PAIR, skip=1)
    assert set(run["members"]) == {"a", "b"}
    assert run["step_seconds"] == pytest.approx(23.5)  # median(max(20, 25), max(22, 21))
    assert run["step_tokens_per_s"] == pytest.approx(4 * 144 * 512 / (25.0 + 22.0))


def test_wall_step_is_the_time_between_the_ends_of_consecutive_steps():
    assert pair_summary.run_summary(ALONE, skip=1)["wall_step_seconds"] == pytest.approx(12.0)  # median(11, 13)
    assert pair_summary.run_summary(PAIR, skip=1)["wall_step_seconds"] == pytest.approx(25.5)  # median(29, 22)


def test_trl_medians_leave_out_the_warm_up_step():
    trl = pair_summary.trl_summary(trl_result([40.0, 30.0, 26.0]), skip=1)
    assert trl["step_seconds"] == pytest.approx(28.0)
    assert trl["gen_seconds"] == pytest.approx(14.0)
    assert trl["update_seconds"] == pytest.approx(11.0)
    assert trl["step_tokens_per_s"] == pytest.approx(2 * 72000 / 56.0)
    assert trl["peak_allocated_gib"] == 32.0  # the largest of every step's, the first included


def test_gpu_memory_peak_is_the_largest_nvidia_smi_sample(tmp_path):
    samples = tmp_path / "alone.gpumem"
    samples.write_text("memory.used [MiB]\n1000\n40960\n\n2048\n")
    assert pair_summary.gpu_memory_peak_gib(samples) == pytest.approx(40.0)
    assert pair_summary.gpu_memory_peak_gib(tmp_path / "absent.gpumem") is None


SETTINGS = {"precision": "bfloat16", "master_dtype": "float32", "attention": "sdpa", "compile": "compile",
            "vocab_size": 151936, "batch": 144, "length": 512}


def write_results(folder, trl_seconds, trl_settings=SETTINGS, ours_settings=SETTINGS):
    """A results folder; each side's settings (None: not recorded) alike by default."""
    folder.mkdir()
    for name, records in (("alone", ALONE), ("pair-sync", PAIR)):
        lines = [{"step": 0, "member": r, "kind": "eval", "dataset": "tiny-last", "accuracy": 0.0, "samples": 16}
                 for r in ("m",)] + records
        (folder / f"{name}.metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    if ours_settings is not None:
        (folder / "alone.settings.json").write_text(json.dumps({"m": ours_settings}))
    trl = trl_result(trl_seconds)
    if trl_settings is not None:
        trl["settings"] = trl_settings
    (folder / "trl.json").write_text(json.dumps(trl))
    (folder / "alone.gpumem").write_text("2048\n30720\n")


def test_trl_over_ours_is_the_ratio_of_the_median_steps(tmp_path):
    write_results(tmp_path / "results", [40.0, 30.0, 26.0])
    summary = pair_summary.summarize(tmp_path / "results", skip=1)
    versus = summary["trl_vs_alone"]
    assert versus["ours_step_seconds"] == pytest.approx(11.0)
    assert versus["trl_step_seconds"] == pytest.approx(28.0)
    assert versus["trl_over_ours"] == pytest.approx(28.0 / 11.0)
    assert versus["goal_2x_met"] is True and versus["like_for_like"] and versus["unlike"] == []
    assert versus["trl_over_ours_mean"] == pytest.approx((30.0 + 26.0) / (10.0 + 12.0))  # steps 2-3 each
    assert summary["device"] == "NVIDIA H100 80GB HBM3"  # no device.txt: TRL's record names it
    assert summary["runs"]["alone"]["gpu_memory_peak_gib"] == pytest.approx(30.0)


def test_the_2x_goal_is_not_met_below_twice(tmp_path):
    write_results(tmp_path / "results", [40.0, 20.0, 21.0])  # median 20.5 s against ours' 11 s: 1.86x
    versus = pair_summary.summarize(tmp_path / "results", skip=1)["trl_vs_alone"]
    assert versus["trl_over_ours"] == pytest.approx(20.5 / 11.0)
    assert versus["goal_2x_met"] is False


def test_main_writes_the_json_and_the_table(tmp_path):
    write_results(tmp_path / "results", [40.0, 30.0, 26.0])
    (tmp_path / "results" / "device.txt").write_text("NVIDIA H100 80GB HBM3\n")
    assert pair_summary.main(["--results", str(tmp_path / "results"), "--output", str(tmp_path / "out" / "pair")]) == 0
    saved = json.loads((tmp_path / "out" / "pair.json").read_text())
    assert saved["trl_vs_alone"]["trl_over_ours"] == pytest.approx(28.0 / 11.0)
    table = (tmp_path / "out" / "pair.md").read_text()
    assert "28.00 / 11.00 = 2.55x (like for like)" in table
    assert saved["trl"]["settings"] == saved["runs"]["alone"]["settings"]["m"] == SETTINGS
    assert "| pair-sync | b | 23.00 |" in table  # median(25, 21)


def test_a_ratio_between_runs_that_differ_names_each_difference_and_judges_no_goal(tmp_path):
    """The 2026-11-27 comparison: TRL in pure bf16 and eager against float32 masters and compiled layers."""
    trl = {**SETTINGS, "master_dtype": "bfloat16", "compile": "eager"}
    write_results(tmp_path / "results", [40.0, 30.0, 26.0], trl_settings=trl)
    summary = pair_summary.summarize(tmp_path / "results", skip=1)
    versus = summary["trl_vs_alone"]
    assert versus["unlike"] == ["master_dtype", "compile"] and not versus["like_for_like"]
    assert versus["goal_2x_met"] is None  # 2.55x, but not between like runs
    table = pair_summary.markdown(summary)
    assert "28.00 / 11.00 = 2.55x (unlike: master_dtype, compile)**" in table
    assert "| master_dtype | float32 | bfloat16 | **differs** |" in table
    assert "| compile | compile | eager | **differs** |" in table and "| attention | sdpa | sdpa |  |" in table
    assert "goal: >= 2x; not judged: the runs differ" in table


def test_a_side_that_records_no_settings_is_never_like_for_like(tmp_path):
    write_results(tmp_path / "results", [40.0, 30.0, 26.0], trl_settings=None)
    versus = pair_summary.summarize(tmp_path / "results", skip=1)["trl_vs_alone"]
    assert versus["unlike"] == [f"{key} (unknown)" for key in pair_summary.SETTINGS]
    assert versus["goal_2x_met"] is None


def test_ours_settings_are_what_the_engine_resolves_for_each_member(tmp_path):
    """configs/tiny.yaml on this CPU: float32 compute and masters, sdpa and eager layers (auto on a CPU), the
    built-ins' vocabularies (the character tokenizer's 101 ids), 8 prompts x 16 completions of 2 tokens."""
    import shutil

    shutil.copy(pair_summary.pathlib.Path(__file__).parents[1] / "configs" / "tiny.yaml", tmp_path / "config.yaml")
    settings = pair_summary.ours_settings(tmp_path)
    expected = {"precision": "float32", "master_dtype": "float32", "attention": "sdpa", "compile": "eager",
                "vocab_size": 101, "batch": 128, "length": 2}
    assert settings == {"tiny-s": expected, "tiny-m-lora": expected}
    assert pair_summary.main(["--settings", str(tmp_path)]) == 0


LEVERS = {"sleep_level": 2, "seeds": "one stream", "kv_cache_gib": 3.0, "gpu_memory_utilization": 0.1}


def test_the_engines_levers_count_where_both_sides_record_them(tmp_path):
    """Issue 67's levers: a lever set differently on the two sides makes the ratio unlike; one a side does not
    record (results from before the levers were recorded) is shown but judged by the settings alone."""
    write_results(tmp_path / "same", [40.0, 30.0, 26.0], trl_settings={**SETTINGS, **LEVERS},
                  ours_settings={**SETTINGS, **LEVERS})
    versus = pair_summary.summarize(tmp_path / "same", skip=1)["trl_vs_alone"]
    assert versus["like_for_like"] and versus["goal_2x_met"] is True
    assert "| kv_cache_gib | 3.0 | 3.0 |  |" in pair_summary.markdown(pair_summary.summarize(tmp_path / "same"))
    write_results(tmp_path / "differ", [40.0, 30.0, 26.0], trl_settings={**SETTINGS, **LEVERS},
                  ours_settings={**SETTINGS, **LEVERS, "sleep_level": 1, "kv_cache_gib": "share"})
    versus = pair_summary.summarize(tmp_path / "differ", skip=1)["trl_vs_alone"]
    assert versus["unlike"] == ["sleep_level", "kv_cache_gib"] and versus["goal_2x_met"] is None
    write_results(tmp_path / "older", [40.0, 30.0, 26.0], trl_settings={**SETTINGS, **LEVERS})
    assert pair_summary.summarize(tmp_path / "older", skip=1)["trl_vs_alone"]["like_for_like"]


def test_ours_levers_are_the_configs_engine_settings(tmp_path):
    import shutil

    from ftis_engine.config import load_config

    shutil.copy(pair_summary.pathlib.Path(__file__).parents[1] / "configs" / "tiny.yaml", tmp_path / "tiny.yaml")
    config = load_config(tmp_path / "tiny.yaml", ["members.0.generator=vllm", "members.0.vllm.kv_cache_gib=0.5",
                                                  "members.0.vllm.per_request_seed=false"])
    (tmp_path / "config.yaml").write_text(pair_summary.json.dumps(config.model_dump(mode="json")))
    settings = pair_summary.ours_settings(tmp_path)
    assert {k: settings["tiny-s"][k] for k in pair_summary.LEVERS} == {
        "sleep_level": 1, "seeds": "one stream", "kv_cache_gib": 0.5, "gpu_memory_utilization": 0.3}
    assert not set(pair_summary.LEVERS) & set(settings["tiny-m-lora"])  # a transformers generator has no engine


def test_the_pair_is_set_against_trl_training_both_shapes_one_after_the_other(tmp_path):
    write_results(tmp_path / "results", [40.0, 30.0, 26.0])
    big = trl_result([60.0, 50.0, 54.0])
    big["config"] = {"model": "builtin:shape-3b-qwen"}
    (tmp_path / "results" / "trl-3b.json").write_text(json.dumps(big))
    summary = pair_summary.summarize(tmp_path / "results", skip=1)
    sequential = summary["pair_vs_trl_sequential"]
    assert sequential["trl_sequential_step_seconds"] == pytest.approx(28.0 + 52.0)
    assert sequential["pair_step_seconds"] == pytest.approx(23.5)  # median(max(20, 25), max(22, 21))
    assert sequential["trl_sequential_over_pair"] == pytest.approx(80.0 / 23.5)
    table = pair_summary.markdown(summary)
    assert "| trl-3b | builtin:shape-3b-qwen | 52.00 |" in table and "= 80.00 s against the pair's 23.50 s" in table
