"""Build of pfl-kernels and its extension ``pfl_kernels._C``.

Torch extensions must be built against the installed torch, so install with
``pip install --no-build-isolation -e .`` (or without -e).

Environment switches:
  PFL_KERNELS_SKIP_EXTENSION=1   build no extension (the pure-PyTorch/Triton paths still work)
  PFL_KERNELS_CUDA=1 / =0        force / skip compiling csrc/cuda (default: only where
                                 CUDA_HOME is set and torch is a CUDA build)
  PFL_KERNELS_OPT_LEVEL=0..3     the C++ compiler's -O level for csrc/*.cpp (default 3; CI's floor
                                 phase builds at 1); nvcc's stays -O3
"""
import glob
import os

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _flag(name):
    value = os.environ.get(name)
    return None if value is None or value == "" else value not in ("0", "false", "no")


def _opt_level():
    """The -O flag of the C++ build, from PFL_KERNELS_OPT_LEVEL (default 3)."""
    value = os.environ.get("PFL_KERNELS_OPT_LEVEL") or "3"
    if value not in ("0", "1", "2", "3"):
        raise SystemExit(f"PFL_KERNELS_OPT_LEVEL must be 0, 1, 2 or 3, got {value!r}")
    return f"-O{value}"


def _extensions():
    if _flag("PFL_KERNELS_SKIP_EXTENSION"):
        return [], {}
    opt_level = _opt_level()  # before torch's import: a bad value is refused at once
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/autograd/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    cuda_sources = sorted(glob.glob("csrc/cuda/*.cu"))
    use_cuda = _flag("PFL_KERNELS_CUDA")
    if use_cuda is None:
        use_cuda = CUDA_HOME is not None and torch.version.cuda is not None
    use_cuda = bool(use_cuda and cuda_sources)

    openmp = ["-fopenmp"] if not torch.backends.mps.is_built() else []
    # The sources are C++17; BuildExtension adds the -std its torch's headers need (c++20
    # for recent torch) and -DPy_LIMITED_API for py_limited_api=True, so neither is set here.
    # -g0 overrides the -g of Python's own CFLAGS: debug info for torch's template-heavy headers
    # took 30% of a fresh build (98 s -> 69 s on 2 cores; GCC's code is the same either way).
    # A lower level is for builds that only check that the sources compile and agree with the
    # reference (test_floor.sh): -O1 took 114 s against -O3's 164 s on 2 cores, and the floor's
    # tests, whose tensors are small, ran in the same time on either build (163 s against 165 s).
    cxx = [opt_level, "-g0", *openmp]
    extra = {"cxx": cxx}
    extension = CppExtension
    if use_cuda:
        extension = CUDAExtension
        sources += cuda_sources
        extra["nvcc"] = ["-O3", "-std=c++17"]
    ext = extension("pfl_kernels._C", sources, extra_compile_args=extra,
                    extra_link_args=openmp, py_limited_api=True)
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = _extensions()

setup(
    packages=find_packages(include=["pfl_kernels*", "pfl_algorithms*"]),
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    options={"bdist_wheel": {"py_limited_api": "cp39"}} if ext_modules else {},
)
