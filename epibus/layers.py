"""The installed names of epibus's layers, and the check that they are epibus's own.

The wheel installs the layers as the top-level packages `bus`, `observers` and `mesh`, the names of the
repository's folders, so that every tool resolves a module by its path (mypy, IDEs, tracebacks, `python -m`)
and a checkout and an install import the same names. The price is that those short names could be taken by
another distribution or by a local module on sys.path: instead of renaming them at install time (which makes
the installed name differ from the folder), epibus checks at import that each layer is the one installed beside
it, and `epibus doctor` reports any other distribution that claims one of the names."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

LAYERS = ("bus", "observers", "mesh")
DISTRIBUTION = "epibus"


def shadowed_layers() -> dict[str, str]:
    """The layers Python would import from somewhere other than beside the `epibus` package, with where it
    finds each (a local `bus.py` in the working directory, another distribution's `mesh`): empty when all is
    well. Cheap: it finds the modules' files, it does not import them."""
    home = Path(__file__).resolve().parent.parent
    found: dict[str, str] = {}
    for name in LAYERS:
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec is not None else None
        if origin is None or Path(origin).resolve().parent.parent != home:
            found[name] = origin or "nowhere"
    return found


def claimed_by_others() -> dict[str, list[str]]:
    """The layer names another installed distribution also ships (pip would have written both into one
    folder), with those distributions' names."""
    owners = importlib.metadata.packages_distributions()
    return {
        name: sorted({d for d in owners[name] if d.lower() != DISTRIBUTION})
        for name in LAYERS
        if any(d.lower() != DISTRIBUTION for d in owners.get(name, []))
    }


def require_own_layers() -> None:
    """Raise ImportError, in one line saying how to fix it, when a layer Python would import is not epibus's."""
    shadowed = shadowed_layers()
    if shadowed:
        name, origin = next(iter(shadowed.items()))
        raise ImportError(
            f"epibus needs its own package {name!r}, but Python finds it at {origin}: a local module or another "
            f"distribution named {name!r} shadows it; run epibus from another directory or in its own virtual "
            "environment"
        )
