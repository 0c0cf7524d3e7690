"""Tokenizer: a ``tokenizers.Tokenizer`` plus special tokens and the model's chat template.

Built either from a folder (``tokenizer.json`` + ``tokenizer_config.json`` + optional ``chat_template.jinja``,
as a Hugging Face model or a converted checkpoint has them) or from a GGUF file's metadata
(``tokenizer.ggml.*``; byte-level BPE, llama.cpp's ``gpt2`` tokenizer model). Chat templates are rendered
with a sandboxed jinja2 environment that has the globals Hugging Face templates expect.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
from tokenizers.models import BPE

# llama.cpp's pre-tokenizer names (``tokenizer.ggml.pre``) -> how text is split before BPE.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_REGEX_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# These split every digit off first, then apply the GPT-2 regex (llama.cpp: ``\p{N}`` then the GPT-2 rule).
_DIGIT_SPLIT_PRES = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


@functools.cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable unicode character table (the byte-level BPE alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def gguf_metadata(reader: Any) -> dict[str, Any]:
    """All key/value metadata of a ``gguf.GGUFReader`` as plain Python values (str, int, float, list)."""
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def _token_content(value: Any) -> str | None:
    """A special token from a tokenizer_config value: a string, or an AddedToken dict with "content"."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in a sandbox with the globals Hugging Face templates use."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class Tokenizer:
    """Text <-> token ids, special tokens and chat template of one model.

    backend: the ``tokenizers.Tokenizer`` (its own post-processor is bypassed: BOS is added by ``encode``).
    add_bos_token: whether ``encode`` prepends BOS by default.
    extra_eos_token_ids: more ids that end generation besides ``eos_token`` (e.g. from generation_config).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        add_bos_token: bool = False,
        extra_eos_token_ids: Sequence[int] = (),
    ):
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.unk_token = unk_token
        self.pad_token = pad_token
        self.add_bos_token = add_bos_token
        self.extra_eos_token_ids = tuple(int(i) for i in extra_eos_token_ids)

    # ------------------------------------------------------------------ ids
    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self.pad_token)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: the EOS token's, then the extra ones (deduplicated, in order)."""
        ids = [self._id(self.eos_token), *self.extra_eos_token_ids]
        return tuple(dict.fromkeys(i for i in ids if i is not None))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    # ------------------------------------------------------------------ text
    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``; special-token strings in the text become their ids.

        add_bos: prepend BOS (default: the tokenizer's ``add_bos_token``); never doubled when the text already
        starts with it.
        """
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_bos is None:
            add_bos = self.add_bos_token
        bos = self.bos_token_id
        if add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (special tokens dropped unless ``skip_special_tokens=False``)."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}, ...]) with the model's chat template.

        Extra keyword arguments (``tools``, ``enable_thinking``, ...) are passed to the template.
        """
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        context = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "unk_token": self.unk_token,
            "pad_token": self.pad_token,
            **kwargs,
        }
        return _compile_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **context
        )

    # ------------------------------------------------------------------ files
    def save(self, path: str | Path) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (loadable by ``from_dir`` and by HF)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(path / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "unk_token": self.unk_token,
            "pad_token": self.pad_token,
            "add_bos_token": self.add_bos_token,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "extra_eos_token_ids": list(self.extra_eos_token_ids),
        }
        if self.chat_template:
            config["chat_template"] = self.chat_template
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load from a folder with ``tokenizer.json`` and ``tokenizer_config.json`` (HF model folder or
        converted checkpoint); a missing one is a FileNotFoundError naming it (without the config, the chat
        template and the special tokens would be lost silently).

        EOS ids are the tokenizer's EOS plus those in ``generation_config.json`` and ``model_config.json``
        when the folder has them.
        """
        path = Path(path)
        for name, what in (
            ("tokenizer.json", "the vocabulary"),
            ("tokenizer_config.json", "the special tokens and the chat template"),
        ):
            if not (path / name).is_file():
                raise FileNotFoundError(
                    f"{path / name} not found: a tokenizer folder needs tokenizer.json and "
                    f"tokenizer_config.json ({name} holds {what})"
                )
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        try:
            config: dict[str, Any] = json.loads((path / "tokenizer_config.json").read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path / 'tokenizer_config.json'}: not a JSON file: {e}") from e
        if not isinstance(config, dict):
            raise ValueError(f"{path / 'tokenizer_config.json'}: expected a JSON object")
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        extra_eos: list[int] = list(config.get("extra_eos_token_ids") or [])
        for name, key in (("generation_config.json", "eos_token_id"), ("model_config.json", "eos_token_ids")):
            if (path / name).is_file():
                value = json.loads((path / name).read_text()).get(key)
                extra_eos += value if isinstance(value, list) else ([] if value is None else [value])
        bos = _token_content(config.get("bos_token"))
        add_bos = config.get("add_bos_token")
        if add_bos is None:  # the tokenizer.json post-processor tells whether BOS is added
            bos_id = backend.token_to_id(bos) if bos else None
            add_bos = bos_id is not None and bos_id in backend.encode("", add_special_tokens=True).ids
        return cls(
            backend,
            chat_template=template,
            bos_token=bos,
            eos_token=_token_content(config.get("eos_token")),
            unk_token=_token_content(config.get("unk_token")),
            pad_token=_token_content(config.get("pad_token")),
            add_bos_token=bool(add_bos),
            extra_eos_token_ids=extra_eos,
        )

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Build from a GGUF file's ``tokenizer.*`` metadata."""
        import gguf

        path = Path(path)
        try:
            reader = gguf.GGUFReader(path)
        except Exception as e:
            raise ValueError(f"{path}: cannot read GGUF file (corrupt or truncated?): {e}") from e
        return cls.from_gguf_metadata(gguf_metadata(reader), source=str(path))

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], source: str = "GGUF") -> Tokenizer:
        """Build from GGUF metadata (``gguf_metadata(reader)``); byte-level BPE (tokenizer.ggml.model "gpt2").

        Tokens of type 3 (control) become special added tokens, type 4 (user-defined) plain added tokens.
        """
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(
                f"{source}: tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2')"
            )
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        token_types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges") or []]
        bad = [m for m in merges if len(m) != 2]
        if bad:
            raise ValueError(f"{source}: malformed BPE merges, e.g. {' '.join(bad[0])!r}")
        alphabet = _byte_alphabet()
        letters = set(alphabet.values())

        def spelled(token: str) -> str:  # a token not written in the byte alphabet is respelled into it
            return token if set(token) <= letters else "".join(alphabet[b] for b in token.encode("utf-8"))

        vocab: dict[str, int] = {}
        for i, token in enumerate(tokens):
            vocab.setdefault(spelled(token), i)
        backend = tokenizers.Tokenizer(
            BPE(
                vocab=vocab,
                merges=merges,
                dropout=None,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
            )
        )
        pre = meta.get("tokenizer.ggml.pre")
        if pre in _REGEX_SPLITS:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(_REGEX_SPLITS[pre]), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        elif pre in _DIGIT_SPLIT_PRES:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                ]
            )
        else:  # "gpt-2", "default", absent: the GPT-2 regex
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        backend.decoder = decoders.ByteLevel()
        # Control tokens become special added tokens; one not spelled in the byte alphabet is a mislabel
        # (adding it would grow the vocabulary past the model's), so it is skipped, as transformers does.
        control = [
            AddedToken(t, normalized=False, special=True)
            for t, kind in zip(tokens, token_types, strict=False)
            if kind == _TOKEN_TYPE_CONTROL and set(t) <= letters
        ]
        user = [
            AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, token_types, strict=False)
            if kind == _TOKEN_TYPE_USER_DEFINED and t in vocab
        ]
        if control:
            backend.add_special_tokens(control)
        if user:
            backend.add_tokens(user)

        def token(key: str) -> str | None:
            idx = meta.get(f"tokenizer.ggml.{key}")
            return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

        extra_eos = [
            meta[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in meta
        ]
        return cls(
            backend,
            chat_template=meta.get("tokenizer.chat_template"),
            bos_token=token("bos_token_id"),
            eos_token=token("eos_token_id"),
            unk_token=token("unknown_token_id"),
            pad_token=token("padding_token_id"),
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            extra_eos_token_ids=extra_eos,
        )


def token_index(tokenizer: Any, text: str, char_offset: int) -> int:
    """Index in ``tokenizer.encode(text)`` of the first token of ``text[char_offset:]``: the length of the
    longest common prefix of the encodings of ``text`` and ``text[:char_offset]`` (a token merged across the
    boundary counts as after it). Splits a prompt into context and question tokens."""
    full, head = tokenizer.encode(text), tokenizer.encode(text[:char_offset])
    n = 0
    while n < min(len(full), len(head)) and full[n] == head[n]:
        n += 1
    return n
