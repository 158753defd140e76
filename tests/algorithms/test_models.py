"""Models: shapes, the body/head split, conversion by pfl_kernels.nn, functional use."""
import pytest
import torch
from torch import nn

from pfl_algorithms.models import MODELS, body_parameter_names, build_client_models, build_model, head_parameter_names
from pfl_kernels.nn import factorize, factorized_layers, multibranch, multibranch_layers

EMBEDDING = {"resnet9": 256, "resnet9-dawnbench": 512, "lenet5": 84, "fedgen-cnn": 32, "digits-cnn": 64, "mlp": 128, "pfedhn-cnn": 84}


# ResNet-9 at 16x16 (its smallest comfortable size) keeps the conversion tests fast.
SMALL = {"resnet9": (3, 16, 16), "resnet9-dawnbench": (3, 16, 16)}


def _build(name, num_classes=10, small=False, **options):
    shape = SMALL.get(name, MODELS[name].example_input_shape) if small else MODELS[name].example_input_shape
    return build_model(name, input_shape=shape, num_classes=num_classes, **options)


def _input(name, n=2, small=False):
    return torch.randn(n, *(SMALL.get(name, MODELS[name].example_input_shape) if small else MODELS[name].example_input_shape))


def test_registry_names():
    assert set(MODELS) == {"resnet9", "resnet9-dawnbench", "lenet5", "fedgen-cnn", "digits-cnn", "mlp", "pfedhn-cnn"}
    assert all(spec.description and "\n" not in spec.description for spec in MODELS.values())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_shapes_and_split(name):
    model = _build(name, num_classes=7)
    x = _input(name, 3)
    assert model.embedding_dim == EMBEDDING[name]
    assert isinstance(model.head, nn.Linear) and model.head.out_features == 7
    assert model.embed(x).shape == (3, EMBEDDING[name])
    out = model(x)
    assert out.shape == (3, 7)
    torch.testing.assert_close(out, model.head(model.body(x)))
    heads, bodies = head_parameter_names(model), body_parameter_names(model)
    assert heads == ["head.weight", "head.bias"]
    assert all(n.startswith("body.") for n in bodies)
    assert set(heads) | set(bodies) == {n for n, _ in model.named_parameters()}


def test_resnet9_parameter_count_by_hand():
    convs = 3 * 64 * 9 + 64 * 128 * 25 + 2 * 128 * 128 * 9 + 128 * 256 * 9 + 2 * 256 * 256 * 9 + 256 * 256 * 9
    batchnorms = 2 * (64 + 128 + 2 * 128 + 256 + 2 * 256 + 256)
    model = _build("resnet9", num_classes=10)
    assert sum(p.numel() for p in model.body.parameters()) == convs + batchnorms == 2_568_768
    assert sum(p.numel() for p in model.head.parameters()) == 256 * 10 + 10
    assert not any(m.bias is not None for m in model.modules() if isinstance(m, nn.Conv2d))


def test_resnet9_dawnbench_layers_and_parameter_count_by_hand():
    """FedDAF's ResNet-9 (64-128-256-512): convs k3 without bias, BatchNorm after each."""
    convs = 3 * 64 * 9 + 64 * 128 * 9 + 2 * 128 * 128 * 9 + 128 * 256 * 9 + 256 * 512 * 9 + 2 * 512 * 512 * 9
    batchnorms = 2 * (64 + 128 + 2 * 128 + 256 + 512 + 2 * 512)
    model = _build("resnet9-dawnbench", num_classes=10)
    assert sum(p.numel() for p in model.body.parameters()) == convs + batchnorms == 6_568_000
    assert sum(p.numel() for p in model.head.parameters()) == 512 * 10 + 10
    assert [m.out_channels for m in model.modules() if isinstance(m, nn.Conv2d)] == [64, 128, 128, 128, 256, 512, 512, 512]
    assert not any(m.bias is not None for m in model.modules() if isinstance(m, nn.Conv2d))
    narrow = build_model("resnet9-dawnbench", input_shape=(1, 28, 28), num_classes=10, width=4)
    assert narrow.embedding_dim == 32 and narrow(torch.randn(2, 1, 28, 28)).shape == (2, 10)


