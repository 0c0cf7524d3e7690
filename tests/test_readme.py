"""The README's Python blocks run as written (in order, one namespace, in a fresh interpreter with 6 fake CPU
devices for the multi-device block), on the embedded SmolLM2 model."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tiny import ROOT

FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(text: str) -> list[str]:
    return FENCE.findall(text)


def test_readme_python_blocks_run():
    blocks = python_blocks((ROOT / "README.md").read_text())
    assert blocks, "the README has no Python block"
    script = "\n".join(blocks) + "\nprint('README-BLOCKS-OK', res.compressed)\n"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=6", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "README-BLOCKS-OK" in proc.stdout
