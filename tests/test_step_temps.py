"""step_temps.peak_bytes, the traced estimate of a program's temporaries the default KV pool
leaves free, against XLA's own figures for the host."""

import types

import jax
import jax.numpy as jnp

from kernels_pallas.paged_attention.triton_ragged import prerotate_keys
from serving.cache.step_temps import peak_bytes


def test_live_intermediates_count_and_in_place_writes_do_not():
    """x @ w then tanh: one [1024, 4096] f32 buffer (tanh takes the product's); a scatter into
    an argument (a donated page array) holds nothing."""
    x = jax.ShapeDtypeStruct((1024, 256), jnp.float32)
    w = jax.ShapeDtypeStruct((256, 4096), jnp.float32)
    got = peak_bytes(jax.make_jaxpr(lambda x, w: jnp.tanh(x @ w).sum())(x, w))
    assert 1024 * 4096 * 4 <= got <= 1024 * 4096 * 4 + 64
    pages = jax.ShapeDtypeStruct((1000, 64), jnp.float32)
    row = jax.ShapeDtypeStruct((64,), jnp.float32)
    assert peak_bytes(jax.make_jaxpr(lambda c, v: c.at[3].set(v))(pages, row)) <= 64


def test_prerotation_estimate_matches_xla():
    """The overflow step's key pre-rotation: XLA holds the gathered copy and the rotated output
    (elementwise float32 math fused); the estimate says the same within 10%."""
    def f(k_pages, tables, starts, inv_freq):
        md = types.SimpleNamespace(block_tables=tables, block_pos_start=starts)
        return prerotate_keys(k_pages, md, inv_freq, 1.0)
    args = (jax.ShapeDtypeStruct((256, 16, 8, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((8, 64), jnp.int32), jax.ShapeDtypeStruct((8, 64), jnp.int32),
            jax.ShapeDtypeStruct((64,), jnp.float32))
    mem = jax.jit(f).lower(*args).compile().memory_analysis()
    xla = mem.temp_size_in_bytes + mem.output_size_in_bytes
    assert abs(peak_bytes(jax.make_jaxpr(f)(*args)) - xla) <= 0.1 * xla


def test_a_residual_stream_does_not_hold_every_layer():
    """h = h + x @ w over many layers, h also read by a norm: the estimate stays one layer's
    (a fused value read by several loops is recomputed only from buffers; before, each sum was
    taken as fused and held every layer's product to the end)."""
    def net(h, ws):
        for w in ws:
            n = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True))
            h = h + n @ w
        return h
    h = jax.ShapeDtypeStruct((512, 256), jnp.float32)
    peaks = [peak_bytes(jax.make_jaxpr(net)(h, [jax.ShapeDtypeStruct((256, 256), jnp.float32)]
                                            * n)) for n in (4, 16)]
    assert peaks[0] == peaks[1], peaks


def test_a_flat_view_of_live_pages_is_no_copy():
    """A kernel reading the pages through a reshape (triton_gather's flat view) while the pages
    live on (written in place, returned): XLA passes the same buffer, so the estimate holds only
    the gathered rows. Before, the view counted as a copy of the pool: on a GPU the default pool
    of a one-attention-layer hybrid came to 2 blocks (s31), half the pool given to the phantom."""
    def f(pages, row, idx):
        pages = pages.at[3].set(row)
        flat = pages.reshape(-1, pages.shape[-1])
        return pages, jnp.take(flat, idx, axis=0)
    args = (jax.ShapeDtypeStruct((4096, 16, 64), jnp.float32),
            jax.ShapeDtypeStruct((16, 64), jnp.float32), jax.ShapeDtypeStruct((32,), jnp.int32))
    got = peak_bytes(jax.make_jaxpr(f)(*args))
    assert got <= 32 * 64 * 4 + 64, got
    mem = jax.jit(f, donate_argnums=0).lower(*args).compile().memory_analysis()
    assert mem.temp_size_in_bytes < 4096 * 16 * 64 * 4 // 8  # XLA: no copy of the pages either


def test_writing_pages_whose_view_is_read_later_counts_a_copy():
    """The other order: a view of the old pages read after the pages are written in place needs
    the old values kept, so the write cannot take the buffer: the estimate counts the pages."""
    def f(pages, row, idx):
        flat = pages.reshape(-1, pages.shape[-1])
        new = pages.at[3].set(row)
        return new, jnp.take(flat, idx, axis=0)
    args = (jax.ShapeDtypeStruct((4096, 16, 64), jnp.float32),
            jax.ShapeDtypeStruct((16, 64), jnp.float32), jax.ShapeDtypeStruct((32,), jnp.int32))
    assert peak_bytes(jax.make_jaxpr(f)(*args)) >= 4096 * 16 * 64 * 4
