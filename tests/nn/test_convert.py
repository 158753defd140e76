"""What the converters (factorize, multibranch, fedpara) and from_dense refuse or keep: subclasses
whose forward differs, parametrized / hooked / lazy modules, shared modules and tied parameters,
requires_grad, their arguments, a shared α, channels-last."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pfl_kernels.nn import (FEDPARA_LAYERS, FactorizedConv2d, FactorizedLinear, FedParaLinear, MultiBranchConv2d,
                            MultiBranchLinear, alpha_parameters, branch_parameters, factorize, factorized_layers,
                            fedpara, multibranch, multibranch_layers, sparsity_loss)
from pfl_kernels.nn.convert import _targets
from tests.tolerances import assert_close

CONVERTERS = {
    "factorize": lambda model, **kw: factorize(model, rank=2, **kw),
    "multibranch": lambda model, **kw: multibranch(model, branches=3, **kw),
}
ALL_CONVERTERS = {**CONVERTERS, "fedpara": lambda model, **kw: fedpara(model, 0.5, **kw)}
FROM_DENSE = {
    "factorize": (FactorizedConv2d.from_dense, FactorizedLinear.from_dense),
    "multibranch": (MultiBranchConv2d.from_dense, MultiBranchLinear.from_dense),
}
CONVERTED = (FactorizedConv2d, FactorizedLinear, MultiBranchConv2d, MultiBranchLinear)


class WeightStandardizedConv2d(nn.Conv2d):
    """Weight standardization (Qiao et al.): the forward uses a normalized weight."""

    def forward(self, x):
        w = self.weight
        w = (w - w.mean((1, 2, 3), keepdim=True)) / (w.std((1, 2, 3), keepdim=True) + 1e-5)
        return self._conv_forward(x, w, self.bias)


class PaddedConv2d(nn.Conv2d):
    """Changes the convolution itself (``_conv_forward``), not ``forward``."""

    def _conv_forward(self, x, weight, bias):
        return F.conv2d(F.pad(x, (1, 1, 1, 1)), weight, bias, self.stride, 0, self.dilation, self.groups)


class ScaledLinear(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


class NamedConv2d(nn.Conv2d):
    """A subclass that computes exactly what nn.Conv2d computes."""

    def extra_repr(self):
        return "named, " + super().extra_repr()


def model_with(layer: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Sequential(nn.ReLU(), layer))


def _layers(model):
    return [(name, type(m)) for name, m in model.named_modules(remove_duplicate=False)]


# ---- subclasses, parametrizations, hooks, lazy modules --------------------------------

REFUSED = {
    "forward": (lambda: WeightStandardizedConv2d(4, 4, 3), r"'1\.1' \(WeightStandardizedConv2d\) is a subclass of "
                r"nn\.Conv2d that overrides forward.*allow_subclasses=True"),
    "_conv_forward": (lambda: PaddedConv2d(4, 4, 3), r"'1\.1' \(PaddedConv2d\) .*overrides _conv_forward"),
    "linear forward": (lambda: nn.Sequential(nn.Flatten(), ScaledLinear(4, 2)),
                       r"'1\.1\.1' \(ScaledLinear\) is a subclass of nn\.Linear that overrides forward"),
    "parametrization": (lambda: nn.utils.parametrizations.weight_norm(nn.Conv2d(4, 4, 3)),
                        r"'1\.1' \(ParametrizedConv2d\) has parametrizations on weight .*remove_parametrizations"),
    "hook-based weight_norm": (lambda: nn.utils.weight_norm(nn.Conv2d(4, 4, 3)),
                               r"'1\.1' \(Conv2d\) has forward pre-hooks .*would not run"),
    "forward hook": (lambda: _with_forward_hook(nn.Conv2d(4, 4, 3)), r"'1\.1' \(Conv2d\) has forward hooks"),
    "lazy": (lambda: nn.LazyConv2d(4, 3), r"'1\.1' \(LazyConv2d\) is a lazy module .*run one forward pass"),
    # What the class checks and the module hooks did not see (each was converted and dropped):
    "instance forward": (lambda: _with_instance_forward(nn.Conv2d(4, 4, 3)),
                         r"'1\.1' \(Conv2d\) has forward set on the instance \(not its class\), which the "
                         r"converted layer would not run; remove it first \(del module\.forward\)"),
    "weight gradient hook": (lambda: _with_weight_hook(nn.Conv2d(4, 4, 3)),
                             r"'1\.1' \(Conv2d\) has a gradient hook on its weight \(Tensor\.register_hook"),
    "bias post-accumulate hook": (lambda: _with_bias_post_accumulate_hook(nn.Conv2d(4, 4, 3)),
                                  r"'1\.1' \(Conv2d\) has a gradient hook on its bias"),
    "extra buffer": (lambda: CalibratedConv2d(4, 4, 3),
                     r"'1\.1' \(CalibratedConv2d\) holds buffer 'calib' besides its weight and bias, which the "
                     r"converted layer would drop \(state_dict entries included\)"),
    "extra parameter": (lambda: _with_parameter(nn.Conv2d(4, 4, 3)),
                        r"'1\.1' \(Conv2d\) holds parameter 'scale' besides its weight and bias"),
    "submodule": (lambda: _with_submodule(nn.Conv2d(4, 4, 3)),
                  r"'1\.1' \(Conv2d\) holds submodule 'act' besides its weight and bias"),
    # A NaN or Inf weight: factorize's eigh failed naming no module, multibranch copied it.
    "NaN weight": (lambda: _with_weight_entry(nn.Conv2d(4, 4, 3), float("nan")),
                   r"'1\.1' \(Conv2d\) has a non-finite weight \(NaN or Inf\)"),
    "Inf linear weight": (lambda: nn.Sequential(nn.Flatten(), _with_weight_entry(nn.Linear(4, 2), float("-inf"))),
                          r"'1\.1\.1' \(Linear\) has a non-finite weight \(NaN or Inf\)"),
}


def _with_forward_hook(module):
    module.register_forward_hook(lambda mod, args, out: out * 2)
    return module


def _with_instance_forward(module):
    dense_forward = module.forward
    module.forward = lambda x: 2 * dense_forward(x)
    return module


def _with_weight_hook(module):
    module.weight.register_hook(lambda grad: grad * 0)  # a gradient mask
    return module


def _with_bias_post_accumulate_hook(module):
    module.bias.register_post_accumulate_grad_hook(lambda param: None)
    return module


class CalibratedConv2d(nn.Conv2d):
    """Overrides nothing, but holds state of its own."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("calib", torch.ones(1))


