"""The Python a Triton launch costs per call, on a CPU: Triton's path (``kernel[grid](...)``:
bind, specialize, look the compiled kernel up, launch) against a direct launch
(``pfl_kernels/triton/_direct.py``: the compiled kernel, its signature bound once), for the
launches the ops make at ``gpu_launch.py``'s quick shapes (issue 30, item 1).

    python benchmarks/launch_python.py [--calls N] [--json PATH]

No GPU is needed, and none is touched: Triton's active driver is a stand-in for one CUDA
device (sm_90), ``JITFunction._do_compile`` hands back a stand-in compiled kernel (its
``[grid]`` runner is Triton's own code, its C launcher a no-op), and the CUDA device and
stream queries return 0.  Everything is restored at exit.  So both sides run all of their
Python and none of the driver's work: compare the two columns with each other, and not with
a GPU machine's figures (its CPU may be slower, and its C launcher adds a few µs to both).

Each launch is recorded from the public op (factorized_weight, its backward op,
branch_combine, pairwise_cosine), then replayed three ways, interleaved, ``--repeats`` times
(medians): Triton's path; ``DirectLaunch[grid](...)``, which keys every argument; and
``DirectLaunch.planned``, which keys the tensors and a plan's identity (what the launchers of
``factorized_weight``, ``branch_combine`` and the pairwise ops use; the others could, with
their scalars in a cached plan).  Writes ``benchmarks/results/launch_python_cpu.json``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import _gpu_common as common  # noqa: E402


class _Compiled:
    """Stands in for a ``CompiledKernel``: Triton's ``[grid]`` runner (the same Python), with a
    C launcher that does nothing."""

    function, packed_metadata = 0, None

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, *args):
        pass

    def __getitem__(self, grid):
        def runner(*args, stream=None):
            metadata = self.launch_metadata(grid, stream, *args)
            self.run(grid[0], grid[1], grid[2], stream, self.function, self.packed_metadata, metadata,
                     None, None, *args)
        return runner


class _Driver:
    """Triton's active driver for one CUDA device (sm_90), without a GPU."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")


@contextlib.contextmanager
def no_gpu_launches(kernels: Sequence) -> Iterator[None]:
    """Within the block ``kernels`` launch as on a GPU, up to the compiled kernel's C launcher,
    which does nothing (module docstring)."""
    from triton.runtime import driver as _unused  # noqa: F401  (loads the module)
    driver_config = sys.modules["triton.runtime.driver"].driver
    saved_driver = driver_config._active
    saved_torch = {name: getattr(torch._C, name, None) for name in ("_cuda_getDevice", "_cuda_getCurrentRawStream")}

    def fake_compile(kernel):
        def compile_(key, signature, device, constexprs, options, attrs, warmup):
            compiled = _Compiled()
            kernel.device_caches[device][0][key] = compiled  # as Triton caches what it compiled
            return compiled
        return compile_

    driver_config.set_active(_Driver())
    torch._C._cuda_getDevice = lambda: 0
    torch._C._cuda_getCurrentRawStream = lambda device: 0
    for k in kernels:
        k._do_compile = fake_compile(k)
    try:
        yield
    finally:
        for k in kernels:
            del k._do_compile
            k.device_caches.clear()  # the stand-in compiled kernels must not outlive the block
        driver_config._active = saved_driver
        for name, fn in saved_torch.items():
            if fn is None:
                delattr(torch._C, name)
            else:
                setattr(torch._C, name, fn)


def recorded_launches() -> list[tuple[str, object]]:
    """(name, Launch) of each Triton launch the ops make at small shapes (the interpreter's
    CPU launchers, recorded; nothing runs on a GPU)."""
    from benchmarks import gpu_launch
    from pfl_kernels import triton as pfl_triton
    from pfl_kernels.ops import branch_combine, factorized_weight, pairwise_cosine

    k, shape = 100, [6, 3, 5, 5]
    u, v, mu = torch.randn(k, 25, 1), torch.randn(k, 1, 18), torch.randn(k, 25, 18)
    weights, alpha = torch.randn(20, 3, 16, 6, 5, 5), torch.softmax(torch.randn(20, 3), 1)
    x = torch.randn(20, 4096)
    calls = {
        "factorized_weight": lambda: factorized_weight(u, v, mu, shape=shape),
        "factorized_weight_backward": lambda: torch.ops.pfl.factorized_weight_backward(
            torch.randn(k, *shape), u, v, mu, None, shape=shape, layout="spatial",
            output_mask=[True, True, True, False]),
        "branch_combine": lambda: branch_combine(weights, alpha, shared_weights=False),
        "pairwise_cosine": lambda: pairwise_cosine(x),
    }
    out = []
    with pfl_triton.launchers_on_cpu():
        for name, call in calls.items():
            with gpu_launch.recording(make=False) as launches:
                call()
            out += [(f"{name} [{i}]" if len(launches) > 1 else name, rec) for i, rec in enumerate(launches)]
    return out


