"""How the windows that miss F compete for the Q tier (``CacheConfig.q_rank``): one class per way, registered by
its name where it is defined. The name is the option's value at the edge (``--set q_rank=blend``); the routing
sees the object (``Capacities.q_rank``), which says whether the ledger keeps key-norm scores and turns the two
ranking keys into the Q tier's.

F is always the top windows by the ranking's (spilled) score; a Q key orders the rest.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

_Q_KEYS: dict[str, type[QKey]] = {}


def register(cls: type[QKey]) -> type[QKey]:
    """Class decorator: make ``cls`` available as ``q_rank=cls.name``."""
    if cls.name in _Q_KEYS:
        raise ValueError(f"a Q key named {cls.name!r} is already registered ({_Q_KEYS[cls.name].__name__})")
    _Q_KEYS[cls.name] = cls
    return cls


def available_q_keys() -> tuple[str, ...]:
    """The names ``CacheConfig.q_rank`` accepts, in the order they were registered."""
    return tuple(_Q_KEYS)


def q_key(name: str) -> QKey:
    """The Q key named ``name``; an unknown name is a ValueError listing the available ones."""
    if name not in _Q_KEYS:
        raise ValueError(f"unknown q_rank {name!r}; available: {', '.join(_Q_KEYS)}")
    return _Q_KEYS[name]()


@dataclasses.dataclass(frozen=True)
class QKey(abc.ABC):
    """How the windows not in F are ordered for the Q tier (hashable: part of the static ``Capacities``).

    name: the option's value. reads_key_norm: the key needs each window's key-norm score, so the ledger keeps
    one per entry (``cache.Ledger.norm_score``) and the routing computes the candidates'.
    """

    name: ClassVar[str]
    reads_key_norm: ClassVar[bool]

    @abc.abstractmethod
    def key(self, score_key: jax.Array, norm_key: jax.Array | None, eligible: jax.Array) -> jax.Array:
        """The Q tier's ranking key [N] (larger is better) from the spilled score key [N], the spilled
        key-norm key [N] (None unless ``reads_key_norm``) and the entries competing for Q, eligible [N] bool."""


@register
@dataclasses.dataclass(frozen=True)
class ByScore(QKey):
    """The ranking's score, as F: Q holds the next windows after F's."""

    name: ClassVar[str] = "score"
    reads_key_norm: ClassVar[bool] = False

    def key(self, score_key: jax.Array, norm_key: jax.Array | None, eligible: jax.Array) -> jax.Array:
        return score_key


@register
@dataclasses.dataclass(frozen=True)
class ByKeyNorm(QKey):
    """Minus the window's mean key norm (``windows.key_norm_score``): what no query has asked for yet."""

    name: ClassVar[str] = "keynorm"
    reads_key_norm: ClassVar[bool] = True

    def key(self, score_key: jax.Array, norm_key: jax.Array | None, eligible: jax.Array) -> jax.Array:
        return norm_key


@register
@dataclasses.dataclass(frozen=True)
class Blend(QKey):
    """A window in the top of either key: minus the better of its percentile ranks by score and by key norm
    among the eligible entries.

    An attention score knows what the prompt's last queries read; a key norm knows what no query has asked
    for yet. Taking the better rank keeps both sets, half the room each when they do not overlap.
    """

    name: ClassVar[str] = "blend"
    reads_key_norm: ClassVar[bool] = True

    def key(self, score_key: jax.Array, norm_key: jax.Array | None, eligible: jax.Array) -> jax.Array:
        return -jnp.minimum(percentile_rank(score_key, eligible), percentile_rank(norm_key, eligible))


BY_SCORE = ByScore()
"""The default Q key (``CacheConfig.q_rank`` "score")."""


def percentile_rank(key: jax.Array, eligible: jax.Array) -> jax.Array:
    """[N] f32 share of the eligible entries that rank above each entry by ``key`` [N] (0 = best; ties in
    index order, as ``lax.top_k`` takes them); 1 where not ``eligible`` [N] bool."""
    order = jnp.argsort(-jnp.where(eligible, key.astype(jnp.float32), -jnp.inf), stable=True)
    rank = jnp.zeros(key.shape, jnp.int32).at[order].set(jnp.arange(key.shape[0], dtype=jnp.int32))
    count = jnp.maximum(jnp.sum(eligible, dtype=jnp.int32), 1)
    return jnp.where(eligible, rank.astype(jnp.float32) / count, 1.0)
