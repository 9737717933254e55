"""Behavioural checks for the sglang 0.5.9 patch set (stdlib only, no GPU, no torch).

Shipped with the set to the host and run by the environment's python on the patched
sources before any file is replaced. Importing the real modules would need torch and a
GPU, so each check compiles just the patched class or function out of the source (with
annotations dropped) and runs it against small stand-ins for its collaborators.

CHECKS maps a patch name to check(sources): sources maps each file the patch touches
(path relative to site-packages) to its patched text; a check raises on failure.
"""

import ast
import types

ALL_REDUCE_UTILS = "sglang/srt/distributed/device_communicators/all_reduce_utils.py"
TORCH_SYMM_MEM = "sglang/srt/distributed/device_communicators/torch_symm_mem.py"
KIMI_K25 = "sglang/srt/models/kimi_k25.py"


class CheckFailed(Exception):
    pass


def _expect(condition, message):
    if not condition:
        raise CheckFailed(message)


def _class_source(source, name, path, members):
    """Module AST with a bare class `name` holding only the named methods and attributes.

    Bases, decorators, other members and annotations are dropped: they name torch and
    sglang objects the check does not load.
    """
    tree = ast.parse(source, path)
    found = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name]
    _expect(found, f"{path}: class {name} not found")
    cls = found[0]
    cls.body = [node for node in cls.body if _member_name(node) in members] or [ast.Pass()]
    cls.bases, cls.keywords, cls.decorator_list = [], [], []
    for node in cls.body:
        if isinstance(node, ast.FunctionDef):
            node.returns = None
            for arg in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
                arg.annotation = None
    return ast.fix_missing_locations(ast.Module(body=[cls], type_ignores=[]))


def _member_name(node):
    if isinstance(node, ast.FunctionDef):
        return node.name
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    return None


def _load_class(source, name, path, members, namespace):
    exec(compile(_class_source(source, name, path, members), path, "exec"), namespace)
    return namespace[name]


def _max_sizes(source):
    """TORCH_SYMM_MEM_ALL_REDUCE_MAX_SIZES, from the module's plain assignments only."""
    tree = ast.parse(source, ALL_REDUCE_UTILS)
    assigns = [node for node in tree.body if isinstance(node, ast.Assign)]
    namespace = {}
    exec(compile(ast.Module(body=assigns, type_ignores=[]), ALL_REDUCE_UTILS, "exec"), namespace)
    return namespace["TORCH_SYMM_MEM_ALL_REDUCE_MAX_SIZES"]


class _Logger:
    def __init__(self):
        self.warnings = []

    def warning(self, message, *args):
        self.warnings.append(message % args)


class _Buffer:
    """Just enough of a tensor for TorchSymmMemCommunicator.all_reduce."""

    shape = (4,)

    def __getitem__(self, index):
        return self

    def copy_(self, other):
        return self

    def view(self, *shape):
        return self

    def numel(self):
        return 4


def _communicator(source, sizes, capability, multicast_ptr, calls):
    """TorchSymmMemCommunicator(group, device 0) on a fake GPU of that capability."""
    dtype = types.SimpleNamespace(itemsize=2)
    symm_mem_ops = types.SimpleNamespace(
        multimem_all_reduce_=lambda *a: calls.append("multimem"),
        two_shot_all_reduce_=lambda *a: calls.append("two_shot"),
    )
    torch = types.SimpleNamespace(
        bfloat16=dtype,
        device=lambda spec: spec,
        cuda=types.SimpleNamespace(
            set_device=lambda device: None,
            get_device_capability=lambda device: (capability, 0),
        ),
        empty_like=lambda inp: _Buffer(),
        ops=types.SimpleNamespace(symm_mem=symm_mem_ops),
    )
    logger = _Logger()
    namespace = {
        "torch": torch,
        "dist": types.SimpleNamespace(get_world_size=lambda group: 8),
        "torch_symm_mem": types.SimpleNamespace(
            empty=lambda *a, **k: _Buffer(),
            rendezvous=lambda buffer, name: types.SimpleNamespace(multicast_ptr=multicast_ptr),
        ),
        "torch_symm_mem_available": True,
        "logger": logger,
        "TORCH_SYMM_MEM_ALL_REDUCE_MAX_SIZES": sizes,
    }
    members = {"_WORLD_SIZES_MULTIMEM", "__init__", "all_reduce"}
    cls = _load_class(source, "TorchSymmMemCommunicator", TORCH_SYMM_MEM, members, namespace)
    return cls(types.SimpleNamespace(group_name="tp"), 0), logger


def check_sm120(sources):
    sizes = _max_sizes(sources[ALL_REDUCE_UTILS])
    _expect(12 in sizes, "TORCH_SYMM_MEM_ALL_REDUCE_MAX_SIZES has no entry for capability 12")
    _expect(sizes[12] == sizes[10], f"SM120 sizes {sizes[12]} differ from SM100's {sizes[10]}")
    source = sources[TORCH_SYMM_MEM]

    comm, logger = _communicator(source, sizes, 12, multicast_ptr=0, calls=[])
    _expect(comm.disabled and any("multicast" in w for w in logger.warnings),
            "SM120 without multicast (PCIe) does not disable itself with a warning")

    calls = []
    comm, _ = _communicator(source, sizes, 12, multicast_ptr=1, calls=calls)
    _expect(not comm.disabled and comm.max_size == sizes[12][8], "SM120 with multicast is not enabled")
    comm.all_reduce(_Buffer(), out=_Buffer())
    _expect(calls == ["two_shot"], f"SM120 all_reduce ran {calls}, expected the two-shot kernel")

    comm, logger = _communicator(source, sizes, 11, multicast_ptr=1, calls=[])
    _expect(comm.disabled and any("capability 11" in w for w in logger.warnings),
            "an unrecognised capability does not disable the communicator with a warning")


_KIMI_DELEGATES = {
    "get_embed_and_head": ((), "embed-and-head"),
    "set_embed_and_head": (("embed", "head"), None),
    "set_eagle3_layers_to_capture": (([2, 30, 58],), None),
}


class _LanguageModel:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        if name not in _KIMI_DELEGATES:
            raise AttributeError(name)
        return lambda *args: self.calls.append((name, args)) or _KIMI_DELEGATES[name][1]


def check_kimi_eagle3(sources):
    cls = _load_class(sources[KIMI_K25], "KimiK25ForConditionalGeneration", KIMI_K25, _KIMI_DELEGATES, {})
    for name, (args, returned) in _KIMI_DELEGATES.items():
        _expect(name in vars(cls), f"KimiK25ForConditionalGeneration has no {name}")
        model = object.__new__(cls)
        model.language_model = _LanguageModel()
        result = getattr(model, name)(*args)
        _expect(model.language_model.calls == [(name, args)] and result == returned,
                f"{name} does not delegate to language_model")
        model.language_model = object()
        try:
            getattr(model, name)(*args)
        except AttributeError as exc:
            _expect("language_model" in str(exc), f"{name}: unclear error {exc!r}")
        else:
            raise CheckFailed(f"{name} does not fail when language_model lacks it")
    _expect(cls.set_eagle3_layers_to_capture.__defaults__ == (None,),
            "set_eagle3_layers_to_capture(layer_ids=None) default is missing")


CHECKS = {
    "0001-sm120-torch-symm-mem": check_sm120,
    "0002-kimi-k25-eagle3-hooks": check_kimi_eagle3,
}
