"""The `vkmoe` command (also `python -m vkmoe`).

    vkmoe --version
    vkmoe info [--json] [--device SEL]                the device report (Device().info())
    vkmoe probe [--json] [--no-cache] [--force-fail] [--device SEL] [--repeats N]
                                                      may the persistent kernel run here, and on how many workgroups
    vkmoe demo [--device SEL] [--experts E] [--tokens M] [--seed S]
                                                      a random Qwen3-30B-A3B-shaped MoE layer vs the CPU tier
    vkmoe bench ...                                   tools/bench_moe (times Exl3MoeMlp; --store-crossover)
    vkmoe check-decode ...                            tools/check_decode (the device's decoder, bit for bit)
    vkmoe make-checkpoint ...                         tools/make_exl3_moe_checkpoint (a random EXL3 MoE model)

The last three run the scripts of tools/ with the remaining arguments (`vkmoe bench --help`); a wheel carries
them as vkmoe/_tools/, a checkout runs them from tools/.

Exit codes of `probe`: 0 = persistent mode allowed, 3 = use the split fallback, 2 = error (bad arguments, no such
device, a Vulkan failure, a wait that timed out). `demo`: 0 = PASS, 1 = FAIL, 2 = error.
"""
import argparse
import json
import logging
import os
import runpy
import sys

from ._version import __version__
from .argcheck import int_range, non_negative_int, positive_int
from .layout import ROUTE_MAX_EXPERTS

EXIT_OK, EXIT_ERROR, EXIT_FALLBACK = 0, 2, 3


def _open_device(selector):
    from . import Device

    return Device(selector)


def cmd_info(args):
    from .vk.report import format_info  # here, not at the top: without a Vulkan loader `vkmoe` still starts

    with _open_device(args.device) as dev:
        info = dev.info()
    print(json.dumps(info, indent=1, default=str) if args.json else format_info(info))
    return EXIT_OK


