"""train.layers (layers.py): regional torch.compile of the decoder layers and Liger-Kernel's fused RMSNorm and SwiGLU.
Each mode is checked against the eager model built from the same seed: the update's loss and every gradient,
with and without recompute, a LoRA member, generation (which stays eager), a deep-copied replica, and the errors
that name the field."""

from __future__ import annotations

import copy
import functools
import importlib.util
import sys

import pytest
import torch
from ftis_kernels import LossConfig

from ftis_engine.model import layers
from ftis_engine.model.batch import pack
from ftis_engine.config import ConfigError
from ftis_engine.model.models import load_model
from ftis_engine.model.update import batch_loss

from .helpers import TINY, member, random_items

CFG = LossConfig(method="f-tis")


def loss_and_grads(m, packed):
    m.model.zero_grad(set_to_none=True)
    out = batch_loss(m, packed, CFG, backend="torch")
    out.loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in m.model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads


def assert_same_update(a, b, rtol=1e-5, atol=1e-6):
    packed = pack(random_items(a.vocab_size, n_groups=3, per_group=3))
    loss_a, grads_a = loss_and_grads(a, packed)
    loss_b, grads_b = loss_and_grads(b, packed)
    torch.testing.assert_close(loss_b, loss_a, rtol=rtol, atol=atol)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 0
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=rtol, atol=atol, msg=name)


@pytest.fixture
def compile_calls(request, monkeypatch):
    """How many times a compiled layer forward ran. The compiled function is wrapped; it is torch.compile's
    default (inductor) where a test asks for it with @pytest.mark.inductor, else torch.compile with the aot_eager
    backend (the same graph capture and autograd, without inductor's minutes of code generation on a CPU)."""
    calls = []
    inductor = request.node.get_closest_marker("inductor") is not None
    real = layers._compiled if inductor else functools.cache(lambda fn: torch.compile(fn, backend="aot_eager"))

    def counting(forward):
        compiled = real(forward)

        def run(*args, **kwargs):
            calls.append(1)
            return compiled(*args, **kwargs)
        return run

    monkeypatch.setattr(layers, "_compiled", counting)
    return calls


@pytest.mark.parametrize("overrides", [pytest.param((), marks=pytest.mark.inductor),
                                       ("train.gradient_checkpointing=true",)], ids=["inductor", "recompute"])
def test_compiled_layers_give_the_eager_update(overrides, compile_calls):
    eager, _ = member(0, *overrides)
    compiled, _ = member(0, "train.layers=compile", *overrides)
    assert layers.compiled(compiled.model) and not layers.compiled(eager.model)
    assert_same_update(eager, compiled)
    assert len(compile_calls) >= len(layers.decoder_layers(compiled.model))  # every layer ran compiled


def test_a_compiled_lora_member_gives_the_eager_update(compile_calls):
    eager, _ = member(1)  # tiny.yaml's member 1 is a LoRA member
    compiled, _ = member(1, "train.layers=compile")
    assert eager.settings.lora is not None
    assert_same_update(eager, compiled)
    assert compile_calls


def test_generation_runs_the_layers_eagerly(compile_calls):
    eager, _ = member(0)
    compiled, _ = member(0, "train.layers=compile")
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    kwargs = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    with torch.no_grad():
        assert torch.equal(compiled.model.generate(ids, **kwargs), eager.model.generate(ids, **kwargs))
    assert compile_calls == []


def test_a_deep_copy_calls_its_own_layers(compile_calls):
    compiled, _ = member(0, "train.layers=compile")
    replica = copy.deepcopy(compiled.model)
    for original, copied in zip(layers.decoder_layers(compiled.model), layers.decoder_layers(replica)):
        assert copied.forward.__self__ is copied and original.forward.__self__ is original
    with torch.no_grad():
        for p in replica.parameters():
            p.zero_()
    ids = torch.tensor([[5, 6, 7, 8]])
    assert not torch.equal(replica(ids).logits, compiled.model(ids).logits)
    assert compile_calls  # with autograd on, both ran their compiled layers


