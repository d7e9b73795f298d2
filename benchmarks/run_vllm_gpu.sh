#!/usr/bin/env bash
# vLLM on the GPU machine, in one call after the bundle has been brought over (benchmarks/README.md, "vLLM"):
# installs vLLM and what it needs from /root/vb (the joined pieces), then runs the vLLM tests, the generator
# benchmark and a short training run with generator: vllm. Stages run in the order given; logs and results go to
# $RESULTS (default benchmarks/results/vllm) and, where $OUT is set, are copied there.
#
#   bash benchmarks/run_vllm_gpu.sh [install] [tests] [bench] [bench-1.5b] [train]     (default: all)
set -uo pipefail
out="${RESULTS:-benchmarks/results/vllm}"
mkdir -p "$out"
site=/tmp/vsite
mkdir -p /tmp/ftis-src && ln -sfn "$PWD/kernels" /tmp/ftis-src/ftis_kernels && ln -sfn "$PWD/ftis_engine" /tmp/ftis-src/ftis_engine
export PYTHONPATH="$PWD:/tmp/ftis-src:$site" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(install tests bench bench-1.5b train)
status=0
for stage in "${stages[@]}"; do
  start=$(date +%s)
  case "$stage" in
    install)
      if [ ! -f "$site/.done" ]; then
        cat /root/vb/p[0-9][0-9] > /root/bundle.tar && md5sum /root/bundle.tar && tar -xf /root/bundle.tar -C /root &&
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" /root/bund/whl/*.whl &&
        python3 -c "import tarfile; tarfile.open('/root/bund/vllm-trim.tar.xz').extractall('$site')" &&
        touch "$site/.done"
      fi
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
      python3 -c "import torch, triton, transformers, vllm; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)" ;;
    tests)  # vLLM allows one sleep-mode engine per process (its CuMem allocator): each engine test in its own
      gpu="logprobs_match sleep_releases weight_sync_changes pushes_only_its_adapter"
      rc=0
      TRITON_INTERPRET=0 python3 -m pytest -q -rs tests/test_vllm.py -p no:cacheprovider \
        -k "not (${gpu// / or })" || rc=1
      for k in $gpu; do TRITON_INTERPRET=0 python3 -m pytest -q -rs tests/test_vllm.py -p no:cacheprovider -rP -k "$k" || rc=1; done
      exit $rc ;;
    bench) python3 benchmarks/vllm_generator.py --output "$out/vllm_generator" ;;
    bench-1.5b) python3 benchmarks/vllm_generator.py --model builtin:shape-1.5b --output "$out/vllm_generator_1.5b" ;;
    train) python3 -m ftis_engine train --config configs/gpu/vllm-shape-0.5b.yaml --output-dir /tmp/runs &&
           cp /tmp/runs/vllm-shape-0.5b/metrics.jsonl "$out/train_metrics.jsonl" ;;
    *) echo "unknown stage $stage"; false ;;
  esac 2>&1 | tee "$out/$stage.log"
  rc=${PIPESTATUS[0]}
  echo "== stage $stage: exit $rc after $(( $(date +%s) - start )) s" | tee -a "$out/stages.txt"
  [ "$rc" -ne 0 ] && status=1
done
if [ -n "${OUT:-}" ]; then
  cp "$out"/* "$OUT"/ 2>/dev/null
fi
exit $status
