"""serving.tiers: the cache tiers under the device KV pool; imports serving.cache (and the records).

  engine_tiers.py       the tiers set up at start; a step's page moves
  offload.py            host tier (`cpu_offload_gb`): evicted blocks kept in host memory
  kv_store_tier.py      the disk span store as the engine sees it: prefetch, admit, write
  disk_store.py         the store folder: run files, LRU, `cache_salt` namespaces, atomic writes
  run_file.py           the file format: one safetensors file per run of blocks
  store_identity.py     STORE.json: what made a store's blocks
  fingerprint.py        a model's fingerprint: config, dtype, every weight byte
  weight_digests.py     xxh3-128 digests of checkpoint files, cached by file identity
  kv_store_moves.py     chunked gathers of blocks to write; copy-ins of staged runs
  kv_store_staging.py   staged blocks, counted in device bytes (`kv_store_staging_gb`)
  kv_store_buffers.py   host buffers reads land in, and their transfer to the device
  kv_store_failures.py  failed writes: counted, one warning per flush, no lost result
"""
