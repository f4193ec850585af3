# The closing call (DLPack costs and bench's copy rows before strix): the whole suite on the GPU machine in parts (the CUDA state machines on both targets, the
# files of issues 17-19, the rest), and under strix the files that read capture state. Logs under $OUT/logs.tgz.
source tools/gpu-run/common.sh
START=$(date +%s)
left() { echo $(( ${1} - ($(date +%s) - START) )); }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $LOG/smi.txt 2>&1
python3 -c "import numpy,torch,cupy; print('numpy',numpy.__version__,'torch',torch.__version__,'cupy',cupy.__version__)" >> $LOG/smi.txt 2>&1
metrale --version >> $LOG/smi.txt 2>&1; git rev-parse --short HEAD >> $LOG/smi.txt 2>&1; date -u >> $LOG/smi.txt
R="-rfEs --tb=short --durations=8"
timeout 120 $PYT $R -s tests/test_tensor_maps.py tests/test_ntile.py tests/test_interop.py tests/test_distributed.py > $LOG/rel.txt 2>&1
echo "rel rc=$?" >> $LOG/summary.txt; tail -1 $LOG/rel.txt >> $LOG/summary.txt; grep -h "agreement on cuda" $LOG/rel.txt >> $LOG/summary.txt
timeout 100 $PYT $R -k cuda tests/test_state_machine.py > $LOG/sm.txt 2>&1; echo "sm rc=$?" >> $LOG/summary.txt
tail -1 $LOG/sm.txt >> $LOG/summary.txt
timeout 130 $PYT $R tests examples/pipeline/tests examples/tracing-backend/tests --ignore=tests/test_state_machine.py \
  --ignore=tests/test_tensor_maps.py --ignore=tests/test_ntile.py --ignore=tests/test_interop.py \
  --ignore=tests/test_distributed.py > $LOG/rest.txt 2>&1; echo "rest rc=$?" >> $LOG/summary.txt
tail -1 $LOG/rest.txt >> $LOG/summary.txt
timeout 30 python3 tools/gpu-run/dlpack_cost.py > $LOG/dlpack_cost.txt 2>&1; echo "cost rc=$?" >> $LOG/summary.txt
timeout 80 metrale bench --only copy > $LOG/bench.txt 2>&1; echo "bench rc=$?" >> $LOG/summary.txt
T=$(left ${BUDGET:-540})
METRALE_TARGET_HW=strix-h200 timeout $T $PYT $R -k "(cuda or not fake) and not agrees" tests/test_state_machine.py tests/test_capture.py \
  tests/test_distributed.py tests/test_tensor_maps.py > $LOG/strix.txt 2>&1; echo "strix rc=$? (limit $T s)" >> $LOG/summary.txt
tail -1 $LOG/strix.txt >> $LOG/summary.txt
grep -hE "^(FAILED|ERROR)" $LOG/*.txt | cut -c1-300 | head -30 >> $LOG/summary.txt
cat $LOG/summary.txt $LOG/smi.txt $LOG/dlpack_cost.txt
for f in rel sm rest strix; do echo "== $f"; grep -E "^(E  |tests/)" $LOG/$f.txt | cut -c1-300 | head -10; done
grep -v "^\s*\[" $LOG/bench.txt | tail -20
finish
