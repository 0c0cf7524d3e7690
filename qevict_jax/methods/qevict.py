"""The window engine's KV method (``WindowMethod``), and QEvict's named configurations (the paper's R1-R4).

Every variant is a ``CacheConfig`` over the same window engine (``qevict_jax.engines.window``): R1-R4 differ in
window size and in whether the Q tier exists; "qevict-nospill" ranks each window by its own score only (the
ablation of ``CacheConfig.spill``); "qevict-restkv" ranks the prompt's windows with the ReST-KV
output-change score; "qevict-all" initializes the scores from every prompt query (the ablation of the
observation-window initialization).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from models.model import LayerContext
from pallas_kernels.dispatch import use_pallas
from qevict_jax.core.budget import BudgetedTiers, WindowAllocation
from qevict_jax.core.cache import SizedByCapacities, TieredCache
from qevict_jax.core.config import CacheConfig, Capacities
from qevict_jax.core.kv import CacheRequest
from qevict_jax.core.sharding import DATA, REPLICATED, on_shards, row_specs
from qevict_jax.engines.migrate import route_stacked
from qevict_jax.engines.window import decode_layer, fold_head_means, prefill_layer
from qevict_jax.methods.full import Compressing
from qevict_jax.rankings.reconstruction import Reconstruction
from qevict_jax.rankings.scoring import Ranking, available_rankings, make_ranking

NOT_WINDOW_OPTIONS = ("budget", "static")
"""``CacheConfig`` fields that are not options of the window engine's methods: the budget is their own argument
(``make_method(name, budget)``), and a compress-once cache is the token pool's."""

QEVICT_OPTIONS = tuple(f.name for f in dataclasses.fields(CacheConfig) if f.name not in NOT_WINDOW_OPTIONS)
"""Options of the window-tier methods (QEvict, R1-R4): every field of their ``CacheConfig`` the window engine
reads, so a new field is an option where it is declared."""