def _with_parameter(module):
    module.scale = nn.Parameter(torch.ones(1))
    return module


def _with_submodule(module):
    module.act = nn.ReLU()
    return module


def _with_weight_entry(module, value):
    with torch.no_grad():
        module.weight.view(-1)[3] = value
    return module


@pytest.mark.filterwarnings("ignore:.*weight_norm.*deprecated")
@pytest.mark.parametrize("case", REFUSED)
@pytest.mark.parametrize("converter", CONVERTERS)
def test_refuses_a_module_it_cannot_replace_exactly_and_changes_nothing(converter, case):
    make, message = REFUSED[case]
    model = model_with(make())
    before = _layers(model)
    with pytest.raises(ValueError, match=message):
        CONVERTERS[converter](model)
    assert _layers(model) == before, "nothing is converted when one module is refused"


@pytest.mark.filterwarnings("ignore:.*weight_norm.*deprecated")
@pytest.mark.parametrize("case", REFUSED)
@pytest.mark.parametrize("converter", CONVERTERS)
def test_from_dense_refuses_the_same_modules(converter, case):
    make, message = REFUSED[case]
    module = make()
    module = module[1] if isinstance(module, nn.Sequential) else module
    conv_from_dense, linear_from_dense = FROM_DENSE[converter]
    from_dense = conv_from_dense if isinstance(module, nn.Conv2d) else linear_from_dense
    with pytest.raises(ValueError, match=message.replace(r"'1\.1\.1'", "module").replace(r"'1\.1'", "module")):
        from_dense(module)


