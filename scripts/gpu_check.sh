#!/usr/bin/env bash
# The checks that need a GPU: the CUDA tests and the engine benchmark on cuda.
# Run on a machine with an NVIDIA GPU from the repository root:  bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
if [ ! -x "$PY" ]; then
  python3 -m venv .venv && .venv/bin/pip install -q -e '.[dev]' || exit 1
fi
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "GPUs", torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])'
"$PY" -m pytest tests/test_cuda.py -v -p no:cacheprovider
status=$?
"$PY" benchmarks/engine_overhead.py --device cuda --width 4096 --batch-size 4096
"$PY" -m pipelab run --device cuda --steps 20 --width 1024 --batch-size 512 --out "${OUT:-pipelab-out}"
if [ "$("$PY" -c "import torch; print(torch.cuda.device_count())")" -ge 2 ]; then  # NCCL: one GPU per rank
  "$PY" -m torch.distributed.run --nproc-per-node 2 -m pipelab.launch --device cuda --stages 2 --steps 20 --width 1024 --batch-size 512 --out "${OUT:-pipelab-out}"
fi
exit $status
