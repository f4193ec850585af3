# Diagnose and verify on the GPU machine, within one call: the CUDA state machines (both targets), the files of
# issues 17-19, then as much of the rest of the suite as time allows. Logs under $OUT/logs.tgz.
source tools/gpu-run/common.sh
START=$(date +%s)
left() { echo $(( ${1} - ($(date +%s) - START) )); }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $LOG/smi.txt 2>&1
metrale --version >> $LOG/smi.txt 2>&1; date -u >> $LOG/smi.txt
R="-rfEs --tb=short --durations=12"
timeout 130 $PYT $R -k cuda tests/test_state_machine.py > $LOG/sm.txt 2>&1; echo "sm rc=$?" >> $LOG/summary.txt
tail -1 $LOG/sm.txt >> $LOG/summary.txt
METRALE_TARGET_HW=strix-h200 timeout 70 $PYT $R -k "cuda and (env or scale)" tests/test_state_machine.py > $LOG/strix.txt 2>&1
echo "strix rc=$?" >> $LOG/summary.txt; tail -1 $LOG/strix.txt >> $LOG/summary.txt
timeout 150 $PYT $R -s tests/test_tensor_maps.py tests/test_ntile.py tests/test_interop.py tests/test_distributed.py > $LOG/rel.txt 2>&1
echo "rel rc=$?" >> $LOG/summary.txt; tail -1 $LOG/rel.txt >> $LOG/summary.txt; grep -h "agreement on" $LOG/rel.txt >> $LOG/summary.txt
T=$(left ${BUDGET:-540})
timeout $T $PYT $R tests examples/pipeline/tests examples/tracing-backend/tests --ignore=tests/test_state_machine.py \
  --ignore=tests/test_tensor_maps.py --ignore=tests/test_ntile.py --ignore=tests/test_interop.py \
  --ignore=tests/test_distributed.py > $LOG/rest.txt 2>&1; echo "rest rc=$? (limit $T s)" >> $LOG/summary.txt
tail -1 $LOG/rest.txt >> $LOG/summary.txt
grep -hE "^(FAILED|ERROR)" $LOG/*.txt | cut -c1-300 | head -30 >> $LOG/summary.txt
cat $LOG/summary.txt
for f in sm strix rel rest; do echo "== $f"; grep -E "^(E  |tests/|metrale_core/.*Error|[A-Za-z]*Error)" $LOG/$f.txt | head -25; done
finish