@pytest.mark.parametrize("converter", CONVERTERS)
def test_allow_subclasses_converts_the_named_classes_only(converter):
    convert = CONVERTERS[converter]
    model = convert(model_with(WeightStandardizedConv2d(4, 4, 3)), allow_subclasses=WeightStandardizedConv2d)
    assert isinstance(model[1][1], CONVERTED)
    model = convert(model_with(WeightStandardizedConv2d(4, 4, 3)), allow_subclasses=True)
    assert isinstance(model[1][1], CONVERTED)
    with pytest.raises(ValueError, match="WeightStandardizedConv2d"):
        convert(model_with(WeightStandardizedConv2d(4, 4, 3)), allow_subclasses=[PaddedConv2d])
    conv_from_dense, _ = FROM_DENSE[converter]
    assert isinstance(conv_from_dense(PaddedConv2d(2, 2, 1), allow_subclasses=True), CONVERTED)


@pytest.mark.parametrize("bad", ["yes", 1, [nn.ReLU], nn.Module, [WeightStandardizedConv2d, "x"]])
@pytest.mark.parametrize("converter", CONVERTERS)
def test_error_bad_allow_subclasses(converter, bad):
    with pytest.raises(TypeError, match="allow_subclasses must be a bool, or a class or classes derived from "
                                        r"nn\.Conv2d / nn\.Linear"):
        CONVERTERS[converter](model_with(nn.Conv2d(4, 4, 3)), allow_subclasses=bad)


@pytest.mark.parametrize("bad", [3, None, [nn.Conv2d(4, 4, 3)]])
@pytest.mark.parametrize("converter", CONVERTERS)
def test_error_model_not_a_module(converter, bad):
    with pytest.raises(TypeError, match=f"model must be a torch.nn.Module, got {type(bad).__name__}"):
        CONVERTERS[converter](bad)


@pytest.mark.parametrize("converter", CONVERTERS)
def test_allow_subclasses_does_not_drop_state(converter):
    """allow_subclasses vouches for what a class computes, not for state the new layer would drop."""
    with pytest.raises(ValueError, match=r"holds buffer 'calib'"):
        CONVERTERS[converter](model_with(CalibratedConv2d(4, 4, 3)), allow_subclasses=True)


@pytest.mark.parametrize("converter", ALL_CONVERTERS)
def test_removed_hooks_and_patches_no_longer_refuse(converter):
    model = model_with(nn.Conv2d(4, 4, 3))
    model[1][1].weight.register_hook(lambda grad: grad).remove()
    _with_instance_forward(model[0])
    del model[0].forward
    ALL_CONVERTERS[converter](model)
    assert not any(type(m) in (nn.Conv2d, nn.Linear) for m in model.modules())


@pytest.mark.parametrize("converter", CONVERTERS)
def test_subclasses_that_compute_the_same_are_converted(converter):
    torch.manual_seed(0)
    model = model_with(NamedConv2d(4, 5, 3)).double().eval()
    x = torch.randn(2, 3, 7, 7, dtype=torch.float64)
    y = model(x)
    CONVERTERS[converter](model)
    assert isinstance(model[1][1], CONVERTED)
    assert_close(model(x), y, torch.float64, "output")


@pytest.mark.parametrize("converter", CONVERTERS)
def test_multihead_attention_out_proj_is_converted_and_computes_the_same(converter):
    """nn.MultiheadAttention's out_proj is a Linear subclass that overrides nothing, and the
    attention reads its weight directly: the rebuilt weight serves it."""
    torch.manual_seed(1)
    attention = nn.MultiheadAttention(8, 2, dtype=torch.float64)
    model = nn.ModuleDict({"attention": attention})
    x = torch.randn(5, 3, 8, dtype=torch.float64)
    y = attention(x, x, x)[0]
    CONVERTERS[converter](model)
    assert isinstance(attention.out_proj, CONVERTED)
    assert_close(attention(x, x, x)[0], y, torch.float64, "output")


# ---- shared modules --------------------------------------------------------------------

