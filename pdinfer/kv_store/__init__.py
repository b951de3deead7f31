"""KV cache store: completion engines save full blocks, prefill engines load stored prefixes."""

from pdinfer.kv_store.backends import open_store
from pdinfer.kv_store.store import KVStore, TieredStore, layout_namespace, prefix_hashes

__all__ = ["KVStore", "TieredStore", "layout_namespace", "open_store", "prefix_hashes"]
