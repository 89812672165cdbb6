"""tools/bench_moe's outputs people read: the plot (spread, CPU tier, reference points, axes, title) and the
crossover it stores (only a difference larger than the run-to-run spread counts). No device needed."""
import os
import runpy

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bench():
    return runpy.run_path(os.path.join(ROOT, "tools", "bench_moe"), run_name="bench_moe")


def row(m, mode, median, p10, p90, experts=8):
    return {"m": m, "mode": mode, "median_us": median, "p10_us": p10, "p90_us": p90, "min_us": p10,
            "distinct_experts": experts, "flags": [], "effective_gb_per_s": 1.0,
            "exllamav3_us": {1: 38.9, 64: 511.2}.get(m)}


def doc_for(results, cpu_tier=()):
    return {"shape": {"name": "qwen3", "H": 2048, "I": 768, "E": 128, "top_k": 8, "bits": 4, "codebook": "mul1",
                      "activation": "silu"},
            "device": {"name": "Test GPU"}, "vkmoe_version": "9.8.7", "commit": "abc1234+working tree",
            "trellis_bytes_per_expert": 2048 * 768 * 3 // 2, "results": list(results), "cpu_tier": list(cpu_tier),
            "reference": {"gpu": "H200", "same_gpu": False, "exllamav3_us": {1: 38.9, 4: 94.0, 16: 373.7, 64: 511.2},
                          "llamacpp_us": {1: 34.2, 64: 1310.0}}}


@pytest.mark.parametrize("split, persistent, winner", [
    ((50.0, 49.0, 51.0), (40.0, 39.0, 41.0), "persistent"),   # 10 us apart, spread 2: a real win
    ((50.0, 45.0, 55.0), (48.0, 43.0, 53.0), "tie"),          # 2 us apart, spread 10: noise
    ((40.0, 39.5, 40.5), (60.0, 59.0, 61.0), "split"),
])
def test_crossover_outcome_needs_more_than_the_spread(bench, split, persistent, winner):
    out = bench["crossover_outcomes"]([row(4, "split", *split), row(4, "persistent", *persistent)])
    assert out[4][0] == winner


def test_store_crossover_stores_only_a_clear_result(bench, monkeypatch):
    from vkmoe.sched import residency

    stored = []
    monkeypatch.setattr(residency, "store_crossover", lambda dev, shape, max_m, ev, **kw: stored.append((shape, max_m))
                        or kwargs.append(kw) or "/cache/residency.json")
    kwargs = []
    # Persistent clearly faster at m=1 and 4, a tie at 16: the switch point is 4.
    doc = doc_for([row(1, "split", 50, 49, 51), row(1, "persistent", 40, 39, 41),
                   row(4, "split", 80, 79, 81), row(4, "persistent", 70, 69, 71),
                   row(16, "split", 200, 190, 210), row(16, "persistent", 199, 189, 209)])
    bench["store_crossover"](None, doc)
    assert stored == [("qwen3", 4)] and doc["crossover_max_m"] == 4
    assert doc["crossover_evidence"]["16"]["winner"] == "tie"
    # and, for layers of this shape, every m where persistent won clearly (the tie at 16 is not a win)
    assert kwargs == [dict(dims={"E": 128, "H": 2048, "I": 768, "top_k": 8}, measured=[1, 4, 16], wins=[1, 4])]
    # A win past a loss: the switch point stays below the loss, the win is kept for this shape.
    stored.clear(), kwargs.clear()
    doc = doc_for([row(4, "split", 80, 79, 81), row(4, "persistent", 90, 89, 91),
                   row(16, "split", 220, 219, 221), row(16, "persistent", 200, 199, 201)])
    bench["store_crossover"](None, doc)
    assert stored == [("qwen3", 0)] and kwargs[0]["wins"] == [16] and kwargs[0]["measured"] == [4, 16]
    # Every difference within the spread: nothing is stored.
    stored.clear(), kwargs.clear()
    doc = doc_for([row(1, "split", 50, 40, 60), row(1, "persistent", 49, 39, 59)])
    bench["store_crossover"](None, doc)
    assert stored == [] and doc["crossover_max_m"] is None


def test_reference_figures_are_those_of_the_same_gpu(bench):
    """An H100 is compared with exllamav3 measured on an H100, an H200 with the H200's figures; any other device
    with the H200's, saying that they come from another GPU."""
    ref = bench["reference_for"]
    h100 = ref("NVIDIA H100 80GB HBM3", "qwen3")
    assert h100["gpu"] == "H100" and h100["same_gpu"] and h100["exllamav3_us"][1] == 39.2
    assert h100["llamacpp_us"] == {}
    h200 = ref("NVIDIA H200", "deepseek")
    assert h200["gpu"] == "H200" and h200["same_gpu"] and h200["exllamav3_us"][1024] == 15678.0
    assert h200["llamacpp_us"] == {1: 716.0, 64: 11235.0}
    other = ref("llvmpipe (LLVM 15.0.6, 256 bits)", "qwen3")
    assert other["gpu"] == "H200" and not other["same_gpu"] and other["exllamav3_us"][1] == 38.9
    assert ref("NVIDIA H100 80GB HBM3", "small")["exllamav3_us"] == {}


def test_plot(bench, tmp_path, monkeypatch):
    plt = pytest.importorskip("matplotlib.pyplot", reason="matplotlib is the optional [plot] extra")
    figures = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))
    results = [row(m, mode, t, t * 0.9, t * 1.2) for m, ts in ((1, (45, 80)), (4, (80, 160)), (64, (500, 1300)))
               for mode, t in zip(("split", "persistent"), ts)]
    path = tmp_path / "bench.png"
    bench["write_plot"](str(path), doc_for(results, cpu_tier=[{"m": 1, "median_us": 7000.0}]))
    assert path.stat().st_size > 10_000
    (fig,) = figures
    ax_t, ax_b = fig.axes
    assert "vkmoe 9.8.7 @ abc1234+working tree" in fig._suptitle.get_text()
    assert ax_b.get_ylim()[0] == 0 and ax_b.get_yscale() == "linear"
    lines = {line.get_label(): line for line in ax_t.get_lines()}
    assert lines["llama.cpp q4_K (H200)"].get_linestyle() == "None"   # two points, no line between them
    assert list(lines["llama.cpp q4_K (H200)"].get_xdata()) == [1, 64]
    assert "vkmoe.cpu (wall clock)" in lines
    # p10-p90 bars: one error-bar collection per vkmoe mode, spanning p10..p90 at each m.
    spans = [seg for coll in ax_t.collections for seg in coll.get_segments()]
    assert any(abs(seg[0][1] - 45 * 0.9) < 1e-9 and abs(seg[1][1] - 45 * 1.2) < 1e-9 for seg in spans)
