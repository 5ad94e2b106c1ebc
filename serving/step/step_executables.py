"""The engine step's compiled variants, prepared up front and called directly.

A step has a few dozen static variants (token bucket, sampling mode, attention plan, span chain).
`StepExecutables.prepare` readies a list of them at once: each is loaded from the executable
store (serving/step/executable_store.py: no tracing at all) or traced and lowered (sequential, Python)
and compiled in threads as soon as it is lowered (XLA compiles off the GIL while the next
variants are lowered; JAX's persistent cache serves repeats
when no store is in use, see executable_store.fresh_compiles) and stored. Calls then go
straight to the variant's `jax.stages.Compiled` (C++ dispatch, the jitted function is not traced
again). A call with a variant never prepared prepares it then, so the warm-up list is a speed
matter, never a correctness one.

`timings` (seconds per phase) and `counts` (variants loaded / compiled) say where start-up went.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from concurrent.futures import ThreadPoolExecutor

import jax

from serving.step.executable_store import ExecutableStore, describe_args, fresh_compiles, store_folder

PHASES = ("load_s", "trace_s", "lower_s", "compile_s", "save_s")


class StepExecutables:
    """`jax.jit(fun)` plus a table of compiled variants keyed by the static arguments.

    Static arguments are `fun`'s keyword-only parameters (defaults filled in, so an omitted one
    and its default name the same variant). `context()` (optional) describes everything else
    the traced program depends on; without it, or with the store off (`store_setting`, see
    executable_store.store_folder), nothing is stored. `compiler_options` (XLA options, e.g.
    serving/step/compile_options.py's command buffers) go to every compile and key the store, so
    an executable stored without them is never loaded with them (nor the reverse)."""

    def __init__(self, fun, *, signature_of, donate_argnums, context=None, source_dirs=(),
                 store_setting=None, compiler_options=None):
        params = inspect.signature(signature_of).parameters.values()
        self._static = tuple((p.name, p.default) for p in params
                             if p.kind is inspect.Parameter.KEYWORD_ONLY)
        # omitted trailing positional arguments are passed as their defaults: one variant
        self._defaults = tuple(p.default for p in inspect.signature(fun).parameters.values()
                               if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)
        self.compiler_options = dict(compiler_options or {})
        self.donate_argnums = tuple(donate_argnums)  # kv_pool.size_pool: what XLA aliases
        # the options on the jit too: the plain-jit fallback of __call__ compiles with them
        self.jitted = jax.jit(fun, donate_argnums=donate_argnums,
                              static_argnames=tuple(n for n, _ in self._static),
                              compiler_options=self.compiler_options or None)
        self.context = context
        self.source_dirs = tuple(source_dirs)
        self.store_setting = store_setting  # Config.step_cache (executable_store.store_folder)
        self._table: dict = {}
        self._spelled: dict = {}  # the same executables under the callers' own keyword order
        self.counts = {"loaded": 0, "compiled": 0}
        self.timings = dict.fromkeys(PHASES, 0.0)
        # on_compile(done, total): told before a prepare's compiles start (done 0) and as each
        # ends, so a front end can say why the first steps take seconds (progress bars)
        self.on_compile = None

    def add_compiler_options(self, options: dict) -> None:
        """More XLA options for every compile from now on (kv_pool.size_pool's memory limit,
        known once the pool is sized); a ValueError once a variant is ready (it would keep
        the old ones)."""
        if not options:
            return
        if self._cache_size():
            raise ValueError("compiler options added after step variants were compiled")
        self.compiler_options.update(options)
        self.jitted = jax.jit(self.jitted.__wrapped__, donate_argnums=self.donate_argnums,
                              static_argnames=tuple(n for n, _ in self._static),
                              compiler_options=self.compiler_options)

    def _key(self, args, kw):
        static = tuple(kw.get(n, d) for n, d in self._static)
        return static, tuple([a is None for a in args])

    def __call__(self, *args, **kw):
        if len(args) < len(self._defaults):
            args += self._defaults[len(args):]
        fast = (tuple(kw.items()), tuple([a is None for a in args]))  # as the caller spells it
        exe = self._spelled.get(fast)
        if exe is None:
            key = self._key(args, kw)
            if key not in self._table:
                self.prepare([(args, kw)])
            exe = self._spelled[fast] = self._table[key]
        try:
            return exe(*args)
        except TypeError:  # arguments of another shape than the variant's (rare): plain jit
            return self.jitted(*args, **kw)

    def lower(self, *args, **kw):
        return self.jitted.lower(*args, **kw)

    def trace(self, *args, **kw):
        return self.jitted.trace(*args, **kw)

    def _cache_size(self) -> int:
        return len(self._table) + self.jitted._cache_size()

    def _store(self):
        folder = store_folder(self.store_setting)
        if folder is None or self.context is None:
            return None
        context = self.context()
        if self.compiler_options:
            context += f"\ncompiler_options {sorted(self.compiler_options.items())!r}"
        return ExecutableStore(folder, context, self.source_dirs)

    def prepare(self, calls) -> None:
        """Ready every (args, static kwargs) variant of `calls` not ready yet (see module doc).
        Arguments are only read (nothing donated)."""
        todo = {}
        for args, kw in calls:
            key = self._key(args, kw)
            if key not in self._table:
                todo.setdefault(key, (args, kw))
        if not todo:
            return
        store = self._store()
        names = {}
        if store is not None:
            t0 = time.perf_counter()
            names = {key: store.key(key, describe_args(args)) for key, (args, _) in todo.items()}
            with ThreadPoolExecutor(max_workers=min(len(todo), 8)) as pool:
                found = list(pool.map(lambda k: store.load(*names[k]), list(todo)))
            for key, exe in zip(list(todo), found):
                if exe is not None:
                    self._table[key] = exe
                    del todo[key]
                    self.counts["loaded"] += 1
            self._tick("load_s", t0)
        if todo:
            self._compile(todo, store, names)

    def _compile(self, todo: dict, store, names: dict) -> None:
        """Trace and lower each variant in turn (Python, under the GIL) and hand it to a compile
        thread at once: XLA compiles (off the GIL) run while the next variants are traced and
        lowered, so `compile_s` is the wait for the compiles after the last lowering (it was the
        whole compile when every variant was lowered first: benchmarks/RESULTS.md, Engine, the
        H100 warm-up phases)."""
        tell = self.on_compile or (lambda done, total: None)
        tell(0, len(todo))
        options = self.compiler_options or None
        compiled = {}
        with fresh_compiles() if store is not None else contextlib.nullcontext(), \
                ThreadPoolExecutor(max_workers=min(len(todo), 8)) as pool:
            futures = {}
            t0 = time.perf_counter()
            for key, (args, kw) in todo.items():
                traced = self.jitted.trace(*args, **kw)
                t0 = self._tick("trace_s", t0)
                lowered = traced.lower()
                del traced
                t0 = self._tick("lower_s", t0)
                futures[key] = pool.submit(lowered.compile, compiler_options=options)
            for key, future in futures.items():
                compiled[key] = future.result()
                tell(len(compiled), len(todo))
        t0 = self._tick("compile_s", t0)
        self._table.update(compiled)
        self.counts["compiled"] += len(compiled)
        if store is not None:
            with ThreadPoolExecutor(max_workers=min(len(compiled), 8)) as pool:
                list(pool.map(lambda k: store.save(*names[k], compiled[k]), list(compiled)))
            self._tick("save_s", t0)

    def _tick(self, phase: str, t0: float) -> float:
        now = time.perf_counter()
        self.timings[phase] += now - t0
        return now
