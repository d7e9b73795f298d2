#!/usr/bin/env bash
# The GPU benchmarks in one device call (see benchmarks/README.md). Stages run in the order given; a stage that
# fails is reported and the next one still runs. Results and logs go to benchmarks/results/gpu (or $RESULTS);
# where $OUT is set (a folder that a remote runner copies back), they are also packed as $OUT/gpu-results.tar.gz.
#
#   bash benchmarks/run_gpu.sh [check] [tune] [kernels] [kernels-16k] [update] [exchange]    (default: all but tune)
#   bash benchmarks/run_gpu.sh grid-1.5b            # issue 27: attention x train.layers for one model; the next
#   bash benchmarks/run_gpu.sh grid-3b              # call the other (needs .whl/ with Liger). Each run is merged
#                                                   # into $RESULTS/update_step.json; copy it to benchmarks/results/
# The results are packed after every stage, so a call cut off at its limit still brings back the stages it finished.
set -uo pipefail
out="${RESULTS:-benchmarks/results/gpu}"
mkdir -p "$out"
if [ -d .whl ]; then  # Liger-Kernel, Cut Cross-Entropy, torchao... carried as wheels (kept in /tmp/site while warm)
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site
# the packages from the working tree without installing it (ftis_kernels lives in kernels/)
mkdir -p /tmp/ftis-src && ln -sfn "$PWD/kernels" /tmp/ftis-src/ftis_kernels && ln -sfn "$PWD/ftis_engine" /tmp/ftis-src/ftis_engine
export PYTHONPATH="$PWD:/tmp/ftis-src:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, 'transformers', transformers.__version__)"
  python3 -m pip list 2>/dev/null | grep -iE "^(liger|cut.cross|peft) " || true
} | tee "$out/versions.txt"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(check kernels update exchange)
status=0
for stage in "${stages[@]}"; do
  start=$(date +%s)
  case "$stage" in
    check) python3 benchmarks/check_gpu.py --output "$out/check_gpu.json" ;;
    tune) python3 benchmarks/tune.py --output "$out/tune.json" ;;
    kernels) python3 benchmarks/kernel_bench.py --dims 1536 --tokens 4096 16384 65536 --output "$out/kernels" ;;
    kernels-16k) python3 benchmarks/kernel_bench.py --dims 1536 --tokens 16384 --output "$out/kernels" ;;
    update) python3 benchmarks/update.py --output "$out/update" ;;
    grid-1.5b|grid-3b)  # the landed precision (float32 masters, bf16 autocast), fused path: sdpa eager as the
      # before, then varlen and flex_attention with every way of running the layers; the memory-saving mode (bfloat16
      # masters) with varlen and liger+compile. Merged into update_step.json after every run; GRID_LIMIT s at most.
      m="${stage#grid-}"
      timeout -k 10 "${GRID_LIMIT:-480}" bash -c "
        python3 benchmarks/update.py --models $m --paths fused --repeats 3 --attn sdpa --layers eager \
          --output $out/update-$stage-sdpa --update-step $out/update_step.json;
        python3 benchmarks/update.py --models $m --paths fused --repeats 3 --attn varlen flex_attention \
          --layers eager liger compile liger+compile --output $out/update-$stage --update-step $out/update_step.json;
        python3 benchmarks/update.py --models $m --paths fused --repeats 3 --masters bfloat16 --attn varlen \
          --layers liger+compile --output $out/update-$stage-bf16 --update-step $out/update_step.json" ;;
    varlen-1.5b|varlen-3b)  # torch's varlen kernel with float32 masters (fixed after grid-1.5b) and bf16 masters
      m="${stage#varlen-}"
      timeout -k 10 "${GRID_LIMIT:-480}" bash -c "
        python3 benchmarks/update.py --models $m --paths fused --repeats 3 --attn sdpa varlen --layers eager \
          --output $out/update-$stage-eager --update-step $out/update_step.json;
        python3 benchmarks/update.py --models $m --paths fused --repeats 3 --attn varlen --layers compile liger \
          --output $out/update-$stage --update-step $out/update_step.json;
        python3 benchmarks/update.py --models $m --paths fused --repeats 3 --masters bfloat16 --attn varlen \
          --layers compile --output $out/update-$stage-bf16 --update-step $out/update_step.json" ;;
    exchange) python3 benchmarks/exchange.py --processes 2 --output "$out/exchange-gpu.json" ;;
    *) echo "unknown stage $stage"; false ;;
  esac 2>&1 | tee "$out/$stage.log"
  rc=${PIPESTATUS[0]}
  echo "== stage $stage: exit $rc after $(( $(date +%s) - start )) s" | tee -a "$out/stages.txt"
  [ "$rc" -ne 0 ] && status=1
  if [ -n "${OUT:-}" ]; then
    tar -czf "$OUT/gpu-results.tar.gz" -C "$(dirname "$out")" "$(basename "$out")"
  fi
done
exit $status
