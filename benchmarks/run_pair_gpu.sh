#!/usr/bin/env bash
# Issue 28 on the GPU machine (benchmarks/README.md, "The pair and TRL on one GPU"): ftis-engine alone on one
# member's shape, TRL's GRPOTrainer on the same, and the paper's pair in sync and async mode, in one sitting.
# Stages run in the order given; a stage that fails is reported and the next one still runs.
#
#   bash benchmarks/run_pair_gpu.sh [install] [alone] [trl] [pair-sync] [pair-async] [summary] [seeds]
#   (default: every stage but seeds)
#
# install    vLLM and what it needs from the joined pieces (benchmarks/run_vllm_gpu.sh install; once per machine)
# alone      ftis-engine train --config configs/gpu/alone-shape-1.5b.yaml                  -> alone.metrics.jsonl
#            (ALONE_ARGS adds arguments: "--set members.0.model=builtin:shape-1.5b-qwen" for Qwen2.5's vocabulary,
#            with the packaged Qwen2.5-Coder's tokenizer files and ftis-package.json under $FTIS_CACHE_DIR/models/)
# trl        TRL from .whl-trl (carried in this call or an earlier one), then benchmarks/trl_grpo.py -> trl.json
#            (float32 masters under bf16 autocast and compiled layers, as ours; TRL_ARGS adds arguments, e.g.
#            TRL_ARGS="--precision bf16 --layers eager" as on 2026-11-27, or "--model builtin:shape-1.5b-qwen")
# pair-sync  ftis-engine train --config configs/gpu/pair-shapes.yaml --nproc 2             -> pair-sync.metrics.jsonl
# pair-async the same with --set swarm.mode=async                                          -> pair-async.metrics.jsonl
# summary    benchmarks/pair_summary.py over all of it                        -> pair_h100.{json,md} (or _h200)
# seeds      benchmarks/vllm_generator.py on the 1.5B shape, the alone batch at 512 tokens: per-request seeds
#            against one seeded stream, and sleep level 1 against 2 (the gap to TRL's generation) -> seeds.{json,md}
#
# Every stage also leaves <stage>.log and <stage>.gpumem (nvidia-smi's memory.used every 0.5 s while it ran) in
# $RESULTS (default /tmp/pair-results, which outlives a call while the machine stays warm), appends its exit
# status to stages.txt, and packs the folder into $OUT/pair-results.tar.gz where $OUT is set. A device call may
# run 10 minutes: give each one the stages that fit (README). The stages of one call share $CALL_LIMIT seconds
# (570, counted from the script's start): each stage is stopped when they are spent, and one that would start with
# less than a minute left is skipped, so the call ends in time to pack what it has. $STEPS (default: the configs'
# 10, trl_grpo.py's 10) shortens every training stage alike, for a session of 15 device-minutes (README).
set -uo pipefail
out="${RESULTS:-/tmp/pair-results}"
runs=/tmp/pair-runs
site=/tmp/vsite  # where run_vllm_gpu.sh installs vLLM
deadline=$(( $(date +%s) + ${CALL_LIMIT:-570} ))
mkdir -p "$out" "$runs"
mkdir -p /tmp/ftis-src && ln -sfn "$PWD/kernels" /tmp/ftis-src/ftis_kernels && ln -sfn "$PWD/ftis_engine" /tmp/ftis-src/ftis_engine
export PYTHONPATH="$PWD:/tmp/ftis-src:$site" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1

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
  return $rc
}

stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(install alone trl pair-sync pair-async summary)
status=0
for stage in "${stages[@]}"; do
  start=$(date +%s)
  limit=$(( deadline - start - 15 ))  # what is left of the call, less the time to pack the results
  if [ "$limit" -lt 60 ]; then
    echo "== stage $stage: skipped, ${limit} s left in this call" | tee -a "$out/stages.txt"
    status=1
    continue
  fi
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$out/$stage.gpumem" 2>/dev/null &
  sampler=$!
  case "$stage" in
    install)
      OUT='' RESULTS="$out/vllm-install" bash benchmarks/run_vllm_gpu.sh install &&
      nvidia-smi --query-gpu=name --format=csv,noheader | head -1 > "$out/device.txt" ;;
    alone) train alone --config configs/gpu/alone-shape-1.5b.yaml ${ALONE_ARGS:-} ;;
    trl)
      if [ ! -f "$site/.trl-done" ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl-trl/*.whl &&
        touch "$site/.trl-done"
      fi &&
      timeout -k 10 "$limit" python3 benchmarks/trl_grpo.py ${STEPS:+--steps $STEPS} ${TRL_ARGS:-} \
        --output "$out/trl.json" ;;
    # no step-0 eval (64 greedy completions a member, to 512 tokens): seconds of a 15-minute session for nothing the
    # issue measures; the final eval stays
    pair-sync) train pair-sync --config configs/gpu/pair-shapes.yaml --nproc 2 --set checkpoint.save_optimizer=false \
                 --set eval.at_start=false ;;
    pair-async) train pair-async --config configs/gpu/pair-shapes.yaml --nproc 2 --set checkpoint.save_optimizer=false \
                  --set eval.at_start=false --set swarm.mode=async ;;
    seeds) timeout -k 10 "$limit" python3 benchmarks/vllm_generator.py --model builtin:shape-1.5b --prompts 12 --n 12 \
             --max-new-tokens 512 --no-hf --output "$out/seeds" ;;
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
exit $status
