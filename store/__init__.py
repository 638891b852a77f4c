"""The shared KV store: patch-first entries in a pinned-DRAM tier and an LMDB tier; no policy."""
