"""The deterministic held-out split every prompt set and task shares.

An item is held out when a stable hash of its source text (the HumanEval prompt, the article, the
English message), the first 8 bytes of its SHA-256 modulo 100, is below HELDOUT_PERCENT (20). The rule
depends on the text alone, not on a file's order or a package's version, so a message held out in one
set (the `ende` prompts) is held out in every task that contains it (the gettext translation task).
"""

from __future__ import annotations

import hashlib

HELDOUT_PERCENT = 20


def hash_percent(source_text: str) -> int:
  """A stable bucket 0..99 of a text: the first 8 bytes of its SHA-256 modulo 100."""
  digest = hashlib.sha256(source_text.encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "big") % 100


def is_heldout(source_text: str) -> bool:
  """Whether an item belongs to the held-out split (about HELDOUT_PERCENT percent of items)."""
  return hash_percent(source_text) < HELDOUT_PERCENT
