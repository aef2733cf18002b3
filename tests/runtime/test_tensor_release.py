"""npu_shim/runtime/tensor_release.py: the generic free-and-guard machinery, with a guard of the
test's own (the MLA patch's policy and its guard are tests/patches/test_mla_weight_release.py's).

Each test builds its own ``Guard`` (so its guarded classes are made in the test) and measures the
base-reference baseline afresh (``_BASE_REFS`` is filled on first use): what the module caches
for a process is built by the test that checks it.
"""
import logging
import weakref

import pytest
import torch

from npu_shim.runtime import tensor_release


class Touched(Exception):
    """The test guard's error."""


@pytest.fixture
def guard():
    return tensor_release.Guard(Touched, "nothing reads it now", "set KEEP=1 to keep it",
                                "a weight", "an unnamed weight")


@pytest.fixture(autouse=True)
def fresh_baseline(monkeypatch):
    monkeypatch.setattr(tensor_release, "_BASE_REFS", [])


@pytest.fixture
def said():
    """``free_weight``'s ``say``: what it was told, as (key, level, message)."""
    lines = []
    return lines, lambda key, level, message: lines.append((key, level, message))


def touched(what, op):
    return ("npu-shim released %s to free NPU memory (nothing reads it now), but `%s` touched it "
            "afterwards; set KEEP=1 to keep it" % (what, op))


def w_kc_layout():
    """A view whose ``_base`` is on the same memory (how sglang lays out w_kc)."""
    return torch.randn(4, 16, 8).transpose(1, 2).contiguous().transpose(1, 2)


# -- freeing ------------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [lambda: torch.randn(8, 8), w_kc_layout,
                                  lambda: torch.nn.Parameter(torch.randn(8, 8), requires_grad=False)])
def test_a_sole_holder_is_freed_and_its_bytes_returned(guard, said, make):
    tensor = make()
    storage = tensor.untyped_storage()
    nbytes = storage.nbytes()
    assert tensor_release.free_weight(tensor, "w of layer 1", guard, said[1]) == nbytes > 0
    assert storage.nbytes() == 0 and said[0] == []
    assert tensor_release.is_released(tensor)
    assert tensor_release.free_weight(tensor, "w of layer 1", guard, said[1]) == 0  # already released


def test_the_object_keeps_an_empty_tensor_of_its_dtype_device_and_no_grad(guard, said):
    """Code that bypasses ``__torch_function__`` sees a plain empty tensor like the weight was: its
    dtype, its device (a meta tensor here, not the default device), no grad, no ``_base``."""
    for tensor, dtype, device in ((torch.randn(4, 4).to(torch.float16), torch.float16, "cpu"),
                                  (torch.empty(4, 4, dtype=torch.bfloat16, device="meta"), torch.bfloat16,
                                   "meta")):
        assert tensor_release.free_weight(tensor, "w", guard, said[1]) == 32
        with torch._C.DisableTorchFunctionSubclass():
            seen = (tensor.numel(), tensor.dtype, tensor.device.type, tensor.requires_grad, tensor._base)
        assert seen == (0, dtype, device, False, None)


def test_attributes_of_the_weight_survive_the_release(guard, said):
    param = torch.nn.Parameter(torch.randn(8, 8), requires_grad=False)
    param.weight_loader = "loader"
    assert tensor_release.free_weight(param, "w", guard, said[1]) == 256
    assert param.weight_loader == "loader"


@pytest.mark.parametrize("alias, count", [
    (lambda t: [t.view(-1)], "1 other holder"),
    (lambda t: [t.view(-1), t.t()], "2 other holders"),
])
def test_an_aliased_weight_is_kept_whole_and_the_holders_counted(guard, said, alias, count):
    tensor = torch.randn(8, 8)
    values = tensor.clone()
    views = alias(tensor)
    assert tensor_release.free_weight(tensor, "w of layer 2", guard, said[1]) == 0
    assert not tensor_release.is_released(tensor) and torch.equal(tensor, values) and views
    assert said[0] == [("aliased", logging.WARNING,
                        "keeping w of layer 2: its memory has %s (a view, .data, .detach() or its base "
                        "taken elsewhere); freeing it would crash whoever reads them" % count)]


