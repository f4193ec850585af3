# The short closing call, for a budget too small for run6.sh: the files of issues 17-19 (tensor maps with the
# padded layout and the fake-against-GPU bytes, DLPack, distributed), DLPack costs and bench's copy rows.
source tools/gpu-run/common.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $LOG/smi.txt 2>&1
python3 -c "import numpy,torch,cupy; print('numpy',numpy.__version__,'torch',torch.__version__,'cupy',cupy.__version__)" >> $LOG/smi.txt 2>&1
metrale --version >> $LOG/smi.txt 2>&1; date -u >> $LOG/smi.txt
R="-rfEs --tb=short --durations=8"
timeout 150 $PYT $R -s tests/test_tensor_maps.py tests/test_ntile.py tests/test_interop.py tests/test_distributed.py > $LOG/rel.txt 2>&1
echo "rel rc=$?" >> $LOG/summary.txt; tail -1 $LOG/rel.txt >> $LOG/summary.txt; grep -h "agreement on cuda" $LOG/rel.txt >> $LOG/summary.txt
timeout 30 python3 tools/gpu-run/dlpack_cost.py > $LOG/dlpack_cost.txt 2>&1; echo "cost rc=$?" >> $LOG/summary.txt
timeout 80 metrale bench --only copy > $LOG/bench.txt 2>&1; echo "bench rc=$?" >> $LOG/summary.txt
grep -hE "^(FAILED|ERROR)" $LOG/*.txt | cut -c1-300 | head -30 >> $LOG/summary.txt
cat $LOG/summary.txt $LOG/smi.txt $LOG/dlpack_cost.txt
echo "== rel"; grep -E "^(E  |tests/)" $LOG/rel.txt | cut -c1-300 | head -12
grep -v "^\s*\[" $LOG/bench.txt | tail -20
finish
