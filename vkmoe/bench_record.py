"""What a benchmark's result file says about how it was made (tools/bench_moe, tools/bench_linear,
tools/profile_moe)."""
import os
import sys


def command_line(argv=None):
    """The command that made a result file: the tool's name and its arguments, each file path among them reduced to
    its base name (`--json /root/out/x.json` -> `--json x.json`): a path of one machine says nothing on another,
    and docs/bench/ keeps no machine's paths."""
    argv = sys.argv if argv is None else argv
    words = [os.path.basename(argv[0])]
    for arg in argv[1:]:
        option, eq, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
        if os.sep in value:
            value = os.path.basename(value)
        words.append(option + eq + value)
    return " ".join(words)