class SharedTwice(nn.Module):
    """One Linear registered under two names (named_modules() yields it once)."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(6, 6)
        self.body = nn.Sequential(nn.Tanh(), self.first)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.body(self.first(x)))


@pytest.mark.parametrize("converter", CONVERTERS)
def test_a_shared_module_becomes_one_layer_under_every_name(converter):
    torch.manual_seed(2)
    model = SharedTwice().double()
    x = torch.randn(4, 6, dtype=torch.float64)
    y = model(x)
    CONVERTERS[converter](model)
    assert isinstance(model.first, CONVERTED) and model.body[1] is model.first
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert_close(model(x), y, torch.float64, "output")
    layers = factorized_layers(model) + multibranch_layers(model)
    assert len(layers) == 2


@pytest.mark.parametrize("converter", CONVERTERS)
def test_a_shared_module_excluded_under_one_name_only_is_refused(converter):
    with pytest.raises(ValueError, match=r"'body\.1' and 'first' are the same Linear module, excluded under the "
                                         "first name only; exclude both names or neither"):
        CONVERTERS[converter](SharedTwice(), exclude=["body"])
    model = CONVERTERS[converter](SharedTwice(), exclude=["first", "body.1"])
    assert type(model.first) is nn.Linear and model.body[1] is model.first
    assert isinstance(model.head, CONVERTED)


# ---- tied parameters -------------------------------------------------------------------

class TiedLinears(nn.Module):
    """Two Linears sharing one weight Parameter (own biases), and a third sharing the second's bias."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(5, 5)
        self.decoder = nn.Linear(5, 5)
        self.decoder.weight = self.encoder.weight
        self.extra = nn.Linear(7, 5)
        self.extra.bias = self.decoder.bias

    def forward(self, x, z):
        return self.decoder(torch.tanh(self.encoder(x))) + self.extra(z)


class TiedConvs(nn.Module):
    """Weight sharing across scales: one kernel at stride 1 and stride 2."""

    def __init__(self):
        super().__init__()
        self.fine = nn.Conv2d(3, 4, 3, padding=1)
        self.coarse = nn.Conv2d(3, 4, 3, stride=2, padding=1, bias=False)
        self.coarse.weight = self.fine.weight

    def forward(self, x):
        return self.fine(x).mean((2, 3)) + self.coarse(x).mean((2, 3))


def _train_step(model, inputs):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(*inputs).square().sum().backward()
    opt.step()


@pytest.mark.parametrize("converter", CONVERTERS)
def test_tied_linears_stay_tied_through_training(converter):
    torch.manual_seed(3)
    model = TiedLinears().double()
    inputs = (torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 7, dtype=torch.float64))
    y = model(*inputs)
    CONVERTERS[converter](model, **({"noise": 0.1} if converter == "multibranch" else {}))
    if converter == "factorize":
        assert_close(model(*inputs), y, torch.float64, "output")
        shared = ("u", "v", "mu")
        assert model.extra.bias is model.decoder.bias
    else:
        shared = ("branch_weight", "alpha_param")
        # The bias tie links extra to decoder, and so to encoder: all three share one α.
        assert model.extra.alpha_param is model.encoder.alpha_param
        assert model.extra.branch_bias is model.decoder.branch_bias
        assert model.encoder.branch_bias is not model.decoder.branch_bias
    for attr in shared:
        assert getattr(model.encoder, attr) is getattr(model.decoder, attr), attr
    _train_step(model, inputs)
    assert torch.equal(model.encoder.weight, model.decoder.weight)
    assert torch.equal(model.extra.bias, model.decoder.bias)
    assert not torch.equal(model.encoder.bias, model.decoder.bias)


@pytest.mark.parametrize("converter", CONVERTERS)
def test_tied_convolutions_with_different_strides_stay_tied(converter):
    torch.manual_seed(4)
    model = TiedConvs().double()
    x = torch.randn(2, 3, 9, 9, dtype=torch.float64)
    y = model(x)
    CONVERTERS[converter](model)
    assert_close(model(x), y, torch.float64, "output")
    _train_step(model, (x,))
    assert torch.equal(model.fine.weight, model.coarse.weight)
    assert model.coarse.bias is None


