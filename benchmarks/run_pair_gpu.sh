#!/usr/bin/env bash
# Issues 28 and 67 on the GPU machine (benchmarks/README.md, "The pair and TRL on one GPU"): the paper's pair, then
# ftis-engine alone on one member's shape and TRL's GRPOTrainer on the same, like for like, in one sitting. Stages
# run in the order given; a stage that fails is reported and the next one still runs.
#
#   bash benchmarks/run_pair_gpu.sh [install] [pair-sync] [alone] [trl] [summary] [trl-3b] [pair-async] [seeds]
#   (default: install pair-sync alone trl summary, the issue's order: what matters most first)
#
# install    vLLM and what it needs from the joined pieces (benchmarks/run_vllm_gpu.sh install; once per machine)
# pair-sync  ftis-engine train --config configs/gpu/pair-shapes.yaml --nproc 2            -> pair-sync.metrics.jsonl
#            (float32 masters where the GPU has 120 GiB or more, as ours alone and TRL train: python
#            benchmarks/pair_plan.py; the config's bf16 masters elsewhere; PAIR_ARGS adds arguments)
# alone      ftis-engine train --config configs/gpu/alone-shape-1.5b.yaml                  -> alone.metrics.jsonl
#            (ALONE_ARGS adds arguments, e.g. "--set train.steps=6"; TRL gets the same --set overrides)
# trl        TRL from .whl-trl (carried in this call or an earlier one), then benchmarks/trl_grpo.py --like
#            configs/gpu/alone-shape-1.5b.yaml: every setting ours' config gives its member, the same model, seed,
#            batch, length, temperature, learning rate, float32 masters under bf16 autocast, varlen attention,
#            compiled layers and KV cache (TRL_ARGS adds arguments)                        -> trl.json
# summary    benchmarks/pair_summary.py over all of it                        -> pair_h100.{json,md} (or _h200)
# trl-3b     TRL as `trl` on the 3B shape (the pair's other member): with trl, the time TRL needs to train the
#            pair's two shapes one after the other (pair_summary's pair_vs_trl_sequential) -> trl-3b.json
# pair-async the pair with --set swarm.mode=async                                          -> pair-async.metrics.jsonl
# seeds      benchmarks/vllm_generator.py on the 1.5B shape, the alone batch at 512 tokens: per-request seeds
#            against one seeded stream, and sleep level 1 against 2                      -> seeds.{json,md}
#
# The built-ins with Qwen2.5's vocabulary read the packaged Qwen2.5-Coder's tokenizer files: carry .tok
# (benchmarks/tokenizer_bundle.sh) and FTIS_CACHE_DIR points there. Scratch (the engines' weight files, the runs'
# checkpoints, inductor's cache) goes to a folder in /dev/shm where it has room (writing 18 GB of float32 weights
# for the pair's engines to disk would take a good part of a minute), else /tmp.
#
# Every stage also leaves <stage>.log and <stage>.gpumem (nvidia-smi's memory.used every 0.5 s while it ran) in
# $RESULTS (default /tmp/pair-results, which outlives a call while the machine stays warm), appends its exit
# status to stages.txt, and packs the folder into $OUT/pair-results.tar.gz where $OUT is set, so that a call cut
# off at its limit still brings back every stage that ended (and the steps a cut training stage finished: the
# metrics files and trl.json are written after every step). The stages of one call share $CALL_LIMIT seconds
# (570, counted from the script's start): each stage is stopped when they are spent, and one that would start with
# less than its least useful time left (least_seconds: its start and three steps) is skipped. $STEPS shortens every
# training stage alike.
set -uo pipefail

least_seconds() {  # a stage's start and three steps, from the 2026-11-27 logs (benchmarks/README.md): skip below
  case "$1" in
    install) echo 60 ;; pair-sync | pair-async) echo 200 ;; alone | trl) echo 140 ;; trl-3b) echo 160 ;;
    seeds) echo 120 ;; *) echo 20 ;;
  esac
}

pair_precision() {  # GPU memory in MiB -> the pair's --set arguments: float32 masters where they fit
  if [ "${1:-0}" -ge $((120 * 1024)) ]; then
    echo "--set members.0.master_dtype=float32 --set members.1.master_dtype=float32"
  fi
}

