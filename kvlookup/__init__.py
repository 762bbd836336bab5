"""kvlookup: a cluster-wide index of where LLM KV-cache chunks live, on Redis."""

from kvlookup.client import Client, InstanceMatch
from kvlookup.hashing.lmcache import HashProfile

__version__ = "0.1.0"
__all__ = ["Client", "HashProfile", "InstanceMatch", "__version__"]
