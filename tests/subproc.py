"""The environment of a child Python that a test starts (a tool, the CLI, a script of its own)."""
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_env(*first, **extra):
    """os.environ with PYTHONPATH = `first` paths, the repository, then the caller's own PYTHONPATH (where the
    binding's wheels live on a machine without a venv, e.g. the GPU machine's: a child given only the repository
    failed on "No module named 'vulkan'"), and the `extra` variables."""
    path = [*first, REPO, *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p), **extra)
