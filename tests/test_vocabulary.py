"""T5's SentencePiece vocabulary (specjax/vocabulary.py).

A small unigram model is trained here on generated sentences. Oracles: the raw `sentencepiece`
processor on the same file (ids + EOS), exact ASCII round trips, seqio's sentinel numbering
(`<extra_id_k>` = vocab_size - 1 - k), and transformers' own conversion of the model to a
tokenizer.json, which must give the same ids.
"""

import json
import random
import shutil

import pytest
import sentencepiece as spm

from specjax import vocabulary
from specjax.vocabulary import SentencePieceVocabulary

PIECES, EXTRA = 150, 10


def _sentences(seed, n):
  rng = random.Random(seed)
  syllables = ["ka", "to", "ri", "mu", "sen", "dal", "or", "ex", "quo", "zip", "lan", "ber", "ith",
               "gro", "vy", "pe", "nu", "chi", "wa", "sol"]
  words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(300)]
  out = []
  for _ in range(n):
    sentence = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12))).capitalize()
    out.append(sentence + rng.choice([".", "!", "?", f", {rng.randint(0, 999)}.", " (ok)."]))
  return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """(directory holding spiece.model, vocabulary with EXTRA extra ids, held-out sentences)."""
  directory = tmp_path_factory.mktemp("spm")
  vocab = vocabulary.train(_sentences(0, 400), directory / "spiece.model", PIECES,
                                    extra_ids=EXTRA)
  return directory, vocab, _sentences(1, 40)


def test_t5_special_ids_eos_appended_no_bos(trained):
  directory, vocab, texts = trained
  assert (vocab.pad_id, vocab.eos_id, vocab.unk_id) == (0, 1, 2)
  assert [vocab.id_to_piece(i) for i in range(3)] == ["<pad>", "</s>", "<unk>"]
  raw = spm.SentencePieceProcessor(model_file=str(directory / "spiece.model"))
  assert raw.bos_id() == -1 and raw.get_piece_size() == PIECES
  for text in texts:
    ids = vocab.encode(text)
    assert ids == raw.encode(text) + [1]  # the library's ids, then EOS, and nothing in front
    assert 1 not in ids[:-1] and 0 not in ids
    assert vocab.encode(text, add_eos=False) == ids[:-1]


def test_decode_round_trips_and_stops_at_eos(trained):
  _, vocab, texts = trained
  for text in texts:
    assert vocab.decode(vocab.encode(text)) == text
  a, b = texts[:2]
  assert vocab.decode(vocab.encode(a) + vocab.encode(b)) == a  # stops at the first EOS
  assert vocab.decode(vocab.encode(a, add_eos=False) + [0, 0, 0]) == a  # pad skipped
  assert vocab.decode(vocab.encode(a) + [0, 0, 0]) == a
  # Ids past the vocabulary (T5's unused logits) decode as unk, as in seqio.
  unk = vocab.decode([vocab.unk_id])
  assert vocab.decode([vocab.vocab_size + 3]) == unk == vocab.decode([-1])


def test_extra_ids_at_the_top(trained):
  _, vocab, _ = trained
  assert vocab.extra_ids == EXTRA and vocab.vocab_size == PIECES + EXTRA
  for k in range(EXTRA):
    assert vocab.extra_id(k) == vocab.vocab_size - 1 - k
    assert vocab.id_to_piece(vocab.extra_id(k)) == f"▁<extra_id_{k}>"
  assert vocab.extra_id(EXTRA - 1) == PIECES  # the first id past the trained pieces
  ids = vocab.encode("Kato <extra_id_0> sen <extra_id_3>.", add_eos=False)
  assert vocab.extra_id(0) in ids and vocab.extra_id(3) in ids
  assert "<extra_id_3>" in vocab.decode(ids)
  with pytest.raises(ValueError, match="extra_id_10"):
    vocab.extra_id(EXTRA)


