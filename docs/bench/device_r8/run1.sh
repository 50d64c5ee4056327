#!/bin/bash
# Device check (not part of the repo): GPU tests, the heavy policy on the GPU, and the 16-core scaling runs.
set -u
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 MPLBACKEND=Agg
S=${SCALE:-0.3}; Q=${QUICK:-}; R=/tmp/res; mkdir -p $R
if [ -z "$Q" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD; PY=python3; NICE="nice -n -10"
else
  PY=.venv/bin/python; export PYTHONPATH=$PWD; NICE=""
fi
$PY -c "import xdist" 2>/dev/null && XD="-n 8" || XD=""
sec() { echo; echo "=== $1 $(date +%T)"; }
sec env
nproc; grep -m1 "model name" /proc/cpuinfo
$PY -c "import torch, torchrl, tensordict, gymnasium, lightning; print(torch.__version__, torch.cuda.is_available() and torch.cuda.get_device_name(0), torchrl.__version__, tensordict.__version__, gymnasium.__version__, lightning.__version__); from lightning_rollout.loop.auto import usable_cores, cgroup_cpu_limit; print('usable_cores', usable_cores(), 'cgroup limit', cgroup_cpu_limit())"
sec cuda-tests
timeout 100 $PY -m pytest -q -p no:cacheprovider -rs -m cuda tests/test_cuda.py tests/test_lightning.py 2>&1 | tail -40
sec conformance
timeout 110 $PY -m pytest -q -p no:cacheprovider tests/test_torchrl_conformance.py $XD 2>&1 | grep -v "^XFAIL\|^SKIPPED" | tail -40
sec heavy-gpu
timeout 100 $NICE $PY -m benchmarks ${Q:+--quick} --scenario heavy_policy --policy-device ${DEV:-cuda} --frames-scale $S --out $R/heavy_gpu 2>&1 | tail -12
sec scaling
timeout 150 $NICE $PY -m benchmarks ${Q:+--quick} --group scaling --frames-scale $S --out $R/scaling 2>&1 | tail -20
sec cores16
timeout 90 $NICE $PY -m benchmarks ${Q:+--quick} --scenario cheap --scenario gil --scenario stragglers --contender 'threaded auto*' --contender 'threaded free*' --contender 'gym SyncVectorEnv loop' --contender 'gym AsyncVectorEnv loop' --frames-scale $S --out $R/cores16 2>&1 | tail -20
sec done
for d in heavy_gpu scaling cores16; do [ -f $R/$d/table.md ] && { echo "##### $d"; cat $R/$d/table.md; }; done
tar czf ${OUT:-/tmp}/results.tgz -C $R . 2>/dev/null
