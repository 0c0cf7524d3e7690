"""Tiny random checkpoints for conversion tests.

numpy-only writers (no torch): ``tiny_hf_config`` / ``random_hf_state`` / ``write_hf_dir`` make a Hugging Face
folder (config.json + safetensors, optionally sharded or bf16) and ``write_gguf`` a GGUF file from the same
tensors, the way llama.cpp's converter lays them out (Llama q/k rows permuted, Llama-3 RoPE as
``rope_freqs.weight``). Tensor names here are written out by hand, independently of ``models.convert``.

With transformers installed, ``make_hf_model`` builds a random ``*ForCausalLM`` and ``hf_logits`` runs it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

VOCAB = 128
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    hidden_act="silu",
)

# kind -> (architecture, model_type, extra config.json keys)
KINDS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama3": (
        "LlamaForCausalLM",
        "llama",
        dict(
            rope_theta=10000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
            tie_word_embeddings=False,
        ),
    ),
    "llama_tied": ("LlamaForCausalLM", "llama", dict(rope_theta=100000.0, tie_word_embeddings=True)),
    "mistral": (
        "MistralForCausalLM",
        "mistral",
        dict(rope_theta=10000.0, sliding_window=24, tie_word_embeddings=False),
    ),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", dict(rope_theta=10000.0, tie_word_embeddings=False)),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", dict(rope_theta=10000.0, head_dim=24, tie_word_embeddings=False)),
}


def tiny_hf_config(kind: str) -> dict[str, Any]:
    """A config.json dict for a tiny model of ``kind`` (see ``KINDS``)."""
    arch, model_type, extra = KINDS[kind]
    return {"architectures": [arch], "model_type": model_type, **_COMMON, **extra}


def _head_dim(hf: dict[str, Any]) -> int:
    return hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]


def random_hf_state(hf: dict[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 tensors under Hugging Face names ([out, in] linear weights) for config ``hf``."""
    rng = np.random.default_rng(seed)
    dm, f, v = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    hd = _head_dim(hf)
    hq, hkv = hf["num_attention_heads"] * hd, hf["num_key_value_heads"] * hd

    def w(*shape: int) -> np.ndarray:
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    state = {"model.embed_tokens.weight": w(v, dm), "model.norm.weight": norm(dm)}
    if not hf.get("tie_word_embeddings"):
        state["lm_head.weight"] = w(v, dm)
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state |= {
            p + "input_layernorm.weight": norm(dm),
            p + "post_attention_layernorm.weight": norm(dm),
            p + "self_attn.q_proj.weight": w(hq, dm),
            p + "self_attn.k_proj.weight": w(hkv, dm),
            p + "self_attn.v_proj.weight": w(hkv, dm),
            p + "self_attn.o_proj.weight": w(dm, hq),
            p + "mlp.gate_proj.weight": w(f, dm),
            p + "mlp.up_proj.weight": w(f, dm),
            p + "mlp.down_proj.weight": w(dm, f),
        }
        if hf["model_type"] == "qwen2":
            state |= {p + "self_attn.q_proj.bias": w(hq), p + "self_attn.k_proj.bias": w(hkv)}
            state |= {p + "self_attn.v_proj.bias": w(hkv)}
        if hf["model_type"] == "qwen3":
            state |= {p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd)}
    return state


def write_hf_dir(
    path: Path, hf: dict[str, Any], state: dict[str, np.ndarray], shards: int = 1, bf16: bool = False
) -> Path:
    """Write config.json and the safetensors file(s) (an index when ``shards`` > 1) into ``path``."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf, indent=2))
    dtype = ml_dtypes.bfloat16 if bf16 else np.float32
    tensors = {k: np.ascontiguousarray(v.astype(dtype)) for k, v in state.items()}
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "np"})
        return path
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({k: tensors[k] for k in part}, str(path / file), metadata={"format": "np"})
        weight_map |= dict.fromkeys(part, file)
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return path


def _byte_alphabet() -> list[str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs, strict=True))]


def tiny_tokens(vocab: int = VOCAB) -> list[str]:
    """A byte-level vocabulary: the special tokens, then single bytes 0, 1, ... in GPT-2's alphabet."""
    return SPECIAL_TOKENS + _byte_alphabet()[: vocab - len(SPECIAL_TOKENS)]


