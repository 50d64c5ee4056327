#!/bin/bash
# Device check 2 (not part of the repo).
set -u
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 MPLBACKEND=Agg
S=${SCALE:-0.3}; Q=${QUICK:-}; R=/tmp/res; mkdir -p $R; O=${OUT:-/tmp/out2}; mkdir -p $O
if [ -z "$Q" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD; PY=python3; NICE="nice -n -10"; SPY=/tmp/site/bin/py-spy
else
  PY=.venv/bin/python; export PYTHONPATH=$PWD; NICE=""; SPY=.venv/bin/py-spy
fi
$PY -c "import xdist" 2>/dev/null && XD="-n 8" || XD=""
sec() { echo; echo "=== $1 $(date +%T)"; }
sec tests
timeout 70 $PY -m pytest -q -p no:cacheprovider -rs -m cuda tests/test_cuda.py tests/test_lightning.py 2>&1 | tail -15
timeout 60 $PY -m pytest -q -p no:cacheprovider tests/test_torchrl_conformance.py $XD 2>&1 | grep -v "^XFAIL\|^SKIPPED" | tail -4
sec heavy-gpu
timeout 60 $NICE $PY -m benchmarks ${Q:+--quick} --scenario heavy_policy --policy-device ${DEV:-cuda} --frames-scale 0.5 --out $R/heavy_gpu 2>&1 | grep "^\[" 
sec scaling
timeout 90 $NICE $PY -m benchmarks ${Q:+--quick} --scenario scaling --frames-scale $S --out $R/scaling 2>&1 | grep "^\["
sec cheap-compare
timeout 35 $NICE $PY .whl/prof_cheap.py compare
sec spy
$NICE $PY .whl/prof_cheap.py ours 9 & P=$!; sleep 4; timeout 20 $SPY record -r 997 -f raw --threads -d 4 -p $P -o $O/spy_ours.txt 2>&1 | tail -1; wait $P
$NICE $PY .whl/prof_cheap.py gym 8 & P=$!; sleep 4; timeout 20 $SPY record -r 997 -f raw --threads -d 3 -p $P -o $O/spy_gym.txt 2>&1 | tail -1; wait $P
sec done
for d in heavy_gpu scaling; do [ -f $R/$d/table.md ] && { echo "##### $d"; cat $R/$d/table.md; }; done
tar czf $O/results.tgz -C $R . 2>/dev/null
