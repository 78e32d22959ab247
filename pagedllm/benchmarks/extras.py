"""The optional packages of ``pip install 'pagedllm[bench]'`` (aiohttp for the load
generator, matplotlib for ``--plot``), imported only where used, through
``import_bench_package``."""
from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

INSTALL_HINT = "pip install 'pagedllm[bench]'"


class MissingBenchPackageError(ValueError):
    """A package of the ``bench`` extra is not installed (a ValueError, so the CLI prints
    the message as its one error line and exits 2)."""


def _missing(names: tuple[str, ...], purpose: str) -> MissingBenchPackageError:
    verb = "is" if len(names) == 1 else "are"
    return MissingBenchPackageError(f"{purpose} needs {' and '.join(names)}, which {verb} not installed: "
                                    f"{INSTALL_HINT}")


def require_bench_packages(*names: str, purpose: str = "this benchmark") -> None:
    """Check before any work that the packages ``names`` (top-level, e.g. ``"aiohttp"``)
    import.

    Raises:
        MissingBenchPackageError: naming them and ``pip install 'pagedllm[bench]'``.
    """
    missing = tuple(n for n in names if importlib.util.find_spec(n) is None)
    if missing:
        raise _missing(missing, purpose)


def import_bench_package(name: str, purpose: str = "this benchmark") -> ModuleType:
    """``importlib.import_module(name)`` for a module of a ``bench`` extra package.

    Raises:
        MissingBenchPackageError: its package is not installed; an import error from inside
            an installed package propagates.
    """
    top = name.partition(".")[0]
    try:
        importlib.import_module(top)
    except ModuleNotFoundError as e:
        if e.name != top:
            raise
        raise _missing((top,), purpose) from None
    return importlib.import_module(name)