def _llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (rotate-half layout -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_factors(hf: dict[str, Any]) -> np.ndarray:
    """What llama.cpp writes to ``rope_freqs.weight`` for Llama-3 RoPE scaling."""
    rs = hf["rope_scaling"]
    hd = _head_dim(hf)
    freqs = 1.0 / (hf["rope_theta"] ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def write_gguf(path: Path, hf: dict[str, Any], state: dict[str, np.ndarray], arch: str | None = None) -> Path:
    """Write ``state`` (Hugging Face names and layout) as an F32 GGUF the way llama.cpp's converter does."""
    import gguf

    arch = arch or {"mistral": "llama"}.get(hf["model_type"], hf["model_type"])
    hd = _head_dim(hf)
    nh, nkv = hf["num_attention_heads"], hf["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny test model")
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_rope_freq_base(hf["rope_theta"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_rope_dimension_count(hd)
    if hd != hf["hidden_size"] // nh:
        w.add_key_length(hd)
        w.add_value_length(hd)
    w.add_vocab_size(hf["vocab_size"])
    tokens = tiny_tokens(hf["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS)))
    w.add_token_merges([])
    w.add_bos_token_id(hf["bos_token_id"])
    w.add_eos_token_id(hf["eos_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "self_attn.q_proj.bias": "attn_q.bias",
        "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.bias": "attn_v.bias",
        "self_attn.q_norm.weight": "attn_q_norm.weight",
        "self_attn.k_norm.weight": "attn_k_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    for i in range(hf["num_hidden_layers"]):
        names |= {f"model.layers.{i}.{k}": f"blk.{i}.{v}" for k, v in per_layer.items()}
    rope = hf.get("rope_scaling") or {}
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_factors(hf))
    for hf_name, tensor in state.items():
        tensor = np.ascontiguousarray(np.asarray(tensor, np.float32))
        if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            tensor = _llama_permute(tensor, nh if ".q_proj." in hf_name else nkv)
        w.add_tensor(names[hf_name], tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ------------------------------------------------------------------------------------- transformers
def make_hf_model(kind: str, seed: int = 0):
    """A random transformers ``*ForCausalLM`` (float32, eager attention) of ``kind``; every weight random."""
    import torch
    import transformers

    hf = tiny_hf_config(kind)
    arch = hf.pop("architectures")[0]
    model_type = hf.pop("model_type")
    config_cls = transformers.AutoConfig.for_model(model_type).__class__
    config = config_cls(**hf, architectures=[arch])
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    return model


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    """float32 logits [B, T, V] of a transformers model on ``tokens`` [B, T]."""
    import torch

    with torch.no_grad():
        out = model(torch.as_tensor(np.asarray(tokens), dtype=torch.long))
    return out.logits.float().numpy()


def hf_state(model) -> dict[str, np.ndarray]:
    """A transformers model's state dict as float32 numpy (tied lm_head dropped)."""
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return {k: v for k, v in state.items() if "rotary_emb" not in k}


def hf_config_dict(model) -> dict[str, Any]:
    """``config.json`` dict of a transformers model, with the fields ``write_gguf`` reads filled in."""
    from models.config import ModelConfig

    hf = model.config.to_dict()
    cfg = ModelConfig.from_hf_dict(hf)
    hf.setdefault("rope_theta", cfg.rope_theta)
    if cfg.rope_llama3 is not None:
        f, lo, hi, orig = cfg.rope_llama3
        hf["rope_scaling"] = dict(
            rope_type="llama3",
            factor=f,
            low_freq_factor=lo,
            high_freq_factor=hi,
            original_max_position_embeddings=orig,
        )
    return hf
