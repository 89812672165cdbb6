"""The device report of `Device().info()` as text (what `python -m vkmoe info` prints, and the head of the
residency probe's report)."""


def format_info(info):
    """A device report from Device().info() as text."""
    driver = info.get("driver_info") or info.get("driver")
    lines = [f"Device {info['index']}: {info['name']} ({info['type']})"]
    if info.get("mesa_version"):
        flavour = "lavapipe, " if info["type"] == "cpu" or "llvmpipe" in info["name"].lower() else ""
        lines.append(f"  driver:         {info['driver']} ({flavour}Mesa {info['mesa_version']}) - {driver}")
    else:
        lines.append(f"  driver:         {info['driver']} - {driver}")
    lines.append(f"  Vulkan API:     {info['api']}   vendor {info['vendor_id']:#06x} device {info['device_id']:#06x}")
    lines.append(f"  compute units:  {info['compute_units']} (source: {info['compute_units_source']})")
    sg = info["subgroup_size_range"]
    lines.append(f"  subgroup size:  {info['subgroup_size']} (range {sg[0]}..{sg[1]})")
    L = info["limits"]
    lines.append(f"  shared memory:  {L['max_shared_memory']} B per workgroup; workgroup <= "
                 f"{L['max_workgroup_invocations']} invocations; max groups {L['max_workgroup_count'][0]}")
    lines.append(f"  storage range:  {L['max_storage_buffer_range']} B; push constants {L['max_push_constants_size']} B;"
                 f" timestamp period {L['timestamp_period_ns']} ns")
    on = [k for k, v in info["features"].items() if v]
    off = [k for k, v in info["features"].items() if not v]
    lines.append(f"  features:       {', '.join(on)}")
    if off:
        lines.append(f"  not available:  {', '.join(off)}")
    lines.append("  cooperative matrices (VK_KHR_cooperative_matrix): " + _coop_shapes(info.get("cooperative_matrix_shapes")))
    lines.append(f"  int dot product accelerated: {info['integer_dot_product_accelerated']}; "
                 f"validation layer: {'on' if info['validation'] else 'off'}")
    quirks = info.get("quirks") or {}
    cap = quirks.get("loop_iteration_cap")
    lines.append("  quirks:         loop iteration cap " + (f"{cap} (loops silently end after it)" if cap else "none")
                 + "".join(f"; {k}: {v}" for k, v in quirks.items() if k != "loop_iteration_cap"))
    return "\n".join(lines)


def _coop_shapes(shapes):
    """'16x16x16 float16*float16+float32->float32 (subgroup), ...' or 'not available'."""
    if not shapes:
        return "not available"
    return ", ".join(f"{s['M']}x{s['N']}x{s['K']} {s['A']}*{s['B']}+{s['C']}->{s['result']} ({s['scope']}"
                     + (", saturating)" if s["saturating"] else ")") for s in shapes)
