"""Token streaming: the decode loop hands each step's sampled tokens to a host function as they are produced.

A stream is registered under an integer id (``open_stream``). The decode loop compiled with a stream id (a
traced int32 scalar, not a static argument) calls ``emit`` once per step through an ordered
``jax.debug.callback``, and ``emit`` looks the sink up by that id: one executable serves every stream. The
loop compiled without one (``stream_id=None``, an empty pytree) contains no callback at all, so streaming
costs nothing when it is off.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

TokenSink = Callable[[np.ndarray, np.ndarray], None]
"""``sink(tokens [B] int32, live [B] bool)``: one call per sampled position, in order; a row that has already
hit EOS is not live (its token is padding)."""

_SINKS: dict[int, TokenSink] = {}
_IDS = itertools.count(1)
_LOCK = threading.Lock()


@contextlib.contextmanager
def open_stream(sink: TokenSink) -> Iterator[jax.Array]:
    """Register ``sink`` for the duration of the block; yields its id, the decode loop's ``stream_id`` [].

    On exit every callback the block's computations issued has run (``jax.effects_barrier``), so no token
    reaches a sink after its block.
    """
    with _LOCK:
        sid = next(_IDS)
        _SINKS[sid] = sink
    try:
        yield jnp.int32(sid)
    finally:
        jax.effects_barrier()
        with _LOCK:
            del _SINKS[sid]


def emit(stream_id: jax.Array, tokens: jax.Array, live: jax.Array) -> None:
    """Host side of the callback: stream_id [], tokens [B], live [B] -> the registered sink."""
    with _LOCK:
        sink = _SINKS.get(int(stream_id))
    if sink is not None:
        sink(np.asarray(tokens), np.asarray(live))


def emit_in_loop(stream_id: jax.Array | None, tokens: jax.Array, live: jax.Array) -> None:
    """Inside a jitted loop: hand ``tokens`` [B] and ``live`` [B] to the stream, in step order; nothing
    at all when ``stream_id`` is None."""
    if stream_id is not None:
        jax.debug.callback(emit, stream_id, tokens, live, ordered=True)


class TextStream:
    """A sink that writes one row's text as it grows: the row's tokens so far are decoded whole and only the
    new suffix is written, so a character split over several tokens appears once complete.

    decode: token ids -> text (the tokenizer's ``decode``); write: where the text goes (e.g. stdout's write,
    flushed per call by the caller's choice of stream); row: which batch row to follow.
    """

    def __init__(
        self, *, decode: Callable[[Sequence[int]], str], write: Callable[[str], object], row: int = 0
    ):
        self.decode, self.write, self.row = decode, write, row
        self.tokens: list[int] = []
        self.text = ""

    def __call__(self, tokens: np.ndarray, live: np.ndarray) -> None:
        if not live[self.row]:
            return
        self.tokens.append(int(tokens[self.row]))
        text = self.decode(self.tokens)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for its next token
            return
        if text.startswith(self.text):
            self.write(text[len(self.text) :])
        self.text = text
