# The one H200 call that decides the pending patches (docs/pending/README.md). Prepare with
# docs/pending/make_variants.sh and the device machine's Vulkan loader and wheels (.gl, .whl); carry .gl .whl vkmoe/_spv vkmoe/_native.abi3.so
# shaders/include/generated exp. Every step has its own timeout and its own log; all.tgz under $OUT (the logs, the
# JSON, summary.txt) is refreshed after each group, so a call cut short still returns what it measured.
# DRY_RUN=1: no device environment (a lavapipe run of the plumbing: the steps time out or fail, the logs say why).
[ -n "${DRY_RUN:-}" ] || source .gl/activate.sh
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
swap() { cp exp/spv_$1/*.spv vkmoe/_spv/; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo "(no nvidia-smi)"
R=$(mktemp -d); T0=$SECONDS
el() { echo "[$1 t=$((SECONDS-T0))]"; tar czf $OUT/all.tgz -C $R .; }
# step NAME SECONDS CMD...: CMD's output in $R/NAME.log; a failure prints its exit status (124: timed out) and
# the log's last line.
step() {
  local name=$1 limit=$2; shift 2
  timeout $limit "$@" > $R/$name.log 2>&1
  local rc=$?
  if [ $rc = 0 ]; then echo "$name: ok ($(tail -n 1 $R/$name.log | cut -c1-120))"
  else echo "$name: FAILED rc $rc ($(tail -n 1 $R/$name.log | cut -c1-160))"; fi
}
step check_goldens 90 $PY tools/check_goldens
step check_coop 60 $PY tools/check_coopmat --quick
step check_coop_moe 60 $PY tools/check_coopmat --moe --quick; el checks
step pytest_linear 100 $PY -m pytest -q -x -p no:cacheprovider tests/test_linear.py
# The router's NaN slots (main, a3b1c36: landed on lavapipe's checks) and the device block on this GPU.
step pytest_router 120 $PY -m pytest -q -x -p no:cacheprovider tests/test_device_router.py tests/test_device_block.py
el pytest
dec() {
  step dq_$1 50 $PY tools/bench_moe --shape qwen3 --m 1,4,16 --modes split,persistent --iters 20 --json $R/dq_$1.json
  step dd_$1 40 $PY tools/bench_moe --shape deepseek --m 1,4 --modes split,persistent --iters 10 --json $R/dd_$1.json
  step dl_$1 25 $PY tools/bench_linear --k 7168 --n 2048 --m 1,4 --iters 30 --json $R/dl_$1.json
  el "dec $1"
}
dec land; swap fma1d; dec fma1d; swap land
cs() {
  step cl_$1 50 $PY tools/bench_linear --k 8192 --n 8192 --m 16,64,256,1024 --iters 10 --coopmat on --json $R/cl_$1.json
  step cq_$1 50 $PY tools/bench_moe --shape qwen3 --m 256,1024,4096 --modes split --iters 3 --json $R/cq_$1.json
  step cd_$1 50 $PY tools/bench_moe --shape deepseek --m 256,1024 --modes split --iters 3 --json $R/cd_$1.json
  el "coop $1"
}
cs land; swap based; cs based; swap land
for n in 1 2 4; do
  cp exp/spv_epw$n/*.spv vkmoe/_spv/
  EPW=$n step router_epw$n 40 $PY exp/router_parts.py $R/router_epw$n.json
done
swap land; el router
$PY - $R > $R/summary.txt <<'PY'
import json, glob, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    try:
        d = json.load(open(f))
    except ValueError as e:
        print(os.path.basename(f), "unreadable:", e)
        continue
    rows = [f"m={r.get('m')}:{r.get('median_us')}" + (f"({r['mode']})" if r.get('mode') else "")
            for r in d.get("results", []) if 'median_us' in r]
    print(os.path.basename(f), " ".join(rows))
PY
cat $R/summary.txt; grep -hv ids $R/router_epw*.log
el end
