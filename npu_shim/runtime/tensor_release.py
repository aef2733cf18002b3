"""Releasing a tensor's memory while code may still hold the tensor object: the generic machinery a
patch that frees weights uses (which weights, and when, is the patch's policy, in its own module).

``free_weight`` frees a tensor's memory only where nothing but the tensor object and its own
``_base`` chain holds it (the storage's C++ use count decides), then gives the object a fresh
0-element tensor and a guarded class whose every torch operation raises the patch's error
(``Guard``): a later touch says what was released and how to keep it, never reads freed memory.
A release is all or nothing: memory torch cannot free (owned outside it, ``torch.from_numpy``) is
refused before anything changes, and a resize that fails all the same puts the weight back as it
was.
"""

import sys

# The per-tensor marker in the released tensor's __dict__: what was released (the message names it).
_TAG = "_npu_shim_released"


class Guard:
    """How a patch's released tensors answer a touch: ``error`` raised with the message (what was
    released, ``because`` it is no longer needed, the op that touched it, and the ``hint`` that
    keeps it); ``unnamed``: what the message calls a tensor without a name, ``repr_unnamed`` its
    repr."""

    def __init__(self, error, because, hint, unnamed, repr_unnamed):
        self.error, self.because, self.hint = error, because, hint
        self.unnamed, self.repr_unnamed = unnamed, repr_unnamed


_GUARDED = {}


def _find_released(args, kwargs):
    for value in list(args) + list((kwargs or {}).values()):
        for item in (value if isinstance(value, (list, tuple)) else (value,)):
            tag = is_released(item) and item.__dict__.get(_TAG)
            if tag:
                return tag
    return None


def _guard_torch_function(cls, func, types, args=(), kwargs=None):
    guard = cls._npu_shim_guard
    name = getattr(func, "__name__", None) or repr(func)
    what = _find_released(args, kwargs) or guard.unnamed
    raise guard.error(
        "npu-shim released %s to free NPU memory (%s), but `%s` touched it afterwards; %s"
        % (what, guard.because, name, guard.hint))


def _guard_repr(self):
    guard = type(self)._npu_shim_guard
    return "<released by npu-shim: %s; %s>" % (self.__dict__.get(_TAG, guard.repr_unnamed), guard.hint)


def guarded_class(cls, guard):
    """The subclass of a tensor class (Tensor, Parameter, sglang's parameter classes) whose
    every torch operation raises ``guard``'s error."""
    guarded = _GUARDED.get((cls, guard))
    if guarded is None:
        guarded = type("Released" + cls.__name__, (cls,), {
            "__torch_function__": classmethod(_guard_torch_function),
            "__repr__": _guard_repr,
            "__str__": _guard_repr,
            "_npu_shim_guard": guard,
        })  # type() gives it this module as __module__, the module of the code that calls it
        _GUARDED[(cls, guard)] = guarded
    return guarded


def is_released(tensor):
    return hasattr(type(tensor), "_npu_shim_guard")


def storage_holders(storage):
    """How many tensors and storage objects hold ``storage`` (the C++ use count of its StorageImpl;
    ``storage`` itself, a Python handle, counts as one)."""
    import torch

    return torch._C._storage_Use_Count(storage._cdata)


def _base_chain(tensor, storage):
    """The tensor's own ``_base`` chain on the same memory (what the view keeps alive)."""
    chain, base = [], tensor._base
    while base is not None and base.untyped_storage().data_ptr() == storage.data_ptr():
        chain.append(base)
        base = base._base
    return chain


def _chain_refs(chain):
    return [sys.getrefcount(base) for base in chain]


_BASE_REFS = []  # Python references to a base that only its own view holds (measured once)


def _base_held_elsewhere(chain):
    """True when code other than the view holds a base tensor object (it would outlive the
    release).  The baseline is measured on a fresh view through the same calls, so it does not
    depend on how this Python version counts references."""
    import torch

    if not _BASE_REFS:
        probe = torch.empty(1)[:]
        _BASE_REFS.extend(_chain_refs(_base_chain(probe, probe.untyped_storage())))
    return any(refs > _BASE_REFS[0] for refs in _chain_refs(chain))


