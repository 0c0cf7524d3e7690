"""The README and docs/ as a reader meets them: the README fits on a few screens, every relative link
resolves, and the Python blocks of the README, docs/generate.md and docs/multi-device.md run as written (in that
order, one namespace, in a fresh interpreter with 6 fake CPU devices for the multi-device block) on the
embedded SmolLM2 model."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tiny import ROOT

FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN_IN_ORDER = [ROOT / "README.md", ROOT / "docs" / "generate.md", ROOT / "docs" / "multi-device.md"]


def python_blocks(text: str) -> list[str]:
    return FENCE.findall(text)


def test_the_readme_fits_on_a_few_screens():
    assert len((ROOT / "README.md").read_text()) < 15_000


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page: Path):
    missing = []
    for target, _ in LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        if not (page.parent / target).exists():
            missing.append(target)
    assert not missing, f"{page.name} links to missing files: {missing}"


def test_python_blocks_run():
    blocks = [b for page in RUN_IN_ORDER for b in python_blocks(page.read_text())]
    assert len(blocks) >= 3, "expected the README's, generate.md's and multi-device.md's Python blocks"
    script = "\n".join(blocks) + "\nprint('PYTHON-BLOCKS-OK', res.compressed, reply.compressed)\n"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=6", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "PYTHON-BLOCKS-OK" in proc.stdout


def test_every_design_reference_in_the_code_names_a_section_of_docs_design():
    sections = set(re.findall(r"^## (\d+)\. ", (ROOT / "docs" / "design.md").read_text(), re.M))
    refs = []
    for pkg in ("qevict_jax", "pallas_kernels", "models", "tests", "bench"):
        for path in (ROOT / pkg).rglob("*.py"):
            text = path.read_text()
            outside = "DESIGN" + " §"  # spelled so that this file does not match itself
            assert outside not in text, f"{path}: a reference to a design document outside the repo"
            for ref in re.findall(r"docs/design\.md (§[\d§\- ,]+)", text):
                refs.append((path.name, ref))
                for n in re.findall(r"\d+", ref):
                    assert n in sections, f"{path}: docs/design.md §{n} does not exist"
    assert len(refs) >= 10  # the docstrings do point into it