def test_tied_factors_count_once():
    model = factorize(TiedLinears())
    with torch.no_grad():
        for layer in factorized_layers(model):
            layer.mu.fill_(0.5)
    # encoder and decoder share μ [5, 5]; extra has its own [7, 5].
    assert torch.isclose(sparsity_loss(model), torch.tensor(0.5 * (25 + 35)))
    model = multibranch(TiedLinears(), branches=2)
    params = branch_parameters(model)
    # Weights: encoder's = decoder's, extra's; biases: encoder's, decoder's = extra's.
    assert len(params) == len({id(p) for p in params}) == 4
    assert len(alpha_parameters(model)) == 1


class EmbeddingTiedClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.classifier = nn.Linear(4, 10, bias=False)
        self.classifier.weight = self.embed.weight


class TiedToExcluded(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.b.weight = self.a.weight


class TiedToParentParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 3)
        self.scale = self.proj.bias


@pytest.mark.parametrize("converter", CONVERTERS)
@pytest.mark.parametrize("make,exclude,message", [
    (EmbeddingTiedClassifier, (), r"the weight of 'classifier' \(Linear\) is the same Parameter as 'embed\.weight', "
                                  r"which {converter} does not convert, so converting would untie them; exclude "
                                  r"'classifier', or untie the two first"),
    (TiedToExcluded, ("a",), r"the weight of 'b' \(Linear\) is the same Parameter as 'a\.weight'"),
    (TiedToParentParameter, (), r"the bias of 'proj' \(Linear\) is the same Parameter as 'scale'"),
], ids=["embedding", "excluded", "parent"])
def test_a_tie_to_something_left_unconverted_is_refused(converter, make, exclude, message):
    model = make()
    before = _layers(model)
    with pytest.raises(ValueError, match=message.format(converter=converter)):
        CONVERTERS[converter](model, exclude=exclude)
    assert _layers(model) == before


# ---- requires_grad, arguments, shared α -----------------------------------------------

