"""Tokenizer from GGUF metadata / tokenizer.json: ids, decoding and chat templates (vs transformers)."""

from __future__ import annotations

import hf_tiny
import jinja2
import pytest

from models.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "  leading, and   runs of   spaces\t\ttabs\n\n\nnew lines \n ",
    "Numbers: 1234567890, 3.14159, -42, 1e10, 2024-06-01",
    "Unicode: café naïve Ünïcödé 日本語 中文 한국어 Ελληνικά 🤖🚀👍🏽",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "special tokens glued<|endoftext|>inside<|im_end|>text",
    "code:\n\tdef f(x):\n        return x ** 2  # square\n",
    "contractions: I'm, you're, can't, it's, we'll, they've, I'd",
    "",
    " ",
]
MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Count: 1 2 3 🤖"},
    ],
]


# ------------------------------------------------------------------------------------------- tiny GGUF
@pytest.fixture
def tiny(tmp_path) -> Tokenizer:
    hf = hf_tiny.tiny_hf_config("llama_tied")
    return Tokenizer.from_gguf(hf_tiny.write_gguf(tmp_path / "t.gguf", hf, hf_tiny.random_hf_state(hf)))


def test_tiny_gguf_tokenizer(tiny, tmp_path):
    tokens = hf_tiny.tiny_tokens()
    assert (tiny.bos_token_id, tiny.eos_token_ids, tiny.vocab_size) == (1, (2,), hf_tiny.VOCAB)
    ids = tiny.encode("<|im_start|>ab<|im_end|>")
    assert ids == [1, tokens.index("a"), tokens.index("b"), 2]
    assert tiny.decode(ids) == "ab"
    assert tiny.decode(ids, skip_special_tokens=False) == "<|im_start|>ab<|im_end|>"
    assert tiny.encode("ab", add_bos=True)[0] == 1
    assert tiny.encode("<|im_start|>a", add_bos=True).count(1) == 1  # BOS never doubled
    chat = tiny.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    tiny.save(tmp_path / "saved")
    again = Tokenizer.from_dir(tmp_path / "saved")
    assert again.encode("<|im_start|>ab") == tiny.encode("<|im_start|>ab")
    assert again.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=False
    ) == chat.removesuffix("<|im_start|>assistant\n")


def test_chat_template_sandbox_and_raise_exception(tiny):
    tiny.chat_template = "{{ raise_exception('bad role: ' + messages[0]['role']) }}"
    with pytest.raises(jinja2.TemplateError, match="bad role: tool"):
        tiny.apply_chat_template([{"role": "tool", "content": ""}])
    tiny.chat_template = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        tiny.apply_chat_template([])
    tiny.chat_template = "{{ messages | tojson }}{{ extra }}"
    assert tiny.apply_chat_template([{"a": "é"}], extra="!") == '[{"a": "é"}]!'
    tiny.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        tiny.apply_chat_template([])


# ------------------------------------------------------------------------------------------- SmolLM2
@pytest.fixture(scope="module")
def hf_tok(smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="module")
def ours(smollm2_gguf) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf)


@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_encode_decode_matches_transformers(hf_tok, ours, text):
    ids = ours.encode(text)
    assert ids == hf_tok.encode(text)
    assert ids == hf_tok(text, add_special_tokens=False)["input_ids"]
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ids, skip_special_tokens=False) == text


@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.parametrize("messages", MESSAGES)
def test_smollm2_chat_template_matches_transformers(hf_tok, ours, messages):
    for gen in (True, False):
        expected = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(messages, add_generation_prompt=gen) == expected
    rendered = ours.apply_chat_template(messages)
    assert ours.encode(rendered) == hf_tok.encode(rendered)


@pytest.mark.slow
@pytest.mark.parity
def test_smollm2_special_tokens_match_transformers(hf_tok, ours):
    assert ours.bos_token_id == hf_tok.bos_token_id == 1
    assert ours.eos_token_ids == (hf_tok.eos_token_id,) == (2,)
    assert ours.vocab_size == len(hf_tok) == 49152


@pytest.mark.slow
def test_smollm2_converted_folder_tokenizer(smollm2_dir, ours):
    saved = Tokenizer.from_dir(smollm2_dir)
    assert (saved.bos_token_id, saved.eos_token_ids, saved.add_bos_token) == (1, (2,), False)
    for text in TEXTS:
        assert saved.encode(text) == ours.encode(text)
    assert saved.apply_chat_template(MESSAGES[1]) == ours.apply_chat_template(MESSAGES[1])
