"""Every benchmark script runs in its --quick CPU mode and writes its results (so that none of them rots)."""

from __future__ import annotations

import json

import pytest

from benchmarks import adversary_summary, exchange, kernel_bench, tiny_default, update


def test_kernel_benchmark_quick(tmp_path):
    rows = kernel_bench.main(["--quick", "--output", str(tmp_path / "kernels")])
    by_peer = {r["peer"]: r for r in rows}
    assert by_peer["ours-fused-linear"]["ms"] > 0 and by_peer["naive-torch"]["ms"] > 0
    assert by_peer["naive-torch"]["time_ratio"] > 0
    for peer in ("liger-fused-linear", "cce"):  # not installed in CI: reported, not fatal
        assert "ms" in by_peer[peer] or "skipped" in by_peer[peer]
    saved = json.loads((tmp_path / "kernels.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(rows))
    assert (tmp_path / "kernels.md").read_text().count("\n") >= len(rows) + 2
    assert (tmp_path / "kernels.png").stat().st_size > 0


def test_kernel_benchmark_peers_compute_the_same_loss():
    """The F-TIS peers compute one loss: ours (both entry points) and naive torch agree."""
    import torch

    x = kernel_bench.make_inputs(64, 500, 16, torch.device("cpu"), torch.float32)
    values = [kernel_bench.PEERS[p](x).item() for p in ("ours-fused-linear", "ours-logits", "naive-torch")]
    assert values == pytest.approx([values[0]] * 3, rel=1e-5)


def test_the_kernel_benchmark_records_the_share_of_sequences_the_filter_drops():
    """With an unrelated sampler's log-probs (the published inputs) F-TIS drops every sequence with A <= 0; with the
    trainer's own (a member's own rollouts) none. Peers without the filter record no share."""
    import torch

    cpu = torch.device("cpu")
    x = kernel_bench.make_inputs(4 * 1024, 300, 16, cpu, torch.float32)
    negative = float((x["adv"] <= 0).float().mean())
    assert 0 < negative < 1  # the oracle tells both cases apart
    rows = {(peer, gen): kernel_bench.measure(peer, kernel_bench.PEERS[peer], 4 * 1024, 300, 16, cpu, torch.float32, True, gen)
            for peer in ("ours-fused-linear", "naive-torch", "ours-fused-linear-tis") for gen in ("unrelated", "own")}
    for peer in ("ours-fused-linear", "naive-torch"):
        assert rows[peer, "unrelated"]["filtered_frac"] == pytest.approx(negative)
        assert rows[peer, "own"]["filtered_frac"] == 0.0
    assert "filtered_frac" not in rows["ours-fused-linear-tis", "unrelated"]
    own = kernel_bench.make_inputs(4 * 1024, 300, 16, cpu, torch.float32, gen_logprobs="own")
    assert torch.equal(own["adv"], x["adv"]) and torch.equal(own["targets"], x["targets"])  # only gen differs
    table = kernel_bench.markdown(list(rows.values()), {})
    assert f"| ours-fused-linear | {100 * negative:.0f}% |" in table and "| ours-fused-linear | 0% |" in table
    assert "| ours-fused-linear-tis | - (no filter) |" in table


def test_the_filtered_count_of_the_published_inputs_agrees_with_the_op():
    """count_filtered (a KL lower bound from each sequence's first 16 tokens, on the CPU) names the sequences the op
    itself filters, on inputs small enough to run the op here."""
    import torch

    x = kernel_bench.make_inputs(4 * 1024, 300, 16, torch.device("cpu"), torch.float32)
    count = kernel_bench.count_filtered(4 * 1024, 300, 16, torch.float32)
    assert count["exact"] and count["sequences"] == 4 and count["negative"] == int((x["adv"] <= 0).sum())
    assert count["filtered_frac"] == pytest.approx(kernel_bench.filtered_frac(x))


def test_update_benchmark_quick(tmp_path):
    target = tmp_path / "update_step.json"
    rows = update.main(["--quick", "--output", str(tmp_path / "update"), "--attn", "sdpa", "varlen",
                        "--update-step", str(target)])
    assert [(r["attention"], r["path"]) for r in rows] == [("sdpa", "fused"), ("sdpa", "logits"),
                                                           ("varlen", "fused"), ("varlen", "logits")]
    assert all(r["tokens_per_s"] > 0 and r["layers"] == "eager" for r in rows[:2])
    # varlen needs a CUDA GPU: its rows say why they were skipped, and the other runs still happen
    assert all(r["skipped"].startswith("ConfigError: train.attn_implementation: varlen") for r in rows[2:])
    assert (tmp_path / "update.md").is_file()
    records = json.loads(target.read_text())
    assert [(r["attention"], r["path"]) for r in records] == [("sdpa", "fused"), ("sdpa", "logits")]
    assert {"model", "attention", "layers", "tokens_per_s", "peak_gib", "device"} - records[0].keys() <= {"peak_gib"}


def test_update_step_records_replace_the_same_run_and_keep_the_others(tmp_path):
    target = tmp_path / "update_step.json"
    meta = {"device": "H100", "torch": "2.11", "peak_tflops": 989.0, "command": "c"}
    run = {"model": "1.5b", "attention": "sdpa", "layers": "eager", "path": "fused", "sequences": 16,
           "prompt_len": 256, "completion_len": 768, "checkpointing": True, "tokens_per_s": 1.0, "mfu": 0.1}
    update.merge_update_step(target, [run, {**run, "layers": "compile", "mfu": 0.2}], meta)
    update.merge_update_step(target, [{**run, "mfu": 0.3, "profile": "table"}, {**run, "skipped": "oom"}],
                             {**meta, "command": "d"})
    update.merge_update_step(target, [{**run, "mfu": 0.4}], {**meta, "device": "H200"})
    records = json.loads(target.read_text())
    assert [(r["device"], r["layers"], r["mfu"], r["command"]) for r in records] == [
        ("H100", "compile", 0.2, "c"), ("H100", "eager", 0.3, "d"), ("H200", "eager", 0.4, "c")]
    assert all("profile" not in r for r in records)


def test_the_update_counts_the_heads_flops_over_the_rows_it_runs_on(tmp_path):
    """The fused path's head runs on the completion tokens (4 x 24 of the 4 x 39 input tokens in --quick), the logits
    path's on every input token: each row's achieved TFLOP/s counts exactly that."""
    from transformers import Qwen2Config

    rows = update.main(["--quick", "--output", str(tmp_path / "update"), "--attn", "sdpa"])
    config, parameters = Qwen2Config(**update.SHAPES["tiny"]), update.shape_parameters("tiny")
    vd = 1000 * 64  # the tiny shape's tied head: V x d
    body = parameters - vd
    per_token = 6 * body + 12 * 2 * 64 * (16 + 24) // 2  # the body and attention at the mean context
    for row, head in zip(rows, (4 * 24, 4 * 39), strict=True):  # fused, logits
        assert row["tokens"] == 4 * 39
        expected = per_token * row["tokens"] + 6 * vd * head
        assert update.model_flops(config, parameters, row["tokens"],
                                  update.head_rows(row["path"], row["tokens"], 4 * 24), 20) == expected
        assert row["achieved_tflops"] == pytest.approx(expected / row["seconds"] / 1e12)


def test_a_recount_keeps_the_timings_and_counts_the_fused_head_over_the_completion_tokens(tmp_path):
    """The published 1.5B varlen + compile update (0.5236 s for 16 x 1,023 tokens) first read 30.1% MFU, the head
    counted over every input token; over the 16 x 768 completion tokens it runs on: 29.0%."""
    target = tmp_path / "update_step.json"
    record = {"device": "H100", "peak_tflops": 989.0, "model": "1.5b", "attention": "varlen", "layers": "compile",
              "path": "fused", "sequences": 16, "prompt_len": 256, "completion_len": 768, "tokens": 16368,
              "seconds": 0.5235963829999974, "mfu": 0.3011183961463995}
    target.write_text(json.dumps([record, {**record, "path": "logits"}, {**record, "model": "7b"}]))
    fused, logits, unknown = update.main(["--recount", str(target)])
    # Qwen2.5-1.5B: 1,543,714,304 parameters, a tied head of 151,936 x 1,536
    vd, body, attention = 151_936 * 1536, 1_543_714_304 - 151_936 * 1536, 12 * 28 * 1536 * 512
    flops = (6 * body + attention) * 16368 + 6 * vd * 16 * 768
    assert fused["mfu"] == pytest.approx(flops / 0.5235963829999974 / 989e12)
    assert round(100 * fused["mfu"], 1) == 29.0 and fused["mfu_before_recount"] == 0.3011183961463995
    assert logits["mfu"] == pytest.approx(0.3011183961463995)  # the logits path's head does run on every token
    assert "mfu_before_recount" not in logits
    assert unknown == {**record, "model": "7b"}  # a shape this file does not know is left as it was
    assert json.loads(target.read_text()) == [fused, logits, unknown]


@pytest.mark.slow
def test_exchange_benchmark_quick(tmp_path):
    rows = exchange.main(["--quick", "--output", str(tmp_path / "exchange.json")])
    (row,) = rows
    assert row["bytes_per_member"] == row["expected_bytes"]
    assert row["median_ms"] > 0


@pytest.mark.slow
def test_tiny_default_benchmark_records_time_load_and_accuracy(tmp_path):
    rows = tiny_default.main(["--steps", "2", "--threads", "1", "--output", str(tmp_path / "tiny")])
    (row,) = rows
    assert row["exit_code"] == 0 and row["seconds"] > 0 and row["threads"] == 1
    assert set(row["accuracy"]) == {"tiny-s", "tiny-m-lora"} and "loadavg_1min_before" in row
    assert (tmp_path / "tiny.md").read_text().count("|") > 10


@pytest.mark.slow
def test_async_throughput_benchmark_sync_waits_max_lead_bounds_and_null_never_waits(tmp_path):
    from benchmarks import async_throughput

    result = async_throughput.main(["--quick", "--output", str(tmp_path / "async.json")])
    sync, lead, free = (result["settings"][s]["tiny-s"] for s in ("sync", "2", "null"))
    # rank 1 sleeps 0.3 s before generating each step: sync's fast member waits for it every step; with max_lead 2
    # it starts its step 3 only with the slow member's step 1 in hand, and trains on it; with null it never waits
    # (the policy itself is tested with a fake clock in test_async.py; here only what cannot depend on load)
    assert free["lead_wait_seconds_per_step"] == 0 and sync["wait_seconds_per_step"] > free["wait_seconds_per_step"]
    assert lead["peer_sequences_per_step"] > 0 and -2 <= lead["staleness_min"] <= lead["staleness_max"] <= 8
    assert sync["steps"] == lead["steps"] == free["steps"] == 3
    assert (tmp_path / "async.md").is_file() and (tmp_path / "async.png").is_file()


def test_the_floor_of_a_recomputing_head_is_8nvd_at_the_measured_matmul_rate():
    rows = [{"peer": "ours-fused-linear-tis", "tokens": 1000, "vocab": 500, "dim": 100, "ms": 10.0},
            {"peer": "naive-torch", "tokens": 1000, "vocab": 500, "dim": 100, "ms": 1.0},
            {"peer": "ours-fused-linear", "tokens": 1000, "vocab": 500, "dim": 200, "ms": 1.0}]
    kernel_bench.add_floor(rows, {"100x1000": 0.004})  # 4 GFLOP/s: 8 N V d = 0.4 GFLOP takes 100 ms
    assert rows[0]["floor_frac"] == pytest.approx(10.0)  # 100 ms of floor done in 10 ms
    assert "floor_frac" not in rows[1] and "floor_frac" not in rows[2]  # not a recomputing head; no rate measured
    rows[0]["tflops"] = 6 * 1000 * 500 * 100 / 10e-3 / 1e12  # what measure() adds: 6 N V d over the time
    assert "| 750% | 1000% |" in kernel_bench.markdown(rows[:1], {"100x1000": 0.004})  # 6NVd of the rate; 8NVd floor


@pytest.mark.slow
def test_open_swarm_benchmark_quick_a_killed_member_redoes_its_steps_since_its_checkpoint(tmp_path):
    from benchmarks import open_swarm
    from tests.netlab import NetLab

    reason = NetLab.unavailable()
    if reason is not None:
        pytest.skip(f"network namespaces: {reason}")
    # the churn scenario only: the steady one is the same swarm without the kill (the smoke test needs one run)
    results = open_swarm.main(["--quick", "--scenario", "churn", "--out", str(tmp_path / "open_swarm")])
    [churn] = results
    assert all(m["steps"] == 10 and m["rejected_batches"] == 0 for m in churn["members"].values())
    events = churn["events"]
    assert events["killed_at"] >= 3 and churn["members"]["tiny-m-lora"]["redone"] == events["killed_at"] - \
        events["checkpoint"] >= 0
    assert "| churn | tiny-m-lora |" in (tmp_path / "open_swarm.md").read_text()
    assert all(m["dropped_sequences"] == m["stale_dropped"] + m["surplus_dropped"] for m in churn["members"].values())


@pytest.mark.slow
def test_swarm_scale_quick_replaying_members_pass_every_check_and_the_churn_is_measured(tmp_path):
    """Four replaying members (benchmarks/swarm_scale.py) through the real coordinator, transport and receiver: what
    they send passes every check of the receivers (nothing refused or rejected), each takes its peers' parcels, the
    killed member's expiry is seen about a lease after the kill, and the newcomer is welcomed and heard by a peer."""
    from benchmarks import swarm_scale
    from tests.netlab import NetLab

    reason = NetLab.unavailable()
    if reason is not None:
        pytest.skip(f"network namespaces: {reason}")
    [r] = swarm_scale.main(["--quick", "--output", str(tmp_path / "swarm_scale")])
    assert r["members"] == 4 and r["rejected_batches"] == 0 and r["refused"] == 0
    assert r["parcels_in_per_step"] > 0 and r["payload_in_bytes_per_step"] > 0
    # the kill was noticed, by the lease: the coordinator expired the member after a lease (2 s) of silence
    assert r["crash_noticed_s"] is not None and r["crash_silent_s"] >= 2.0
    # the newcomer was welcomed, and a peer took its parcel (the others held for it: no race with its start-up)
    assert r["joiner"]["to_welcome_s"] is not None and r["joiner"]["to_first_parcel_at_a_peer_s"] is not None
    # the members' own views saw both, the kill no sooner than the coordinator's expiry could have told them
    assert r["crash_seen_by_members_s"] >= r["crash_noticed_s"] - 0.5 and r["joiner_seen_by_members_s"] is not None
    # the coordinator relays every parcel: what leaves it is at least what the members took in
    assert r["coordinator_tx_bytes_per_step"] >= r["payload_in_bytes_per_step"]
    assert "| 4 |" in (tmp_path / "swarm_scale.md").read_text()


def test_the_open_swarm_table_gives_each_members_dropped_peer_sequences_their_own_column():
    from benchmarks import open_swarm

    def member(dropped):
        return {"steps": 40, "redone": 0, "steps_per_s": 1.0, "waited_per_step": 0.5, "with_peer_rollouts": 1.0,
                "staleness_mean": 0.0, "outbox_dropped": 0, "dropped_sequences": dropped, "rejected_batches": 0}

    events = {"wall_seconds": 1.0, "relayed": 1, "undeliverable": 0, "newcomer_when_tiny_s_at": 25}
    results = [{"scenario": "churn", "repeat": k, "events": events,
                "members": {name: member(dropped) for name in (*open_swarm.MEMBERS, open_swarm.NEWCOMER)}}
               for k, dropped in enumerate((520, 504))]
    table = open_swarm.table(results)
    assert "unsent parcels | peer sequences dropped (stale or surplus) | rejected |" in table
    assert "| churn | tiny-s | 40 (0) | 1.00 | 0.500 | 100% | 0.00 | 0 | 512 | 0 |" in table  # the repeats' mean


def test_adversary_summary_pairs_the_receiver_with_the_honest_swarm_seed_by_seed(tmp_path):
    """The table's paired difference is taken seed by seed (a seed the honest group lacks is left out), its attack
    success rates are the study's final values, and it writes the table, its JSON and the figure."""
    def final(values, seeds):
        return {"mean": sum(values) / len(values), "low": min(values), "high": max(values), "n": len(values),
                "values": values, "seeds": seeds}

    def group(name, accuracy, seeds, asr=None):
        finals = {"arith": final(accuracy, seeds), "arith-ood": final(accuracy, seeds)}
        if asr is not None:
            finals["arith-asr-inject"] = final(asr, seeds)
        return {"group": name, "method": "f-tis", "seeds": seeds,
                "by_member": {"receiver": {"final": finals, "auc": finals, "train": {}}}}

    summary = {"groups": [group("honest", [0.5, 0.6, 0.7], [0, 1, 2]),
                          group("inject", [0.4, 0.6, 0.9, 0.1], [0, 1, 2, 3], asr=[0.0, 0.5, 1.0, 0.5])]}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    text = adversary_summary.main(tmp_path)
    rows = {r["group"]: r for r in json.loads((tmp_path / "table.json").read_text())}
    assert rows["inject"]["vs_honest"]["values"] == pytest.approx([-0.1, 0.0, 0.2])
    assert rows["inject"]["asr_inject"]["mean"] == 0.5 and rows["honest"]["vs_honest"] is None
    assert "| inject | f-tis | 4 |" in text and (tmp_path / "attack_success.png").stat().st_size > 0


def test_adversary_summary_keeps_shares_of_questions_within_0_and_1():
    """An accuracy or attack-success interval reaching past 0 or 1 (a t-interval over few seeds) is set on the bound
    and marked: 0.010 [-0.008, 0.028] is no share of questions."""
    near_zero = {"mean": 0.01, "low": -0.008, "high": 0.028, "n": 5, "values": [0, 0, 0, 0, 0.05], "seeds": [0, 1, 2, 3, 4]}
    shown = adversary_summary._ci(adversary_summary._share(near_zero))
    assert shown == "0.010 [0.000, 0.028]*" and near_zero["low"] == -0.008  # the study's summary is left as it is
    one_seed = {"mean": 0.5, "low": 0.5, "high": 0.5, "n": 1}
    assert adversary_summary._share(one_seed) is one_seed


def test_the_real_gpu_summary_gives_the_share_of_completions_cut_and_the_reward_over_the_rest(tmp_path):
    from benchmarks import real_gpu_summary

    train = [{"kind": "train", "member": "m", "step": s, "reward_mean": 0.1, "truncated_frac": 0.5, "step_seconds": 2.0,
              "gen_seconds": 1.5, "train_seconds": 0.5, "is_weight_mean": 1.0, "gpu_peak_gib": 1.0} for s in range(1, 11)]
    evals = [{"kind": "eval", "member": "m", "step": 0, "accuracy": 0.25, "samples": 400}]
    (tmp_path / "learn.metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals + train))
    (tmp_path / "weights.json").write_text("{}")
    text = real_gpu_summary.main(tmp_path)
    assert "| 1-10 | 0.100 | 50% | 0.200 |" in text  # a reward of 0.1 from the half that stopped: at most 0.2 there
    assert "cannot be split into form and answer" in text


def test_the_real_step_benchmark_means_steps_after_the_first_and_divides_before_by_after():
    from benchmarks import real_step_cpu

    def run(side, scale):
        return {"side": side, "records": [
            {"step": s, "member": m, "gen_seconds": 1.0, "train_seconds": scale * (10.0 if s > 1 else 99.0),
             "sync_seconds": 0.5, "step_seconds": scale * 10.0 + 1.5, "rss_mib": 100.0 * s}
            for s in (1, 2, 3) for m in ("full", "lora")]}

    summary = real_step_cpu.summarise([run("before", 4.0), run("after", 1.0)])
    assert summary["by_side"]["after"]["full"]["train_seconds"] == 10.0  # step 1 left out
    assert summary["by_side"]["before"]["lora"]["steps_measured"] == 2
    assert summary["speedup"]["full"]["update"] == 4.0
    assert summary["speedup"]["full"]["step"] == 41.5 / 11.5
    table = real_step_cpu.markdown(summary, {"command": "c", "machine": "m", "date": "d", "rounds": 1, "steps": 3})
    assert "| full | before | 1.0 | 40.0 | 0.50 | 41.5 | 300 |" in table and "| full | 4.00x | 3.61x |" in table


def test_the_committed_scale_estimate_is_what_the_script_computes_and_a_members_parcels_do_not_grow(tmp_path):
    """benchmarks/scale_estimate.py (docs/scale.md): the committed rows are recomputed from the wire format (the DHT
    record's size signed here when hivemind is present, else its measured constant: the same bytes); with direct
    exchange a member's parcels a step stay 2K whatever N, while the relay's and the membership's grow with N."""
    import json

    from benchmarks import scale_estimate

    from .helpers import ROOT

    rows = scale_estimate.main(["--output", str(tmp_path / "scale_estimate")])
    committed = json.loads((ROOT / "benchmarks/results/scale_estimate.json").read_text())["rows"]
    assert json.loads(json.dumps(rows)) == committed
    for profile in ("peft", "paper"):
        mine = [r for r in rows if r["profile"] == profile]
        assert len({r["member_exchange_bytes_per_step"] for r in mine}) == 1
        assert mine[0]["member_exchange_bytes_per_step"] == 2 * 4 * mine[0]["parcel_bytes"]
        relay = [r["relay_member_in_bytes_per_step"] for r in mine]
        assert relay == sorted(relay) and relay[-1] == (mine[-1]["members"] - 1) * mine[0]["parcel_bytes"]
    peft = {r["members"]: r for r in rows if r["profile"] == "peft"}
    assert peft[16]["parcel_bytes"] == 4 * (1 + 8 * 32 + 2 * 32 * 22)  # the wire format: 8 bytes a token, 32 a sequence
    shares = [peft[n]["share_of_membership_in_member_in"]["coordinator"] for n in (16, 64, 1000)]
    assert shares == sorted(shares) and shares[-1] > 0.9  # the member list, sent whole every second, takes over
    # a DHT read takes in the whole key from each of its 5 replicas; past a 4-MiB key no replica's answer comes
    record, row = 984, peft[1000]
    reads = 5 * 1000 * record * row["step_s"] / 1.0
    assert row["member_in_kbit_s"]["dht"] == pytest.approx(8 * (row["member_exchange_bytes_per_step"] + reads)
                                                           / row["step_s"] / 1e3)
    assert row["dht_key_readable"] and not scale_estimate.estimate(
        4263, 4, scale_estimate.PROFILES["peft"], 1, 1.0, 1, record, 10.0, 0.2, 0.01)["dht_key_readable"]
