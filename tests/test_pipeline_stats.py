"""Pipeline statistics (VK_KHR_pipeline_executable_properties): Device(pipeline_statistics=True) /
VKMOE_PIPELINE_STATISTICS, Pipeline.statistics(), and tools/pipeline_stats end to end. Neither lavapipe offers the
extension: there the clear error is checked, and the reading of the driver's arrays runs against an emulated
driver; on a device that has it the real statistics are checked."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import vulkan as vk

import vkmoe
from vkmoe.ops.plan import coop_moe_unavailable, coop_unavailable
from vkmoe.vk import Pipeline, StatisticsUnavailableError, statistics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAXPY = os.path.join(ROOT, "tests", "_spv", "test_saxpy.spv")
TOOL = os.path.join(ROOT, "tools", "pipeline_stats")
ffi = vk.ffi


def _stat(fmt, field, value, name=b"x"):
    s = ffi.new("VkPipelineExecutableStatisticKHR*")
    s.name, s.format = name, fmt
    setattr(s.value, field, value)
    return s[0]


def test_statistic_values_by_format():
    assert statistics.statistic_value(_stat(vk.VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_BOOL32_KHR, "b32", 1)) is True
    assert statistics.statistic_value(_stat(vk.VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_INT64_KHR, "i64", -5)) == -5
    big = statistics.statistic_value(_stat(vk.VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_UINT64_KHR, "u64", 2**40))
    assert big == 2**40 and isinstance(big, int)
    assert statistics.statistic_value(_stat(vk.VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_FLOAT64_KHR, "f64", 0.5)) == 0.5
    with pytest.raises(vkmoe.VkmoeError, match="'Odd' has unknown format 77"):
        statistics.statistic_value(_stat(77, "u64", 1, b"Odd"))


def _emulated_driver(executables):
    """Entry points as a driver would answer (count first, then the arrays the caller allocated), checking the
    sTypes the caller must set; executables: [(name, [(statistic, format, field, value)])]."""
    def properties(device, info, count, props):
        assert info.sType == vk.VK_STRUCTURE_TYPE_PIPELINE_INFO_KHR and info.pipeline == ffi.NULL
        count[0] = len(executables)
        if props != ffi.NULL:
            for i, (name, _) in enumerate(executables):
                assert props[i].sType == vk.VK_STRUCTURE_TYPE_PIPELINE_EXECUTABLE_PROPERTIES_KHR
                props[i].name = name.encode()
        return vk.VK_SUCCESS

    def stats(device, exe, count, out):
        assert exe.sType == vk.VK_STRUCTURE_TYPE_PIPELINE_EXECUTABLE_INFO_KHR
        listed = executables[exe.executableIndex][1]
        count[0] = len(listed)
        if out != ffi.NULL:
            for i, (name, fmt, field, value) in enumerate(listed):
                assert out[i].sType == vk.VK_STRUCTURE_TYPE_PIPELINE_EXECUTABLE_STATISTIC_KHR
                out[i].name, out[i].format = name.encode(), fmt
                setattr(out[i].value, field, value)
        return vk.VK_SUCCESS

    return {"vkGetPipelineExecutablePropertiesKHR": properties, "vkGetPipelineExecutableStatisticsKHR": stats}


def test_reads_every_executable_and_statistic(monkeypatch):
    u64, b32 = vk.VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_UINT64_KHR, vk.VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_BOOL32_KHR
    driver = _emulated_driver([("Compute Shader", [("Register Count", u64, "u64", 72), ("Spills", b32, "b32", 0)]),
                               ("Compute Shader", [("Register Count", u64, "u64", 40)]), ("", [])])
    monkeypatch.setattr(statistics, "_entry_point", lambda device, name: driver[name])
    device = SimpleNamespace(name="emulated", handle=ffi.NULL, extensions={statistics.EXTENSION},
                             features={statistics.FEATURE: True}, pipeline_statistics=True)
    assert statistics.pipeline_statistics(device, ffi.NULL, "p") == {
        "Compute Shader": {"Register Count": 72, "Spills": False}, "Compute Shader #2": {"Register Count": 40},
        "executable 2": {}}


def test_errors_name_what_is_missing():
    base = dict(name="dev0", handle=ffi.NULL, pipeline_statistics=False)
    lacking = SimpleNamespace(extensions=set(), features={}, **base)
    with pytest.raises(StatisticsUnavailableError, match="p: dev0 does not offer VK_KHR_pipeline_executable_properties"):
        statistics.pipeline_statistics(lacking, ffi.NULL, "p")
    no_feature = SimpleNamespace(extensions={statistics.EXTENSION}, features={statistics.FEATURE: False}, **base)
    with pytest.raises(StatisticsUnavailableError, match="without its pipelineExecutableInfo feature"):
        statistics.pipeline_statistics(no_feature, ffi.NULL, "p")
    not_asked = SimpleNamespace(extensions={statistics.EXTENSION}, features={statistics.FEATURE: True}, **base)
    with pytest.raises(StatisticsUnavailableError, match=r"opened without pipeline statistics; open it with "
                                                         r"vkmoe.Device\(pipeline_statistics=True\)"):
        statistics.pipeline_statistics(not_asked, ffi.NULL, "p")


def _saxpy(device):
    from test_vk import SaxpyPush

    return Pipeline(device, SAXPY, push=SaxpyPush, spec={0: 64})


def test_default_device_captures_nothing(dev):
    assert dev.pipeline_statistics is False and dev.info()["pipeline_statistics"] is False
    pipe = _saxpy(dev)
    try:
        with pytest.raises(StatisticsUnavailableError, match="test_saxpy"):
            pipe.statistics()
    finally:
        pipe.close()


@pytest.mark.parametrize("how", ["argument", "knob"])
def test_device_with_statistics(dev, monkeypatch, how):
    if how == "knob":
        monkeypatch.setenv("VKMOE_PIPELINE_STATISTICS", "1")
        kwargs = {}
    else:
        monkeypatch.setenv("VKMOE_PIPELINE_STATISTICS", "0")  # the argument wins
        kwargs = {"pipeline_statistics": True}
    reason = statistics.unavailable(dev)
    if reason:
        assert "VK_KHR_pipeline_executable_properties" in reason
        with pytest.raises(StatisticsUnavailableError, match="pipeline statistics were requested .*does not offer "
                                                             "VK_KHR_pipeline_executable_properties"):
            vkmoe.Device(dev.index, **kwargs)
        return
    with vkmoe.Device(dev.index, **kwargs) as d:
        assert d.pipeline_statistics
        stats = _saxpy(d).statistics()
        assert stats and all(isinstance(v, dict) and v for v in stats.values()), stats
        assert all(isinstance(x, (bool, int, float)) for v in stats.values() for x in v.values())
        assert d.take_validation_messages() == []


def _tool(dev, *args):
    run = subprocess.run([sys.executable, TOOL, "--shape", "small", "--m", "1,64", "--coopmat", "off,on", *args],
                         capture_output=True, text=True, env={**os.environ, "VKMOE_DEVICE": str(dev.index)}, timeout=600)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_tool_end_to_end(dev):
    doc = json.loads(_tool(dev, "--json", "-"))
    assert doc["validation_messages"] == []
    rows = doc["pipelines"]
    off = {(r["m"], r["op"], r["stage"]): r["pipeline"] for r in rows if r["coopmat"] == "off"}
    for m in (1, 64):
        assert off[m, "linear", "had_in"] == "exl3_had_in"
        assert off[m, "linear", "gemm H->I"].startswith("exl3_linear")
        assert off[m, "moe split", "gate_up"].startswith("moe_gate_up")
        assert off[m, "moe split", "down"].startswith("moe_down")
        assert off[m, "moe persistent", "persistent"].startswith("moe_persistent")
    assert off[64, "moe split", "route"] == "moe_route"  # m = 1 runs direct: no routing pass
    assert (1, "moe split", "route") not in off
    on = [r for r in rows if r["coopmat"] == "on"]
    if coop_unavailable(dev) is None and coop_moe_unavailable(dev) is None:
        assert {r["pipeline"].split("_idot")[0] for r in on} >= {"exl3_linear_coop", "moe_gate_up_coop", "moe_down_coop"}
        assert not any(r["op"] == "moe persistent" for r in on)
    else:
        assert not on and len(doc["skipped"]) == 4
        assert all("cooperative" in s["reason"] or "lacks" in s["reason"] for s in doc["skipped"])
    if doc["statistics_supported"]:
        assert all(r["executables"] for r in rows)
    else:
        assert "VK_KHR_pipeline_executable_properties" in doc["statistics_note"]
        assert all(r["executables"] is None for r in rows)


def test_tool_table(dev):
    text = _tool(dev)
    assert "shape small: H 512, I 256, E 16, top-4" in text
    for name in ("exl3_had_in", "exl3_linear", "moe_route", "moe_gate_up", "moe_down", "moe_persistent"):
        assert name in text
    if statistics.unavailable(dev):
        assert "NO STATISTICS (pipelines listed only)" in text and "VK_KHR_pipeline_executable_properties" in text
