"""argparse types for the command-line tools: a bad value becomes a usage error (exit 2) at parse time instead
of a traceback, or a failure after a long run (an output path that cannot be written)."""
import argparse
import os


def _int(text):
    try:
        return int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def int_range(low, high=None):
    """An integer in [low, high] (high None: no upper bound)."""
    def parse(text):
        value = _int(text)
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in {low}..{high}"
            raise argparse.ArgumentTypeError(f"expected an integer {bound}, got {text}")
        return value
    parse.__name__ = "integer"  # argparse names the type in its messages
    return parse


positive_int = int_range(1)
non_negative_int = int_range(0)  # e.g. --seed (numpy's generators refuse negative seeds with a traceback)


def non_negative_float(text):
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:  # (NaN too)
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value



def multiple_of_128(text):
    value = _int(text)
    if value <= 0 or value % 128:
        raise argparse.ArgumentTypeError(f"expected a positive multiple of 128, got {text}")
    return value


def int_list(low=1):
    """Comma-separated integers, each >= low (e.g. token counts '1,4,16')."""
    item = int_range(low)

    def parse(text):
        values = [item(s.strip()) for s in str(text).split(",") if s.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers >= {low}, got {text!r}")
        return values
    parse.__name__ = "list of integers"
    return parse


def output_file(text):
    """A file path whose directory exists and is writable (checked before any work is done)."""
    path = os.path.abspath(text)
    folder = os.path.dirname(path)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text} is a directory; expected a file path")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"cannot write {text}: directory {folder} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text}: permission denied")
    return text


def output_dir(text):
    """A directory that exists or can be created (no regular file in the way)."""
    path = os.path.abspath(text)
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise argparse.ArgumentTypeError(f"cannot create directory {text}: {probe} is not a directory")
    if not os.access(probe, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write into {probe}: permission denied")
    return text