@pytest.mark.parametrize("converter", ALL_CONVERTERS)
def test_frozen_layers_stay_frozen(converter):
    """A frozen backbone stays frozen: each new parameter keeps the requires_grad of the dense
    weight or bias it is made from (they all became trainable before)."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    model[2].bias.requires_grad_(False)
    ALL_CONVERTERS[converter](model)
    assert isinstance(model[0], CONVERTED + FEDPARA_LAYERS)
    assert not any(p.requires_grad for p in model[0].parameters())
    made = {name: p.requires_grad for name, p in model[2].named_parameters()}
    assert len(made) > 2 and made == {name: "bias" not in name for name in made}  # bias, branch_bias frozen


def test_from_dense_keeps_requires_grad():
    frozen = nn.Linear(3, 2).requires_grad_(False)
    assert not any(p.requires_grad for p in FactorizedLinear.from_dense(frozen).parameters())
    assert not any(p.requires_grad for p in MultiBranchLinear.from_dense(frozen).parameters())


def test_a_shared_alpha_is_trained_where_a_weight_it_weighs_was():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    model[0].requires_grad_(False)
    multibranch(model, branches=2, shared_alpha=True)
    assert model[0].alpha_param is model[1].alpha_param and model[0].alpha_param.requires_grad
    assert not model[0].branch_weight.requires_grad


def test_shared_alpha_ties_only_the_layers_it_converts():
    """Multi-branch layers the model already had keep their own α: they may have another B or
    simplex (the model then failed at its next forward) or a trained α (its output changed)."""
    torch.manual_seed(5)
    model = nn.Sequential(MultiBranchLinear(3, 3, branches=3), nn.Linear(3, 4), nn.Linear(4, 2))
    own = model[0].alpha_param
    multibranch(model, branches=2, shared_alpha=True)
    assert model[0].alpha_param is own
    assert model[1].alpha_param is model[2].alpha_param
    assert model(torch.randn(2, 3)).shape == (2, 2)
    with torch.no_grad():
        for layer in multibranch_layers(model):
            layer.alpha_param.normal_()
    x = torch.randn(2, 3)
    y = model(x)
    multibranch(model, branches=2, shared_alpha=True)  # nothing left to convert: nothing changes
    assert model[1].alpha_param is not model[0].alpha_param
    assert torch.equal(model(x), y)


@pytest.mark.parametrize("call, error, message", [
    (lambda m: factorize(m, layout="bogus"), ValueError, r"layout must be one of"),
    (lambda m: factorize(m, layout="linear"), ValueError, r"layout 'linear' is for FactorizedLinear"),
    (lambda m: factorize(m, rank=0), ValueError, r"rank must be an integer >= 1, got 0"),
    (lambda m: factorize(m, sparse="no"), TypeError, r"sparse must be a bool, got 'no'"),
    (lambda m: multibranch(m, branches=0), ValueError, r"branches must be an integer >= 1, got 0"),
    (lambda m: multibranch(m, branches=2, simplex="x"), ValueError, r"simplex must be one of"),
    (lambda m: multibranch(m, branches=2, noise=-1), ValueError, r"noise must be a finite number >= 0, got -1"),
    (lambda m: multibranch(m, branches=2, noise="a"), ValueError, r"noise must be a finite number >= 0, got 'a'"),
    (lambda m: multibranch(m, branches=2, noise=float("inf")), ValueError, r"noise must be a finite .* got inf"),
    (lambda m: multibranch(m, branches=2, noise=float("nan")), ValueError, r"noise must be a finite .* got nan"),
    (lambda m: multibranch(m, branches=2, shared_alpha="yes"), TypeError, r"shared_alpha must be a bool"),
    (lambda m: fedpara(m, ratio="0.5"), ValueError, r"ratio must be a number in \[0, 1\], got '0.5'"),
])
@pytest.mark.parametrize("model", [lambda: nn.Sequential(nn.ReLU()), lambda: nn.Sequential(nn.Linear(3, 3))],
                         ids=["no-layer", "linear"])
def test_converter_arguments_are_checked_whatever_the_model_holds(call, error, message, model):
    """Before, an argument was checked only by a layer that used it: a model without
    convolutions took any layout, one without layers any rank or noise."""
    with pytest.raises(error, match=message):
        call(model())


class MixedPrecision(nn.Module):
    """A bfloat16 body under a float32 head."""

    def __init__(self, head_device="cpu"):
        super().__init__()
        self.body = nn.Linear(4, 4, dtype=torch.bfloat16)
        self.head = nn.Linear(4, 2, device=head_device)

    def forward(self, x):
        return self.head(self.body(x.bfloat16()).float())


@pytest.mark.parametrize("make, message", [
    (MixedPrecision, r"'body' \(Linear\) has a torch\.bfloat16 weight on cpu and 'head' \(Linear\) a "
                     r"torch\.float32 one on cpu"),
    (lambda: MixedPrecision(head_device="meta").bfloat16(), r"'body' \(Linear\) has a torch\.bfloat16 weight on cpu "
                                                             r"and 'head' \(Linear\) a torch\.bfloat16 one on meta"),
], ids=["dtype", "device"])
def test_a_shared_alpha_over_layers_of_two_dtypes_or_devices_is_refused(make, message):
    """One α cannot serve both: the model converted, then failed at its forward ("weights must
    have alpha's dtype")."""
    model = make()
    before = _layers(model)
    with pytest.raises(ValueError, match=r"shared_alpha=True needs every layer it converts in one dtype and on one "
                                         r"device, but " + message):
        multibranch(model, branches=2, shared_alpha=True)
    assert _layers(model) == before
    # Without a shared α each layer has its own, in its own dtype, and the model runs.
    model = multibranch(MixedPrecision(), branches=2)
    assert model.body.alpha_param.dtype == torch.bfloat16 and model.head.alpha_param.dtype == torch.float32
    assert model(torch.randn(3, 4)).shape == (3, 2)
    # Excluding the odd one out shares α among the rest.
    model = multibranch(MixedPrecision(), branches=2, shared_alpha=True, exclude=["head"])
    assert type(model.head) is nn.Linear and model(torch.randn(3, 4)).shape == (3, 2)


@pytest.mark.parametrize("converter", ALL_CONVERTERS)
def test_exclude_none_excludes_nothing(converter):
    """factorize and multibranch raised TypeError: 'NoneType' object is not iterable; fedpara
    had no exclude."""
    model = ALL_CONVERTERS[converter](nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4, 2)), exclude=None)
    assert not any(type(m) in (nn.Conv2d, nn.Linear) for m in model.modules())
    model = ALL_CONVERTERS[converter](nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4, 2)), exclude="2")
    assert type(model[2]) is nn.Linear and type(model[0]) is not nn.Conv2d
    with pytest.raises(TypeError, match=r"exclude must be a module name, an iterable of them, or None, got 3"):
        ALL_CONVERTERS[converter](nn.Sequential(nn.Linear(4, 2)), exclude=3)


