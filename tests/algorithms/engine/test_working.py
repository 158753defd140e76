"""The working model: a module rebound onto flat vectors, tied parameters included."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from pfl_algorithms.engine.working import WorkingModel
from pfl_kernels.nn import multibranch


def tied_model():
    torch.manual_seed(0)
    return multibranch(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double(), branches=3,
                       shared_alpha=True)


def test_a_tied_parameter_is_one_flat_slot_in_every_module_holding_it():
    """pFedMB's shared α: both layers read the same view of the flat vector, in the working model
    and in a worker's copy, and the gradient of both uses lands in that one slot."""
    work = WorkingModel(tied_model())
    for module in (work.module, work.copy().module):
        assert module[0].alpha_param is module[2].alpha_param
    assert [n for n in work.layout.names() if n.endswith("alpha_param")] == ["0.alpha_param"]
    assert work.bound()
    span = work.layout.span(["0.alpha_param"])
    work.params[span] = torch.tensor([0.3, -0.2, 0.5], dtype=torch.float64)  # both layers see the write
    assert torch.equal(work.module[2].alpha_param, work.params[span])
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1])
    work.zero_grad()
    F.cross_entropy(work.module(x), y).backward()
    reference = tied_model()
    with torch.no_grad():
        reference[0].alpha_param.copy_(work.params[span])
    for (name, p), q in zip(work.module.named_parameters(), reference.parameters()):
        with torch.no_grad():
            q.copy_(p)
    loss = F.cross_entropy(reference(x), y)
    (grad,) = torch.autograd.grad(loss, reference[0].alpha_param)
    torch.testing.assert_close(work.grads[span], grad, rtol=1e-12, atol=1e-12)


def test_empty_buffer_rows_make_no_copy_and_a_size_mismatch_still_raises():
    """load and store_into skip a model's empty buffer rows (a dispatch per client each on the
    batched executor's finish) but not a row whose size differs from the working vector's."""
    import pytest
    from torch.utils._python_dispatch import TorchDispatchMode

    from pfl_algorithms.engine.working import store_into

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    work = WorkingModel(nn.Linear(3, 2))
    assert work.buffers.numel() == 0 and work.int_buffers.numel() == 0
    row = torch.randn(work.params.numel())
    empty, other, check = torch.empty(0), torch.empty(0), torch.tensor(True)
    empty_int = torch.empty(0, dtype=torch.int64)
    with Ops() as ops:
        work.load(row, empty, empty_int)
        store_into(empty, other, check)
    assert ops.names == ["copy_"] and torch.equal(work.params, row)
    with pytest.raises(RuntimeError):
        work.load(row, torch.ones(2))  # a row where the model has no buffers
    with pytest.raises(RuntimeError):
        store_into(torch.empty(0), torch.ones(2))
    kept, value = torch.zeros(3), torch.ones(3)
    store_into(kept, value, torch.tensor(False))
    store_into(value, kept, torch.tensor(True))
    assert torch.equal(kept, torch.zeros(3)) and torch.equal(value, torch.zeros(3))
