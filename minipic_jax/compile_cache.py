"""JAX's persistent compilation cache, on by default for the engine.

The first start of a configuration compiles its step variants (and their Pallas kernels) and
writes the executables to disk; a second start of the same configuration reads them back instead
of compiling (benchmarks/RESULTS.md, "RAG headline": load + warm-up times).

Where (first match wins):
  1. `LLM(..., compilation_cache=...)`: a folder, or False to leave JAX's setting alone;
  2. JAX's own setting (`JAX_COMPILATION_CACHE_DIR` or `jax.config.jax_compilation_cache_dir`);
  3. `$MINIPIC_COMPILATION_CACHE_DIR`: a folder, or one of "", "0", "off", "false", "none" to
     disable the cache;
  4. `$XDG_CACHE_HOME/minipic_jax/xla`, else `~/.cache/minipic_jax/xla`.

The engine's compiled steps are also stored whole, under `<that folder>/minipic_steps/`
(serving/step/executable_store.py): a second start of the same configuration loads them without
tracing or lowering anything. Keyed by the model, the engine options that reach the step, the
argument shapes, jax/jaxlib versions, the device and a digest of the step's source, so a changed
program never loads a stale file. `LLM(..., step_cache="off")` (Config.step_cache) turns that
store off alone, a folder puts it elsewhere; deleting the folder is always safe.
"""

from __future__ import annotations

import os
import pathlib

ENV = "MINIPIC_COMPILATION_CACHE_DIR"
_OFF = ("", "0", "off", "false", "none", "no")
# JAX writes only compiles that took >= 1 s by default; the engine's start also runs many small
# programs (weight draws, pool fills, weight fusing) that would compile again at every start.
# $JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS, when set, wins.
MIN_COMPILE_TIME_S = 0.0


def default_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "minipic_jax" / "xla"


def resolve(setting=None) -> str | None:
    """The folder the cache should use for `setting` (see module doc), or None for no change."""
    import jax
    if setting is False:
        return None
    if setting is None:
        current = jax.config.jax_compilation_cache_dir
        if current:
            return current
        env = os.environ.get(ENV)
        if env is not None and env.strip().lower() in _OFF:
            return None
        setting = env or default_dir()
    return str(pathlib.Path(setting).expanduser())


def configure(setting=None) -> str | None:
    """Point JAX's persistent compilation cache at `resolve(setting)` (created if missing), every
    compile written (MIN_COMPILE_TIME_S); returns the folder in use, or None when the cache is
    left off. Safe to call again: JAX's cache is re-initialised only when the folder changes."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc
    path = resolve(setting)
    if path is None:
        return jax.config.jax_compilation_cache_dir or None
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_S)
    if path != jax.config.jax_compilation_cache_dir:
        try:
            pathlib.Path(path).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ValueError(f"compilation cache folder {path!r} cannot be created ({err}); "
                             f"set {ENV}=off to disable the cache or point it elsewhere") from None
        jax.config.update("jax_compilation_cache_dir", path)
        cc.reset_cache()  # JAX fixes its cache folder at the first compile; re-read it
    return path


def disable() -> None:
    """Turn the persistent cache off again (tests that turned it on restore this)."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc
    jax.config.update("jax_compilation_cache_dir", None)
    cc.reset_cache()
