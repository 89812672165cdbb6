"""One-off experiment for issue 18 (not product code; docs/pending/README.md): where the device router's time goes.
Chains of 16 routers (each its own random fp16 weight, so no layer finds it in L2), a barrier and a timestamp after
each; median GPU us per router for the GEMV alone (moe_router_logits), the whole router (DeepSeek-V3: dots with
8 groups / 4 kept, dots without groups, std; Qwen3: std) and an empty phase (the barrier alone), m = 1 and 4.
EPW=n runs the router with layout.ROUTER_EXPERTS_PER_WG = n (the SPIR-V in vkmoe/_spv must be built for it);
QUICK=1 is a 2-router, 1-step run for a CPU device. Each config also records one call's ids and weights, which
must not change with EPW. Usage: EPW=1 python3 router_parts.py out.json (repository root)."""
import json, os, statistics, sys, time
sys.path.insert(0, os.getcwd())
import numpy as np
import vkmoe
from vkmoe.ops.router import DeviceRouter
import vkmoe.layout
EPW = int(os.environ.get('EPW', '1'))
vkmoe.layout.ROUTER_EXPERTS_PER_WG = EPW
QUICK = os.environ.get('QUICK') == '1'
L, ITERS = (2, 1) if QUICK else (16, 30)
WARMUP = 5  # untimed submissions before the timed ones
out_path = sys.argv[1] if len(sys.argv) > 1 else None
rng = np.random.default_rng(0)
res = []
with vkmoe.Device() as dev:
    def timed(name, record_layer):
        rec = vkmoe.CommandRecorder(dev, timestamps=L + 1)
        rec.begin(); rec.timestamp()
        for i in range(L):
            record_layer(rec, i); rec.barrier(); rec.timestamp()
        rec.host_barrier(); rec.end()
        per = []
        for it in range(WARMUP + ITERS):
            rec.submit(wait=True)
            s = rec.timestamps_ms()
            if it >= WARMUP:
                per += [(s[i + 1] - s[i]) * 1e3 for i in range(1, L)]
        rec.close()
        med = statistics.median(per)
        res.append({"name": name, "median_us": round(med, 2), "p10": round(np.percentile(per, 10), 2),
                    "p90": round(np.percentile(per, 90), 2)})
        print(f"{name:40s} {med:7.2f} us  (p10 {np.percentile(per,10):.2f}, p90 {np.percentile(per,90):.2f})", flush=True)

    for shape, H, E, fam, ng, tg, bias in [("deepseek", 7168, 256, "dots", 8, 4, True),
                                            ("qwen3", 2048, 128, "std", 1, 1, False)]:
        for m in (1, 4):
            mem = dev.memory
            x = mem.allocate(m * H * 2); x.upload((rng.standard_normal((m, H)) * 0.5).astype(np.float16))
            tok = mem.allocate(max(16, m * 4)); tok.upload(np.zeros(m, np.int32))
            logits = mem.allocate(m * E * 4); ids = mem.allocate(m * 8 * 4); wts = mem.allocate(m * 8 * 4)
            configs = [(fam, ng, tg, bias)]
            if shape == "deepseek":
                configs += [("dots", 1, 1, True), ("std", 1, 1, False)]
            for (f, g, k, b) in configs:
                routers = [DeviceRouter(dev, f, (rng.standard_normal((E, H)) * 0.02).astype(np.float16), top_k=8,
                                        bias=(rng.standard_normal(E) * 0.01).astype(np.float32) if b else None,
                                        n_group=g, topk_group=k, routed_scaling_factor=2.5) for _ in range(L)]
                timed(f"{shape} m={m} router {f} g{g}/{k}",
                      lambda rec, i: routers[i].steps(x, False, tok, logits, ids, wts, m)[0](rec))
                if (f, g) == (fam, ng):
                    timed(f"{shape} m={m} gemv only",
                          lambda rec, i: routers[i].gemv.record(rec, x, False, logits, m))
                hx = (np.random.default_rng(7).standard_normal((m, H)) * 0.5).astype(np.float16)
                ids0, w0 = routers[0](hx)
                res.append({"name": f"{shape} m={m} {f} g{g}/{k} check", "ids": ids0.tolist(), "w": w0.tolist()})
                print("   ids", ids0[0].tolist(), "w", np.round(w0[0], 5).tolist(), flush=True)
                for r in routers: r.close()
            timed(f"{shape} m={m} empty phase", lambda rec, i: None)
            for b in (x, tok, logits, ids, wts): b.close()
if out_path:
    json.dump({"tool": "exp/router_parts", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "epw": EPW, "results": res},
              open(out_path, "w"), indent=1)