def test_a_base_held_elsewhere_keeps_the_view_as_one_other_holder(guard, said):
    """The base's storage use is expected (it is the view's own chain), but a Python reference to
    the base object outside the view means the base outlives the release."""
    base = torch.randn(4, 16, 8)
    weight = base.transpose(1, 2)
    assert tensor_release.free_weight(weight, "w_kc", guard, said[1]) == 0
    assert not tensor_release.is_released(weight) and base.untyped_storage().nbytes() == 4 * 16 * 8 * 4
    assert said[0] == [("aliased", logging.WARNING,
                        "keeping w_kc: its memory has 1 other holder (a view, .data, .detach() or its "
                        "base taken elsewhere); freeing it would crash whoever reads them")]


def test_a_base_on_other_memory_is_not_part_of_the_chain():
    """``weight.data = other`` keeps ``_base`` but moves the weight to other memory: the base is no
    holder of it."""
    base = torch.randn(4, 16, 8)
    weight = base.transpose(1, 2)
    weight.data = torch.randn(4, 8, 16)
    assert tensor_release._base_chain(weight, weight.untyped_storage()) == []
    chain = tensor_release._base_chain(base.transpose(1, 2), base.untyped_storage())
    assert len(chain) == 1 and chain[0] is base


def test_a_tensor_with_a_weakref_is_kept_with_torchs_reason(guard, said):
    tensor = torch.randn(8, 8)
    ref = weakref.ref(tensor)
    assert tensor_release.free_weight(tensor, "w", guard, said[1]) == 0
    assert ref() is tensor and not tensor_release.is_released(tensor) and tensor.numel() == 64
    assert said[0] == [("swap", logging.WARNING, "keeping w: it is held where it cannot be replaced "
                        "(Cannot swap t1 because it has weakref associated with it)")]


def test_a_tensor_an_autograd_graph_holds_is_kept_with_the_first_sentence_of_torchs_reason(guard, said):
    param = torch.nn.Parameter(torch.randn(3))
    graph = (param * param).sum()
    assert tensor_release.free_weight(param, "p", guard, said[1]) == 0 and graph.requires_grad
    assert said[0] == [("swap", logging.WARNING, "keeping p: it is held where it cannot be replaced "
                        "(Expected use_count of t1 to be 1 or 2 with an AccumulateGrad node but got 4 "
                        "make sure you are not holding references to the tensor in other places)")]


def test_a_class_that_cannot_be_guarded_is_put_back_whole(guard, said, monkeypatch):
    param = torch.nn.Parameter(torch.randn(8, 8), requires_grad=False)
    param.weight_loader = "loader"
    values = param.clone()
    slotted = type("Slotted", (torch.nn.Parameter,), {"__slots__": ("x",)})
    monkeypatch.setattr(tensor_release, "guarded_class", lambda cls, guard: slotted)
    assert tensor_release.free_weight(param, "w", guard, said[1]) == 0
    assert type(param) is torch.nn.Parameter and torch.equal(param, values)
    assert param.weight_loader == "loader" and param.untyped_storage().nbytes() == 256
    assert said[0] == [("guard:Parameter", logging.WARNING, "keeping w: its class Parameter cannot be "
                        "guarded (__class__ assignment: 'Slotted' object layout differs from 'Parameter')")]


def test_memory_torch_does_not_own_is_kept_untouched(guard, said):
    """``torch.from_numpy``: the storage cannot be resized, so nothing is swapped or guarded -- not
    a weight that raises on every touch while its memory stays."""
    numpy = pytest.importorskip("numpy")
    param = torch.nn.Parameter(torch.from_numpy(numpy.arange(64, dtype="float32").reshape(8, 8)),
                               requires_grad=False)
    param.weight_loader = "loader"
    values = param.clone()
    assert tensor_release.free_weight(param, "w_kc of layer 3", guard, said[1]) == 0
    assert type(param) is torch.nn.Parameter and not tensor_release.is_released(param)
    assert torch.equal(param + 0, values) and param.weight_loader == "loader"
    assert said[0] == [("not-resizable", logging.WARNING,
                        "keeping w_kc of layer 3: its memory is owned outside torch (torch.from_numpy, "
                        "a DLPack or shared-memory buffer), so it cannot be freed")]


