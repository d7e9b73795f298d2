"""Mixed precision as the field does it (verl, prime-rl): trainable parameters and optimizer states in float32
(master weights), forward and backward in the member's compute dtype (`members.N.dtype`).

Why: a bf16 weight near 0.02 has a spacing of 1.2e-4 between representable values, and an Adam step at lr 1e-6 is
under 1% of that: with bf16 parameters almost every update rounds away. With float32 masters every step lands, and
the matrix work still runs in bf16 (autocast on one rank; FSDP2's MixedPrecisionPolicy on several, fsdp.py).
A LoRA member's frozen base may stay in the compute dtype: it is never stepped. Where float32 masters do not fit,
members.N.master_dtype=bfloat16 is the memory-saving mode: bf16 weights and states, stepped by torchao's AdamW with
stochastic rounding.
"""

from __future__ import annotations

import contextlib

import torch

def master_dtype(setting: str) -> torch.dtype:
    """members.N.master_dtype: float32 masters, or bfloat16 ones stepped with stochastic rounding (the memory-saving
    mode: torchao's AdamW, `make_optimizer`)."""
    return getattr(torch, setting)


def check_low_memory_optimizer(index: int, optimizer: str, weight_decay: float) -> str | None:
    """Why members.N.master_dtype=bfloat16 cannot run here (None when it can): torchao must be importable, and
    its AdamW decouples weight decay, which equals Adam's only when there is none."""
    if optimizer == "adam" and weight_decay > 0:
        return (f"members.{index}.master_dtype: bfloat16 steps with torchao's AdamW (decoupled weight decay); set "
                f"members.{index}.optimizer=adamw or weight_decay=0")
    try:
        import torchao.optim  # noqa: F401
    except ImportError:
        return (f"members.{index}.master_dtype: bfloat16 needs torchao's AdamW with bf16 stochastic rounding: pip "
                "install torchao")
    return None


def make_optimizer(params: list[torch.nn.Parameter], kind: str, lr: float, betas: tuple[float, float],
                   weight_decay: float, master: torch.dtype) -> torch.optim.Optimizer:
    """Adam(W) over a member's trainable parameters. float32 masters: torch's, its states float32. bfloat16 masters:
    torchao's AdamW with bf16 stochastic rounding (states bf16; each rounding of the new weight is unbiased, so an
    update far below bf16's spacing still moves the weight in expectation)."""
    if master == torch.bfloat16:
        import logging

        logging.getLogger("torchao").setLevel(logging.ERROR)  # its optional CUDA extensions' load notes
        from torchao.optim import _AdamW

        return _AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, bf16_stochastic_round=True)
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    on_gpu = on_one_gpu(params)
    # fused on a GPU (TRL's adamw_torch_fused): the default foreach step holds a float32 copy of every parameter
    # (sqrt of exp_avg_sq) at the end of each update, which set ours' device peak (issue 81: 5.75 GiB on the 1.5B
    # shape); the same formula in one kernel, equal to foreach but in the last bits
    optimizer = cls(params, lr=lr, betas=betas, weight_decay=weight_decay, **({"fused": True} if on_gpu else {}))
    if on_gpu:
        materialise_states(optimizer)
    return optimizer


def on_one_gpu(params: list) -> bool:
    """Every parameter a plain CUDA tensor (an FSDP2 member's DTensors keep torch's default optimizer path)."""
    return bool(params) and all(type(p.data) is torch.Tensor and p.is_cuda for p in params)


def materialise_states(optimizer: torch.optim.Optimizer) -> None:
    """Create Adam's states now, the zeros its first step() would create, before the run's activations and its
    engine exist. Created inside the first update, they land in blocks its activations just freed, and the CUDA
    caching allocator can return none of those segments for the rest of the run (issue 81: ~2.9 GiB held between
    steps on the 1.5B shape). One step of lr 0 over zero gradients creates them and leaves every parameter as it was
    (its step is 0 x a finite number; AdamW's decay multiplies by 1); then every state tensor, the step counters
    included, is zeroed, so the first real step finds exactly what it would have made."""
    groups = optimizer.param_groups
    params = [p for group in groups for p in group["params"]]
    rates, grads = [group["lr"] for group in groups], [p.grad for p in params]
    try:
        for group in groups:
            group["lr"] = 0.0
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
    finally:
        for group, lr in zip(groups, rates):
            group["lr"] = lr
        for p, grad in zip(params, grads):
            p.grad = grad
    with torch.no_grad():
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    value.zero_()


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every parameter group's learning rate. torchao's AdamW keeps it as a tensor (so that its compiled step
    does not recompile when it changes) and refuses a float in its place: fill that tensor instead."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def get_lr(optimizer: torch.optim.Optimizer) -> float:
    """The first parameter group's learning rate, as a float (torchao's AdamW holds it as a tensor)."""
    return float(optimizer.param_groups[0]["lr"])


def compute_dtype(setting: str, device: torch.device) -> torch.dtype:
    """members.N.dtype: auto is bfloat16 on a GPU and float32 on the CPU; bfloat16 on the CPU computes in bf16
    under CPU autocast (the GPU's precision, tested where no GPU is)."""
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, setting)


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """The member's forward passes (update, generation, eval, the start-up check, warm start) run in this context:
    autocast to `dtype`, or nothing for float32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)