def test_a_model_without_a_layers_list_is_not_compiled_and_needs_no_layers():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))  # its layers are transformer.h
    assert not layers.compiled(gpt2)  # the start-up check asks every member, whatever train.layers is
    with pytest.raises(ConfigError, match="^train.layers: cannot find the decoder layers of GPT2LMHeadModel"):
        layers.compile_layers(gpt2, "compile")


def test_auto_is_eager_and_bad_choices_name_the_field(monkeypatch):
    cpu = torch.device("cpu")
    assert layers.resolve("auto", cpu) == "eager"
    assert layers.resolve("auto", torch.device("cuda")) == "compile"  # measured fastest on an H100 (issue 27)
    assert layers.resolve("compile", cpu) == "compile"
    with pytest.raises(ConfigError, match="^train.layers: 'fast' is not one of"):
        layers.resolve("fast", cpu)
    if importlib.util.find_spec("liger_kernel") is not None:
        with pytest.raises(ConfigError, match="^train.layers: liger runs Liger-Kernel's Triton kernels on a CUDA GPU"):
            layers.resolve("liger", cpu)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "liger_kernel" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^train.layers: liger\+compile needs the liger-kernel package"):
        layers.resolve("liger+compile", torch.device("cuda"))


def test_the_command_line_rejects_an_unknown_mode(tmp_path, capsys):
    from .helpers import command_here

    proc = command_here(capsys, "train", "--config", TINY, "--set", "train.layers=fast", "--output-dir", tmp_path,
                        "--dry-run")
    assert proc.returncode == 2 and "train.layers" in proc.stderr and "Traceback" not in proc.stderr
    assert not any(tmp_path.iterdir())


def test_liger_on_a_cpu_run_stops_before_any_process_starts(tmp_path, capsys):
    from .helpers import command_here

    proc = command_here(capsys, "train", "--config", TINY, "--set", "train.layers=liger", "--nproc", "2",
                        "--output-dir", tmp_path)
    lines = proc.stderr.strip().splitlines()
    # without liger-kernel it says so; with it, that its kernels need a GPU
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: train.layers: liger ")
    assert not any(tmp_path.iterdir())


liger = pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None,
                           reason="liger-kernel is not installed (pip install liger-kernel)")


@liger
def test_liger_patches_the_norms_and_mlps_and_keeps_the_parameter_names():
    """Where Liger's kernels cannot run (they need a GPU, not Triton's interpreter): what fuse() changes."""
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    fused = load_model("builtin:tiny-s", 256, torch.float32, 0, "sdpa")
    family = sys.modules[type(fused).__module__]
    before = dict(vars(family))
    names = set(fused.state_dict())
    layers.fuse(fused, "liger")
    first = layers.decoder_layers(fused)[0]
    assert first.mlp.forward.__func__ is LigerSwiGLUMLP.forward
    assert first.input_layernorm.forward.__func__ is LigerRMSNorm.forward
    assert fused.model.norm.forward.__func__ is LigerRMSNorm.forward
    assert set(fused.state_dict()) == names  # checkpoints stay plain HF models
    # only this instance: the family's classes and RoPE stay transformers' own, for models built later too
    assert dict(vars(family)) == before
    later = layers.decoder_layers(load_model("builtin:tiny-s", 256, torch.float32, 0, "sdpa"))[0]
    assert not isinstance(later.mlp, LigerSwiGLUMLP) and getattr(later.mlp.forward, "__func__", None) is not \
        LigerSwiGLUMLP.forward


@liger
@pytest.mark.skipif(not torch.cuda.is_available(), reason="Liger-Kernel's kernels run on a CUDA GPU")
@pytest.mark.parametrize("mode", ["liger", "liger+compile"])
def test_liger_layers_give_the_eager_update_on_a_gpu(mode):
    device = torch.device("cuda")
    models = [load_model("builtin:tiny-s", 256, torch.float32, 0, "sdpa").to(device) for _ in range(2)]
    layers.fuse(models[1], mode)
    layers.compile_layers(models[1], mode)
    ids = torch.randint(4, 256, (2, 24), generator=torch.Generator().manual_seed(0)).to(device)
    grads = []
    for model in models:
        loss = model(ids).logits.float().log_softmax(-1).gather(2, ids[..., None]).mean()
        loss.backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-5, msg=name)
