#!/usr/bin/env bash
# The GPU check: run on a machine with one CUDA device, from the repository root.
# Runs the tests marked `gpu` (the trainer's CUDA paths against their CPU references),
# then times the expert GEMMs and the packed attention on the device, and prints one
# JSON line of figures. `make test` never runs this; docs/benchmarks.md records its runs.
# PYTHON picks the interpreter (default: .venv/bin/python, else python3); it needs a
# CUDA build of torch 2.13 and this project's dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-}"
[[ -n "$python" ]] || { [[ -x .venv/bin/python ]] && python=.venv/bin/python || python=python3; }
if ! "$python" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo '{"error": "no CUDA device: the GPU check runs only where torch sees one"}'
  exit 2
fi
log=$(mktemp)
start=$(date +%s)
set +e
timeout 420 "$python" -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py >"$log" 2>&1
tests_rc=$?
set -e
tests_s=$(($(date +%s) - start))
summary=$(grep -E "passed|failed|skipped|error" "$log" | tail -1 || true)
timeout 120 "$python" tools/gpu_figures.py --tests-rc "$tests_rc" --tests-s "$tests_s" \
  --tests-summary "$summary"
[[ $tests_rc == 0 ]] || { tail -40 "$log" >&2; exit 1; }
