"""New weights written into the served weights' own buffers (`LLM.update_weights`).

Two small jitted programs, each taking the served arrays donated and the new (unfused) ones and
writing every result into the donated buffer of its served counterpart: one for the top-level
leaves (embedding, final norm, LM head), one run per layer that also fuses QKV and gate/up as at
load (`family.fuse_params`). The device allocator sees no weight freed and none allocated: beyond
the caller's arrays an update holds the programs' temporaries (at most one layer's
concatenations), and the served weights keep their addresses. The programs compile at the
warm-up (`weights_update.prepare`) or else on the first update (one per layer kind); the step
programs never re-trace (same avals, same buffers).

Why not free the old layer and allocate the new one (what this replaced): the device allocator
then places new arrays in the holes the old ones left. XLA's GPU allocator (BFC) takes the
smallest free chunk that fits and does not split one under twice the request with under 128 MiB
left over, counting the whole chunk as in use; arrays landing in the holes of others' sizes hold
more than they need. That is what the first update's peak on the H200 showed while the live
arrays stayed the same (benchmarks/RESULTS.md, "RL loop"); benchmarks/rl_measure.py records
in-use growth and live-array growth apart.

Under tensor parallelism (`ShardedWeightsWriter`) the same, per device: the programs are compiled
for the mesh, take each new leaf placed by the rules table (serving/step/sharding.py,
`source_shardings`; or as the caller laid it out on the mesh: resharded inside), repeat the KV
heads as the load does (`replicate_kv_heads`; weights stay unfused under TP), and write every
shard into the served shard's buffer (output shardings = the served ones). At the llama3_8b
shape over 2 devices they hold no temporaries (tests/test_weights_update_tp.py).
"""

from __future__ import annotations

import functools

import jax
from jax import lax

from serving.step import sharding


def _into(old, value):
    """`value` written over `old` (donated: the output takes its buffer)."""
    return lax.dynamic_update_slice(old, value.astype(old.dtype), (0,) * old.ndim)


def _avals(tree):
    return tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(tree))


def _write(fuse_family, served, new, *, layer: bool):
    if layer and fuse_family is not None:  # fused as at load (serving/step/model_runner.py)
        new = fuse_family.fuse_params({"embed": None, "lm_head": None, "layers": (new,)})
        new = new["layers"][0]
    return jax.tree.map(_into, served, new)


class _Programs:
    """Write programs compiled on first use and kept by key; `compiles` counts them."""

    def __init__(self):
        self._compiled: dict = {}
        self.compiles = 0

    def _kept(self, key, compile_now):
        fn = self._compiled.get(key)
        if fn is None:
            fn = self._compiled[key] = compile_now()
            self.compiles += 1
        return fn


class WeightsWriter(_Programs):
    """The write programs of one engine, compiled on first use and kept by the avals they take
    (every layer of one kind shares one)."""

    def __init__(self, family, fuse: bool):
        super().__init__()
        self._jit = jax.jit(functools.partial(_write, family if fuse else None),
                            donate_argnums=0, static_argnames="layer")

    def __call__(self, served, new, *, layer: bool):
        """`new` (a layer's params when `layer`, else the top-level leaves) written into
        `served`'s buffers, which it consumes; returns the arrays now serving."""
        return self.ensure(served, new, layer=layer)(served, new)

    def ensure(self, served, new, *, layer: bool):
        """The compiled write program for these avals (`new` may be ShapeDtypeStructs),
        compiled now if it is not yet."""
        key = (layer, jax.tree.structure(served), jax.tree.structure(new), _avals(served),
               _avals(new))
        return self._kept(key, lambda: self.compile(served, new, layer=layer))

    def compile(self, served, new, *, layer: bool):
        """The write program for these arrays or ShapeDtypeStructs (its `memory_analysis()`
        says what an update of that shape holds beyond the weights)."""
        return self._jit.lower(served, new, layer=layer).compile()


def _write_sharded(axes, copies: int, served, new):
    return jax.tree.map(_into, served, sharding.replicate_kv_heads(new, axes, copies))


def _shardings(tree):
    return tuple(x.sharding for x in jax.tree.leaves(tree))


class ShardedWeightsWriter(_Programs):
    """Tensor parallelism: the write programs of one engine's mesh, compiled on first use and
    kept by the avals, shardings and logical axes they take (every layer of one kind shares
    one). `copies`: how many times each KV head is repeated (sharding.kv_replication)."""

    def __init__(self, copies: int):
        super().__init__()
        self.copies = copies

    def __call__(self, served, new, axes):
        """`new` (placed at `sharding.source_shardings(new, axes, mesh, copies)`) written into
        `served`'s buffers, which it consumes; returns the arrays now serving."""
        return self.ensure(served, new, axes)(served, new)

    def ensure(self, served, new, axes):
        """The compiled write program for these arrays or ShapeDtypeStructs (with shardings)
        and `axes` (the logical axes of `new`), compiled now if it is not yet."""
        key = (repr(axes), jax.tree.structure(served), jax.tree.structure(new), _avals(served),
               _avals(new), _shardings(served), _shardings(new))
        return self._kept(key, lambda: self.compile(served, new, axes))

    def compile(self, served, new, axes):
        """The write program: outputs at the served shardings, each aliasing its served input
        (`memory_analysis()`: what an update of that shape holds per device beyond the
        weights)."""
        fn = jax.jit(functools.partial(_write_sharded, axes, self.copies), donate_argnums=0,
                     out_shardings=jax.tree.map(lambda x: x.sharding, served))
        return fn.lower(served, new).compile()
