"""Wrappers that behave like the functions they wrap where wrapt's own proxies do not: they pickle
and copy by reference to the wrapped function's importable name (multiprocessing spawn pickles
sglang's functions and bound methods; wrapt's proxies refuse to).  wrapt itself is loaded through
``wrapt_loader`` (the image's, or the bundle's private copy) on the first wrapper built.
"""

_WRAPPER_CLASSES = []


def function_wrapper(original, wrapper):
    """``wrapt.FunctionWrapper(original, wrapper)`` that pickles and copies like the function it
    wraps (wrapt's own proxies refuse to): by reference to its importable name."""
    if not _WRAPPER_CLASSES:
        _WRAPPER_CLASSES.append(_make_wrapper_class())
    return _WRAPPER_CLASSES[0](original, wrapper)


def _owner_class(function):
    """The class a method was defined in, found by its qualified name (None for a function)."""
    import sys

    owner = sys.modules.get(function.__module__)
    for part in function.__qualname__.split(".")[:-1]:
        owner = getattr(owner, part, None)
    return owner if isinstance(owner, type) else None


def _make_wrapper_class():
    from npu_shim import wrapt_loader

    wrapt = wrapt_loader.load()

    def reduce(self, protocol=None):
        function = self.__wrapped__
        instance = getattr(self, "_self_instance", None)
        if instance is not None:
            return getattr, (instance, function.__name__)  # a bound method, as Python pickles one
        owner = _owner_class(function)
        if owner is not None:
            return getattr, (owner, function.__name__)
        return function.__qualname__  # a module-level name: pickled as a global, like a function

    def deepcopy(self, memo):
        instance = getattr(self, "_self_instance", None)
        if instance is None:
            return self  # functions are atomic to copy.deepcopy
        import copy

        return getattr(copy.deepcopy(instance, memo), self.__wrapped__.__name__)

    methods = {"__reduce__": reduce, "__reduce_ex__": reduce, "__copy__": lambda self: self,
               "__deepcopy__": deepcopy, "__module__": __name__}
    # wrapt's names, so that what reports a wrapper's type (logs, tests) reads the same
    bound = type("BoundFunctionWrapper", (wrapt.BoundFunctionWrapper,), dict(methods))
    return type("FunctionWrapper", (wrapt.FunctionWrapper,),
                dict(methods, __bound_function_wrapper__=bound))
