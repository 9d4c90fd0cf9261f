"""pdd.cache: MainDecode's Decode-side RadixCache (DRC) and the router's view of it.

    hashing    block hash chains (names of KV blocks; shared by P, MD and the router)
    radix      the radix index: prefix-closed block tree, pins, LRU leaf-first eviction
    host_tier  the host-memory arena of KV block slots, owners, landing and commit
    drc        DecodeRadixCache: request leases, event log, snapshots, stats (MD side)
    messages   typed events / snapshots / stats a DRC exports
    view       PrefixIndexView: the router's replica, answering cached_tokens(prompt)

No torch and no vLLM here: pdd.engine's KV connector moves bytes between vLLM's tensors and
the host tier. Import the submodules directly (the router needs only hashing, messages, view).
"""
