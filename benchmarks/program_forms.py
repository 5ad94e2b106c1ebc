"""Benchmark forms: program switches (serving/step/program_switches.py) set for an in-process
A/B. A form is a comma list NAME=0|1 ("" = the switches as they are); `program_form` sets one,
clears JAX's traces (kernels under their own module-level jits keep the form they were first
traced with) and drops a runner's step programs, so its next steps compile under the form; the
switches are put back after."""

from __future__ import annotations

import contextlib
import importlib


def parse_form(form: str, flag: str = "--forms") -> tuple[dict, dict]:
    """form -> ({switch: its module}, {switch: bool}); a clear error naming `flag` on a name
    that is no program switch or a value that is not 0 / 1."""
    from serving.step import program_switches
    modules = {name: importlib.import_module(mod) for mod, name in program_switches.SWITCHES}
    settings = {}
    for item in filter(None, form.split(",")):
        name, _, value = item.partition("=")
        if name not in modules or value not in ("0", "1"):
            raise ValueError(f"{flag} {form!r}: {item!r} is not NAME=0|1 of a program switch "
                             f"({', '.join(sorted(modules))})")
        settings[name] = value == "1"
    return modules, settings


@contextlib.contextmanager
def program_form(form: str, runner=None, flag: str = "--forms"):
    """The form's switches set (and `runner`'s step programs dropped) inside the block."""
    modules, settings = parse_form(form, flag)
    before = {name: getattr(modules[name], name) for name in settings}

    def apply(values):
        import jax
        for name, value in values.items():
            setattr(modules[name], name, value)
        if values:
            jax.clear_caches()
            if runner is not None:
                runner._step._spelled.clear()
                runner._step._table.clear()
    apply(settings)
    try:
        yield
    finally:
        apply(before)
