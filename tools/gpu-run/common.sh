set -u
mkdir -p $OUT/logs
LOG=$OUT/logs
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > $LOG/install.txt 2>&1 || { cat $LOG/install.txt; exit 1; }
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
python3 -m pip install -q --no-index --no-build-isolation --no-deps -e . -e backends/fake -e backends/cuda -e examples/tracing-backend -e examples/pipeline >> $LOG/install.txt 2>&1 || { tail -30 $LOG/install.txt; exit 1; }
PYT="python3 -m pytest -p no:cacheprovider --hypothesis-profile=gpu -q"
finish() { (cd $OUT && tar czf logs.tgz logs && rm -rf logs); }