scratch() {  # where the runs write: a folder in /dev/shm with 48 GiB free, else /tmp
  local free
  free=$(df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 {print $4}')
  if [ "${free:-0}" -ge $((48 * 1048576)) ]; then echo /dev/shm/pair-scratch; else echo /tmp; fi
}

train() {  # run name, then arguments of ftis-engine train; its metrics.jsonl is kept whatever its exit status
  local name=$1 rc
  shift
  rm -rf "${runs:?}/$name"
  timeout -k 10 "$limit" python3 -m ftis_engine train --output-dir "$runs" --set run_name="$name" \
    ${STEPS:+--set train.steps=$STEPS} "$@"
  rc=$?
  cp "$runs/$name/metrics.jsonl" "$out/$name.metrics.jsonl" 2>/dev/null
  # what it ran with (auto resolved here, as the run resolved it), for pair_summary's like-for-like check
  python3 benchmarks/pair_summary.py --settings "$runs/$name" > "$out/$name.settings.json" 2>/dev/null ||
    rm -f "$out/$name.settings.json"
  rm -rf "${runs:?}/$name" "$TMPDIR"/ftis-vllm-*  # the checkpoint (gigabytes in memory), an engine's leftovers
  return $rc
}

# TRL on the 3B shape, as ours' pair member: the alone config with the 3B model and its engine's KV need at the
# config's length (python benchmarks/pair_plan.py --config configs/gpu/pair-shapes.yaml --kv: members.1)
TRL_3B="--set members.0.model=builtin:shape-3b-qwen --set members.0.vllm.kv_cache_gib=3.8125"

trl() {  # output name, then arguments of trl_grpo.py beyond ours' alone config: TRL as ours alone runs
  local name=$1 rc
  shift
  if [ ! -f "$site/.trl-done" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl-trl/*.whl &&
      touch "$site/.trl-done" || return 1
  fi
  timeout -k 10 "$limit" python3 benchmarks/trl_grpo.py --like configs/gpu/alone-shape-1.5b.yaml "$@" \
    ${ALONE_ARGS:-} ${STEPS:+--steps $STEPS} ${TRL_ARGS:-} --output "$out/$name.json"
  rc=$?
  rm -rf "$TMPDIR"/trl-grpo-*  # a cut run's exported weights
  return $rc
}

main() {
  out="${RESULTS:-/tmp/pair-results}"
  site="${VLLM_SITE:-/tmp/vsite}"  # where run_vllm_gpu.sh installs vLLM
  local src="${FTIS_SRC:-/tmp/ftis-src}"  # the engine and the op under their import names
  deadline=$(( $(date +%s) + ${CALL_LIMIT:-570} ))
  TMPDIR="${TMPDIR:-$(scratch)}"
  runs="$TMPDIR/pair-runs"
  mkdir -p "$out" "$runs"
  mkdir -p "$src" && ln -sfn "$PWD/kernels" "$src/ftis_kernels" && ln -sfn "$PWD/ftis_engine" "$src/ftis_engine"
  export TMPDIR PYTHONPATH="$PWD:$src:$site" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
    HF_HUB_OFFLINE=1
  if [ -z "${FTIS_CACHE_DIR:-}" ] && [ -d .tok/models ]; then export FTIS_CACHE_DIR="$PWD/.tok"; fi
  gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
  [ -s "$out/device.txt" ] || nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 > "$out/device.txt"
  stages=("$@")
  [ ${#stages[@]} -eq 0 ] && stages=(install pair-sync alone trl summary)
  status=0
  for stage in "${stages[@]}"; do
    start=$(date +%s)
    limit=$(( deadline - start - 15 ))  # what is left of the call, less the time to pack the results
    if [ "$limit" -lt "$(least_seconds "$stage")" ]; then
      echo "== stage $stage: skipped, ${limit} s left in this call (it needs $(least_seconds "$stage"))" |
        tee -a "$out/stages.txt"
      status=1
      continue
    fi
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$out/$stage.gpumem" 2>/dev/null &
    sampler=$!
    case "$stage" in
      install)
        OUT='' RESULTS="$out/vllm-install" bash benchmarks/run_vllm_gpu.sh install &&
        echo "scratch: $TMPDIR; tokenizers: ${FTIS_CACHE_DIR:-none}; GPU memory: ${gpu_mib:-?} MiB" ;;
      # shellcheck disable=SC2046  # pair_precision's words are separate arguments
      pair-sync) train pair-sync --config configs/gpu/pair-shapes.yaml --nproc 2 $(pair_precision "$gpu_mib") \
                   ${PAIR_ARGS:-} ;;
      pair-async) train pair-async --config configs/gpu/pair-shapes.yaml --nproc 2 $(pair_precision "$gpu_mib") \
                    --set swarm.mode=async ${PAIR_ARGS:-} ;;
      alone) train alone --config configs/gpu/alone-shape-1.5b.yaml ${ALONE_ARGS:-} ;;
      trl) trl trl ;;
      trl-3b) trl trl-3b $TRL_3B ;;
      seeds) timeout -k 10 "$limit" python3 benchmarks/vllm_generator.py --model builtin:shape-1.5b --prompts 12 \
               --n 12 --max-new-tokens 512 --no-hf --output "$out/seeds" ;;
      summary)  # named for the GPU: pair_h100, pair_h200 (pair_gpu when device.txt does not say)
        tag=$(grep -oiE 'h100|h200|a100|b200' "$out/device.txt" 2>/dev/null | head -1 | tr 'A-Z' 'a-z')
        python3 benchmarks/pair_summary.py --results "$out" --output "$out/pair_${tag:-gpu}" ;;
      *) echo "unknown stage $stage"; false ;;
    esac 2>&1 | tee "$out/$stage.log"
    rc=${PIPESTATUS[0]}
    kill "$sampler" 2>/dev/null
    wait "$sampler" 2>/dev/null
    echo "== stage $stage: exit $rc after $(( $(date +%s) - start )) s" | tee -a "$out/stages.txt"
    [ "$rc" -ne 0 ] && status=1
    if [ -n "${OUT:-}" ]; then  # after every stage: a call cut off at its limit still brings back what was done
      tar -czf "$OUT/pair-results.tar.gz" -C "$(dirname "$out")" "$(basename "$out")"
      cp "$out/stages.txt" "$OUT/" 2>/dev/null
      cp "$out"/pair_*.json "$out"/pair_*.md "$OUT/" 2>/dev/null
    fi
  done
  return $status
}

# sourced (tests/test_run_pair_gpu.py): the functions above, nothing run
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
  exit $?
fi