@pytest.mark.parametrize("make", [lambda: torch.nn.Parameter(torch.randn(8, 8), requires_grad=False),
                                  w_kc_layout])
def test_a_resize_that_fails_puts_the_weight_back_whole(guard, said, monkeypatch, make):
    """The resize fails after the swap: the weight object is back on its own memory, with its
    class, shape, stride, offset and attributes, not guarded, nothing counted, one line."""
    tensor = make()
    tensor.weight_loader = "loader"
    values, layout = tensor.clone(), (tensor.size(), tensor.stride(), tensor.storage_offset())
    cls, storage = type(tensor), tensor.untyped_storage()

    def refuse(self, size):
        raise RuntimeError("Trying to resize storage that is not resizable. More text")

    monkeypatch.setattr(torch.UntypedStorage, "resize_", refuse)
    assert tensor_release.free_weight(tensor, "w", guard, said[1]) == 0
    monkeypatch.undo()
    assert type(tensor) is cls and not tensor_release.is_released(tensor)
    assert (tensor.size(), tensor.stride(), tensor.storage_offset()) == layout
    assert torch.equal(tensor, values) and tensor.weight_loader == "loader"
    assert tensor.untyped_storage().data_ptr() == storage.data_ptr() and storage.nbytes() == values.nbytes
    assert tensor_release._TAG not in tensor.__dict__
    assert said[0] == [("resize", logging.WARNING, "keeping w: its memory cannot be freed (Trying to "
                                                    "resize storage that is not resizable)")]
    assert tensor_release.free_weight(tensor, "w", guard, said[1]) == values.untyped_storage().nbytes()


@pytest.mark.parametrize("make", [
    lambda: torch.randn(8, 8).to(torch.bfloat16),
    lambda: torch.arange(64, dtype=torch.int8).reshape(8, 8),
    lambda: torch.nn.Parameter(torch.randn(8, 8)),
    lambda: torch.empty(8, 8, dtype=torch.float16, device="meta"),
], ids=["bfloat16", "int8", "requires-grad", "meta-device"])
def test_a_weight_put_back_keeps_its_dtype_device_and_requires_grad(guard, said, monkeypatch, make):
    """The resize fails after the swap: the weight comes back as the model had it -- a bf16 or int8
    weight not read as float32, a weight on a device (meta here) not moved to the CPU, a trainable
    parameter still requiring grad -- its values unchanged."""
    tensor = make()
    before = (type(tensor), tensor.dtype, tensor.device, tensor.requires_grad, tensor.size(), tensor.stride())
    values = None if tensor.is_meta else tensor.detach().clone()

    def refuse(self, size):
        raise RuntimeError("Trying to resize storage that is not resizable")

    monkeypatch.setattr(torch.UntypedStorage, "resize_", refuse)
    assert tensor_release.free_weight(tensor, "w", guard, said[1]) == 0
    monkeypatch.undo()
    after = (type(tensor), tensor.dtype, tensor.device, tensor.requires_grad, tensor.size(), tensor.stride())
    assert after == before and not tensor_release.is_released(tensor)
    assert values is None or torch.equal(tensor.detach(), values)
    assert [key for key, level, message in said[0]] == ["resize"]


@pytest.mark.parametrize("held, count", [(1, "1 holder"), (2, "2 holders")])
def test_memory_still_held_after_the_swap_is_guarded_but_not_freed(guard, said, monkeypatch, held, count):
    """Should the holder check miss bases held elsewhere (a chain of ``held`` of them), the weight
    is guarded, its memory left to them, and nothing counted as freed."""
    base = torch.randn(4, 16, 8)
    weight = base.transpose(1, 2)
    chain = [base, base.view(-1)][:held]
    monkeypatch.setattr(tensor_release, "_base_chain", lambda tensor, storage: list(chain))
    monkeypatch.setattr(tensor_release, "_base_held_elsewhere", lambda chain: False)
    assert tensor_release.free_weight(weight, "w_kc", guard, said[1]) == 0
    assert tensor_release.is_released(weight) and base.untyped_storage().nbytes() == 4 * 16 * 8 * 4
    assert said[0] == [("still-held", logging.WARNING,
                        "w_kc is guarded but its memory still has %s; it is freed when they let go"
                        % count)]


