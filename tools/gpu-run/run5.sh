# A short call: the swizzle probe (stdout only) and the DLPack consumer-stream tests.
source tools/gpu-run/common.sh
timeout 100 python3 tools/gpu-run/swizzle_probe.py > $LOG/probe.txt 2>&1; echo "probe rc=$?" >> $LOG/summary.txt
cat $LOG/probe.txt >> $LOG/summary.txt
timeout 90 $PYT -rfEs --tb=short tests/test_interop.py -k "cuda or torch or cupy" > $LOG/interop.txt 2>&1
echo "interop rc=$?" >> $LOG/summary.txt; tail -1 $LOG/interop.txt >> $LOG/summary.txt
grep -hE "^(FAILED|ERROR|E  )" $LOG/interop.txt | cut -c1-300 | head -20 >> $LOG/summary.txt
cat $LOG/summary.txt
finish
