#!/usr/bin/env bash
# TRL for the GPU machine without network (issue 28: benchmarks/trl_grpo.py), as wheels small enough to carry in
# one call beside the working tree. Run here, where pip reaches the registries:
#
#   bash benchmarks/trl_bundle.sh [HAVE.txt]     -> .whl-trl/ (git-ignored through .git/info/exclude)
#
# It resolves TRL together with what benchmarks/vllm_bundle.sh resolves (vLLM 0.24.0 and ftis-engine's needs), so
# that the versions agree, and keeps what TRL adds to that: minus what the GPU machine already holds (HAVE.txt,
# default the 'cuda' image's package list in /work/.library/device/KINDS.md) and minus what the vLLM pieces bring.
# TRL 1.16.0: the newest release; it supports vLLM 0.22-0.31 and transformers >= 4.56.2 (5.17 on the GPU machine,
# 5.23 here). On the GPU machine, benchmarks/run_pair_gpu.sh's trl stage installs .whl-trl/*.whl beside vLLM.
set -euo pipefail
TRL=1.16.0
LIMIT=62914560  # 60 MiB: the wheels plus the working tree stay under a call's 64 MiB
work="${WORK:-/tmp/trl-bundle}"
repo="$(cd "$(dirname "$0")/.." && pwd)"
have="${1:-}"
rm -rf "$work" && mkdir -p "$work"
source "$repo/benchmarks/gpu_machine.sh"  # VLLM, vllm_requirements, plat, machine_packages
machine_packages "$have" "$work"
python3 -m pip install -q uv
compile() {  # requirements in -> pinned closure out, for the GPU machine's Python and platform, names normalised
  uv pip compile "$1" --python-version 3.12 --python-platform x86_64-manylinux_2_28 --no-header --no-annotate -q \
    -o "$2.raw"
  tr 'A-Z_' 'a-z-' < "$2.raw" | grep -v '^ *#' | sed 's/ *;.*//' | sort -u > "$2"
}
vllm_requirements "$work/vllm.in"
{ cat "$work/vllm.in"; echo "trl==$TRL"; } > "$work/trl.in"
compile "$work/vllm.in" "$work/vllm.txt"
compile "$work/trl.in" "$work/trl.txt"
# TRL must not move a version the vLLM pieces carry (two versions of one package stop the install)
moved=$(join -t= -j1 <(sort -t= -k1,1 "$work/vllm.txt") <(sort -t= -k1,1 "$work/trl.txt") | awk -F= '$3 != $5' || true)
if [ -n "$moved" ]; then echo "TRL $TRL moves versions the vLLM pieces carry: $moved" >&2; exit 1; fi
comm -13 "$work/vllm.txt" "$work/trl.txt" | while read -r line; do
  grep -qx "${line%%==*}" "$work/have.norm" || echo "$line"
done > "$work/missing.txt"
echo "TRL adds (beyond the GPU machine's packages and the vLLM pieces):"; sed 's/^/  /' "$work/missing.txt"
rm -rf "$repo/.whl-trl" && mkdir -p "$repo/.whl-trl"
python3 -m pip download -q --no-deps "${plat[@]}" -d "$repo/.whl-trl" -r "$work/missing.txt"
mkdir -p "$repo/.git/info" && (grep -qx '/.whl-trl/' "$repo/.git/info/exclude" 2>/dev/null ||
  echo '/.whl-trl/' >> "$repo/.git/info/exclude")
size=$(du -sb "$repo/.whl-trl" | cut -f1)
ls -l "$repo/.whl-trl"
echo "$size bytes in .whl-trl"
if [ "$size" -gt "$LIMIT" ]; then echo "over the $LIMIT-byte limit" >&2; exit 1; fi
