python3 dev.py gpu --only strix --budget 330 --out $OUT/strix > $OUT/strix.txt 2>&1; tail -14 $OUT/strix.txt
export PYTHONPATH=/tmp/site
python3 backends/cuda/tools/probe_smem_base.py > $OUT/probe.txt 2>&1
for i in 1 2 3; do python3 -m pytest -q -p no:cacheprovider tests/launch/test_tensor_maps.py -k cuda > $OUT/tmaps$i.txt 2>&1; echo "tensor maps run $i: $(tail -1 $OUT/tmaps$i.txt)"; done
python3 -m pytest -q -p no:cacheprovider tests/redzones/test_quarantine.py -k "cuda and (stale_write or close_during or redzone_checks_says)" > $OUT/items.txt 2>&1; echo "items: $(tail -1 $OUT/items.txt)"
head -40 $OUT/probe.txt
