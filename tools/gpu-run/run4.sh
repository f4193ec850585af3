# The second call of a session: where the TMA puts narrow swizzled rows (tools/gpu-run/swizzle_probe.py), the
# CUDA state machines (both targets), the files of issues 17-19, the fake-against-GPU TMA test alone (it may
# fault, and a fault poisons the process's primary context), and bench's copy rows. Logs under $OUT/logs.tgz.
source tools/gpu-run/common.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $LOG/smi.txt 2>&1
python3 -c "import numpy,torch,cupy; print('numpy',numpy.__version__,'torch',torch.__version__,'cupy',cupy.__version__)" >> $LOG/smi.txt 2>&1
metrale --version >> $LOG/smi.txt 2>&1; git rev-parse --short HEAD >> $LOG/smi.txt 2>&1; date -u >> $LOG/smi.txt
R="-rfEs --tb=short --durations=8"
timeout 100 python3 tools/gpu-run/swizzle_probe.py > $LOG/probe.txt 2>&1; echo "probe rc=$?" >> $LOG/summary.txt
cat $LOG/probe.txt >> $LOG/summary.txt
timeout 130 $PYT $R -k cuda tests/test_state_machine.py > $LOG/sm.txt 2>&1; echo "sm rc=$?" >> $LOG/summary.txt
tail -1 $LOG/sm.txt >> $LOG/summary.txt
METRALE_TARGET_HW=strix-h200 timeout 100 $PYT $R -k cuda tests/test_state_machine.py > $LOG/strix.txt 2>&1
echo "strix rc=$?" >> $LOG/summary.txt; tail -1 $LOG/strix.txt >> $LOG/summary.txt
timeout 120 $PYT $R -s tests/test_tensor_maps.py tests/test_ntile.py tests/test_interop.py tests/test_distributed.py \
  --deselect tests/test_tensor_maps.py::test_the_fake_and_the_gpu_copy_the_same_bytes > $LOG/rel.txt 2>&1
echo "rel rc=$?" >> $LOG/summary.txt; tail -1 $LOG/rel.txt >> $LOG/summary.txt; grep -h "agreement on" $LOG/rel.txt >> $LOG/summary.txt
timeout 40 $PYT $R tests/test_tensor_maps.py::test_the_fake_and_the_gpu_copy_the_same_bytes > $LOG/same.txt 2>&1
echo "same rc=$?" >> $LOG/summary.txt; tail -1 $LOG/same.txt >> $LOG/summary.txt
timeout 80 metrale bench --only copy > $LOG/bench.txt 2>&1; echo "bench rc=$?" >> $LOG/summary.txt
grep -hE "^(FAILED|ERROR)" $LOG/*.txt | cut -c1-300 | head -30 >> $LOG/summary.txt
cat $LOG/summary.txt
for f in sm strix rel same; do echo "== $f"; grep -E "^(E  |tests/|[A-Za-z_.]*Error)" $LOG/$f.txt | cut -c1-400 | head -12; done
grep -v "^\s*\[" $LOG/bench.txt | tail -25
finish