def test_the_layers_of_thousands_of_modules_are_found_by_prefix_lookups():
    """_targets looked through every name found so far for each module (quadratic: 7.2 s for
    16k modules); it now looks up each dotted prefix of a name in a set.  No timing here (CI
    times nothing): the lookups are counted, a few per module."""
    import pfl_kernels.nn.convert as convert

    with torch.device("meta"):
        model = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)) for _ in range(4000))
    named = list(model.named_modules(remove_duplicate=False))
    calls = []
    inside = convert._inside
    convert._inside = lambda name, names: calls.append(name) or inside(name, names)
    try:
        targets = _targets(named, set())
    finally:
        convert._inside = inside
    assert len(targets) == 8000 and targets[1][1] == ["0.2"]
    assert len(calls) == 8000  # one lookup of at most depth-many prefixes per layer, not one per layer found


def test_noise_on_a_one_entry_weight_leaves_the_branches_finite():
    layer = MultiBranchLinear.from_dense(nn.Linear(1, 1), noise=0.1)  # its std was NaN: NaN branches
    assert torch.isfinite(layer.branch_weight).all()
    assert torch.equal(layer.branch_weight[0], layer.branch_weight[1])


def test_a_multibranch_model_moves_to_channels_last():
    """nn.Module.to(memory_format=channels_last) refuses 5-D tensors; the [B, O, I, kh, kw]
    branches go through it as B convolution weights, each channels-last."""
    torch.manual_seed(6)
    model = multibranch(nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 1)), branches=3, noise=0.1)
    x = torch.randn(2, 3, 7, 7)
    y = model(x)
    model.to(memory_format=torch.channels_last)
    for layer in multibranch_layers(model):
        assert all(b.is_contiguous(memory_format=torch.channels_last) for b in layer.branch_weight)
    out = model(x.to(memory_format=torch.channels_last))
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert_close(out, y, torch.float32, "output")
    out.sum().backward()
    model.to(memory_format=torch.contiguous_format).double()
    assert model[0].branch_weight.is_contiguous() and model[0].branch_weight.grad.dtype == torch.float64


# ---- fedpara: the same safeguards ------------------------------------------------------

@pytest.mark.filterwarnings("ignore:.*weight_norm.*deprecated")
@pytest.mark.parametrize("case", [c for c in REFUSED if c != "_conv_forward"])
def test_fedpara_refuses_what_factorize_refuses(case):
    make, message = REFUSED[case]
    model = model_with(make())
    before = _layers(model)
    with pytest.raises(ValueError, match=message.replace(r".*allow_subclasses=True", "")):
        fedpara(model)
    assert _layers(model) == before


def test_fedpara_keeps_shared_modules_and_ties():
    model = fedpara(SharedTwice())
    assert isinstance(model.first, FedParaLinear) and model.body[1] is model.first
    model = fedpara(TiedLinears())
    for attr in ("x1", "y1", "x2", "y2"):
        assert getattr(model.encoder, attr) is getattr(model.decoder, attr), attr
    assert model.extra.bias is model.decoder.bias
    tied = fedpara(TiedConvs())
    assert tied.fine.t1 is tied.coarse.t1 and tied.fine.x2 is tied.coarse.x2
    with pytest.raises(ValueError, match=r"model is itself a Conv2d/Linear; convert nn.Sequential\(model\) instead"):
        fedpara(nn.Linear(3, 3))
    with pytest.raises(ValueError, match=r"the weight of 'classifier' \(Linear\) is the same Parameter as "
                                         r"'embed\.weight', which fedpara does not convert"):
        fedpara(EmbeddingTiedClassifier())
