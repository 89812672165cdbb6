"""Every VKMOE_* environment variable vkmoe reads, parsed here and nowhere else.

Values are read when they are used (never at import), so a process may change them between calls, and a bad
value raises KnobError naming the variable, what was expected and what it holds. README.md's "Environment
variables" table documents the same set (tests/test_knobs.py keeps them in step).

A leaf module: it imports nothing from vkmoe, so every layer (vk included) may use it.
"""
import difflib
import os
import warnings
from dataclasses import dataclass
from typing import Callable


class KnobError(ValueError):
    """A VKMOE_* variable holds a value vkmoe cannot use."""

    def __init__(self, name, expected, text):
        self.name = name
        super().__init__(f"{name}={text!r}: expected {expected}")


@dataclass(frozen=True)
class Knob:
    name: str
    default: object
    expected: str                     # what a valid value looks like, for errors and the README
    parse: Callable[[str], object]    # text (stripped, non-empty) -> value; raises ValueError when invalid


def _int_at_least(low):
    def parse(text):
        value = int(text)
        if value < low:
            raise ValueError(text)
        return value
    return parse


def _positive_float(text):
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise ValueError(text)
    return value


def _choice(*options, convert=str.lower):
    def parse(text):
        value = convert(text)
        if value not in options:
            raise ValueError(text)
        return value
    return parse


_FLAGS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def _flag(text):
    return _FLAGS[text.lower()]


def _text(text):
    return text


def _split_pair(text):
    """"GU,D": the k-splits of the gate/up and of the down GEMM."""
    parts = text.split(",")
    values = tuple(int(p) for p in parts)
    if len(values) != 2 or min(values) < 1:
        raise ValueError(text)
    return values


KNOBS = {k.name: k for k in (
    Knob("VKMOE_DEVICE", None, "a device index or a substring of its name", _text),
    Knob("VKMOE_VALIDATION", False, "1/0 (or true/false, yes/no, on/off)", _flag),
    Knob("VKMOE_PIPELINE_STATISTICS", False, "1/0 (or true/false, yes/no, on/off)", _flag),
    Knob("VKMOE_TIMEOUT", 60.0, "a positive number of seconds", _positive_float),
    Knob("VKMOE_CACHE_DIR", None, "a directory", _text),
    Knob("VKMOE_BACKEND", None, "a backend name (vulkan or cpu)", str.lower),
    Knob("VKMOE_DISPATCH", "auto", "auto, persistent or split", _choice("auto", "persistent", "split")),
    Knob("VKMOE_DECODE", "auto", "auto, f16 or fp32", _choice("auto", "f16", "fp32")),
    Knob("VKMOE_HADAMARD", "auto", "auto, subgroup or shared", _choice("auto", "subgroup", "shared")),
    Knob("VKMOE_GEMM_WG_PER_CU", 3, "a positive integer", _int_at_least(1)),
    # the row counts ops.plan.rows_for picks (a leaf module: a literal; tests/test_knobs.py ties the two)
    Knob("VKMOE_MOE_ROWS", None, "1, 4, 8 or 16", _choice(1, 4, 8, 16, convert=int)),
    Knob("VKMOE_MOE_SPLITS", None, "two positive integers GU,D", _split_pair),
    Knob("VKMOE_MOE_DIRECT", "auto", "auto, on or off", _choice("auto", "on", "off")),
    Knob("VKMOE_LINEAR_DIRECT", "auto", "auto or off", _choice("auto", "off")),
    Knob("VKMOE_MOE_STAGE3", "auto", "auto, down or gate_up", _choice("auto", "down", "gate_up")),
    Knob("VKMOE_MOE_TOKEN_SUM", "auto", "auto, on or off", _choice("auto", "on", "off")),
    Knob("VKMOE_PERSISTENT_GRID", None, "a positive integer", _int_at_least(1)),
    Knob("VKMOE_PERSISTENT_WG_PER_CU", None, "a positive integer", _int_at_least(1)),
    Knob("VKMOE_PERSISTENT_MAX_M", None, "an integer >= 0", _int_at_least(0)),
    Knob("VKMOE_PERSISTENT_CLOCK", False, "1/0 (or true/false, yes/no, on/off)", _flag),
    Knob("VKMOE_COOPMAT", "auto", "auto, on or off", _choice("auto", "on", "off")),
    Knob("VKMOE_COOPMAT_MIN_M", 8, "a positive integer", _int_at_least(1)),
    Knob("VKMOE_COOPMAT_MOE_MIN_ROWS", 3, "a positive integer", _int_at_least(1)),
    Knob("VKMOE_COOPMAT_MOE_WIDE_ROWS", 13, "a positive integer", _int_at_least(1)),
    Knob("VKMOE_COOPMAT_B_REGS", "auto", "auto, on or off", _choice("auto", "on", "off")),
    Knob("VKMOE_SHAPE_CACHE", 8, "a positive integer", _int_at_least(1)),
    Knob("VKMOE_NATIVE_CALL", True, "1/0 (or true/false, yes/no, on/off)", _flag),
)}


