source tools/gpu-run/common.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $LOG/smi.txt 2>&1
python3 -c "import torch,cupy,cuda.bindings as cb; print('torch',torch.__version__,'cupy',cupy.__version__,'cuda-bindings',cb.__version__)" >> $LOG/smi.txt 2>&1
metrale --version >> $LOG/smi.txt 2>&1; date -u >> $LOG/smi.txt
timeout 330 $PYT -rs -s tests examples/pipeline/tests examples/tracing-backend/tests > $LOG/full.txt 2>&1; echo "full rc=$?" >> $LOG/summary.txt; tail -2 $LOG/full.txt >> $LOG/summary.txt
grep -h "agreement on" $LOG/full.txt >> $LOG/summary.txt
grep -E "^(FAILED|ERROR)" $LOG/full.txt | head -20 >> $LOG/summary.txt
grep -E "SKIPPED.*(test_interop|test_distributed|test_tensor_maps|test_ntile)" $LOG/full.txt | head -20 >> $LOG/summary.txt
timeout 30 python3 tools/gpu-run/dlpack_cost.py > $LOG/dlpack_cost.txt 2>&1; echo "cost rc=$?" >> $LOG/summary.txt
timeout 100 metrale bench --only copy,graph,eager > $LOG/bench.txt 2>&1; echo "bench rc=$?" >> $LOG/summary.txt
METRALE_TARGET_HW=strix-h200 timeout 70 $PYT tests/test_capture.py tests/test_state_machine.py tests/test_distributed.py > $LOG/strix.txt 2>&1; echo "strix rc=$?" >> $LOG/summary.txt; tail -2 $LOG/strix.txt >> $LOG/summary.txt
cat $LOG/summary.txt; cat $LOG/dlpack_cost.txt; grep -v "^\s*\[" $LOG/bench.txt | tail -45
finish
