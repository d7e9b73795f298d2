#!/usr/bin/env bash
# Builds what vLLM needs on a GPU machine that has torch 2.11 (cu130) and no network, as pieces small enough to
# carry one per call (benchmarks/README.md, "vLLM on the lent GPU"). Run here, where pip reaches the registries:
#
#   bash benchmarks/vllm_bundle.sh [HAVE.txt]     -> .vb/0/p00 .vb/1/p01 ... (git-ignored through .git/info/exclude)
#
# HAVE.txt lists the distribution names the GPU machine already holds, one a line (default: the package list of
# the workplace's 'cuda' image, read from /work/.library/device/KINDS.md). Then, on the GPU machine, one call per
# piece (`mkdir -p /root/vb && cp .vb/N/p* /root/vb/`, carrying .vb/N) back to back, the last piece carried by the
# call that runs `bash benchmarks/run_vllm_gpu.sh` (or run_pair_gpu.sh), which joins and installs them.
#
# What is left out, because an offline engine on a Hopper GPU never loads it (vLLM imports these only when asked
# for): flashinfer (its 440 MB cubin wheel), tilelang, cutlass-dsl and the CUDA compiler wheels it pulls, quack,
# tokenspeed, humming-kernels, fastsafetensors, the FlashAttention-2 and MoE libraries inside vLLM's wheel, the
# Blackwell attention sources and the Rust frontend binary; and the server-only sentry, supervisor, rignore, fastar.
#
# Left out since 2026-11-28 (issue 67), because `from vllm import LLM, SamplingParams` and the engine's modules
# import without them (benchmarks/vllm_imports.py, run in a scratch environment holding this bundle on a CPU torch:
# every module of the engine path imports, but the two that load the CUDA driver, which import none of these):
# structured output's xgrammar (45 MB) with apache-tvm-ffi and torch-c-dlpack-ext, llguidance, outlines-core,
# lm-format-enforcer, interegular and diskcache; mistral-common and pycountry (Mistral tokenizers); the API
# server's anthropic, mcp, uvicorn and their kin; OpenTelemetry's tracing. Two of them vLLM 0.24 names at import
# (dataclass annotations in vllm/v1/structured_output/backend_xgrammar.py and backend_guidance.py: without them the
# engine core does not import), so benchmarks/vllm_stubs/ holds a stand-in for each with those names alone, and a
# request for structured output fails with the reason. openai and openai-harmony stay (vllm.entrypoints.llm imports
# them), as do fastapi and starlette (vllm.entrypoints.pooling, imported by it too).
set -euo pipefail
work="${WORK:-/tmp/vllm-bundle}"
repo="$(cd "$(dirname "$0")/.." && pwd)"
# a piece and the working tree that travels with it (tracked and not-ignored files) must stay under a call's 64 MiB:
# pieces of 62 MiB less today's tree, leaving 2 MiB for it to grow ($PIECE, in bytes, overrides)
tree=$(cd "$repo" && { git ls-files -z; git ls-files -z --others --exclude-standard; } |
       xargs -0 du -cb 2>/dev/null | awk '$2 == "total" {s += $1} END {print s + 0}')
PIECE="${PIECE:-$(( 62 * 1048576 - tree ))}"
if [ "$PIECE" -lt 16777216 ]; then echo "the working tree ($tree bytes) leaves pieces of under 16 MiB" >&2; exit 1; fi
have="${1:-}"
rm -rf "$work" && mkdir -p "$work/bund/whl" "$work/deps" "$work/vllm"
source "$repo/benchmarks/gpu_machine.sh"  # VLLM, vllm_requirements, plat, machine_packages
machine_packages "$have" "$work"
python3 -m pip install -q uv
# the dependency closure of vLLM and ftis-engine for the GPU machine, minus what it has and what is never loaded
vllm_requirements "$work/req.in"
uv pip compile "$work/req.in" --python-version 3.12 --python-platform x86_64-manylinux_2_28 --no-header \
  --no-annotate -q -o "$work/req.txt"
never_loaded='vllm|flashinfer-.*|tilelang|z3-solver|nvidia-.*|cuda-tile|humming-kernels|quack-kernels|tokenspeed-.*|fastsafetensors|sentry-sdk|supervisor|rignore|fastar'
not_imported='xgrammar|apache-tvm-ffi|torch-c-dlpack-ext|llguidance|outlines-core|lm-format-enforcer|interegular|diskcache|mistral-common|pycountry|ijson|anthropic|docstring-parser|mcp|mcp-types|pyjwt|cryptography|cffi|pycparser|uvicorn|httptools|watchfiles|websockets|sse-starlette|prometheus-fastapi-instrumentator|fastapi-cli|fastapi-cloud-cli|rich-toolkit|agent-detector|detect-installer|model-hosting-container-standards|jmespath|python-dotenv|dnspython|opentelemetry-.*|googleapis-common-protos'
tr 'A-Z_' 'a-z-' < "$work/req.txt" | grep -v -E "^($never_loaded|$not_imported)==" | while read -r line; do
  grep -qx "${line%%==*}" "$work/have.norm" || echo "$line"
done > "$work/missing.txt"
python3 -m pip download -q --no-deps "${plat[@]}" -d "$work/bund/whl" -r "$work/missing.txt"
python3 -m pip download -q --no-deps "${plat[@]}" -d "$work/deps" "vllm==$VLLM"
(cd "$work/vllm" && unzip -q "$work"/deps/vllm-*.whl &&
  rm -f vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/_moe_C_stable_libtorch.abi3.so vllm/vllm-rs \
        vllm/third_party/deep_gemm/_C.cpython-31[34]-*.so &&
  rm -rf vllm/third_party/fmha_sm100 && cp -r "$repo"/benchmarks/vllm_stubs/{xgrammar,llguidance} . &&
  tar --exclude=__pycache__ -cf - vllm "vllm-$VLLM.dist-info" xgrammar llguidance |
    xz -6 -T0 > "$work/bund/vllm-trim.tar.xz")
(cd "$work" && tar -cf bundle.tar bund && md5sum bundle.tar)
mkdir -p "$repo/.git/info" && (grep -qx '/.vb/' "$repo/.git/info/exclude" 2>/dev/null || echo '/.vb/' >> "$repo/.git/info/exclude")
rm -rf "$repo/.vb" && split -b "$PIECE" -d "$work/bundle.tar" "$work/p"
for piece in "$work"/p[0-9][0-9]; do n=$((10#${piece##*/p})); mkdir -p "$repo/.vb/$n" && mv "$piece" "$repo/.vb/$n/"; done
ls -l "$repo"/.vb/*/
# the last piece travels with the call that installs and runs (benchmarks/README.md): beside it, the tree and what
# that call carries as well (.tok, the Qwen tokenizer's files; .whl-trl, TRL's wheel), under a call's 64 MiB
last=$(ls "$repo"/.vb/*/p* | tail -1)
extra=$(du -cb "$repo/.tok" "$repo/.whl-trl" 2>/dev/null | tail -1 | cut -f1 || true)
echo "$(ls "$repo"/.vb/*/p* | wc -l) pieces of $(du -cb "$repo"/.vb/*/p* | tail -1 | cut -f1) bytes; the last," \
     "$(stat -c %s "$last") bytes, leaves $(( 64 * 1048576 - tree - $(stat -c %s "$last") )) bytes beside the tree" \
     "for what its call carries besides (.tok and .whl-trl: ${extra:-0} bytes now)"