def free_weight(tensor, what, guard, say):
    """Free ``tensor``'s memory and guard the object with ``guard``; returns the bytes freed (0:
    kept).  ``say(key, level, message)`` says why a weight is kept (the patch decides how often).

    Nothing is freed that anything but the weight itself and its own ``_base`` chain holds: the
    storage's real holders (the C++ use count) decide.  Otherwise the weight is kept whole and one
    warning names the holder count.  The weight object (every reference to it) then holds a fresh
    0-element tensor without ``_base``, so code that bypasses ``__torch_function__`` sees an empty
    tensor, never freed memory."""
    import logging

    import torch

    if is_released(tensor):
        return 0
    storage = tensor.untyped_storage()
    nbytes = storage.nbytes()
    chain = _base_chain(tensor, storage)
    # Holders: our ``storage`` handle, the weight, its base chain; anything more is an alias.
    others = storage_holders(storage) - 2 - len(chain)
    if others > 0 or _base_held_elsewhere(chain):
        count = max(others, 1)
        say("aliased", logging.WARNING,
              "keeping %s: its memory has %d other holder%s (a view, .data, .detach() or its base "
              "taken elsewhere); freeing it would crash whoever reads them"
              % (what, count, "" if count == 1 else "s"))
        return 0
    if not storage.resizable():
        say("not-resizable", logging.WARNING,
            "keeping %s: its memory is owned outside torch (torch.from_numpy, a DLPack or shared-"
            "memory buffer), so it cannot be freed" % what)
        return 0
    cls = type(tensor)
    layout = (tensor.storage_offset(), tensor.size(), tensor.stride(), tensor.requires_grad)
    guarded = guarded_class(cls, guard)
    emptied = torch.Tensor._make_subclass(cls, torch.empty(0, dtype=tensor.dtype, device=tensor.device))
    try:
        # The weight object gets the empty tensor; ``emptied`` gets the old one with its _base.
        torch.utils.swap_tensors(tensor, emptied)
    except RuntimeError as exc:  # C++ holds the tensor itself, or a weakref points at it
        say("swap", logging.WARNING, "keeping %s: it is held where it cannot be replaced (%s)"
              % (what, str(exc).split(".")[0]))
        return 0
    tensor.__dict__, emptied.__dict__ = emptied.__dict__, {}
    try:
        tensor.__class__ = guarded
    except TypeError as exc:
        torch.utils.swap_tensors(tensor, emptied)
        tensor.__dict__, emptied.__dict__ = emptied.__dict__, {}
        say("guard:" + cls.__name__, logging.WARNING,
              "keeping %s: its class %s cannot be guarded (%s)" % (what, cls.__name__, exc))
        return 0
    tensor.__dict__[_TAG] = what
    del emptied, chain
    left = storage_holders(storage) - 1
    if left:
        say("still-held", logging.WARNING,
              "%s is guarded but its memory still has %d holder%s; it is freed when they let go"
              % (what, left, "" if left == 1 else "s"))
        return 0
    try:
        storage.resize_(0)  # only our handle (and Python storage objects, which see 0 bytes) remain
    except Exception as exc:  # noqa: BLE001 - whatever the reason, the weight goes back whole
        _put_back(tensor, cls, storage, layout)
        say("resize", logging.WARNING, "keeping %s: its memory cannot be freed (%s)"
            % (what, str(exc).split(".")[0]))
        return 0
    return nbytes


def _put_back(tensor, cls, storage, layout):
    """Undo the swap after a failed resize (the memory is untouched): the weight object gets a
    tensor on its own storage with its own offset, size and stride, its class and attributes."""
    import torch

    offset, size, stride, requires_grad = layout
    attributes = dict(tensor.__dict__)
    attributes.pop(_TAG, None)
    tensor.__class__ = cls
    with torch.no_grad():
        restored = torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(storage, offset, size, stride)
    restored = torch.Tensor._make_subclass(cls, restored, requires_grad)
    torch.utils.swap_tensors(tensor, restored)
    tensor.__dict__ = attributes


def shares_storage(a, b):
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - any tensor type's failure means "cannot tell", answered below
        return True  # cannot tell: treat as shared (keep the weight)


def exclusive(tensor):
    """The tensor's storage holds this tensor and nothing else."""
    return tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
