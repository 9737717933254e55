"""STAND-IN (servestack sandbox): names that code importing torch, triton or torchvision expects.

Shipped as `<package>/_standin.py` in the stand-in torch, triton, torchvision and torchaudio wheels. SGLang
(0.5.14 at `import sglang`, every version in `sglang.srt.server_args`) imports and decorates with
hundreds of their names at import time; none does GPU work before a GPU is asked for. Every name a
stand-in module does not define is answered by a placeholder class here, which does nothing
(decorators return what they decorate, calls return placeholders, numbers are 0), and any submodule
without a file is an empty placeholder module. What the deploy and SGLang decide from (versions,
`torch.version.cuda`, `torch.cuda.is_available()`, the cuDNN version) is defined by the stand-ins
themselves, never by a placeholder.
"""

import abc
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

# Names a placeholder must not have: asking for them is how Python and libraries probe an object
# (a real CUDA torch has no torch.npu, torch.hpu or torch.musa).
ABSENT = {"npu", "hpu", "musa", "_fields", "_is_protocol", "__path__", "__file__", "__wrapped__"}


def _absent(name):
    return name in ABSENT or (name.startswith("__") and name.endswith("__"))


class _PlaceholderMeta(abc.ABCMeta):
    def __getattr__(cls, name):
        if _absent(name):
            raise AttributeError(name)
        if name == "name":   # e.g. torch.library.Library(...).m.name: code builds attribute names from it
            return cls._standin_name.rsplit(".", 1)[-1]
        made = placeholder(cls._standin_name + "." + name)
        setattr(cls, name, made)
        return made

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and not kwargs and isinstance(args[0], (types.FunctionType, types.MethodType)):
            return args[0]  # used as a decorator
        return super().__call__()

    def __getitem__(cls, item):
        return cls

    def __repr__(cls):
        return "<stand-in placeholder %s>" % cls._standin_name

    def __int__(cls):
        return 0

    def __index__(cls):
        return 0

    def __float__(cls):
        return 0.0


class _Placeholder(metaclass=_PlaceholderMeta):
    _standin_name = "placeholder"

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        if _absent(name):
            raise AttributeError(name)
        if name == "name":
            return type(self)._standin_name.rsplit(".", 1)[-1]
        return placeholder(type(self)._standin_name + "()." + name)

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and isinstance(args[0], (types.FunctionType, types.MethodType, type)):
            return args[0]
        return placeholder(type(self)._standin_name + "()()")()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __getitem__(self, item):
        return placeholder(type(self)._standin_name + "[]")()

    def __bool__(self):
        return False

    def __int__(self):
        return 0

    def __index__(self):
        return 0

    def __float__(self):
        return 0.0


def placeholder(name):
    """A class standing for `name` (e.g. 'torch.nn.Module')."""
    return _PlaceholderMeta(name.rsplit(".", 1)[-1], (_Placeholder,), {"_standin_name": name})


class PlaceholderModule(types.ModuleType):
    """A module whose undefined names are placeholders (its files' names win)."""

    def __getattr__(self, name):
        if _absent(name):
            raise AttributeError(name)
        child = self.__name__ + "." + name
        if child in sys.modules:
            return sys.modules[child]
        path = self.__dict__.get("__path__")
        if path and importlib.machinery.PathFinder.find_spec(child, path) is not None:
            return importlib.import_module(child)
        made = placeholder(child)
        setattr(self, name, made)
        return made


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A submodule of a stand-in package (`roots`) without a file of its own is a PlaceholderModule."""

    servestack_standin = True

    def __init__(self):
        self.roots = set()

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] not in self.roots or "." not in fullname:
            return None
        return (importlib.machinery.PathFinder.find_spec(fullname, path)
                or importlib.machinery.ModuleSpec(fullname, self, is_package=True))

    def create_module(self, spec):
        module = PlaceholderModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        parent, _, child = module.__name__.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], child, module)


def install(module_name):
    """Make module `module_name` answer undefined names with placeholders, and its undefined
    submodules with placeholder modules."""
    # a _Finder, maybe another copy's class
    finder: Any = next((finder for finder in sys.meta_path if getattr(finder, "servestack_standin", False)), None)
    if finder is None:   # one finder for every stand-in package, whichever copy of this file installs it
        finder = _Finder()
        sys.meta_path.insert(0, finder)
    finder.roots.add(module_name.split(".")[0])
    sys.modules[module_name].__class__ = PlaceholderModule
