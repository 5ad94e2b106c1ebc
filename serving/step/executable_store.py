"""Compiled engine steps on disk: a second start of the same configuration loads them.

JAX's persistent compilation cache (minipic_jax/compile_cache.py) saves XLA's compile, but its key
is a digest of the lowered program, so every start still traces and lowers each step variant
(seconds per variant for a 32-layer model). This store keys a serialized executable
(`jax.experimental.serialize_executable`) by everything that can change the program *before*
tracing, so a hit skips tracing, lowering and compiling:

- the caller's context: the model config, the engine Config fields that reach the step, the
  attention plan (ModelRunner._program_context);
- the static arguments of the variant and the tree, shape, dtype and sharding of every argument;
- jax / jaxlib / plugin / flax / numpy versions, backend, platform version, device kind and
  count, XLA_FLAGS, the jax config values that can change a program, MINIPIC_* variables;
- a digest of the first-party source that defines the step (serving, kernels_pallas, configs and
  the model family's package): after any code change nothing stored before is used.

A file holds the full key text next to the executable; a load compares it (no trust in the hash
alone). Any failure to read, unpickle or load is a miss (the variant compiles as usual and the
file is rewritten). Files live in `<compilation cache folder>/minipic_steps/`; with the
compilation cache off there is no store. `Config.step_cache` turns the store off alone ("off")
or puts it elsewhere (a folder); see `store_folder`. Loading runs code from these files: the
folder must be as trusted as JAX's own cache folder. Only fresh compiles are written
(`fresh_compiles`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import os
import pathlib
import pickle
import sys
import warnings

import jax

SUBDIR = "minipic_steps"
# Config.step_cache=None means this ("on"); the test suite sets it to "off" (tests/conftest.py)
DEFAULT_SETTING = "on"
_OFF = ("0", "off", "false", "none", "no")
_FORMAT = 1  # bump when the file layout changes
# jax config values that never change a compiled program (paths, logging, debugging output)
_CONFIG_IGNORED = ("compilation_cache", "persistent_cache", "log", "dump", "pprint", "traceback",
                   "explain", "mtls", "timeout")
_REPO = pathlib.Path(__file__).resolve().parents[1]
SOURCE_PACKAGES = ("serving", "kernels_pallas", "configs")


def store_folder(setting: str | None = None) -> pathlib.Path | None:
    """The folder for Config.step_cache `setting`: None (DEFAULT_SETTING), "" or "on":
    `<jax compilation cache folder>/minipic_steps` (None while that cache is off); "off" (or
    0/false/none/no): None; anything else: that folder."""
    setting = str(DEFAULT_SETTING if setting is None else setting).strip()
    if setting.lower() in _OFF:
        return None
    if setting and setting.lower() != "on":
        return pathlib.Path(setting).expanduser()
    base = jax.config.jax_compilation_cache_dir
    return pathlib.Path(base) / SUBDIR if base else None


@functools.lru_cache(maxsize=None)
def source_digest(extra_dirs: tuple[str, ...] = ()) -> str:
    """sha256 over every .py file (path and bytes) of SOURCE_PACKAGES and `extra_dirs`."""
    h = hashlib.sha256()
    dirs = [_REPO / p for p in SOURCE_PACKAGES] + [pathlib.Path(d) for d in extra_dirs]
    for d in sorted({x.resolve() for x in dirs}):
        for path in sorted(d.rglob("*.py")):
            h.update(str(path.relative_to(d.parent)).encode() + b"\0")
            h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def _versions() -> tuple:
    out = []
    for name in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin",
                 "jax-cuda13-pjrt", "libtpu", "flax", "numpy", "ml_dtypes"):
        try:
            out.append((name, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:
            pass
    return tuple(out) + (("python", sys.version),)


def environment() -> str:
    """Everything outside the program's own inputs that can change what compiles."""
    devices = jax.devices()
    d = devices[0]
    config = sorted((k, repr(v)) for k, v in jax.config.values.items()
                    if not any(word in k for word in _CONFIG_IGNORED))
    env = sorted((k, v) for k, v in os.environ.items()
                 if k in ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "CUDA_VISIBLE_DEVICES")
                 or (k.startswith("MINIPIC_") and "CACHE" not in k))
    return repr((_versions(), d.platform, d.device_kind, d.client.platform_version,
                 getattr(d, "compute_capability", None), len(devices), config, env))


def describe_args(args) -> str:
    """The tree of `args` and each leaf's shape, dtype, weak type and sharding (None: numpy)."""
    leaves, tree = jax.tree.flatten(args)
    rows = []
    for x in leaves:
        sharding = getattr(x, "sharding", None)
        weak = bool(getattr(getattr(x, "aval", None), "weak_type", False))
        rows.append((tuple(x.shape), str(x.dtype), weak,
                     None if sharding is None or not isinstance(x, jax.Array) else repr(sharding)))
    return repr((str(tree), rows))


@contextlib.contextmanager
def fresh_compiles():
    """JAX's persistent compilation cache off inside (process-wide): an executable that cache
    loaded cannot be serialized again (XLA:CPU drops its functions: "Function ... not found" when
    the copy runs), so whatever this store writes must come from a real compile. Trade-off: a
    first start after a code change that left the programs equal compiles them again."""
    from jax.experimental.compilation_cache import compilation_cache as cc
    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    cc.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        cc.reset_cache()


class ExecutableStore:
    """Serialized compiled steps in `folder`, keyed under one `context` (see module doc)."""

    def __init__(self, folder: pathlib.Path, context: str, source_dirs: tuple[str, ...] = ()):
        self.folder = pathlib.Path(folder)
        self.prefix = "\n".join((f"format {_FORMAT}", source_digest(tuple(source_dirs)),
                                 environment(), context))

    def key(self, static: tuple, args_text: str) -> tuple[str, str]:
        """(file name, full key text) of one variant: its static arguments and described args."""
        text = "\n".join((self.prefix, repr(static), args_text))
        return hashlib.sha256(text.encode()).hexdigest()[:40] + ".exe", text

    def load(self, name: str, text: str):
        """The stored jax.stages.Compiled for this key, or None (absent, stale or unreadable)."""
        path = self.folder / name
        try:
            blob = path.read_bytes()
        except OSError:
            return None
        try:
            stored_text, payload, in_tree, out_tree = pickle.loads(blob)
            if stored_text != text:
                return None
            from jax.experimental.serialize_executable import deserialize_and_load
            return deserialize_and_load(payload, in_tree, out_tree)
        except Exception as err:  # a damaged or foreign file is a miss, never an error
            warnings.warn(f"step executable {path} could not be loaded ({type(err).__name__}: "
                          f"{err}); compiling it again", RuntimeWarning, stacklevel=2)
            return None

    def save(self, name: str, text: str, compiled) -> bool:
        """Write `compiled` under this key (atomically); False when it cannot be serialized or
        written (the engine runs on, the next start compiles again)."""
        try:
            from jax.experimental.serialize_executable import serialize
            payload, in_tree, out_tree = serialize(compiled)
            blob = pickle.dumps((text, payload, in_tree, out_tree))
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp = self.folder / f".{name}.{os.getpid()}.tmp"
            tmp.write_bytes(blob)
            os.replace(tmp, self.folder / name)
            return True
        except Exception as err:
            warnings.warn(f"step executable not stored in {self.folder} ({type(err).__name__}: "
                          f"{err})", RuntimeWarning, stacklevel=2)
            return False
