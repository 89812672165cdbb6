"""vkmoe's cache files (`quirks.json`, `residency.json`): where they live, and reading and writing them so that
a malformed or unwritable cache never breaks a forward. A file that is not a JSON object is ignored with a
warning (and rewritten by the next store); a store that fails warns and leaves the caller's values in memory."""
import json
import os
import sys
import warnings

from .. import knobs


class CacheWarning(RuntimeWarning):
    """A cache file was malformed (ignored, re-measured) or could not be written (values kept in memory)."""


def warn(message):
    warnings.warn(message, CacheWarning, stacklevel=3)


def cache_dir():
    """VKMOE_CACHE_DIR, else the platform's user cache directory from platformdirs ($XDG_CACHE_HOME/vkmoe or
    ~/.cache/vkmoe on Linux, ~/Library/Caches/vkmoe on macOS, %LOCALAPPDATA%\\vkmoe\\Cache on Windows); created
    only when a file is stored."""
    own = knobs.get("VKMOE_CACHE_DIR")
    if own:
        return own
    # Auto mode looks the residency cache up on every MoE call: platformdirs costs ~8 us a lookup, so its answer
    # is kept per value of the variables it reads (a test or a caller changing them still gets the new place).
    key = location_key()
    found = _platform_dirs.get(key)
    if found is None:
        try:
            import platformdirs  # only when needed: a host given VKMOE_CACHE_DIR does not need the package
        except ImportError:  # (a dependency, but an environment installed without it must still run every op)
            found = _platform_dirs[key] = _fallback_cache_dir()
        else:
            found = _platform_dirs[key] = platformdirs.user_cache_dir("vkmoe", appauthor=False)
    return found


def _fallback_cache_dir():
    """platformdirs' answer where it matters, without it: $XDG_CACHE_HOME/vkmoe or ~/.cache/vkmoe (Linux and other
    POSIX systems), ~/Library/Caches/vkmoe (macOS), %LOCALAPPDATA%\\vkmoe\\Cache (Windows)."""
    if sys.platform == "win32":
        base = knobs.environ_text("LOCALAPPDATA") or os.path.join(os.path.expanduser("~"), "AppData", "Local")
        return os.path.join(base, "vkmoe", "Cache")
    if sys.platform == "darwin":
        return os.path.join(os.path.expanduser("~"), "Library", "Caches", "vkmoe")
    xdg = (knobs.environ_text("XDG_CACHE_HOME") or "").strip()
    return os.path.join(xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache"), "vkmoe")


# What platformdirs' user cache directory depends on here: $XDG_CACHE_HOME, else ~ ($HOME) on Linux and macOS;
# the profile variables and platformdirs' override on Windows. Only this platform's are read: auto mode computes
# location_key() on every MoE call, so they are read with knobs.environ_text (os.environ.get raises and catches a
# KeyError inside for each unset one: location_key took 6.0 us with VKMOE_CACHE_DIR and XDG_CACHE_HOME unset on the
# dev machine, ~1.6 us now, timed beside a busy test run).
_PLATFORM_ENV = (("LOCALAPPDATA", "USERPROFILE", "WIN_PD_OVERRIDE_LOCAL_APPDATA") if sys.platform == "win32"
                 else ("XDG_CACHE_HOME", "HOME"))
_platform_dirs = {}
# Every variable location_key reads: a memo that watches them (knobs.Watch) sees every move of the cache directory.
LOCATION_VARIABLES = ("VKMOE_CACHE_DIR", *_PLATFORM_ENV)


def location_key():
    """The environment that decides cache_dir(): equal keys, same directory (a cheap check for memos)."""
    own = knobs.get("VKMOE_CACHE_DIR")  # as cache_dir() reads it (blank: unset)
    if own:  # it alone decides
        return own
    return tuple(map(knobs.environ_text, _PLATFORM_ENV))  # (a tuple: never equal to the string above)


def cache_path(filename):
    return os.path.join(cache_dir(), filename)


def read_json(filename):
    """The cache file's top-level object, or {} when it is missing, unreadable or not a JSON object."""
    path = cache_path(filename)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (FileNotFoundError, NotADirectoryError):  # no cache yet (an unusable directory warns when written)
        return {}
    except (OSError, ValueError) as exc:  # ValueError covers JSON and UTF-8 decoding errors
        warn(f"ignoring the vkmoe cache {path}: {exc}")
        return {}
    if not isinstance(data, dict):
        warn(f"ignoring the vkmoe cache {path}: expected a JSON object, found {type(data).__name__}")
        return {}
    return data


def write_json(filename, data):
    """Replace the cache file atomically; returns False (with a warning) when it cannot be written."""
    path = cache_path(filename)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)  # a concurrent reader sees the old or the new file, never half of one
        return True
    except OSError as exc:
        try:
            os.remove(tmp)
        except OSError:
            pass
        warn(f"cannot write the vkmoe cache {path} ({exc}); measured values are kept in memory for this process "
             "(set VKMOE_CACHE_DIR to a writable directory to keep them)")
        return False
