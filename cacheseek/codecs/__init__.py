"""KV codecs: how a generic tier encodes each K and V value before its backend stores it
(``store.codec=none|lossless|int8|int4``; `cacheseek.codecs.base`)."""
