"""`python -m vkmoe ...` is the `vkmoe` command (vkmoe/cli.py)."""
import sys

from .cli import main  # noqa: F401  (tools/probe_residency imports it from here)

if __name__ == "__main__":
    sys.exit(main())
