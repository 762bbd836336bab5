"""Wire formats: LMCache worker and control messages, vLLM KV events, ZMQ endpoint strings.

Decoders here touch no socket and no Redis: bytes in, typed values (or a ``WireError``) out.
"""
