"""Tensor sources of a conversion (docs/convert.md): a Hugging Face folder of safetensors files or one GGUF file, read
with numpy (torch is never imported), each listing its tensors' names and shapes before any data is read; and the
``ModelConfig`` a GGUF file's metadata describes."""

from __future__ import annotations

import json
import math
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Protocol

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so safetensors can read BF16 tensors)
import numpy as np

from models.config import ModelConfig, UnsupportedModelError
from models.tokenizer import gguf_metadata

# GGUF ``general.architecture`` -> our model family (Mistral GGUFs say "llama").
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


class CorruptCheckpointError(ValueError):
    """A source file cannot be parsed (truncated, corrupt, not the format it claims)."""


# ---------------------------------------------------------------------------------------------- sources
class TensorSource(Protocol):
    """Named tensors of one checkpoint, in the source layout ([out, in] for linear weights)."""

    def names(self) -> set[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str) -> np.ndarray: ...

    def where(self, name: str) -> str: ...


class SafetensorsSource:
    """The tensors of a Hugging Face folder: ``model.safetensors`` or shards listed by the index file."""

    def __init__(self, folder: Path, stack: ExitStack):
        from safetensors import safe_open

        index_file = folder / "model.safetensors.index.json"
        if index_file.is_file():
            try:
                weight_map: dict[str, str] = json.loads(index_file.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CorruptCheckpointError(f"{index_file}: unreadable safetensors index: {e}") from e
            files = sorted(set(weight_map.values()))
            for shard in files:
                if not (folder / shard).is_file():
                    raise FileNotFoundError(
                        f"{folder}: shard {shard!r} named by {index_file.name} is missing ({folder / shard})"
                    )
        elif (folder / "model.safetensors").is_file():
            weight_map, files = {}, ["model.safetensors"]
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
            weight_map = {}
            if not files:
                raise FileNotFoundError(
                    f"{folder}: no model.safetensors or model.safetensors.index.json "
                    "(only safetensors checkpoints are supported)"
                )
        self._file: dict[str, str] = {}
        self._handle: dict[str, Any] = {}
        for file in files:
            path = folder / file
            try:
                handle = stack.enter_context(safe_open(str(path), framework="np"))
                keys = list(handle.keys())
            except Exception as e:
                raise CorruptCheckpointError(f"{path}: corrupt or truncated safetensors file: {e}") from e
            for key in keys:
                if key in self._file:
                    raise CorruptCheckpointError(f"{path}: tensor {key!r} is also in {self._file[key]}")
                self._file[key], self._handle[key] = str(path), handle
        for name, shard in weight_map.items():
            if self._file.get(name) != str(folder / shard):
                raise CorruptCheckpointError(
                    f"{index_file}: tensor {name!r} is listed in shard {shard!r}, which does not contain it"
                )

    def names(self) -> set[str]:
        return set(self._file)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle[name].get_slice(name).get_shape())

    def read(self, name: str) -> np.ndarray:
        try:
            return self._handle[name].get_tensor(name)
        except Exception as e:
            raise CorruptCheckpointError(f"{self._file[name]}: cannot read tensor {name!r}: {e}") from e

    def where(self, name: str) -> str:
        return self._file[name]


class GGUFSource:
    """The tensors of a GGUF file, dequantized to float32 and reshaped to numpy order ([out, in])."""

    def __init__(self, path: Path):
        import gguf

        self.path = path
        try:
            self.reader = gguf.GGUFReader(path)
            self.metadata = gguf_metadata(self.reader)
        except Exception as e:
            raise CorruptCheckpointError(f"{path}: corrupt or truncated GGUF file: {e}") from e
        self._tensors = {t.name: t for t in self.reader.tensors}

    def names(self) -> set[str]:
        return set(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(self._tensors[name].shape.tolist()))  # GGUF lists ne0 first

    def read(self, name: str) -> np.ndarray:
        import gguf

        t = self._tensors[name]
        try:
            data = gguf.quants.dequantize(t.data, t.tensor_type)
            return np.asarray(data, np.float32).reshape(self.shape(name))
        except Exception as e:
            raise CorruptCheckpointError(
                f"{self.path}: cannot dequantize tensor {name!r} ({t.tensor_type.name}): {e}"
            ) from e

    def where(self, name: str) -> str:
        return str(self.path)


