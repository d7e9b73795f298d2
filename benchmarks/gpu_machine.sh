# Sourced by benchmarks/vllm_bundle.sh and benchmarks/trl_bundle.sh: which wheels fit the lent GPU machine
# (Python 3.12, x86-64 manylinux) and which packages it already holds.
#
#   VLLM                        the vLLM version the pieces carry (and TRL's wheels are resolved beside)
#   vllm_requirements FILE      writes FILE: vLLM and what ftis-engine needs beside it, the closure both bundles
#                               resolve (so that TRL's wheels agree with the vLLM pieces)
#   plat                        pip download flags for wheels that install there
#   machine_packages HAVE WORK  writes WORK/have.norm: the normalised names of the distributions the machine
#                               holds, from HAVE (one a line) or, when HAVE is empty, the 'cuda' image's package
#                               list in /work/.library/device/KINDS.md
VLLM=0.24.0

vllm_requirements() {  # torchao: members.N.master_dtype=bfloat16 (configs/gpu/pair-shapes.yaml); the machine lacks it
  printf 'vllm==%s\ndatasets>=2.19\nmath-verify[antlr4-13-2]>=0.7\npydantic>=2.6\ntorchao>=0.10\n' "$VLLM" > "$1"
}

plat=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
      --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_26_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64
      --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64 --platform any)

machine_packages() {
  local have="$1" work="$2"
  if [ -z "$have" ]; then
    have="$work/have.txt"
    sed -n '/^## Python packages already there/,$p' /work/.library/device/KINDS.md | tail -1 | sed 's/^Packages: //' |
      tr ',' '\n' | sed 's/^ *//;s/\.$//' > "$have"
  fi
  tr 'A-Z_' 'a-z-' < "$have" | sort -u > "$work/have.norm"
}
