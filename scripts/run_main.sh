#!/usr/bin/env bash
# The README's main job: set-up included, then the kernel benchmarks (quick set) and the
# end-to-end speculative decoding demo on the real model.  Results land in bench_out/.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
python -m specdec_kernels.bench.kernels --quick --out bench_out "$@"
if python -c "import specdec_kernels.bench.e2e" 2>/dev/null; then
  python -m specdec_kernels.bench.e2e --demo --out bench_out
fi
