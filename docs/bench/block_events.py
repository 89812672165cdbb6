"""One-off experiment (issue 18, not product code): does a DeepSeek-V3-shaped device block at m = 1 get faster when
its phases' barriers become events, so that the router's consumers wait for the router only and the shared
expert's chain overlaps the routed one? Chains of L blocks (bench_decode's make_copies), one full barrier between
blocks, a timestamp after each; median GPU us per block for:
  barriers: block.record_buffers (the product's recording)
  events:   the same phases, each chain (router + routed experts; shared expert) waiting by an event for its own
            previous phase only: router; set R | shared up, gate; set S | wait R; routed gate/up; set G | wait S;
            act; set A | wait G; routed down; ... | barrier; sum
Checks every layer's output against the barrier recording, bit for bit.
Usage (repository root): python3 docs/bench/block_events.py [small] [out.json]   (small: a lavapipe-sized shape)"""
import importlib.machinery, importlib.util, json, os, statistics, sys, time
sys.path.insert(0, os.getcwd())
import numpy as np
import vulkan as vk
import vkmoe

ffi = vk.ffi
loader = importlib.machinery.SourceFileLoader("bench_decode", "tools/bench_decode")
spec = importlib.util.spec_from_loader("bench_decode", loader)
bd = importlib.util.module_from_spec(spec); loader.exec_module(bd)

small = "small" in sys.argv[1:]
out_path = next((a for a in sys.argv[1:] if a.endswith(".json")), None)
shape = (512, 256, 32, 4, 4, 256, ("dots", 4, 2)) if small else bd.SHAPES["deepseek"]
L, COPIES, ITERS, WARM = (2, 2, 2, 1) if small else (16, 4, 30, 10)
STAGE = vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT
ACCESS = vk.VK_ACCESS_SHADER_READ_BIT | vk.VK_ACCESS_SHADER_WRITE_BIT


class Events:
    def __init__(self, dev, n):
        self.dev = dev
        info = vk.VkEventCreateInfo(sType=vk.VK_STRUCTURE_TYPE_EVENT_CREATE_INFO, flags=0)
        self.ev = [vk.vkCreateEvent(dev.handle, info, None) for _ in range(n)]

    def reset_all(self, rec):
        for e in self.ev:
            vk.vkCmdResetEvent(rec.handle, e, STAGE)
        rec.barrier()

    def set(self, rec, i):
        vk.vkCmdSetEvent(rec.handle, self.ev[i], STAGE)

    def wait(self, rec, *idx):
        mb = vk.VkMemoryBarrier(sType=vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER, srcAccessMask=ACCESS, dstAccessMask=ACCESS)
        vk.vkCmdWaitEvents(rec.handle, len(idx), [self.ev[i] for i in idx], STAGE, STAGE, 1, [mb], 0, None, 0, None)

    def close(self):
        for e in self.ev:
            vk.vkDestroyEvent(self.dev.handle, e, None)


def record_events(block, rec, ev, base, x, ob, m):
    """The block's phases (vkmoe.ops.block._phases: [shared input Hadamards], [router, shared up/gate GEMMs], then
    the routed split stages aligned to the end beside the shared chain, routed first in each phase, then the sum)
    recorded with one event per chain and phase: a step waits for its own chain's previous phase only."""
    with block._lock:
        s = block._scratch_for(m)
        block._pinned.add(m)
    phases = block._phases(x, False, block._dummy, ob, m, "split", None, s)
    n_router = len(block.router.steps(x, False, block._dummy, s.logits, s.ids, s.weights, m))
    n_routed = len(block.moe.split_stages(x, s.ids, s.weights, ob, m, block.top_k))
    later = phases[2:-1]
    chains = [["S"] * len(phases[0]), ["R"] * n_router + ["S"] * (len(phases[1]) - n_router)]
    for j, ph in enumerate(later):
        has_routed = j >= len(later) - n_routed
        chains.append((["R"] if has_routed else []) + ["S"] * (len(ph) - int(has_routed)))
    assert all(len(c) == len(p) for c, p in zip(chains, phases[:-1]))
    sets, last, nxt = [], {}, [base]
    for ph, ch in zip(phases[:-1], chains):
        for tag in ("R", "S"):
            steps = [st for st, c in zip(ph, ch) if c == tag and st is not None]
            if not steps:
                continue
            if tag in last:
                ev.wait(rec, last[tag])
            sets += [st(rec) for st in steps]
            last[tag] = nxt[0]; ev.set(rec, nxt[0]); nxt[0] += 1
    rec.barrier(); sets.append(phases[-1][0](rec)); rec.barrier()
    assert nxt[0] - base <= EV_PER_BLOCK
    return [d for d in sets if d is not None]


EV_PER_BLOCK = 12


def run_variant(dev, made, ev, variant, x, m, H):
    rec = vkmoe.CommandRecorder(dev, timestamps=L + 1)
    obs, sets = [], []
    try:
        rec.begin()
        if variant == "events":
            ev.reset_all(rec)
        rec.timestamp()
        for i in range(L):
            block = made[i % len(made)][1]
            ob = dev.memory.allocate(m * H * 4); ob.upload(np.full(m * H, np.nan, np.float32)); obs.append(ob)
            if variant == "barriers":
                sets += block.record_buffers(rec, x, False, None, ob, m)
            else:
                sets += record_events(block, rec, ev, EV_PER_BLOCK * i, x, ob, m)
            rec.timestamp()
        rec.host_barrier(); rec.end()
        per = []
        for it in range(WARM + ITERS):
            rec.submit(wait=True)
            st = rec.timestamps_ms()
            if it >= WARM:  # from the first block's end: the first block also holds the submission's start
                per.append((st[-1] - st[1]) * 1e3 / (L - 1))
        return per, [ob.download(np.float32, (m * H,)) for ob in obs]
    finally:
        rec.close()
        for ob in obs: ob.close()
        for d in sets: d.free()


res = []
with vkmoe.Device() as dev:
    made = bd.make_copies(dev, shape, COPIES, L, "split")
    ev = Events(dev, EV_PER_BLOCK * L)
    H = shape[0]
    try:
        for m in (1, 4):
            x = dev.memory.allocate(m * H * 2)
            x.upload((np.random.default_rng(m).standard_normal((m, H)) * 0.5).astype(np.float16))
            ref = None
            for variant in ("barriers", "events", "barriers", "events"):
                per, got = run_variant(dev, made, ev, variant, x, m, H)
                ref = ref or got
                same = all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(got, ref))
                finite = all(np.isfinite(a).all() for a in got)
                med = statistics.median(per)
                print(f"m={m} {variant:9s} {med:8.2f} us/block (p10 {np.percentile(per, 10):.2f}, p90 "
                      f"{np.percentile(per, 90):.2f})  same bits as barriers: {same}  finite: {finite}", flush=True)
                res.append({"m": m, "mode": variant, "median_us": round(med, 2),
                            "p10_us": round(float(np.percentile(per, 10)), 2),
                            "p90_us": round(float(np.percentile(per, 90)), 2), "same_bits": same, "finite": finite})
            x.close()
    finally:
        ev.close()
        bd.close_copies(made)
    if out_path:
        json.dump({"tool": "docs/bench/block_events.py", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                   "device": {"name": dev.name}, "shape": {"name": "small" if small else "deepseek"},
                   "results": res}, open(out_path, "w"), indent=1)
