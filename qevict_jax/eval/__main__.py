"""``python -m qevict_jax.eval ruler|longbench|gsm8k|fidelity ...``: the same as ``qevict eval ...``."""

import sys

from qevict_jax.eval.cli import main

sys.exit(main())