# -- the guard ----------------------------------------------------------------------------------

def test_every_op_raises_the_guards_error_naming_what_and_the_op(guard, said):
    tensor = torch.randn(4, 4)
    tensor_release.free_weight(tensor, "w of layer 3", guard, said[1])
    for op, touch in (("sum", lambda: tensor.sum()),
                      ("add", lambda: torch.add(torch.ones(1), other=tensor)),  # in kwargs
                      ("cat", lambda: torch.cat([torch.ones(1), tensor])),      # in a list
                      ("stack", lambda: torch.stack((torch.ones(4, 4), tensor))),  # in a tuple
                      ("where", lambda: torch.where(torch.tensor(True), 1.0, tensor))):  # after a float
        with pytest.raises(Touched) as info:
            touch()
        assert str(info.value) == touched("w of layer 3", op)


def test_an_op_without_a_name_is_named_by_its_repr(guard, said):
    tensor = torch.randn(2)
    tensor_release.free_weight(tensor, "w", guard, said[1])

    class Op:
        def __repr__(self):
            return "<an op>"

    with pytest.raises(Touched) as info:
        type(tensor).__torch_function__(Op(), (), (tensor,))
    assert str(info.value) == touched("w", "<an op>")


def test_a_guarded_tensor_without_a_name_is_called_the_guards_unnamed(guard):
    released = torch.Tensor._make_subclass(tensor_release.guarded_class(torch.Tensor, guard),
                                           torch.empty(0), False)
    assert tensor_release.is_released(released)
    with pytest.raises(Touched) as info:
        released.sum()
    assert str(info.value) == touched("a weight", "sum")
    assert repr(released) == str(released) == "<released by npu-shim: an unnamed weight; set KEEP=1 to keep it>"


@pytest.mark.parametrize("make", [
    lambda: torch.randn(2),
    # a parameter class with a __str__ of its own: the guard's answers all the same
    lambda: type("Described", (torch.nn.Parameter,), {"__str__": lambda self: "a described weight"})(
        torch.randn(2), requires_grad=False),
])
def test_a_released_tensor_reads_as_released_in_repr_and_str(guard, said, make):
    tensor = make()
    tensor_release.free_weight(tensor, "w of layer 4", guard, said[1])
    assert repr(tensor) == str(tensor) == "<released by npu-shim: w of layer 4; set KEEP=1 to keep it>"


def test_the_guarded_class_subclasses_the_tensors_own_and_is_made_once(guard):
    guarded = tensor_release.guarded_class(torch.nn.Parameter, guard)
    assert guarded is tensor_release.guarded_class(torch.nn.Parameter, guard)
    assert issubclass(guarded, torch.nn.Parameter)
    assert (guarded.__name__, guarded.__module__) == ("ReleasedParameter", "npu_shim.runtime.tensor_release")
    assert guarded._npu_shim_guard is guard
    other = tensor_release.Guard(Touched, "b", "h", "u", "r")
    assert tensor_release.guarded_class(torch.nn.Parameter, other) is not guarded


def test_is_released_only_for_a_guarded_class(guard):
    assert tensor_release.is_released(torch.ones(1)) is False
    released = torch.Tensor._make_subclass(tensor_release.guarded_class(torch.Tensor, guard),
                                           torch.empty(0), False)
    assert tensor_release.is_released(released) is True


# -- storage helpers ----------------------------------------------------------------------------

def test_storage_holders_count_tensors_and_storage_handles():
    tensor = torch.ones(3)
    storage = tensor.untyped_storage()
    assert tensor_release.storage_holders(storage) == 2
    view = tensor.view(-1)
    assert tensor_release.storage_holders(storage) == 3 and view is not None


def test_shares_storage_and_exclusive():
    tensor = torch.ones(4, 4)
    assert tensor_release.shares_storage(tensor, tensor[1:]) is True
    assert tensor_release.shares_storage(tensor, torch.ones(4, 4)) is False
    assert tensor_release.shares_storage(object(), tensor) is True  # cannot tell: shared
    assert tensor_release.exclusive(tensor) is True
    assert tensor_release.exclusive(tensor[1:]) is False
