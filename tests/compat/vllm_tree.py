"""Import vLLM's real KV-event modules from an unpacked source tree, without the engine.

``load(src)`` makes ``import vllm.distributed.kv_events`` (and the few leaf modules it and the
block hashing need) run vLLM's own files from ``src`` (a tree fetched by
tests/compat/fetch_vllm.py) with no vLLM installed and no GPU:

* **Hollow packages.** ``vllm``, ``vllm.config``, ``vllm.distributed``, ``vllm.multimodal`` and
  ``vllm.v1.metrics`` are created with their real directory as ``__path__`` but their
  ``__init__.py`` is not run (each imports the whole engine). Every module the publisher and the
  hashing use loads from its real file.
* **Stand-ins.** Modules that ``v1/core/kv_cache_utils.py`` (and ``vllm/utils/__init__.py`` on
  0.10/0.11) import only for annotations or for functions never called here (``vllm.v1.request``,
  ``vllm.v1.kv_cache_interface``, ``vllm.config.VllmConfig``, ``transformers``, ...) are
  :class:`Standin` classes: any attribute, call or subscript gives another one. torch becomes one
  too when it is not installed (the vLLM venv has none). Each one made is listed in
  :attr:`Tree.standins`; none sits on the path of the structs, the encoder, the sockets or the
  hashing (the decoded fields of every version are pinned by tests/wire/test_vllm_events.py).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

HOLLOW = ("vllm", "vllm.config", "vllm.distributed", "vllm.multimodal", "vllm.v1.metrics")
STANDIN_MODULES = ("vllm.v1.request", "vllm.v1.kv_cache_interface", "vllm.v1.metrics.stats",
                   "vllm.multimodal.utils", "vllm.v1.utils", "vllm.v1.kv_cache_layout",
                   "transformers", "transformers.tokenization_utils_base")


class StandinMeta(type):
    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        child = standin(name, f"{cls.__module__}.{cls.__name__}")
        setattr(cls, name, child)
        return child


class Standin(metaclass=StandinMeta):
    """A placeholder for something vLLM names but this harness never uses."""

    def __init__(self, *args, **kwargs):
        pass

    def __class_getitem__(cls, item):
        return cls

    def __call__(self, *args, **kwargs):
        return self

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return standin(name, type(self).__module__)


def standin(name: str, module: str) -> type:
    return StandinMeta(name, (Standin,), {"__module__": module})


class Tree(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The import hook for one vLLM tree; ``standins`` names every placeholder it handed out."""

    def __init__(self, root: Path, stub_torch: bool):
        self.pkg = root / "vllm"
        self.stub_torch = stub_torch
        self.standins: list[str] = []

    def _standin_module(self, name: str) -> bool:
        if name in STANDIN_MODULES:
            return True
        return self.stub_torch and (name == "torch" or name.startswith("torch.") or name == "vllm.utils.torch_utils")

    def _dir(self, name: str) -> Path:
        return self.pkg.joinpath(*name.split(".")[1:])

    def find_spec(self, name, path=None, target=None):
        if self._standin_module(name):
            spec = importlib.machinery.ModuleSpec(name, self, is_package=True)
            spec.submodule_search_locations = []
            return spec
        if name in HOLLOW and self._dir(name).is_dir():
            spec = importlib.machinery.ModuleSpec(name, self, origin=str(self._dir(name) / "__init__.py"),
                                                  is_package=True)
            spec.submodule_search_locations = [str(self._dir(name))]
            return spec
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module: ModuleType) -> None:
        name = module.__name__
        if self._standin_module(name):
            self.standins.append(f"module {name}")
            module.__getattr__ = self._getattr(name)
        elif name == "vllm.config":  # `from vllm.config import VllmConfig` (annotations only)
            module.__getattr__ = self._getattr(name, real=self._dir(name))

    def _getattr(self, module: str, real: Path | None = None):
        made: dict[str, type] = {}

        def __getattr__(attr: str):
            if attr.startswith("__"):
                raise AttributeError(attr)
            if real is not None and ((real / f"{attr}.py").exists() or (real / attr).is_dir()):
                return importlib.import_module(f"{module}.{attr}")
            if attr not in made:
                self.standins.append(f"{module}.{attr}")
                made[attr] = standin(attr, module)
            return made[attr]

        return __getattr__


class Vllm:
    """vLLM's own modules from one tree: ``kv_events``, ``kv_events_config``, ``kv_cache_utils``,
    ``hashing`` (``get_hash_fn_by_name``), ``envs``; ``version`` is the tree's release."""

    def __init__(self, tree: Tree, root: Path):
        self.tree, self.root = tree, root
        self.version: str = importlib.import_module("vllm.version").__version__
        sys.modules["vllm"].__version__ = self.version  # what vllm/__init__.py would export
        self.envs = importlib.import_module("vllm.envs")
        self.kv_events = importlib.import_module("vllm.distributed.kv_events")
        self.kv_events_config = importlib.import_module("vllm.config.kv_events")
        self.kv_cache_utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
        try:
            self.hashing = importlib.import_module("vllm.utils.hashing")
        except ImportError:  # 0.10 / 0.11 keep the hash functions in vllm.utils
            self.hashing = importlib.import_module("vllm.utils")

    @property
    def standins(self) -> list[str]:
        return self.tree.standins


def load(src: str | os.PathLike) -> Vllm:
    """Hook the tree at ``src`` (``.vllmsrc/x/vllm-<v>``, the folder holding ``vllm/``) into this
    process's imports. Raises ``FileNotFoundError`` when it holds no ``vllm/distributed/kv_events.py``
    and ``RuntimeError`` when a vllm package is already imported."""
    root = Path(src).resolve()
    if not (root / "vllm" / "distributed" / "kv_events.py").exists():
        raise FileNotFoundError(f"no vllm/distributed/kv_events.py under {root} (tests/compat/fetch_vllm.py)")
    if any(m == "vllm" or m.startswith("vllm.") for m in sys.modules):
        raise RuntimeError("a vllm package is already imported in this process")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    tree = Tree(root, stub_torch=importlib.util.find_spec("torch") is None)
    sys.meta_path.insert(0, tree)
    sys.path.insert(0, str(root))
    return Vllm(tree, root)
