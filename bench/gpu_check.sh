#!/usr/bin/env bash
# The GPU check (issue 4), one prepared run for a lent GPU machine, meant to fit in ~8 minutes on
# one H200: the ladder, the batch-size finder, the estimator's accuracy, the FSDP2 path on one
# rank through the recipe and Accelerate's plugin, and the gpu-marked tests.
# NOT YET RUN: no GPU was lent to the sessions that wrote it.
#   bash bench/gpu_check.sh 2>&1 | tee gpu_check.log        (figures also land in bench/results/)
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'; print(torch.cuda.get_device_name(0))"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
( cd bench && timeout 300 python ladder.py --layers 8 --hidden 2048 --batch 8 --seq 1024 --steps 5 --compile-layers 8 \
    --rungs fp32,bf16,bf16+ckpt,bf16+compile,bf16+compile+ckpt )
( cd bench && timeout 120 python batch_finder.py --layers 8 --hidden 1024 --vocab 32000 --seq 1024 --budget 16GiB )
( cd bench && timeout 120 python estimate_accuracy.py --hidden 1024 --layers 4 --seq 512 )
# FSDP2 on one rank through Accelerate's FSDP2 plugin built from the policy (issue 4).
timeout 150 python -m accelerate.commands.launch --config_file recipes/configs/fsdp.yaml --num_processes 1 \
    recipes/finetune.py --policy bf16+ckpt+fsdp --max-steps 30 --save-every 30 --output-dir /tmp/gpu_check_fsdp --overwrite
python -c "import json; r = json.load(open('/tmp/gpu_check_fsdp/report.json')); print({k: r[k] for k in ('policy', 'fsdp', 'steps', 'seconds', 'peak_memory_bytes', 'final_metrics')})"
# The tests marked gpu (skipped on CPU-only CI).
timeout 120 python -m pytest -q -m gpu tests
