"""Compile every Triton kernel variant for the H100/H200 (sm_90a) on any machine, no GPU needed, and report
resource usage from the cubin: registers, spills (local memory), shared memory, and whether the matmuls use
Hopper's wgmma. Catches kernels that only the interpreter accepts, and register pressure before a GPU run.

    python benchmarks/compile_sm90.py             # table on stdout
    python benchmarks/compile_sm90.py --json      # JSON lines, one per variant
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from ftis_kernels import backward, logprobs  # noqa: E402
from ftis_kernels.logprobs import ATOMIC_HALF_BLOCKS, Blocks, default_blocks  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
PTR = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}


@dataclass
class Variant:
    kernel: str  # forward | backward
    mode: str  # fused | logits
    dtype: str  # bf16 | fp16 | fp32
    bias: bool = False
    needs: tuple[bool, bool, bool] = (True, True, False)
    strategy: str | None = None  # backward only: force a strategy (with its own tiles) instead of the default
    entropy: bool = False  # backward only: with the entropy bonus's term


def _forward(v: Variant, blocks: Blocks):
    sig = {"X": PTR[v.dtype], "W": PTR[v.dtype], "B": PTR[v.dtype], "T": "*i64", "M_OUT": "*fp32", "S_OUT": "*fp32",
           "E_OUT": "*fp32", "Z_OUT": "*fp32", "N": "i32", "V": "i32", "D": "i32", "stride_x": "i32",
           "stride_w": "i32", "inv_temp": "fp32", "v_per_split": "i32"}
    const = dict(FUSED=v.mode == "fused", HAS_BIAS=v.bias, BLOCK_N=blocks.block_n, BLOCK_V=blocks.block_v,
                 BLOCK_D=blocks.block_d, PRECISION="ieee" if v.dtype == "fp32" else "tf32", UPCAST=False)
    return logprobs._forward_kernel, sig, const


def _backward(v: Variant, blocks: Blocks):
    # the chunked strategy stores the gradient tile in the input dtype (cuBLAS multiplies it out); the atomic one
    # adds into fp32 dH / dW; logits mode stores the gradient of the logits
    store = v.mode == "logits" or (blocks.strategy == "chunked" and v.dtype != "fp16")
    grad = PTR[v.dtype] if store else "*fp32"
    sig = {"X": PTR[v.dtype], "W": PTR[v.dtype], "B": PTR[v.dtype], "T": "*i64", "LSE": "*fp32", "C": "*fp32",
           "EC": "*fp32", "ENT": "*fp32", "DX": grad, "DW": "*fp32", "DB": "*fp32", "N": "i32", "V": "i32", "D": "i32", "stride_x": "i32",
           "stride_w": "i32", "stride_dx": "i32", "inv_temp": "fp32", "v_blocks": "i64", "v_offset": "i32"}
    const = dict(FUSED=v.mode == "fused", HAS_BIAS=v.bias, NEED_DX=v.needs[0] and not store,
                 NEED_DW=v.needs[1] and not store, NEED_DB=v.needs[2] and v.bias and not store,
                 STORE_GRAD=store and v.mode == "fused", BLOCK_N=blocks.block_n, BLOCK_V=blocks.block_v,
                 BLOCK_D=blocks.block_d, GROUP_N=blocks.group_n, PRECISION="ieee" if v.dtype == "fp32" else "tf32",
                 UPCAST=False, FP32_GRAD=v.dtype == "fp16", HAS_ENT=v.entropy)
    return backward._backward_kernel, sig, const


def compile_variant(v: Variant, blocks: Blocks | None = None) -> dict:
    if blocks is None:
        blocks = ATOMIC_HALF_BLOCKS if v.strategy == "atomic" else default_blocks(v.kernel, v.mode, v.dtype)
    fn, sig, const = (_forward if v.kernel == "forward" else _backward)(v, blocks)
    for name in const:
        sig[name] = "constexpr"
    compiled = triton.compile(ASTSource(fn, sig, const), target=TARGET,
                              options={"num_warps": blocks.num_warps, "num_stages": blocks.num_stages})
    usage = resource_usage(compiled.asm["cubin"])
    usage["spill_bytes"] = spill_bytes(compiled.asm["ptx"])
    usage["wgmma"] = "wgmma.mma_async" in compiled.asm["ptx"]
    usage["shared_static"] = compiled.metadata.shared
    usage["blocks"] = [blocks.block_n, blocks.block_v, blocks.block_d, blocks.num_warps, blocks.num_stages]
    usage["strategy"] = blocks.strategy if v.kernel == "backward" and v.mode == "fused" else "-"
    return usage


def spill_bytes(ptx: str) -> int:
    """Spill stores reported by ptxas -v for this PTX (Triton's own ptxas, the one that takes its PTX version)."""
    bin_dir = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    tool = next(p for p in (bin_dir / "ptxas-blackwell", bin_dir / "ptxas") if p.exists())
    with tempfile.TemporaryDirectory() as tmp:
        src = pathlib.Path(tmp) / "k.ptx"
        src.write_text(ptx)
        out = subprocess.run([str(tool), "-v", "--gpu-name", "sm_90a", str(src), "-o", str(pathlib.Path(tmp) / "k.o")],
                             capture_output=True, text=True, check=True).stderr
    return sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", out))


def resource_usage(cubin: bytes) -> dict:
    tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {"registers": int(fields["REG"]), "local_bytes": int(fields["LOCAL"]), "stack_bytes": int(fields["STACK"])}


VARIANTS = [
    Variant("forward", "fused", "bf16"), Variant("forward", "fused", "bf16", bias=True),
    Variant("forward", "fused", "fp16"), Variant("forward", "fused", "fp32"),
    Variant("forward", "logits", "bf16"), Variant("forward", "logits", "fp32"),
    Variant("backward", "fused", "bf16"), Variant("backward", "fused", "bf16", bias=True, needs=(True, True, True)),
    Variant("backward", "fused", "bf16", needs=(True, False, False)),  # LoRA: frozen lm_head
    Variant("backward", "fused", "fp16"), Variant("backward", "fused", "fp32"),
    Variant("backward", "fused", "bf16", strategy="atomic"),  # the atomic strategy stays available
    Variant("backward", "logits", "bf16"), Variant("backward", "logits", "fp32"),
    Variant("backward", "fused", "bf16", entropy=True),  # algorithm.entropy_coef: the entropy's gradient too
]


def sweep() -> None:
    """Spill-free tile configurations per pass (to choose kernels/ftis_kernels/logprobs.py's defaults)."""
    grids = {
        ("forward", "fused"): [(n, v, d, w) for n in (64, 128) for v in (64, 128, 256) for d in (32, 64) for w in (4, 8)],
        ("backward", "fused"): [(n, v, d, w) for n in (64, 128) for v in (64, 128) for d in (32, 64) for w in (4, 8)],
        ("forward", "logits"): [(n, v, 16, w) for n in (8, 16, 32, 64) for v in (128, 256, 512, 1024) for w in (4, 8)],
        ("backward", "logits"): [(n, v, 16, w) for n in (8, 16, 32, 64) for v in (128, 256, 512, 1024) for w in (4, 8)],
    }
    for (kernel, mode), configs in grids.items():
        for dtype in ("bf16", "fp16", "fp32"):
            for n, v, d, w in configs:
                blocks = Blocks(block_n=n, block_v=v, block_d=d, num_warps=w, num_stages=3)
                try:
                    u = compile_variant(Variant(kernel, mode, dtype), blocks)
                except Exception as exc:  # out of shared memory, etc.
                    print(json.dumps({"kernel": kernel, "mode": mode, "dtype": dtype, "blocks": [n, v, d, w],
                                      "error": str(exc).splitlines()[0][:120]}), flush=True)
                    continue
                print(json.dumps({"kernel": kernel, "mode": mode, "dtype": dtype, **u}), flush=True)


def main(argv=None) -> list[dict]:
    args = sys.argv[1:] if argv is None else argv
    if "--sweep" in args:
        sweep()
        return []
    as_json = "--json" in args
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter does not compile")
    rows = []
    if not as_json:
        print("| kernel | mode | dtype | bias | needs (dx, dw, db) | blocks (n, v, d, warps, stages) | registers "
              "| spill bytes | static smem | wgmma |")
        print("|---|---|---|---|---|---|---|---|---|---|")
    for v in VARIANTS:
        u = compile_variant(v)
        rows.append({**v.__dict__, **u})
        if as_json:
            print(json.dumps(rows[-1]), flush=True)
        else:
            print(f"| {v.kernel} | {v.mode} | {v.dtype} | {v.bias} | {v.needs} | {u['blocks']} | {u['registers']} "
                  f"| {u['spill_bytes']} | {u['shared_static']} | {u['wgmma']} |", flush=True)
    return rows


if __name__ == "__main__":
    main()
