"""Kept-set parity of the ``kvzip`` pool baseline with kvpress 0.5.5's ``KVzipPress`` (NVIDIA's implementation,
written independently of this project), on SmolLM2-135M-Instruct and a needle prompt of about 1K tokens, both in
float32.

kvpress runs as its pipeline does (``with press(model): model.model(input_ids=..., past_key_values=cache)``,
``layerwise=True``: every layer prunes the same number of KV pairs, bottom-k over all its heads, sinks kept) and
its pruned (head, position) pairs are read from each attention module's ``masked_key_indices`` (kvpress's fake
compression: those keys are masked in later attention). Ours: the pool's (``pool_head``, ``pool_pos``) after
``prefill_logits``. Both keep the 4 sinks of every head; the sets compared are the kept positions past them, at
the same count per layer (kvpress's ``compression_ratio`` is chosen so that it prunes exactly what our pool does
not hold).

One intended difference is removed for the comparison: kvpress reconstructs the context after the chat
template's prefix (``prefix_length``, 24 tokens on SmolLM2: its system turn and ``<|im_start|>user\\n``) and its
reconstruction softmax sees only the first 4 of those prefix keys (the prefix's other keys score 0 and are
evicted), where ours reconstructs the whole prompt after its 4 sinks over every key
(``rankings.reconstruction``). Here kvpress's ``prefix_length`` is set to its ``n_sink`` (4), which makes the
two the same computation. Measured with kvpress's own prefix on this prompt (β 0.3): Jaccard mean 0.67 (one
layer-head at 0.36; the [L, Hkv, T] score correlation 0.82 to 0.99 per layer). kvpress's chunking (2048 tokens)
does not apply at this length.

The table printed (``-s``) gives, per layer, the Jaccard of each KV head's kept positions, the correlation of
the two score tensors and their largest difference. A head that keeps no position past its sinks in both
(head-adaptive allocation can give a head none) counts as agreeing (Jaccard 1).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.checkpoint import load_model
from models.tokenizer import Tokenizer
from qevict_jax.eval.needle import needle_prompt_text, needle_sample
from qevict_jax.methods.registry import bind_tokenizer, make_method
from qevict_jax.rankings.reconstruction import reconstruction_scores
from qevict_jax.runtime.prefill import prefill_logits

SKIP = "kvpress parity skipped: torch, transformers and kvpress are needed (the `kvpress` extra, its own venv: make parity-kvpress)"
torch = pytest.importorskip("torch", reason=SKIP)
transformers = pytest.importorskip("transformers", reason=SKIP)
kvpress = pytest.importorskip("kvpress", reason=SKIP)

N_SINK = 4
BETA = 0.3
MIN_JACCARD = 0.95
SCORE_ATOL = 1e-4  # measured: at most 1.2e-5 (float32 on both sides, different summation orders)


@dataclasses.dataclass
class RecordingKVzipPress(kvpress.KVzipPress):
    """``KVzipPress`` that reconstructs after ``prefix`` tokens (None: kvpress's chat-template prefix) and
    records its repeat prompt and its scores [L, Hkv, T] (before the sinks are raised), which kvpress discards."""

    prefix: int | None = None

    def prepare(self, model, tokenizer, prev_postfix_size=8):
        if self.prefix is not None:
            self.prefix_length = self.prefix
        pairs = super().prepare(model, tokenizer, prev_postfix_size)
        context, repeat = pairs[0]
        self.recorded_prefix = self.prefix_length
        self.recorded_repeat = tuple(repeat[0, : repeat.shape[1] - context.shape[1]].tolist())
        return pairs

    def compress_post(self, model):
        self.recorded_scores = self.score_val[:, 0].detach().to(torch.float64).numpy().copy()
        super().compress_post(model)


def jaccard(a: set, b: set) -> float:
    return 1.0 if not a and not b else len(a & b) / len(a | b)


def per_head(kept: set[tuple[int, int]], head: int) -> set[int]:
    return {p for h, p in kept if h == head}


@pytest.fixture(scope="module")
def prompt(smollm2_dir) -> tuple[Tokenizer, list[int]]:
    tok = Tokenizer.from_dir(smollm2_dir)
    sample = needle_sample(0, 1000, lambda t: len(tok.encode(t, add_bos=False)))
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": needle_prompt_text(sample)}]))
    assert 900 <= len(ids) < 2048  # one kvpress chunk
    return tok, ids


@pytest.mark.slow
@pytest.mark.parity
def test_kvzip_kept_sets_match_kvpress(smollm2_gguf, smollm2_dir, prompt):
    tok, ids = prompt
    n = len(ids)
    cfg, model = load_model(smollm2_dir, dtype="float32")
    method = bind_tokenizer(make_method("kvzip", BETA), tok)
    tokens, lengths = jnp.asarray([ids], jnp.int32), jnp.asarray([n], jnp.int32)

    def run(t, ln):
        _, cache = prefill_logits(
            model, t, ln, method, max_new_tokens=4, budget_tokens=n + 4, kv_dtype=jnp.float32
        )
        return (
            cache.pool_pos[:, 0],
            cache.pool_head[:, 0],
            reconstruction_scores(model, t, ln, method.reconstruction),
        )

    pool_pos, pool_head, scores = jax.jit(run)(tokens, lengths)
    pool_pos, pool_head, ours_scores = np.asarray(pool_pos), np.asarray(pool_head), np.asarray(scores)[:, 0]
    hkv, slots = cfg.num_kv_heads, pool_pos.shape[-1]
    ours = [
        {(int(h), int(p)) for p, h in zip(pool_pos[i], pool_head[i], strict=True) if p >= 0}
        for i in range(cfg.num_layers)
    ]

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()
    # KVzipPress loads its tokenizer from the model's name_or_path: the converted folder's tokenizer.json
    hf.config._name_or_path = str(smollm2_dir)
    n_pruned = hkv * (n - N_SINK) - slots  # what our pool does not hold, past the sinks
    press = RecordingKVzipPress(
        compression_ratio=(n_pruned + 0.5) / (hkv * n), layerwise=True, n_sink=N_SINK, prefix=N_SINK
    )
    with torch.no_grad(), press(hf):
        hf.model(input_ids=torch.tensor([ids]), past_key_values=transformers.DynamicCache())
    assert press.recorded_prefix == N_SINK
    assert (
        press.recorded_repeat == method.repeat_prompt
    )  # the same instruction and turn change, token for token
    theirs = []
    for layer in hf.model.layers:
        _, heads, positions = layer.self_attn.masked_key_indices
        pruned = set(zip(heads.tolist(), positions.tolist(), strict=True))
        assert not any(p < N_SINK for _, p in pruned)
        theirs.append({(h, p) for h in range(hkv) for p in range(N_SINK, n)} - pruned)

    table = np.zeros((cfg.num_layers, hkv))
    print(
        f"\nKVzip kept-set parity with kvpress 0.5.5: SmolLM2-135M-Instruct, {n} tokens, {slots} kept per layer"
    )
    print("layer | kept per head (kvpress / ours) | Jaccard per head | score corr | max |d score|")
    for i in range(cfg.num_layers):
        assert len(theirs[i]) == len(ours[i]) == slots
        table[i] = [jaccard(per_head(theirs[i], h), per_head(ours[i], h)) for h in range(hkv)]
        a, b = press.recorded_scores[i, :, N_SINK:], ours_scores[i, :, N_SINK:n]
        corr, diff = np.corrcoef(a.ravel(), b.ravel())[0, 1], np.abs(a - b).max()
        counts = " ".join(f"{len(per_head(theirs[i], h))}/{len(per_head(ours[i], h))}" for h in range(hkv))
        print(f"{i:5d} | {counts:30s} | {' '.join(f'{j:.3f}' for j in table[i])} | {corr:.6f} | {diff:.1e}")
        np.testing.assert_allclose(b, a, atol=SCORE_ATOL, rtol=0, err_msg=f"layer {i} scores")
    print(f"Jaccard per layer: min {table.min(axis=1).round(3).tolist()}")
    print(f"Jaccard per layer: mean {table.mean(axis=1).round(3).tolist()}")
    print(f"Jaccard overall: min {table.min():.3f}, mean {table.mean():.4f}")
    assert table.min() >= MIN_JACCARD, np.argwhere(table < MIN_JACCARD).tolist()
