"""vkmoe.bench_record.command_line: the command a result file records keeps no machine's paths."""
from vkmoe import bench_record


def test_paths_become_base_names():
    argv = ["/home/u/vkmoe/tools/bench_moe", "--shape", "qwen3", "--m", "1,2", "--json", "/root/out/j/q.json",
            "--plot=/tmp/x/plot.png", "--iters", "5"]
    assert (bench_record.command_line(argv)
            == "bench_moe --shape qwen3 --m 1,2 --json q.json --plot=plot.png --iters 5")


def test_arguments_without_paths_are_kept():
    argv = ["tools/profile_moe", "--m", "64,256", "--json=out.json", "--shape=deepseek"]
    assert bench_record.command_line(argv) == "profile_moe --m 64,256 --json=out.json --shape=deepseek"


def test_default_is_this_process(monkeypatch):
    monkeypatch.setattr(bench_record.sys, "argv", ["/a/b/bench_linear", "--k", "8192", "--json", "/c/d.json"])
    assert bench_record.command_line() == "bench_linear --k 8192 --json d.json"
