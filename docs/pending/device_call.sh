# The one H200 call that decides the pending patches (docs/pending/README.md). Prepare with
# docs/pending/make_variants.sh and the device machine's Vulkan loader and wheels (.gl, .whl); carry .gl .whl vkmoe/_spv vkmoe/_native.abi3.so
# shaders/include/generated exp. Every step has its own timeout; all.tgz under $OUT is refreshed after each.
source .gl/activate.sh; export PYTHONUNBUFFERED=1
swap() { cp exp/spv_$1/*.spv vkmoe/_spv/; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
R=$(mktemp -d); T0=$SECONDS; el() { echo "[$1 t=$((SECONDS-T0))]"; tar czf $OUT/all.tgz -C $R .; }
timeout 90 python3 tools/check_goldens > $R/check_goldens.txt 2>&1; tail -n 1 $R/check_goldens.txt; el goldens
timeout 60 python3 tools/check_coopmat --quick > $R/check_coop.txt 2>&1; tail -n 1 $R/check_coop.txt
timeout 60 python3 tools/check_coopmat --moe --quick > $R/check_coop_moe.txt 2>&1; tail -n 1 $R/check_coop_moe.txt; el coopchecks
timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/test_linear.py > $R/pytest.txt 2>&1; tail -n 2 $R/pytest.txt; el pytest
dec() {
  timeout 50 python3 tools/bench_moe --shape qwen3 --m 1,4,16 --modes split,persistent --iters 20 --json $R/dq_$1.json > /dev/null 2>&1 || echo "dq $1 fail"
  timeout 40 python3 tools/bench_moe --shape deepseek --m 1,4 --modes split,persistent --iters 10 --json $R/dd_$1.json > /dev/null 2>&1 || echo "dd $1 fail"
  timeout 25 python3 tools/bench_linear --k 7168 --n 2048 --m 1,4 --iters 30 --json $R/dl_$1.json > /dev/null 2>&1 || echo "dl $1 fail"
  el "dec $1"
}
dec land; swap fma1d; dec fma1d; swap land
cs() {
  timeout 50 python3 tools/bench_linear --k 8192 --n 8192 --m 16,64,256,1024 --iters 10 --coopmat on --json $R/cl_$1.json > /dev/null 2>&1 || echo "cl $1 fail"
  timeout 50 python3 tools/bench_moe --shape qwen3 --m 256,1024,4096 --modes split --iters 3 --json $R/cq_$1.json > /dev/null 2>&1 || echo "cq $1 fail"
  timeout 50 python3 tools/bench_moe --shape deepseek --m 256,1024 --modes split --iters 3 --json $R/cd_$1.json > /dev/null 2>&1 || echo "cd $1 fail"
  el "coop $1"
}
cs land; swap based; cs based; swap land
for n in 1 2 4; do cp exp/spv_epw$n/*.spv vkmoe/_spv/; EPW=$n timeout 40 python3 exp/router_parts.py $R/router_epw$n.json > $R/router_epw$n.txt 2>&1 || echo epw$n failed; done; el router
python3 - $R > $R/summary.txt <<'PY'
import json, glob, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    d = json.load(open(f))
    rows = [f"m={r.get('m')}:{r.get('median_us')}" + (f"({r['mode']})" if r.get('mode') else "") for r in d.get("results", []) if 'median_us' in r]
    print(os.path.basename(f), " ".join(rows))
PY
cat $R/summary.txt; cat $R/router_epw*.txt | grep -v ids
el end
