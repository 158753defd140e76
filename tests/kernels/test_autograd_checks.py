"""The shared autograd checks fail on a wrong derivative in each mode the suite runs them in:
full Jacobians (the main phase), a projection with the batched check (PFL_TEST_GRADCHECK=fast:
the no-extension and floor phases) and a projection without it (the Triton interpreter)."""
import pytest
import torch
from torch.autograd.gradcheck import GradcheckError

from tests.kernels import autograd_checks
from tests.kernels.autograd_checks import assert_all_orders


@pytest.mark.parametrize("fast,by_request", [(False, False), (False, True), (True, False)],
                         ids=["full", "PFL_TEST_GRADCHECK=fast", "interpreter"])
def test_a_wrong_derivative_fails_in_every_mode(monkeypatch, fast, by_request):
    monkeypatch.setattr(autograd_checks, "FAST_BY_REQUEST", by_request)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    assert_all_orders(lambda t: t * t, [x], fast=fast)  # right: passes
    with pytest.raises(GradcheckError):
        assert_all_orders(lambda t: t.detach() * t, [x], fast=fast)  # d/dt is 2t, autograd says t
