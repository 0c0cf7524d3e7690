"""Per-head gate decisions of qevict-gated during RULER answer decoding.

Wraps ``merge_tiers`` (as ``qevict_jax.engines.window`` calls it) with a ``jax.debug.callback`` that records, for
every decode step and layer, each query head's lead of the F tier's max logit over the Q tier's
(``m_F - m_Q``) and whether the Q partial is live; then runs ``qevict eval ruler`` unchanged. The discount is on
for a head when the lead exceeds the gate (0). A diagnostic only: the callback is a host round trip per layer
and step.

usage: python docs/results/gate-heads/gate_stats.py OUT.npz -- <qevict eval ruler arguments>
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import qevict_jax.engines.window as window
from qevict_jax.eval import cli

RECORDS: list[np.ndarray] = []
_merge = window.merge_tiers


def _record(lead: np.ndarray, q_keys: np.ndarray) -> None:
    RECORDS.append(np.where(q_keys[..., None, None] > 0, lead, np.nan).astype(np.float32))


def merge_tiers(tiers, **kw):
    if kw.get("q_bias_gate") is not None and tiers[2].mass.shape[-1] > 0:
        lead = tiers[1].m - tiers[2].m  # [B, Hkv, G]
        q_keys = jnp.sum(tiers[2].l > 0, axis=(1, 2))  # [B]: heads with a live Q tier
        jax.debug.callback(_record, lead, q_keys, ordered=True)
    return _merge(tiers, **kw)


window.merge_tiers = merge_tiers

if __name__ == "__main__":
    out, _, *argv = sys.argv[1:]
    rc = cli.main(argv)
    np.savez_compressed(out, leads=np.stack(RECORDS) if RECORDS else np.zeros(0))
    sys.exit(rc)
