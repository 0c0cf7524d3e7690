"""The question-agnostic token-pool baselines (``baselines.PoolMethod``): scores that do not come from the
prompt's last queries, for a context compressed before anyone knows its questions (issue 49).

- KVzip: context reconstruction, a prompt pass over [prompt | repeat prompt | prompt]
  (``rankings.reconstruction``), kvpress ``KVzipPress``.
- Expected attention: the attention the next queries are expected to pay each key, in closed form from the
  prompt's query statistics (``rankings.expected_attention``), kvpress ``ExpectedAttentionPress`` under
  ``AdaKVPress``.

Both keep kvpress's 4 sinks and no recent region, and split each layer's slots over its heads by their scores
(head-adaptive, ``pool.Allocation``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from qevict_jax.core.config import CacheConfig
from qevict_jax.engines.pool import Allocation
from qevict_jax.methods.baselines import PoolMethod
from qevict_jax.rankings.expected_attention import N_FUTURE_POSITIONS, ExpectedAttentionRanking
from qevict_jax.rankings.reconstruction import KVzipRanking, Reconstruction


@dataclasses.dataclass(frozen=True)
class KVzip(PoolMethod):
    """KVzip: query-agnostic eviction by context reconstruction, head-adaptive within each layer.

    Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", arXiv 2505.23416
    (kvpress ``KVzipPress``). A token's score: the largest attention any query of its KV head's group gives
    it while the model reconstructs the prompt (``rankings.reconstruction``, in the prompt's own pass).
    The layer's ``Hkv * C`` slots go to the top scores over all its heads, with no safeguard; 4 sinks, no
    recent region. By design each layer keeps the same number of tokens (kvpress ``layerwise=True``): its
    default ranks all layers together, a split the layer scan's one pool shape would pay at the largest
    layer's size (PyramidKV's padding, ``baselines``' module docstring).
    """

    name: str = "kvzip"
    cache: CacheConfig = CacheConfig(sink=4, window=1, recent=0, q_frac=0.0, static=True)
    repeat_prompt: tuple[int, ...] = ()  # ``reconstruction.repeat_prompt``, bound from the tokenizer

    @property
    def ranking(self) -> KVzipRanking:
        return KVzipRanking()

    @property
    def allocation(self) -> Allocation:
        return Allocation(adaptive=True, safeguard=0.0)

    @property
    def reconstruction(self) -> Reconstruction:
        return Reconstruction(prompt=self.repeat_prompt, chunk=self.cache.prefill_chunk)


@dataclasses.dataclass(frozen=True)
class ExpectedAttention(PoolMethod):
    """Expected attention with Ada-KV's head-adaptive budgets: kvpress's leaderboard configuration.

    Devoto et al., "Expected Attention: KV Cache Compression by Estimating Attention from Future Queries
    Distribution", arXiv 2510.00636; kvpress 0.5.5 ``AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))``
    (its evaluation's ``adakv_expected_attention_e2``, the leaderboard's "AdaKVExpectedAttention"). Token
    scores: ``expected_attention.expected_attention_scores`` with the press's defaults but ``epsilon``. The
    layer's ``Hkv * C`` slots go to the top scores over all its heads after each head has secured its top
    ``int(0.2 * C)`` (``AdaKVPress``'s ``alpha_safeguard``); the 4 sinks (the press's ``n_sink``) are always
    kept, no recent region. ``epsilon``: added to each expected attention before its value-norm weighting
    (0 is ``ExpectedAttentionPress``'s own default); ``n_future_positions``: the positions the RoPE rotation
    of the query statistics is averaged over.
    """

    name: str = "expected-attention"
    cache: CacheConfig = CacheConfig(sink=4, window=1, recent=0, q_frac=0.0, static=True)
    epsilon: float = 0.01
    n_future_positions: int = N_FUTURE_POSITIONS
    options: ClassVar[tuple[str, ...]] = (*PoolMethod.options, "epsilon", "n_future_positions")

    @property
    def ranking(self) -> ExpectedAttentionRanking:
        return ExpectedAttentionRanking(epsilon=self.epsilon, n_future_positions=self.n_future_positions)

    @property
    def allocation(self) -> Allocation:
        return Allocation(adaptive=True, safeguard=0.2)


AGNOSTIC_BASELINES: dict[str, Any] = {"kvzip": KVzip(), "expected-attention": ExpectedAttention()}
"""Default instance of each question-agnostic baseline (``make_method`` sets β)."""