def per_call_us(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def measure(calls: int, repeats: int) -> list[dict]:
    from pfl_kernels.triton import _direct

    launches = recorded_launches()
    kernels = list({id(rec.kernel): rec.kernel for _, rec in launches}.values())
    rows = []
    saved = _direct.ENABLED, _direct.REASON, dict(_direct._LAUNCHERS)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _direct.ENABLED, _direct.REASON = True, None
        _direct._LAUNCHERS.clear()
        with no_gpu_launches(kernels):
            for name, rec in launches:
                direct = _direct.direct(rec.kernel)

                def jit(rec=rec):
                    rec.kernel[rec.grid](*rec.args, **rec.kwargs)

                def fast(rec=rec, direct=direct):
                    direct[rec.grid](*rec.args, **rec.kwargs)

                # the leading tensors, then the rest as a plan would hold them (DirectLaunch.planned)
                lead = next((i for i, a in enumerate(rec.args) if not isinstance(a, torch.Tensor)), len(rec.args))
                tensors, scalars, meta = rec.args[:lead], tuple(rec.args[lead:]), dict(rec.kwargs)
                token = (scalars, meta)

                def planned(rec=rec, direct=direct, tensors=tensors, scalars=scalars, meta=meta, token=token):
                    direct.planned(rec.grid, token, tensors, scalars, meta)
                jit(), fast(), fast(), planned(), planned()  # compile (stand-in) and bind once
                assert direct.signature(rec.args, rec.kwargs) in direct.signatures, \
                    f"{name}: the direct launch did not keep its signature"
                assert len(direct.planned_signatures) >= 1, f"{name}: the planned launch did not keep its signature"
                times = {"triton_path_us": [], "direct_us": [], "planned_us": []}
                for _ in range(repeats):  # interleaved
                    times["triton_path_us"].append(per_call_us(jit, calls))
                    times["direct_us"].append(per_call_us(fast, calls))
                    times["planned_us"].append(per_call_us(planned, calls))
                row = {"launch": name, "kernel": rec.kernel.fn.__name__, "args": len(rec.args) + len(rec.kwargs),
                       **{key: statistics.median(v) for key, v in times.items()}}
                rows.append(row)
                print(f"{name:<34} {row['args']:>4} {row['triton_path_us']:>10.2f} {row['direct_us']:>10.2f} "
                      f"{row['planned_us']:>10.2f}", flush=True)
    finally:
        _direct.ENABLED, _direct.REASON = saved[0], saved[1]
        _direct._LAUNCHERS.clear()
        _direct._LAUNCHERS.update(saved[2])
        torch.set_num_threads(threads)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000, help="calls per timing (default 20000)")
    parser.add_argument("--repeats", type=int, default=7, help="timings per side, interleaved (default 7)")
    parser.add_argument("--json", type=Path, default=None,
                        help="output path (default: benchmarks/results/launch_python_cpu.json)")
    args = parser.parse_args(argv)
    for name, value in (("--calls", args.calls), ("--repeats", args.repeats)):
        if value < 1:
            parser.error(f"{name} must be >= 1, got {value}")
    try:
        import triton
    except ImportError:
        print("launch_python.py needs triton (not installed): nothing measured", file=sys.stderr)
        return 2
    import os
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("launch_python.py measures compiled launches: run it without TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    print(f"{'launch':<34} {'args':>4} {'triton us':>10} {'direct us':>10} {'planned us':>10}")
    rows = measure(args.calls, args.repeats)
    path = args.json or common.RESULTS / "launch_python_cpu.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "suite": "benchmarks/launch_python.py",
        "machine": {"processor": platform.processor() or platform.machine(), "torch": torch.__version__,
                    "triton": triton.__version__, "threads": 1},
        "config": {"calls": args.calls, "repeats": args.repeats,
                   "timing": "time.perf_counter around back-to-back launches, the two sides interleaved; medians",
                   "launcher": "Triton's [grid] runner with a no-op C launcher; a stand-in driver (sm_90)"},
        "rows": rows}, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
