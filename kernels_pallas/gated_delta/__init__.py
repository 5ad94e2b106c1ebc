"""The chunked gated delta rule (Gated DeltaNet), WY/UT form, with exact checkpoints at chunk
boundaries. Callers use api.py only (`prefill`, `decode_step`, `ragged_gated_delta`, `choose`).

  api.py            the entry points and the registry's choice
  problem.py        the static facts a choice depends on; reference.py: numpy reference
  chunked.py        XLA implementation (the fallback; exact segment sums)
  fused_triton.py   three Pallas kernels: intra_blocked.py (solve), scan_fused.py (state scan),
                    the output kernel; dots.py: their matmul helpers (IEEE float32 for float32)
  intra_mosaic.py   the intra-chunk solve as a Mosaic GPU kernel (wgmma; opt-in "mosaic_intra")
  output_mosaic.py  the output kernel on Mosaic GPU (with intra_mosaic.py: opt-in "mosaic")
  mosaic_calls.py   how those two are called: one kernel per shape, over the chunks in use
  ragged.py, ragged_triton.py   ragged batches (many sequences in one token stream; the scan
                    runs one program per sequence: seq_scan.py; the XLA path: ragged_xla.py)
  joint.py          several ragged passes over one batch's rows as one stream (one kernel call;
                    a sequence cut into units may borrow another's chunks: `chunk_src`)
  transition_scan.py  maps' products over chunks the stream already holds (a span capture's A)
  state_rows.py     their initial states read where they live (cache slots, zeros, I, a pool)
  stream_rows.py    their packed stream read through its source rows inside the kernels
  stream_pack.py    ... or gathered by one kernel that writes the chunks a step uses only
  checkpoint_rows.py  a ragged step's checkpoints as flat (sequence, position) rows
  decode_triton.py  a decode step in place in the state cache (with the layer's glue and conv)
  decode_rows.py    its calls on a ragged step: each sequence's row in, outputs mapped to rows
                    (a prefill step's one-row sequences too: one_rows_in_place)
  affine.py         a span's exact affine map (A, B) from the chunk WY factors; composition
  chain_triton.py   chains of cached span maps applied to states, one pass per chain
  tree_scan.py      associative scan over chunk maps (opt-in `scan="tree"`)
  scan_blocked.py   two-level scan: segment maps composed, segments re-scanned (opt-in)
"""
