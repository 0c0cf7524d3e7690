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
``OUT/convert_info.json`` (with every other file's size, modification time and SHA-256, so that damage
to the folder is found: ``models.checkpoint.damage``). The folder is written under a temporary name and
renamed into place, so an interrupted conversion never leaves a half-written ``OUT``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
from collections.abc import Collection, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so safetensors can read BF16 tensors)
import numpy as np
from tqdm import tqdm

from models.checkpoint import INFO_FILE, file_manifest, save_checkpoint
from models.config import ModelConfig
from models.model import param_shapes
from models.sources import (
    GGUFSource,
    SafetensorsSource,
    TensorSource,
    config_from_gguf,
)
from models.tokenizer import Tokenizer

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
    Raises FileNotFoundError (missing source / shard, or a tokenizer.json without its
    tokenizer_config.json), UnsupportedModelError (architecture or option),
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
        if (src / "tokenizer.json").is_file() and not (src / "tokenizer_config.json").is_file():
            raise FileNotFoundError(
                f"{src / 'tokenizer_config.json'} not found: the folder has tokenizer.json but not the "
                "tokenizer_config.json that holds its special tokens and chat template"
            )
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
        info |= (extra_info or {}) | {"files": file_manifest(tmp)}
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2))
    return out
