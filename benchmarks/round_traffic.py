"""Bytes one training round moves through eager ATen ops, per executor (on a CPU).

    python benchmarks/round_traffic.py [--model resnet9 --factorized --clients 2 --samples 128
                                        --batch 128 --image 32 --autocast bf16 --top 8]

Builds ``gpu_executor.federation`` (FedAvg on CIFAR-shaped synthetic shards), runs one round to
warm it up, then counts the next round with ``step_roofline.TrafficCounter`` (each ATen op's
tensor inputs read once and its new outputs written once) on the sequential and the batched
executor: the same samples and steps, so the difference is what the batched executor's vmap
rules add.  Memory-bound steps (a ResNet-9 step is about 96 FLOP per byte, under an H100's
ridge point) take time in proportion; ``--top`` lists the ops that move the most.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from benchmarks.step_roofline import TrafficCounter  # noqa: E402


def round_traffic(model: str, *, factorized: bool, clients: int, samples: int, batch: int, executor: str,
                  autocast=None, image: int = 32) -> TrafficCounter:
    """The counter of one round (the second) of ``executor`` on the given federation (images of
    3 x ``image`` x ``image``)."""
    from benchmarks.gpu_executor import federation
    from pfl_algorithms.engine.rounds import run_round

    fed, algorithm = federation(model, factorized=factorized, clients=clients, samples=samples, batch=batch,
                                executor=executor, device="cpu", autocast=autocast, image=image)
    fed.step_graphs.static = True  # the static steps a GPU captures, run uncaptured
    try:
        run_round(fed, algorithm, 0)
        traffic = TrafficCounter()
        with traffic:
            run_round(fed, algorithm, 1)
        return traffic
    finally:
        fed.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet9")
    parser.add_argument("--factorized", action="store_true")
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--samples", type=int, default=128, help="per client")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--image", type=int, default=32, help="the images' side, in pixels")
    parser.add_argument("--autocast", choices=("bf16",), default=None)
    parser.add_argument("--top", type=int, default=0, help="also list the ops that move the most")
    args = parser.parse_args(argv)
    for executor in ("sequential", "batched"):
        traffic = round_traffic(args.model, factorized=args.factorized, clients=args.clients, samples=args.samples,
                                batch=args.batch, executor=executor, autocast=args.autocast, image=args.image)
        per_sample = traffic.total / (args.clients * args.samples)
        print(f"{executor:<10} {traffic.total / 1e9:7.2f} GB a round, {per_sample / 1e6:6.2f} MB a sample")
        for op, moved in traffic.by_op.most_common(args.top):
            print(f"    {op:<40} {moved / 1e9:7.3f} GB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
