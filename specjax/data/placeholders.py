"""Placeholders a translation must keep verbatim, swapped for numbered symbols and back.

A software message's placeholders (`%s`, `%(name)s`, `%1$d`, `{0}`, `{name}`, `{{ var }}`, markup
such as `<a href="%(url)s">` and `</a>`, entities such as `&amp;`) are code, not language: the
German must carry them byte for byte. A small model that reads them as SentencePiece fragments
renames them (`%(workflow_name)s` -> `%(name)s`), and BLEU's tokenizer splits each into several
tokens, so a renamed one costs more than a wrong word. Localization systems therefore hide them:
`protect` replaces each distinct placeholder of the English with a symbol `<ph0>`, `<ph1>`, ... in
order of first appearance, in the English and wherever the German repeats it; the vocabulary keeps
the symbols as single pieces (SYMBOLS); `restore` puts the English's placeholders back into any text
the model writes. restore(protect(english, german)) gives back the German exactly.

Placeholders beyond MAX_SYMBOLS distinct ones in a message stay as written (no message offline has
more than 8). A German placeholder that the English lacks stays as written too, and so does one the
German wraps in a larger one (`{0}` inside `<a href="{0}">`: 2 pairs offline). Known gaps, harmless
to the round trip: `${name}` (Zope, 256 messages) protects as `$` + a symbol, and `%%` (a literal
percent sign) is not told apart, so `%%s` reads as `%` + `%s`.
"""

from __future__ import annotations

import re

MAX_SYMBOLS = 10
SYMBOLS = tuple(f"<ph{k}>" for k in range(MAX_SYMBOLS))

_LENGTH = r"(?:hh|h|ll|l|j|z|t|L|q)?"
_CONVERSION = r"[diouxXeEfFgGcrsa]"
# No space flag in printf conversions: "100% done" is a percent sign, not `% d`.
PATTERN = re.compile(
    rf"%\([^()\s]+\)[-#0+]*\d*(?:\.\d+)?{_CONVERSION}"          # %(name)s, %(count).1f
    rf"|%\d+\$[-#0+]*\d*(?:\.\d+)?{_LENGTH}{_CONVERSION}"      # %1$s
    rf"|%[-#0+]*(?:\d+|\*)?(?:\.(?:\d+|\*))?{_LENGTH}{_CONVERSION}"  # %s, %-10s, %lu, %.*s
    r"|\{\{.*?\}\}|\{%.*?%\}"                                 # template variables and tags
    r"|\{[A-Za-z0-9_.\[\]]*(?:![rsa])?(?::[^{}\s]*)?\}"        # {name}, {0}, {}, {count:d}
    r"|</?[A-Za-z][^<>]*>"                                    # markup: <a href="...">, </a>, <br/>
    r"|&(?:[A-Za-z]+|#\d+);")                                 # entities: &amp;, &#160;
_SYMBOL = re.compile(r"<ph(\d+)>")


def find(text: str) -> tuple[str, ...]:
  """The distinct placeholders of a text, in order of first appearance, at most MAX_SYMBOLS."""
  return tuple(dict.fromkeys(PATTERN.findall(text)))[:MAX_SYMBOLS]


def _swap(text: str, table: tuple[str, ...]) -> str:
  index = {placeholder: k for k, placeholder in enumerate(table)}
  return PATTERN.sub(lambda m: SYMBOLS[index[m[0]]] if m[0] in index else m[0], text)


def protect(english: str, german: str | None = None) -> tuple[str, str | None, tuple[str, ...]]:
  """-> (English with symbols, German with the same symbols or None, the table: symbol k stands for
  table[k]). The table comes from the English alone, so a source can be protected without its
  translation, as at decoding time."""
  if _SYMBOL.search(english) or (german is not None and _SYMBOL.search(german)):
    raise ValueError(f"the message {english!r} / {german!r} already contains a placeholder symbol "
                     "such as <ph0>, which protect() could not tell apart from its own")
  table = find(english)
  return _swap(english, table), None if german is None else _swap(german, table), table


def restore(text: str, table: tuple[str, ...]) -> str:
  """Each symbol <phk> of a model's text -> table[k]; a symbol the table has no entry for (the model
  wrote one its source did not have) is dropped."""
  return _SYMBOL.sub(lambda m: table[int(m[1])] if int(m[1]) < len(table) else "", text)
