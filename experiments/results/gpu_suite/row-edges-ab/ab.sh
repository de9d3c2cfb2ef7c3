#!/bin/bash
# A/B on the device: base (HEAD before the change) vs the working tree, same machine, alternating.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
mkdir -p /tmp/base && tar xzf .whl/base.tgz -C /tmp/base
NEW=$PWD
run() { # label tree model args...
  local label=$1 tree=$2 model=$3; shift 3
  (cd $tree && PYTHONPATH=/tmp/site:$tree timeout 120 python3 benchmarks/trainer_throughput.py --device cuda --model $model --steps 5 --warmup 1 --json $OUT/$label.json "$@" 2>&1 | grep -E "^train_step|^bare|train_step / bare|MFU|Error|error" | tail -8)
  echo "== $label done"
}
nvidia-smi --query-gpu=name --format=csv,noheader
for mb in 4 16; do
  run base-05b-mb$mb /tmp/base qwen2.5-0.5b --micro-batch-size $mb
  run new-05b-mb$mb $NEW qwen2.5-0.5b --micro-batch-size $mb
  run new2-05b-mb$mb $NEW qwen2.5-0.5b --micro-batch-size $mb
  run base2-05b-mb$mb /tmp/base qwen2.5-0.5b --micro-batch-size $mb
done
run new-4b-mb4 $NEW qwen3-4b --micro-batch-size 4
run base-4b-mb4 /tmp/base qwen3-4b --micro-batch-size 4
cd $OUT && tar czf ab.tgz *.json && rm -f *.json
