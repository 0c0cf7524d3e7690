"""Model configuration shared by every supported decoder family.

One decoder serves Llama, Mistral, Qwen2 and Qwen3; the differences are data here (QKV bias, per-head
q/k RMSNorm, sliding window, Llama-3 RoPE scaling, tied embeddings, explicit head_dim).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its options is not supported."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static description of a decoder-only transformer (hashable: used as a static jit argument)."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q, k, v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None = None  # Mistral: a query sees keys with q_pos - k_pos < sliding_window
    # Llama-3 RoPE scaling: (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    rope_llama3: tuple[float, float, float, int] | None = None
    max_position_embeddings: int = 8192
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.family not in SUPPORTED_FAMILIES:
            raise UnsupportedModelError(
                f"unknown model family {self.family!r}; supported: {', '.join(SUPPORTED_FAMILIES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA ratio)."""
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Bytes of K and V for one token over all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * itemsize

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies [head_dim/2] in float64 (Llama-3 scaling applied when configured)."""
        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        if self.rope_llama3 is not None:
            factor, low, high, original = self.rope_llama3
            low_wavelen = original / low
            high_wavelen = original / high
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
            smooth = (original / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            inv = np.where(medium, smoothed, scaled)
        return inv

    # ---------------------------------------------------------------- serialization
    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        raw = json.loads(text)
        if raw.get("rope_llama3") is not None:
            raw["rope_llama3"] = tuple(raw["rope_llama3"])
        raw["eos_token_ids"] = tuple(raw.get("eos_token_ids") or ())
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"model config has unknown fields: {sorted(unknown)}")
        return cls(**raw)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict; unsupported options raise naming the option."""
        archs = hf.get("architectures") or []
        model_type = hf.get("model_type")
        family = None
        for arch in archs:
            family = _HF_ARCHITECTURES.get(arch)
            if family:
                break
        if family is None:
            if model_type in SUPPORTED_FAMILIES and not archs:
                family = model_type
            else:
                raise UnsupportedModelError(
                    f"unsupported architecture {archs or model_type!r}; supported: "
                    f"{', '.join(_HF_ARCHITECTURES)}"
                )
        num_heads = hf["num_attention_heads"]
        hidden = hf["hidden_size"]
        head_dim = hf.get("head_dim") or hidden // num_heads
        if family in ("llama", "mistral") and hf.get("mlp_bias"):
            raise UnsupportedModelError("option mlp_bias=True is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(
                f"option hidden_act={hf['hidden_act']!r} is not supported (only silu)"
            )
        rope_llama3 = None
        rope_params = hf.get("rope_scaling") or hf.get("rope_parameters")
        rope_theta = hf.get("rope_theta")
        if rope_params:
            if rope_theta is None:
                rope_theta = rope_params.get("rope_theta")
            rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
            if rope_type == "llama3":
                rope_llama3 = (
                    float(rope_params["factor"]),
                    float(rope_params["low_freq_factor"]),
                    float(rope_params["high_freq_factor"]),
                    int(rope_params["original_max_position_embeddings"]),
                )
            elif rope_type != "default":
                raise UnsupportedModelError(f"option rope_scaling type {rope_type!r} is not supported")
        sliding_window = None
        if family == "mistral":
            sliding_window = hf.get("sliding_window")
        elif family in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
            raise UnsupportedModelError(f"option use_sliding_window=True is not supported for {family}")
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        attention_bias = bool(hf.get("attention_bias", False)) or family == "qwen2"
        if family == "qwen3" and hf.get("attention_bias"):
            raise UnsupportedModelError("option attention_bias=True is not supported for qwen3")
        return cls(
            family=family,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=family == "qwen3",
            sliding_window=sliding_window,
            rope_llama3=rope_llama3,
            max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelConfig:
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"{cfg_path} not found: a Hugging Face model folder needs config.json")
        return cls.from_hf_dict(json.loads(cfg_path.read_text()))