def cmd_probe(args):
    from .sched.probe import format_report, probe_residency

    with _open_device(args.device) as dev:
        report = probe_residency(dev, progress=not args.quiet, repeats=args.repeats, store=not args.no_cache,
                                 force_fail=args.force_fail)
        messages = dev.take_validation_messages()
    if messages:
        report["validation_messages"] = messages
    print(json.dumps(report, indent=1, default=str) if args.json else format_report(report))
    if messages:
        print(f"vkmoe probe: {len(messages)} validation message(s); first: {messages[0]}", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK if report["verdict"]["persistent"] else EXIT_FALLBACK


def cmd_demo(args):
    # ---- DEMO: a random Qwen3-30B-A3B-shaped EXL3 MoE layer on the device, checked against the CPU tier
    # ---- (vkmoe/demo.py). Exit 0 = PASS, 1 = FAIL (relative RMS error vs the CPU tier > 3e-3), 2 = error.
    from .demo import run

    return EXIT_OK if run(device=args.device, experts=args.experts, tokens=args.tokens, seed=args.seed) else 1


# Subcommands that run a script of tools/: name -> (script, help).
TOOL_COMMANDS = {
    "bench": ("bench_moe", "time Exl3MoeMlp per batch size and mode; --store-crossover sets auto mode's switch point"),
    "check-decode": ("check_decode", "check the device's EXL3 decoder bit for bit against the numpy decoder"),
    "make-checkpoint": ("make_exl3_moe_checkpoint", "write a random, valid exllamav3-format MoE checkpoint"),
}
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def tool_path(script):
    """The tool script: vkmoe/_tools/ in an installed wheel, else tools/ of the checkout this package is in."""
    for candidate in (os.path.join(_PACKAGE_DIR, "_tools", script),
                      os.path.join(os.path.dirname(_PACKAGE_DIR), "tools", script)):
        if os.path.isfile(candidate):
            return candidate
    raise FileNotFoundError(f"vkmoe: the tool script {script!r} is neither in {os.path.join(_PACKAGE_DIR, '_tools')} "
                            "nor in a checkout's tools/; reinstall vkmoe")


def run_tool(command, argv):
    """Run the script behind `command` as __main__ with argv; returns its exit status."""
    script = TOOL_COMMANDS[command][0]
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [f"vkmoe {command}", *argv]
    try:
        runpy.run_path(tool_path(script), run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return EXIT_ERROR
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return EXIT_OK


def build_parser():
    p = argparse.ArgumentParser(prog="vkmoe", description="vkmoe: exllamav3's fused EXL3 MoE MLP on Vulkan")
    p.add_argument("--version", action="version", version=f"vkmoe {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    device_help = "device index or name substring (default: VKMOE_DEVICE, else the best device)"

    pi = sub.add_parser("info", help="print the device report")
    pi.add_argument("--json", action="store_true", help="machine-readable output")
    pi.add_argument("--device", default=None, help=device_help)
    pi.set_defaults(fn=cmd_info)

    pp = sub.add_parser("probe", help="measure co-residency and decide persistent vs split",
                        description="Measures co-resident workgroups per pipeline variant, checks the spin barrier "
                                    "and message passing, prints a verdict and caches it for the launch plan. "
                                    "Exit: 0 persistent OK, 3 use the split fallback, 2 error.")
    pp.add_argument("--json", action="store_true", help="print the report as JSON")
    pp.add_argument("--no-cache", action="store_true", help="do not store the result in the residency cache")
    pp.add_argument("--force-fail", action="store_true",
                    help="test hook: require more co-resident workgroups than were launched, so the verdict "
                         "fails (exit 3); the result is not cached")
    pp.add_argument("--device", default=None, help=device_help)
    pp.add_argument("--repeats", type=int_range(1, 1000), default=5, help="co-residency measurements per variant (default 5)")
    pp.add_argument("--quiet", action="store_true", help="no progress bar")
    pp.set_defaults(fn=cmd_probe)

    pd = sub.add_parser("demo", help="run a random Qwen3-30B-A3B-shaped MoE layer and check it against the CPU",
                        description="Builds a random EXL3 MoE layer (hidden 2048, intermediate 768, top-8, 4-bit "
                                    "mul1), runs it on the device (auto dispatch, or VKMOE_DISPATCH) and compares "
                                    "with vkmoe.cpu. Exit: 0 PASS, 1 FAIL, 2 error.")
    pd.add_argument("--device", default=None, help=device_help)
    pd.add_argument("--experts", type=int_range(8, ROUTE_MAX_EXPERTS), default=16,
                    help=f"number of experts (default 16; 8 (top-8) .. {ROUTE_MAX_EXPERTS}, the op's limit)")
    pd.add_argument("--tokens", type=positive_int, default=4, help="tokens in the batch (default 4)")
    pd.add_argument("--seed", type=non_negative_int, default=0, help="random seed (default 0)")
    pd.set_defaults(fn=cmd_demo)

    for name, (script, help_text) in TOOL_COMMANDS.items():
        # Listed here for `vkmoe --help`; main() hands their arguments to the script before argparse sees them.
        sub.add_parser(name, help=f"{help_text} (tools/{script}; `vkmoe {name} --help`)", add_help=False)
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in TOOL_COMMANDS:
        return run_tool(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    # Library modules log through `logging` and stay quiet by default; the command shows their progress.
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s", stream=sys.stderr)
    if getattr(args, "repeats", 1) < 1:
        print("vkmoe: --repeats must be >= 1", file=sys.stderr)
        return EXIT_ERROR
    try:
        from .vk.errors import VkmoeError
    except Exception as exc:  # no Vulkan loader: vkmoe.vk's NoVulkanError says what to install
        print(f"vkmoe {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    try:
        return args.fn(args)
    # VkmoeError includes device selection errors and vkmoe.TimeoutError; the others are the library's named
    # refusals of what it was given (e.g. a --tokens batch beyond the device's buffers) and what the system refused.
    except (VkmoeError, ValueError, TypeError, MemoryError, OSError) as exc:
        print(f"vkmoe {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_ERROR


if __name__ == "__main__":
    # argparse exits with 2 on bad arguments, matching EXIT_ERROR.
    sys.exit(main())