# (name, text) -> the parsed value: ops read some knobs on every call (a decode step makes thousands), and the
# environment is still looked up each time, so a change between calls is seen; only valid texts are kept.
_parsed = {}
_PARSED_MAX = 256  # a process cycling through ever new values starts over rather than growing without bound


_encoded = {}  # knob name -> its key in os.environ's own dict


def _encode(env, name):
    key = _encoded[name] = env.encodekey(name)
    return key


def environ_text(name):
    """os.environ.get(name), without its cost for an unset variable: Mapping.get raises and catches a KeyError
    inside (~2.5 us on the dev machine), and the ops read several unset knobs on every call. CPython's
    os.environ keeps its encoded entries in a dict, read here directly (os.environ is looked up each time: it may
    be replaced; where it is not CPython's mapping, its get() runs)."""
    env = os.environ
    data = getattr(env, "_data", None)
    if type(data) is not dict:
        return env.get(name)
    raw = data.get(_encoded.get(name) or _encode(env, name))
    return None if raw is None else env.decodevalue(raw)


class Watch:
    """Some environment variables (knobs, or others vkmoe reads, e.g. the cache directory's), for a memo that must
    see when any of them changes: texts() is their raw texts as one tuple, equal between two calls exactly when
    none of them changed. One dict lookup per name, a fraction of a get() each: for memos checked on every op call
    (Exl3MoeMlp's call plans)."""
    __slots__ = ("names", "_keys")

    def __init__(self, *names):
        self.names, self._keys = names, None

    def texts(self):
        env = os.environ
        data = getattr(env, "_data", None)
        if type(data) is not dict:  # (not CPython's mapping: environ_text's fallback)
            return tuple(map(env.get, self.names))
        keys = self._keys
        if keys is None:
            keys = self._keys = tuple(_encoded.get(name) or _encode(env, name) for name in self.names)
        return tuple(map(data.get, keys))


_last = {}  # knob name -> (its raw text in os.environ's dict, or None; the value it gave)


def get(name, environ=None):
    """The value of knob `name` now: its default when unset or blank, else the parsed text. Looked up in the
    environment on every call (a change between calls is seen), but its raw text is compared with the last one
    first, as os.environ stores it (the same object until the variable is set again): an unchanged variable costs
    no decode and no lookup of the (name, text) memo. Ops read some knobs on every call: ~0.4 -> ~0.3 us for an
    unset knob, ~0.65 -> ~0.4 us for a set one, timed side by side on the dev machine."""
    if environ is None:
        env = os.environ
        data = getattr(env, "_data", None)
        if type(data) is dict:
            raw = data.get(_encoded.get(name) or _encode(env, name))
            last = _last.get(name)
            if last is not None and last[0] is raw:
                return last[1]
            value = _value(name, None if raw is None else env.decodevalue(raw))
            _last[name] = (raw, value)  # (one tuple, swapped whole: a thread never sees half of it)
            return value
        environ = env  # not CPython's mapping: its get() each time
    return _value(name, environ.get(name))


def _value(name, text):
    """Knob `name`'s value for environment text `text` (None: unset)."""
    if text is None:
        return KNOBS[name].default
    try:
        return _parsed[name, text]
    except KeyError:
        pass
    knob = KNOBS[name]
    if not text.strip():
        return knob.default
    try:
        value = knob.parse(text.strip())
    except (ValueError, KeyError):
        raise KnobError(name, knob.expected, text) from None
    if len(_parsed) >= _PARSED_MAX:
        _parsed.clear()
    _parsed[name, text] = value
    return value


def parse(name, text):
    """`text` parsed as knob `name` would be (e.g. a dispatch= argument checked like VKMOE_DISPATCH)."""
    return get(name, {name: text})


# Read by the test suite and the bootstrap script, not by the package (README's table lists them with the knobs).
OUTSIDE_PACKAGE = ("VKMOE_GOLDEN_DIR", "VKMOE_BOOTSTRAP_QUIET")


class KnobWarning(UserWarning):
    """A VKMOE_* variable that no vkmoe code will read, or one whose value will raise KnobError where it is read."""


_warned = set()  # (name, text) pairs warned about already: once per process


def warn_about_environment(environ=None):
    """Warn (KnobWarning, once per name and value) about each VKMOE_* variable set now that is not a knob (a
    misspelt VKMOE_DISPATH was ignored without a word) or holds a value its knob refuses (VKMOE_NATIVE_CALL=2 let
    a layer's first call run and failed its second, the first to read it). A warning, not an error: a knob is read
    where it is used, so that e.g. a bad VKMOE_PERSISTENT_* never stops a split call. Device() runs it."""
    env = os.environ if environ is None else environ
    for name in sorted(k for k in env if k.startswith("VKMOE_")):
        text = env[name]
        if (name, text) in _warned or name in OUTSIDE_PACKAGE:
            continue
        if name not in KNOBS:
            close = difflib.get_close_matches(name, KNOBS, n=1)
            message = f"{name} is not a vkmoe variable" + (f" (did you mean {close[0]}?)" if close else "") + \
                ": vkmoe ignores it"
        else:
            try:
                _value(name, text)
                continue
            except KnobError as exc:
                message = f"{exc}: the calls that read it will raise KnobError"
        _warned.add((name, text))
        warnings.warn(message, KnobWarning, stacklevel=3)
