#!/usr/bin/env bash
# One short GPU window (a few minutes on one H100/H200): the CUDA tests, the launch counts, and the CUDA
# benchmark's eager and CUDA-graph tables in float32 and bfloat16 on the ResNet-50 shapes and on 10,000 tensors,
# with the HBM floor measured in the same run, and the lean-memory rows (bench/lean.py --device cuda: bytes
# per parameter from torch.cuda.memory_allocated / max_memory_allocated and step times of every precision x
# state dtype for SGD, LARS, LAMB and Adam on the ResNet-50 shapes, 60 s). Needs a python3 with a CUDA torch
# (and pytest); nothing is installed: optkit runs from src/. Results go to $OUT (or bench/results/): cuda.md, cuda_tests.log, launches.md,
# lean_cuda.md.
#   bash bench/gpu_window.sh            # whole window, about 7 minutes
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_cuda.py 2>&1 | tee "$OUT/cuda_tests.log"
timeout 60 python3 -m bench.launches > "$OUT/launches.md" 2>/dev/null
OPTKIT_BENCH_CUDA_SETS=resnet50,tiny_10k OPTKIT_BENCH_CUDA_DTYPES=float32,bfloat16 \
  timeout 330 python3 -m bench.cuda "$OUT/cuda.md" > /dev/null
timeout 90 python3 -m bench.lean --device cuda --budget 60 "$OUT/lean_cuda.md" > /dev/null 2>"$OUT/lean_cuda.log"
echo "wrote $OUT/cuda.md ($(grep -c '^###' "$OUT/cuda.md" 2>/dev/null || echo 0) tables)"
echo "wrote $OUT/lean_cuda.md ($(grep -c '^| [a-z*]' "$OUT/lean_cuda.md" 2>/dev/null || echo 0) rows)"