def test_resnet9_width_narrows_every_layer():
    model = build_model("resnet9", input_shape=(1, 28, 28), num_classes=10, width=8)
    convs = [m.out_channels for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert convs == [8, 16, 16, 16, 32, 32, 32, 32] and model.embedding_dim == 32
    assert model(torch.randn(3, 1, 28, 28)).shape == (3, 10)
    for bad in (0, -4, 2.5, True):
        with pytest.raises(ValueError, match="width must be a positive integer"):
            build_model("resnet9", input_shape=(1, 28, 28), num_classes=10, width=bad)


def test_input_shapes_follow_the_data():
    assert build_model("resnet9", input_shape=(1, 28, 28), num_classes=10)(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    lenet = build_model("lenet5", input_shape=(1, 28, 28), num_classes=10)
    assert lenet.body[7].in_features == 16 * 4 * 4
    assert _build("lenet5").body[7].in_features == 400
    assert _build("fedgen-cnn").body[7].in_features == 784
    assert build_model("digits-cnn", input_shape=(3, 8, 8), num_classes=2)(torch.randn(1, 3, 8, 8)).shape == (1, 2)
    mlp = build_model("mlp", input_shape=(1, 8, 8), num_classes=10, hidden=(32, 16))
    assert mlp(torch.randn(4, 1, 8, 8)).shape == (4, 10) and mlp.embedding_dim == 16


def test_fed_cma_toy_and_logistic_regression():
    toy = build_model("mlp", input_shape=(2,), num_classes=4, hidden=(2, 2), activation=None)
    assert [m for m in toy.modules() if isinstance(m, nn.Linear)].__len__() == 3
    assert not any(isinstance(m, nn.ReLU) for m in toy.modules())
    logreg = build_model("mlp", input_shape=(5,), num_classes=3, hidden=())
    assert logreg.embedding_dim == 5 and body_parameter_names(logreg) == []


def test_fedgen_embedding_activation():
    x = _input("fedgen-cnn", 8)
    emb = _build("fedgen-cnn", embedding_activation="sigmoid").embed(x)
    assert emb.min() >= 0 and emb.max() <= 1
    assert (_build("fedgen-cnn", embedding_activation=None).embed(x) < 0).any()
    with pytest.raises(ValueError, match="embedding_activation"):
        _build("fedgen-cnn", embedding_activation="gelu")


def test_pfedhn_cnn_is_the_codes_cnn_target():
    """pFedHN's CNNTarget: the code's parameter shapes (conv 3→16 k5, conv 16→32 k5, fc 800→120,
    120→84, 84→10), the flatten size following the input, and the embedding activation."""
    model = _build("pfedhn-cnn")
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert shapes == [(16, 3, 5, 5), (16,), (32, 16, 5, 5), (32,), (120, 800), (120,), (84, 120), (84,), (10, 84), (10,)]
    assert sum(p.numel() for p in model.parameters()) == 1216 + 12832 + 96120 + 10164 + 850
    assert not any(True for _ in model.buffers())  # nothing for a hypernetwork to miss
    gray = build_model("pfedhn-cnn", input_shape=(1, 28, 28), num_classes=4, n_kernels=8)
    assert gray.body[7].in_features == 16 * 4 * 4 and gray(torch.randn(2, 1, 28, 28)).shape == (2, 4)
    x = _input("pfedhn-cnn", 8)
    emb = _build("pfedhn-cnn", embedding_activation="sigmoid").embed(x)
    assert emb.min() >= 0 and emb.max() <= 1
    assert (_build("pfedhn-cnn").embed(x) >= 0).all()
    assert (_build("pfedhn-cnn", embedding_activation=None).embed(x) < 0).any()
    with pytest.raises(ValueError, match="at least 16x16"):
        build_model("pfedhn-cnn", input_shape=(3, 8, 8), num_classes=10)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_factorize_converts_and_runs(name):
    model = _build(name, small=True).eval()
    x = _input(name, small=True)
    before = model(x)
    factorize(model, exclude=["head"])
    assert factorized_layers(model)
    assert isinstance(model.head, nn.Linear)
    # sparse=True makes the converted model compute the same function.
    torch.testing.assert_close(model(x), before, rtol=1e-4, atol=1e-4)
    assert head_parameter_names(model) == ["head.weight", "head.bias"]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_multibranch_converts_and_runs(name):
    model = _build(name, small=True).eval()
    x = _input(name, small=True)
    before = model(x)
    multibranch(model, branches=3)
    layers = multibranch_layers(model)
    assert layers and model.head in layers
    torch.testing.assert_close(model(x), before, rtol=1e-4, atol=1e-4)
    assert all(n.startswith("head.") for n in head_parameter_names(model)) and head_parameter_names(model)


@pytest.mark.parametrize("name", ["lenet5", "digits-cnn", "mlp", "fedgen-cnn", "pfedhn-cnn"])
def test_functional_call_and_vmap_over_stacked_parameters(name):
    model = _build(name).eval()
    x = _input(name, 4)
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = dict(model.named_buffers())
    torch.testing.assert_close(torch.func.functional_call(model, (params, buffers), (x,)), model(x))
    stacked = {k: torch.stack([v, v + 0.01]) for k, v in params.items()}
    out = torch.func.vmap(lambda p: torch.func.functional_call(model, (p, buffers), (x,)))(stacked)
    assert out.shape == (2, 4, 10)
    torch.testing.assert_close(out[0], model(x))


# The image models' smallest input: what each accepts must run, one pixel less is refused.
SMALLEST = {"lenet5": 16, "pfedhn-cnn": 16, "resnet9": 11, "resnet9-dawnbench": 8, "digits-cnn": 2, "fedgen-cnn": 1}


@pytest.mark.parametrize("name", sorted(SMALLEST))
def test_the_smallest_accepted_image_runs_and_one_less_is_refused(name):
    size = SMALLEST[name]
    for shape in ((3, size, size), (3, size, size + 5), (3, size + 5, size)):  # H and W apart
        model = build_model(name, input_shape=shape, num_classes=10).eval()
        assert model(torch.randn(2, *shape)).shape == (2, 10)
    if size > 1:
        for shape in ((3, size - 1, size), (3, size, size - 1)):
            with pytest.raises(ValueError, match=f"{name} needs inputs of at least {size}x{size}"):
                build_model(name, input_shape=shape, num_classes=10)


def test_errors():
    with pytest.raises(ValueError, match="valid models"):
        build_model("vgg", input_shape=(3, 32, 32), num_classes=10)
    with pytest.raises(ValueError, match="valid options"):
        build_model("mlp", input_shape=(2,), num_classes=2, width=3)
    with pytest.raises(ValueError, match="at least 11x11"):
        build_model("resnet9", input_shape=(1, 8, 8), num_classes=10)
    with pytest.raises(ValueError, match=r"\(C, H, W\)"):
        build_model("lenet5", input_shape=(784,), num_classes=10)
    with pytest.raises(ValueError, match="num_classes"):
        build_model("mlp", input_shape=(2,), num_classes=0)
    with pytest.raises(TypeError, match="body"):
        head_parameter_names(nn.Linear(2, 2))


@pytest.mark.parametrize("name, options", [("digits-cnn", {}), ("lenet5", {}), ("fedgen-cnn", {}),
                                           ("mlp", {"hidden": (7, 5)})])
def test_embedding_activation_bounds_the_embedding_and_defaults_keep_each_models_own(name, options):
    torch.manual_seed(0)
    shape = MODELS[name].example_input_shape
    x = 4 * torch.randn(6, *shape)
    default = build_model(name, input_shape=shape, num_classes=3, **options)
    assert (default.embed(x) >= 0).all() and type(default.body[-1]).__name__ == "ReLU"  # each model's own
    bounded = build_model(name, input_shape=shape, num_classes=3, embedding_activation="sigmoid", **options)
    z = bounded.embed(x)
    assert ((z > 0) & (z < 1)).all() and z.shape == (6, bounded.embedding_dim)
    linear = build_model(name, input_shape=shape, num_classes=3, embedding_activation=None, **options)
    assert (linear.embed(x) < 0).any()


def test_mlp_embedding_activation_same_is_the_hidden_activation():
    torch.manual_seed(0)
    x = torch.randn(5, 2)
    toy = build_model("mlp", input_shape=(2,), num_classes=4, hidden=(2, 2), activation=None)
    assert [type(m).__name__ for m in toy.body] == ["Flatten", "Linear", "Identity", "Linear", "Identity"]
    bounded = build_model("mlp", input_shape=(2,), num_classes=4, hidden=(2, 2), activation=None,
                          embedding_activation="sigmoid")
    assert [type(m).__name__ for m in bounded.body][-1] == "Sigmoid" and type(bounded.body[2]).__name__ == "Identity"
    assert bounded(x).shape == (5, 4)


def test_a_mixed_federation_bounds_embeddings_with_a_sigmoid_unless_told_otherwise():
    entries = ["digits-cnn(embedding_dim=32)", "mlp(hidden=(64, 32))", "fedgen-cnn(embedding_activation='relu')"]
    models = build_client_models(entries, input_shape=(1, 8, 8), num_classes=10)
    last = lambda model: type(model.body[-1]).__name__
    assert [last(models[e]) for e in entries] == ["Sigmoid", "Sigmoid", "ReLU"]  # the entry's own option wins
    relu = build_client_models(entries[:2], input_shape=(1, 8, 8), num_classes=10,
                               options={"embedding_activation": "relu"})
    assert [last(m) for m in relu.values()] == ["ReLU", "ReLU"]  # the run's model option next


@pytest.mark.parametrize("name, shape", [("digits-cnn", (1, 8, 8)), ("lenet5", (1, 28, 28))])
def test_norm_batch_puts_batchnorm_after_each_conv_and_none_keeps_the_names(name, shape):
    """``norm='batch'``: a BatchNorm2d of the conv's width after every conv (the normalized models
    of the demo), 'group' a GroupNorm (digits-cnn's default); None builds the model without either."""
    plain = build_model(name, input_shape=shape, num_classes=10, norm=None)
    assert [n for n, _ in plain.named_parameters()][:2] == ["body.0.weight", "body.0.bias"]
    assert not any(isinstance(m, (torch.nn.BatchNorm2d, torch.nn.GroupNorm)) for m in plain.modules())
    normed = build_model(name, input_shape=shape, num_classes=10, norm="batch")
    default = build_model(name, input_shape=shape, num_classes=10)
    assert any(isinstance(m, torch.nn.GroupNorm) for m in default.modules()) == (name == "digits-cnn")
    layers = list(normed.body)
    convs = [i for i, m in enumerate(layers) if isinstance(m, torch.nn.Conv2d)]
    assert convs and all(isinstance(layers[i + 1], torch.nn.BatchNorm2d)
                         and layers[i + 1].num_features == layers[i].out_channels for i in convs)
    assert normed(torch.randn(4, *shape)).shape == (4, 10)
    with pytest.raises(ValueError, match="norm must be one of"):
        build_model(name, input_shape=shape, num_classes=10, norm="layer")
