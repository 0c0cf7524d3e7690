"""Convert a Hugging Face folder (safetensors) or a GGUF file into a converted checkpoint folder.

Conversion is one table, ``PARAM_TABLE``: each row maps one entry of our params tree (the layout of
``models.model.param_shapes``) to its Hugging Face and GGUF tensor names. ``{i}`` in a name is the layer
index; such rows are stacked on a leading ``[L]`` axis. Linear weights are stored ``[out, in]`` by both
sources and ``[in, out]`` by us (``transpose``). llama.cpp permutes the rows of the Llama-family q and k
projections (and their biases) for its RoPE layout; ``gguf_permute`` names the head count that undoes it.

Every tensor's name and shape is checked before any data is read; a source tensor that no row uses is an
error (except ones that carry no information: rotary ``inv_freq`` buffers, a tied ``lm_head.weight``).
Sources are read with numpy (``safetensors`` framework "np", ``gguf``): torch is never imported.

Output (see ``models.checkpoint``): ``OUT/params`` (orbax), ``OUT/model_config.json``, tokenizer files,
``OUT/convert_info.json``. The folder is written under a temporary name and renamed into place, so an
interrupted conversion never leaves a half-written ``OUT``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import uuid
from collections.abc import Collection, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Protocol

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so safetensors can read BF16 tensors)
import numpy as np
from tqdm import tqdm

from models.checkpoint import INFO_FILE, save_checkpoint
from models.config import ModelConfig, UnsupportedModelError
from models.model import param_shapes
from models.tokenizer import Tokenizer, gguf_metadata

FORMAT_VERSION = 1

DTYPES: dict[str, Any] = {
    "float32": np.float32,
    "bfloat16": ml_dtypes.bfloat16,
    "float16": np.float16,
}

# Tokenizer-related files copied from a Hugging Face folder when present.
HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)

# GGUF ``general.architecture`` -> our model family (Mistral GGUFs say "llama").
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


class CorruptCheckpointError(ValueError):
    """A source file cannot be parsed (truncated, corrupt, not the format it claims)."""


@dataclasses.dataclass(frozen=True)
class ParamRule:
    """One row of the conversion table.

    ours: dotted path in our params tree ("layers.wq").
    hf / gguf: tensor name templates in the two source formats; "{i}" = layer index (stacked rows).
    transpose: the source stores the 2-D weight [out, in], we store [in, out].
    gguf_permute: "num_heads" / "num_kv_heads": undo llama.cpp's q/k row permutation with that head count
        (Llama-family GGUFs only).
    """

    ours: str
    hf: str
    gguf: str
    transpose: bool = False
    gguf_permute: str | None = None

    @property
    def stacked(self) -> bool:
        return "{i}" in self.hf


_L = "model.layers.{i}."
PARAM_TABLE: tuple[ParamRule, ...] = (
    ParamRule("embed", "model.embed_tokens.weight", "token_embd.weight"),
    ParamRule("layers.attn_norm", _L + "input_layernorm.weight", "blk.{i}.attn_norm.weight"),
    ParamRule("layers.wq", _L + "self_attn.q_proj.weight", "blk.{i}.attn_q.weight", True, "num_heads"),
    ParamRule("layers.wk", _L + "self_attn.k_proj.weight", "blk.{i}.attn_k.weight", True, "num_kv_heads"),
    ParamRule("layers.wv", _L + "self_attn.v_proj.weight", "blk.{i}.attn_v.weight", True),
    ParamRule("layers.wo", _L + "self_attn.o_proj.weight", "blk.{i}.attn_output.weight", True),
    ParamRule("layers.bq", _L + "self_attn.q_proj.bias", "blk.{i}.attn_q.bias", False, "num_heads"),
    ParamRule("layers.bk", _L + "self_attn.k_proj.bias", "blk.{i}.attn_k.bias", False, "num_kv_heads"),
    ParamRule("layers.bv", _L + "self_attn.v_proj.bias", "blk.{i}.attn_v.bias"),
    ParamRule("layers.q_norm", _L + "self_attn.q_norm.weight", "blk.{i}.attn_q_norm.weight"),
    ParamRule("layers.k_norm", _L + "self_attn.k_norm.weight", "blk.{i}.attn_k_norm.weight"),
    ParamRule("layers.mlp_norm", _L + "post_attention_layernorm.weight", "blk.{i}.ffn_norm.weight"),
    ParamRule("layers.w_gate", _L + "mlp.gate_proj.weight", "blk.{i}.ffn_gate.weight", True),
    ParamRule("layers.w_up", _L + "mlp.up_proj.weight", "blk.{i}.ffn_up.weight", True),
    ParamRule("layers.w_down", _L + "mlp.down_proj.weight", "blk.{i}.ffn_down.weight", True),
    ParamRule("final_norm", "model.norm.weight", "output_norm.weight"),
    ParamRule("lm_head", "lm_head.weight", "output.weight", True),
)


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


# ---------------------------------------------------------------------------------------------- table
def _lookup(tree: dict[str, Any], dotted: str) -> Any:
    node: Any = tree
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _assign(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        tree = tree.setdefault(key, {})
    tree[last] = value


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: w [n_heads * head_dim, ...] with rows (head, pair, half) ->
    (head, half, pair), the Hugging Face rotate-half layout. Works for weights [out, in] and biases [out]."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gather_params(
    cfg: ModelConfig,
    source: TensorSource,
    fmt: str,
    dtype: Any = np.float32,
    permute: bool = False,
    ignore: Collection[str] = (),
    *,
    progress: bool = False,
) -> dict[str, Any]:
    """Read ``source`` into our params tree following ``PARAM_TABLE`` (``fmt`` = "hf" or "gguf").

    Checks every name and shape first (a ValueError lists all problems, each naming its tensor), then reads.
    permute: undo llama.cpp's q/k row permutation. ignore: source tensors that are allowed to be unused.
    progress: a progress bar per tensor read, on a terminal only (tqdm ``disable=None``).
    Returns a nested dict of numpy arrays of ``dtype`` in the layout of ``param_shapes(cfg)``.
    """
    shapes = param_shapes(cfg)
    plan: list[tuple[ParamRule, tuple[int, ...], list[str]]] = []
    problems: list[str] = []
    available = source.names()
    used: set[str] = set()
    for rule in PARAM_TABLE:
        target = _lookup(shapes, rule.ours)
        if target is None:
            continue  # not part of this config (no bias, tied head, ...)
        template = getattr(rule, fmt)
        per_layer = target[1:] if rule.stacked else target
        src_shape = tuple(reversed(per_layer)) if rule.transpose else tuple(per_layer)
        names = [template.format(i=i) for i in range(cfg.num_layers)] if rule.stacked else [template]
        for name in names:
            if name not in available:
                problems.append(f"tensor {name!r} (for {rule.ours}) is missing; expected shape {src_shape}")
                continue
            used.add(name)
            got = source.shape(name)
            if got != src_shape:
                problems.append(
                    f"tensor {name!r} in {source.where(name)} has shape {got}, but the model config "
                    f"implies {src_shape} (for {rule.ours} {tuple(target)})"
                )
        plan.append((rule, tuple(target), names))
    unexpected = sorted(available - used - set(ignore))
    for name in unexpected:
        problems.append(f"unexpected tensor {name!r} in {source.where(name)} (shape {source.shape(name)})")
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise ValueError("checkpoint does not match its model config: " + "; ".join(shown))

    params: dict[str, Any] = {}
    with tqdm(
        total=len(used), unit="tensor", desc="converting", disable=None if progress else True, leave=False
    ) as bar:
        for rule, target, names in plan:
            out = np.empty(target, dtype)
            for idx, name in enumerate(names):
                w = source.read(name)
                bar.update()
                if permute and rule.gguf_permute is not None:
                    w = unpermute_rows(w, getattr(cfg, rule.gguf_permute))
                if rule.transpose:
                    w = w.T
                if rule.stacked:
                    out[idx] = w
                else:
                    out[...] = w
            _assign(params, rule.ours, out)
    return params


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
            family="llama", vocab_size=1, hidden_size=head_dim, intermediate_size=1, num_layers=1,
            num_heads=1, num_kv_heads=1, head_dim=head_dim, rope_theta=theta, rope_llama3=cand,
        )  # fmt: skip
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


# ---------------------------------------------------------------------------------------------- readers
def read_hf(
    src: Path, dtype: Any = np.float32, *, progress: bool = False
) -> tuple[ModelConfig, dict[str, Any]]:
    """(config, params) of a Hugging Face folder (config.json + safetensors); progress: see gather_params."""
    cfg = ModelConfig.from_hf_dir(src)
    with ExitStack() as stack:
        source = SafetensorsSource(src, stack)
        ignore = {n for n in source.names() if n.endswith("rotary_emb.inv_freq")}
        if cfg.tie_word_embeddings:
            ignore.add("lm_head.weight")
        params = gather_params(cfg, source, "hf", dtype, ignore=ignore, progress=progress)
    return cfg, params


def read_gguf(
    src: Path, dtype: Any = np.float32, *, progress: bool = False
) -> tuple[ModelConfig, dict[str, Any], GGUFSource]:
    """(config, params, source) of a GGUF file; tensors are dequantized, Llama q/k un-permuted; progress:
    see gather_params."""
    source = GGUFSource(src)
    cfg = config_from_gguf(source)
    params = gather_params(
        cfg,
        source,
        "gguf",
        dtype,
        permute=cfg.family == "llama",
        ignore={"rope_freqs.weight"},
        progress=progress,
    )
    return cfg, params, source


@contextmanager
def _staging_dir(out: Path) -> Iterator[Path]:
    """A fresh temporary folder next to ``out``, renamed to ``out`` on success and removed on failure."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        yield tmp
        try:
            os.rename(tmp, out)  # atomic; replaces ``out`` only if it is an empty folder
        except OSError as e:
            raise FileExistsError(f"{out} already exists (written concurrently?)") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def convert(
    src: str | Path,
    out: str | Path,
    dtype: str = "float32",
    extra_info: dict[str, Any] | None = None,
    *,
    progress: bool = False,
) -> Path:
    """Convert a Hugging Face folder or a ``.gguf`` file at ``src`` into a checkpoint folder ``out``.

    dtype: stored parameter dtype, "float32" or "bfloat16" (or "float16").
    ``out`` must not exist or be an empty folder. ``extra_info`` is merged into ``convert_info.json``.
    progress: a progress bar per tensor on a terminal (tqdm ``disable=None``: silent when not a TTY).
    Returns ``out``.
    Raises FileNotFoundError (missing source / shard), UnsupportedModelError (architecture or option),
    CorruptCheckpointError (unreadable file), ValueError (names or shapes that disagree with the config).
    """
    src, out = Path(src), Path(out)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if not src.exists():
        raise FileNotFoundError(f"source model {src} does not exist")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"output folder {out} already exists and is not empty")
    np_dtype = DTYPES[dtype]
    tokenizer: Tokenizer | None = None
    if src.is_file():
        if src.suffix != ".gguf":
            raise ValueError(f"{src}: expected a Hugging Face folder or a .gguf file")
        cfg, params, source = read_gguf(src, np_dtype, progress=progress)
        kind = "gguf"
        if "tokenizer.ggml.tokens" in source.metadata:
            tokenizer = Tokenizer.from_gguf_metadata(source.metadata, source=str(src))
        del source
    else:
        cfg, params = read_hf(src, np_dtype, progress=progress)
        kind = "hf"
    with _staging_dir(out) as tmp:
        save_checkpoint(params, cfg, tmp)
        if tokenizer is not None:
            tokenizer.save(tmp)
        if kind == "hf":
            for name in HF_TOKENIZER_FILES:
                if (src / name).is_file():
                    shutil.copyfile(src / name, tmp / name)
        info = {"format_version": FORMAT_VERSION, "source": str(src.absolute()), "kind": kind, "dtype": dtype}
        info |= extra_info or {}
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2))
    return out
