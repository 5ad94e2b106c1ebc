"""Paged attention: RoPE applied to keys at read time (position_free) or keys stored rotated.

  api.py                    `paged_attention(implementation="auto" | name)`; the registry, its
                            default order and `step_options` (per-step plans decided on the host)
  problem.py                the static facts a kernel choice depends on
  validation.py             input checks; metadata.py: the `AttentionMetadata` pytree
  reference.py              numpy reference
  xla.py                    gather + dense fallback (CPU, anything the kernels do not take)
  triton_ragged.py          ragged prefill + decode, RoPE at read, split-K over long contexts
  triton_tiles.py           its query tiles and the key steps each can see
  triton_merge.py           its split-K partials merged (reads only the splits that saw keys)
  triton_decode.py          decode only, split-K, table RoPE with bf16x2 key rotation
  mosaic_decode.py          the GPU decode default for head_dim 128 (Mosaic GPU: TMA page ring,
                            warp-level MMAs, keys rotated in registers)
  mosaic_prefill.py         Mosaic GPU prefill (TMA + wgmma, warp-specialised); its pre-pass of the
                            keys in mosaic_prefill_prep.py; values read from the pages (`direct_v`)
  mosaic_prefill_split.py   the same with the key axis split (few query rows, long context)
  mosaic_prefill_paged.py, mosaic_prefill_paged_stream.py   the prefill with no pre-pass: K / V
                            read from the pages, keys rotated in SMEM (`MixedOptions.paged_k`)
  mosaic_mixed.py           `"mixed"`: prefill rows on the Mosaic prefill, decode rows on the decode
                            kernel, overflow decided per step on the host
  triton_gather.py          the prefill pre-pass's gather of live key steps only
  triton_common.py, mosaic_common.py, decode_common.py   what kernels of one backend share
  write.py, triton_write.py the K/V row write (its own registry)
  random_inputs.py          random ragged batches over a paged cache, for tests and benchmarks
  interpret_threads.py      when an interpreted Mosaic GPU kernel can hang on a small CPU machine
"""
