"""The optional packages of ``pip install 'pagedllm[bench]'``: aiohttp (the load
generator's HTTP client: ``bench serve``, ``bench sweep``, ``bench server``) and
matplotlib (their ``--plot``). The engine and the other commands run without them, so
they are imported only inside the functions that use them, through ``import_bench_package``.
"""
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
    """Check, before any work starts, that the packages ``names`` (top-level names, e.g.
    ``"aiohttp"``) can be imported.

    Raises:
        MissingBenchPackageError: naming those that cannot and ``pip install 'pagedllm[bench]'``.
    """
    missing = tuple(n for n in names if importlib.util.find_spec(n) is None)
    if missing:
        raise _missing(missing, purpose)


def import_bench_package(name: str, purpose: str = "this benchmark") -> ModuleType:
    """``importlib.import_module(name)`` for a module of a package of the ``bench`` extra
    (``"aiohttp"``, ``"matplotlib.figure"``).

    Raises:
        MissingBenchPackageError: its package is not installed (named, with
            ``pip install 'pagedllm[bench]'``); an import error from inside an installed
            package propagates as it is.
    """
    top = name.partition(".")[0]
    try:
        importlib.import_module(top)
    except ModuleNotFoundError as e:
        if e.name != top:
            raise
        raise _missing((top,), purpose) from None
    return importlib.import_module(name)