@dataclasses.dataclass(frozen=True)
class WindowMethod(SizedByCapacities, Compressing):
    """A method of the window engine: its ranking (``cache.ranking`` and the options of the ranking) ×
    its ``allocation`` of the budget (``budget.WindowAllocation``) over the F / Q / evicted window tiers
    (``engines.window``, ``engines.routing``). QEvict (arXiv 2608.05326), R1-R4, StreamingLLM and KIVI are
    configurations of it (``VARIANTS``, ``baselines``).

    name: registry name. cache: the static configuration (budget, window, tiers, ranking). allocation: how the
    budget becomes capacities. options: the names ``configure`` may set (fields of ``cache``).
    protects_recent: the recent region is the method's own protected window, set by a benchmark's protocol.
    """

    name: str = "qevict"
    cache: CacheConfig = CacheConfig()
    allocation: WindowAllocation = BudgetedTiers()
    options: tuple[str, ...] = QEVICT_OPTIONS
    protects_recent: bool = True
    # the kvzip ranking's repeat prompt (``reconstruction.repeat_prompt``)
    repeat_prompt: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.cache.static:
            raise ValueError(
                f"{self.name}: static (compress-once) caches are the token pool's, not the window engine's"
            )
        ranking = self.ranking  # an unknown name is a ValueError listing the rankings
        if self.cache.deferred_head_mean and not ranking.linear_in_mass:
            linear = ", ".join(name for name, cls in available_rankings().items() if cls.linear_in_mass)
            raise ValueError(
                f"deferred_head_mean needs a ranking linear in the attention mass (the head mean of running "
                f"masses must equal the running mass of head means); {ranking.name!r} is not. Linear: {linear}"
            )

    @property
    def uses_budget(self) -> bool:
        return self.allocation.uses_budget

    @property
    def ranking(self) -> Ranking:
        c = self.cache
        return make_ranking(
            c.ranking,
            decay=c.decay,
            p=c.p,
            n_obs=c.n_obs,
            max_pool_width=c.max_pool_width,
            spill=self.spill_windows,
            q_spill=None if c.q_spill is None else self.covering_windows(c.q_spill),
        )

    @property
    def reconstruction(self) -> Reconstruction | None:
        """The context reconstruction the kvzip ranking scores the prompt by, in the prompt pass."""
        if not self.ranking.reconstructs:
            return None
        return Reconstruction(prompt=self.repeat_prompt, chunk=self.cache.prefill_chunk)

    @property
    def spill_windows(self) -> int:
        """Windows covering the ``spill`` tokens after a window (its ranking key spills over them)."""
        return self.covering_windows(self.cache.spill)

    def covering_windows(self, tokens: int) -> int:
        """Windows of W tokens that cover ``tokens`` tokens (rounded up): a spill in the ranking's units."""
        return -(-tokens // self.cache.window)

    def capacities(self, request: CacheRequest) -> Capacities:
        """Static buffer sizes for a request: the ``allocation``'s."""
        return self.allocation.capacities(self.cache, request)

    def prefill_attend(self, q, k, v, layer_cache: TieredCache, ctx: LayerContext):
        """q [B, T, H, D], k, v [B, T, Hkv, D] (post-RoPE, right-padded prompt) -> (out, layer cache)."""
        return prefill_layer(q, k, v, layer_cache, ctx, ranking=self.ranking, config=self.cache)

    def route(self, cache: TieredCache, inv_freq: jax.Array, due: jax.Array | None = None) -> TieredCache:
        """A routing event of every layer and row of a stacked cache (windows that left the recent region
        compete, Q windows whose scores rose are promoted); ``due`` [] bool: only if it holds (None: always).
        With ``due`` the plan runs every call and the moves are masked by it, with no conditional around them
        (``migrate.route_stacked``)."""
        cache = fold_head_means(cache, due)  # before the plan reads the scores
        # per shard of rows on a mesh: XLA partitions the plan's vmapped top_k by gathering its batch axis
        rows = row_specs(cache)
        if due is None:
            run = lambda c, f: route_stacked(c, f, self.ranking, self.cache.promotion)
            return on_shards(run, in_specs=(rows, REPLICATED), out_specs=rows, axes=(DATA,))(cache, inv_freq)
        run = lambda c, f, d: route_stacked(c, f, self.ranking, self.cache.promotion, d)
        specs = (rows, REPLICATED, REPLICATED)
        return on_shards(run, in_specs=specs, out_specs=rows, axes=(DATA,))(cache, inv_freq, due)

    def reserve(self, cache: TieredCache, total_tokens: int) -> TieredCache:
        """The window tiers are sized by the byte budget, not the length: any length fits."""
        return cache

    def decode_attend(self, q, k, v, layer_cache: TieredCache, ctx: LayerContext):
        """q [B, 1, H, D], k, v [B, 1, Hkv, D] (post-RoPE) -> (out [B, 1, H, D], layer cache)."""
        return decode_layer(
            q, k, v, layer_cache, ctx, ranking=self.ranking, use_kernel=use_pallas(self.cache.pallas)
        )


QEVICT_DEFAULT: dict[str, Any] = {"q_frac": 0.85, "quant": "crot-k4v3", "q_rank": "blend"}
"""The default ``qevict``'s ``CacheConfig`` fields over the defaults (why: its entry in ``VARIANTS``)."""

VARIANTS: dict[str, dict[str, Any]] = {
    # One configuration for a question in the prompt and for a context compressed before its question: attention
    # chooses F; Q holds the windows in the top of either the attention ranking or the key-norm ranking
    # (q_rank "blend": a later question cannot contradict a key norm), in the centered rotated format that
    # reads both models' K/V back (crot-k4v3, 31.4% of an F window), with 85% of the historical bytes in Q
    # (about 18 Q windows per F window). Chosen on development samples (seed 1000, 2K, both modes) against
    # q_frac 0.70 / 0.90 / 0.95 and q_rank "score" / "keynorm" (docs/results.md, "One default for both modes")
    "qevict": QEVICT_DEFAULT,
    # the default with its Q tier read at a discount (Q logits lowered by 1 at decode, so ~18 low-bit windows
    # per F window, most of them haystack, weigh less; windows scored by the undiscounted softmax, so a question
    # that matches a Q window still promotes it). Chosen on development samples (seed 1000) against biases -1 /
    # -2 with discounted scores; held out it retrieves better question-aware and costs fidelity to Full-KV and
    # some question-agnostic score, so it is not the default (docs/results.md, "Reading the Q tier at a discount")
    "qevict-discount": {**QEVICT_DEFAULT, "q_logit_bias": -1.0, "q_biased_mass": False},
    # qevict-discount with the discount gated per query head and step: kept only while the head's best F-tier
    # logit leads its best Q-tier logit (q_bias_gate 0), so a head whose best historical match sits in Q reads Q
    # at full weight (a context compressed before its question). Chosen on development samples (seed 1000)
    # against gate 1; held out it retrieves better than the default in both modes and moves the next-token
    # distribution further from Full-KV's, so it is not the default (docs/results.md, "Gating the discount by where
    # the best match is")
    "qevict-gated": {**QEVICT_DEFAULT, "q_logit_bias": -1.0, "q_biased_mass": False, "q_bias_gate": 0.0},
    # the default before issue 25 (KIVI's INT2 tier, half of the historical bytes in Q, ranked by attention
    # alone): chosen on RULER at 2K, where 0.70 put too few windows in F for retrieval; kept for ablation
    "qevict-int2": {"q_frac": 0.5},
    "r1": {"window": 1, "q_frac": 0.0},  # token-level eviction
    "r2": {"window": 8, "q_frac": 0.0},  # two-tier window eviction
    "r3": {"window": 8},
    "r4": {"window": 32},
    # ablations of R3, the paper's configuration
    "qevict-nopromo": {"promotion": False},
    "qevict-nospill": {"spill": 0},  # ranked by each window's own score (ablation of the spill)
    "qevict-restkv": {"ranking": "restkv"},  # ReST-KV output-change ranking of the prompt's windows
    "qevict-all": {"ranking": "cumulative-all"},  # scores initialized from every prompt query (ablation)
    # QEvict ranked by key norm (the paper's Appendix J alternative), independent of any query: for a context
    # compressed before its question (question-agnostic mode), where the observation window is the context's
    # own tail and says nothing about what the question will need (README, "Question-agnostic")
    "qevict-keynorm": {"q_frac": 0.5, "ranking": "keynorm"},
    # QEvict with the rotated per-token Q tier (keys 4 bits, values 3: docs/quant_study.md) at the paper's
    # q_frac 0.70; chosen on development samples (seed 1000) against q_frac 0.5 and rot-k4v4 (docs/results.md)
    "qevict-rot": {"quant": "rot-k4v3"},
    # QEvict with the centered rotated Q tier (each window's pre-RoPE key mean kept in f16, the rest rotated:
    # keys 4 bits, values 3; docs/quant_study.md), the format that reads well on both models; q_frac 0.70,
    # chosen on development samples (seed 1000) against q_frac 0.5 (docs/results.md)
    "qevict-crot": {"quant": "crot-k4v3"},
    # QEvict with its F and Q tiers chosen by KVzip's context-reconstruction scores (``rankings.reconstruction``):
    # for a context compressed before its question; and the same ranking with no Q tier (R2's layout), to
    # measure what the Q tier adds
    "qevict-kvzip": {**QEVICT_DEFAULT, "ranking": "kvzip"},
    "r2-kvzip": {"window": 8, "q_frac": 0.0, "ranking": "kvzip"},
    # the same two with expected attention's tiers (``rankings.expected_attention``: closed form from the
    # prompt's own query statistics, no pass before the prompt's), the other question-agnostic signal
    "qevict-ea": {**QEVICT_DEFAULT, "ranking": "expected-attention"},
    "r2-ea": {"window": 8, "q_frac": 0.0, "ranking": "expected-attention"},
    # qevict-keynorm with the rotated Q tier: for a context compressed before its question
    "qevict-keynorm-rot": {"q_frac": 0.5, "ranking": "keynorm", "quant": "rot-k4v3"},
}
"""QEvict's named configurations (``CacheConfig`` fields over the defaults)."""
