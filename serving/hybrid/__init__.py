"""serving.hybrid: hybrid models' recurrent caches; imports cache, tiers (and the records).

Prefix caching with recurrent checkpoints:
  recurrent_part.py    the cache manager's part for recurrent layers (what admission and chunks add)
  resume.py            what a hybrid admission planned, from plan to commit or cancel
  hybrid_prefix.py     admission with a checkpoint restore; checkpoints taken per chunk
  checkpoint_store.py  host bookkeeping: keys, GreedyDual eviction, pins, the host tier
  checkpoint_pool.py   the device pool of recurrent states
  slot_moves.py        the stores' slot moves applied to the device pools before a step
  checkpoint_plan.py   where a prefill takes checkpoints (the planner's DP)
  overlap_estimate.py  how deep later requests will share a prompt (the DP's pmf)
  bucket_fit.py        chunks cut to fit a smaller token bucket (opt-in)
SSEP spans on hybrid models (docs/DESIGN.md section 5):
  span_rows.py         cold path: a step's span rows and pieces; where chunks may end
  span_cache.py        warm path: cached span maps, skipped spans, pins
  span_capture.py      which computed spans capture their map (the capture policy)
  span_partial.py      spans longer than a step: captured in pieces, the map so far in one slot
  span_maps.py         the maps' device pool and their composition into an entry state
  span_compose.py      the composition as a program of its own, run right before the step
  chain_compose.py     the composition loops: rows longest chain first, one loop per row width
  span_step.py         the runner's side: static span shapes, host fields, warm-step code
"""