# ---------------------------------------------------------------------------------------------- GGUF config
def _llama3_rope_from_factors(
    theta: float, head_dim: int, factors: np.ndarray
) -> tuple[float, float, float, int]:
    """Recover Llama-3 RoPE scaling (factor, low_freq_factor, high_freq_factor, original_max_pos) from the
    per-frequency divisors llama.cpp stores in ``rope_freqs.weight`` [head_dim/2] (scaled = inv / factors).

    Only the resulting frequencies matter, so low_freq_factor is fixed to 1 and the rest fitted (or taken
    from the usual values); the result is verified against the stored divisors.
    """
    factors = np.asarray(factors, np.float64)
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    factor = float(factors.max())
    wavelen = 2 * math.pi / inv_freq
    medium = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    candidates: list[tuple[float, float, float, int]] = []
    if medium.sum() >= 2:
        # medium band: 1/f = (1 - s)/factor + s, s = (orig/wavelen - low)/(high - low) = a/wavelen + b
        s = (1 / factors[medium] - 1 / factor) / (1 - 1 / factor)
        a, b = np.polyfit(1 / wavelen[medium], s, 1)  # a = orig/(high - low), b = -low/(high - low)
        if b < 0:  # rounded to what a config would say, then as fitted
            candidates.append((factor, 1.0, float(f"{1.0 - 1.0 / b:.6g}"), round(-a / b)))
            candidates.append((factor, 1.0, float(1.0 - 1.0 / b), round(-a / b)))
    candidates += [(factor, 1.0, 4.0, orig) for orig in (8192, 4096, 2048, 16384, 32768, 131072, 1024)]
    target = inv_freq / factors
    for cand in candidates:
        probe = ModelConfig(
            family="llama",
            vocab_size=1,
            hidden_size=head_dim,
            intermediate_size=1,
            num_layers=1,
            num_heads=1,
            num_kv_heads=1,
            head_dim=head_dim,
            rope_theta=theta,
            rope_llama3=cand,
        )
        if np.allclose(probe.inv_freq(), target, rtol=1e-4, atol=0):
            return cand
    raise UnsupportedModelError(
        "rope_freqs.weight does not match Llama-3 RoPE scaling: unsupported RoPE scaling"
    )


def config_from_gguf(source: GGUFSource) -> ModelConfig:
    """ModelConfig from GGUF metadata (``general.architecture`` llama / qwen2 / qwen3) and tensor list."""
    meta = source.metadata
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{source.path}: unsupported GGUF architecture {arch!r}; supported: "
            f"{', '.join(GGUF_ARCHITECTURES)} (Mistral GGUFs use 'llama')"
        )
    missing = object()

    def get(key: str, default: Any = missing) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is missing:
            raise CorruptCheckpointError(f"{source.path}: GGUF metadata {arch}.{key} is missing")
        return value

    def get_float(key: str, default: float) -> float:
        # GGUF stores float32: take the shortest decimal that rounds to it (1e-6, not 9.99999997e-07)
        return float(str(np.float32(get(key, default))))

    names = source.names()
    num_heads = int(get("attention.head_count"))
    kv = get("attention.head_count_kv", num_heads)
    if isinstance(kv, list):
        if len(set(kv)) != 1:
            raise UnsupportedModelError(
                f"{source.path}: per-layer KV head counts {sorted(set(kv))} not supported"
            )
        kv = kv[0]
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // num_heads))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise UnsupportedModelError(f"{source.path}: value head size differs from key head size")
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise UnsupportedModelError(f"{source.path}: partial rotary embedding is not supported")
    scaling = get("rope.scaling.type", None)
    if scaling not in (None, "none"):
        raise UnsupportedModelError(f"{source.path}: option rope scaling {scaling!r} is not supported")
    if get("attention.sliding_window", None) is not None:
        raise UnsupportedModelError(f"{source.path}: option sliding_window is not supported for GGUF")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size", None)
    if vocab is None:
        vocab = len(tokens) if tokens else source.shape("token_embd.weight")[0]
    bias = "blk.0.attn_q.bias" in names
    if arch == "qwen3" and bias:
        raise UnsupportedModelError(f"{source.path}: option attention bias is not supported for qwen3")
    theta = get_float("rope.freq_base", 10000.0)
    rope_llama3 = None
    if "rope_freqs.weight" in names:
        if arch != "llama":
            raise UnsupportedModelError(f"{source.path}: rope_freqs.weight is not supported for {arch}")
        factors = source.read("rope_freqs.weight").reshape(-1)
        if factors.shape != (head_dim // 2,):
            raise CorruptCheckpointError(f"{source.path}: rope_freqs.weight has shape {factors.shape}")
        if not np.allclose(factors, 1.0):
            rope_llama3 = _llama3_rope_from_factors(theta, head_dim, factors)
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    return ModelConfig(
        family=GGUF_ARCHITECTURES[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(kv),
        head_dim=head_dim,
        rope_theta=theta,
        rms_norm_eps=get_float("attention.layer_norm_rms_epsilon", 1e-6),
        tie_word_embeddings="output.weight" not in names,
        attention_bias=arch == "qwen2" or bias,
        qk_norm=arch == "qwen3",
        sliding_window=None,
        rope_llama3=rope_llama3,
        max_position_embeddings=int(get("context_length", 8192)),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)),
    )
