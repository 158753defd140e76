"""FedAvg on the classifier only (FedAvgSim in Pillutla et al., 2022, "Federated Learning with
Partial Model Personalization"; Fed-CMA's Table 2 "FedAvg"): every client keeps its feature
extractor, of any architecture, and starts each round from the global classifier; the server
averages the classifiers weighted by training-set size, v ← Σ_i (n_i / n) v_i.  Each client is
evaluated with the global classifier on its own extractor."""
from __future__ import annotations

from ..api import Capabilities
from .fedavg import FedAvg


class FedAvgClassifier(FedAvg):
    """FedAvg of the ``head`` group; the ``body`` never leaves a client."""

    name = "fedavg-classifier"
    description = "FedAvg of the classifier only; every feature extractor (of any architecture) stays local"
    capabilities = Capabilities(mixed_architectures=True, head="shared")

    def local_groups(self, *, keep_head_local: bool) -> set[str]:
        return {"body"}