def test_tokenizer_json_gives_the_same_ids(trained, tmp_path, monkeypatch):
  """transformers converts the spm model to a tokenizer.json (offline); loading only that file
  must give the same vocabulary and ids."""
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  transformers = pytest.importorskip("transformers")
  directory, vocab, texts = trained
  source = tmp_path / "slow"
  source.mkdir()
  shutil.copy(directory / "spiece.model", source / "spiece.model")
  transformers.T5TokenizerFast.from_pretrained(str(source), extra_ids=EXTRA).save_pretrained(
      str(tmp_path / "hf"))
  only_json = tmp_path / "only_json"
  only_json.mkdir()
  shutil.copy(tmp_path / "hf" / "tokenizer.json", only_json / "tokenizer.json")
  fast = SentencePieceVocabulary.from_directory(only_json)
  assert fast.source.endswith("tokenizer.json")
  assert (fast.vocab_size, fast.extra_ids) == (vocab.vocab_size, vocab.extra_ids)
  assert (fast.pad_id, fast.eos_id, fast.unk_id) == (0, 1, 2)
  for k in range(EXTRA):
    assert fast.extra_id(k) == vocab.extra_id(k)
    assert fast.id_to_piece(fast.extra_id(k)) == f"<extra_id_{k}>"
  for text in texts:
    assert fast.encode(text) == vocab.encode(text)
    assert fast.decode(fast.encode(text)) == text
  with_sentinels = "Kato <extra_id_0> sen <extra_id_3> ka."  # sentinels as words
  assert fast.encode(with_sentinels) == vocab.encode(with_sentinels)
  # A model file beside tokenizer.json wins; its extra ids come from transformers' config.
  shutil.copy(directory / "spiece.model", tmp_path / "hf" / "spiece.model")
  both = SentencePieceVocabulary.from_directory(tmp_path / "hf")
  assert both.source.endswith("spiece.model") and both.extra_ids == EXTRA
  assert all(both.encode(text) == fast.encode(text) for text in texts)
  with pytest.raises(ValueError, match="has 10 extra ids"):
    SentencePieceVocabulary.from_directory(only_json, extra_ids=3)


def test_from_directory_extra_ids_from_tokenizer_config(trained, tmp_path):
  directory, _, _ = trained
  shutil.copy(directory / "spiece.model", tmp_path / "sentencepiece.model")
  assert SentencePieceVocabulary.from_directory(tmp_path).vocab_size == PIECES
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"extra_ids": 4}))
  vocab = SentencePieceVocabulary.from_directory(tmp_path)
  assert (vocab.extra_ids, vocab.vocab_size) == (4, PIECES + 4)
  assert SentencePieceVocabulary.from_directory(tmp_path, extra_ids=0).vocab_size == PIECES


def test_check_fits(trained):
  _, vocab, _ = trained
  vocab.check_fits(PIECES + EXTRA)
  vocab.check_fits(32128)
  with pytest.raises(ValueError, match=r"has 160 ids \(150 pieces \+ 10 extra ids\) but the model "
                     r"has only 128 logits"):
    vocab.check_fits(128)


def test_missing_files_name_the_path(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"no SentencePiece model at .*nope\.model"):
    SentencePieceVocabulary.from_file(tmp_path / "nope.model")
  with pytest.raises(FileNotFoundError, match=r"no SentencePiece vocabulary in .*: looked for "
                     r"spiece\.model, sentencepiece\.model and tokenizer\.json"):
    SentencePieceVocabulary.from_directory(tmp_path)
  with pytest.raises(FileNotFoundError, match="no vocabulary directory"):
    SentencePieceVocabulary.from_directory(tmp_path / "absent")
  (tmp_path / "spiece.model").write_bytes(b"not a model")
  with pytest.raises(ValueError, match="is not a SentencePiece model"):
    SentencePieceVocabulary.from_file(tmp_path / "spiece.model")


def test_train_reports_an_impossible_size(tmp_path):
  with pytest.raises(ValueError, match=r"training for .*tiny\.model failed.*Vocabulary size"):
    vocabulary.train(["ab ab ab", "ba ba"], tmp_path / "tiny.model", 500)
