"""The README's Python blocks run as written, in order, in one namespace (a user copying them gets what the
README promises: each block checks its own result with asserts)."""
import os
import re

import numpy as np

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def python_blocks():
    with open(README) as f:
        return re.findall(r"^```python\n(.*?)^```", f.read(), flags=re.S | re.M)


def test_readme_has_the_quick_start_blocks():
    blocks = python_blocks()
    assert len(blocks) >= 3, f"expected the quick start's Python blocks in README.md, found {len(blocks)}"
    text = "\n".join(blocks)
    for name in ("random_exl3_tensor", "random_moe_layer", "random_routing", "Exl3MoeMlp", "record("):
        assert name in text, f"the README's Python blocks no longer use {name}"


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the blocks write files into the working directory
    ns = {"__name__": "readme"}
    try:
        for i, block in enumerate(python_blocks()):
            exec(compile(block, f"README.md python block {i}", "exec"), ns)
        # The outputs are real results, not leftovers: finite, non-zero, the shapes the README states.
        assert ns["y"].shape == (4, 512) and ns["y"].dtype == np.float16 and np.isfinite(ns["y"]).all()
        assert ns["out"].shape == (4, 1024) and ns["out"].dtype == np.float32
        assert np.isfinite(ns["out"]).all() and np.abs(ns["out"]).max() > 0
        assert os.path.exists(tmp_path / "layer0.safetensors")
        messages = ns["dev"].take_validation_messages()
        assert not messages, f"validation layer reported {len(messages)} message(s): {messages[:3]}"
    finally:
        if "dev" in ns:
            ns["dev"].close()
