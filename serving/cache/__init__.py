"""serving.cache: the paged KV cache on the host side; imports only the records above it.

  manager.py        `CacheManager`: the one object in front of the scheduler (owns all below)
  admission.py      the one admission routine: a plan every cache kind adds to, then the table
  chunks.py         a prefill chunk's token indices over a sequence's blocks
  block_manager.py  ref counts, LRU free list, hash -> block; pending vs ready blocks
  free_list.py      the LRU free list as numpy arrays (whole-array share and release)
  hashing.py        chained block hashes (prefix and SSEP chains, `cache_salt`)
  prefix_keys.py    each sequence's block keys (generated blocks included) and their tokens
  run_memo.py       cached span runs found whole at admission (block stamps prove them unchanged)
  kv_pool.py        how many KV blocks fit the device, and what one costs in bytes
  step_temps.py     the step's peak temporaries, estimated from its jaxpr (the pool leaves them)
  xla_limit.py      XLA's memory limit for a step program, and the most blocks that keep under it
  page_zeroing.py   pages handed out for new content zeroed on device (request isolation)
  span_jobs.py      isps span jobs: span-only prefills of a waiting request's spans
"""
