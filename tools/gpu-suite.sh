#!/usr/bin/env bash
# The whole test suite on a GPU machine, in the two configurations the CUDA backend must pass:
# default settings, and the scale variant with red zones. Run from the repository root, with the
# wheels of ../shared/gpu/fetch-wheels.sh in .whl/ (the GPU test machine has no network).
# Logs go to $OUT (or ./gpu-logs); extra arguments go to pytest.
set -uo pipefail
out=${OUT:-gpu-logs}
mkdir -p "$out"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
python3 -m pip install -q --no-index --no-build-isolation --no-deps -e . -e backends/fake -e backends/cuda -e examples/tracing-backend -e examples/pipeline || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee "$out/gpu.txt"
python3 -c 'import cuda.bindings, numpy, sys; print("python", sys.version.split()[0], "cuda-bindings", cuda.bindings.__version__, "numpy", numpy.__version__)' | tee -a "$out/gpu.txt"
python3 -m metrale_core backends | tee "$out/backends.txt"
python3 -m metrale_core preflight metrale_core/kernels/*.ptx 2>&1 | tee "$out/preflight.txt"
python3 -m metrale_core selftest 2>&1 | tee "$out/selftest.txt"
rc=${PIPESTATUS[0]}
python3 -m metrale_core conformance cuda 2>&1 | tee "$out/conformance-cuda.txt"
rc=$(( rc | PIPESTATUS[0] ))
python3 -m pytest -q -p no:cacheprovider --hypothesis-profile=${HYPOTHESIS_PROFILE:-gpu} -rs tests examples/tracing-backend/tests examples/pipeline/tests "$@" 2>&1 | tee "$out/pytest-default.txt"
rc=$(( rc | PIPESTATUS[0] ))
METRALE_TARGET_HW=strix-halo METRALE_REDZONE=256 \
  python3 -m pytest -q -p no:cacheprovider --hypothesis-profile=${HYPOTHESIS_PROFILE:-gpu} -rs tests examples/tracing-backend/tests examples/pipeline/tests "$@" 2>&1 | tee "$out/pytest-strix-redzone.txt"
rc=$(( rc | PIPESTATUS[0] ))
python3 tools/bench_redzones.py --zones 10000 2>&1 | tee "$out/bench-redzones.txt"
python3 backends/cuda/tools/probe_costs.py 2>&1 | tee "$out/probe-costs.txt"
python3 -m metrale_core bench --json "$out/bench.json" 2>"$out/bench-progress.txt" | tee "$out/bench.txt"
rc=$(( rc | PIPESTATUS[0] ))
echo "gpu-suite: exit $rc"
exit $rc
