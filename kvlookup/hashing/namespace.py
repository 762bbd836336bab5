"""A request's namespace: what besides its tokens decides which cached chunks it may reuse."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Namespace:
    """lora_name: the LoRA adapter of the request; cache_salt: vLLM's per-request salt. Both are
    part of the root of vLLM's block hash chain (kvlookup.hashing.vllm.request_root), so a
    prompt under one namespace never matches blocks stored under another; LMCache's classic
    chunk hashes ignore them. Empty strings mean unset."""

    lora_name: str | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "lora_name", self.lora_name or None)
        object.__setattr__(self, "cache_salt", self.cache_salt or None)

    def is_default(self) -> bool:
        """No adapter and no salt."""
        return self.lora_name is None and self.cache_salt is None

    def label(self) -> dict[str, str]:
        """The fields that are set, by name (for answers and logs)."""
        return {k: v for k, v in (("lora_name", self.lora_name), ("cache_salt", self.cache_salt)) if v}


#: the namespace of a request that names none
DEFAULT = Namespace()
