"""Client banks: one flat [K, P] tensor per kind of client state, with named views.

A federation's parameters, optimizer buffers and BatchNorm statistics are each one bank.
A client's model is a row (a view, never a deep copy); aggregation over clients is one op
over ``bank.data[:, span]``; a checkpoint is one tensor per bank.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from .layout import FlatLayout


class ClientBank:
    """The state of ``num_clients`` clients, laid out by ``layout``: ``data`` is [K, P]."""

    def __init__(self, layout: FlatLayout, num_clients: int, *, device: Union[str, torch.device] = "cpu",
                 fill: Optional[torch.Tensor] = None):
        if isinstance(num_clients, bool) or not isinstance(num_clients, int) or num_clients < 1:
            raise ValueError(f"num_clients must be an integer >= 1, got {num_clients!r}")
        self.layout = layout
        self.data = torch.zeros(num_clients, layout.numel, dtype=layout.dtype, device=device)
        if fill is not None:
            self.data.copy_(fill.reshape(1, -1).expand_as(self.data))

    @property
    def num_clients(self) -> int:
        return self.data.shape[0]

    def row(self, client: int) -> torch.Tensor:
        """Client ``client``'s flat state [P] (a view)."""
        return self.data[client]

    def state_dict(self) -> dict:
        return {"data": self.data}

    def load_state_dict(self, state: dict) -> None:
        data = state["data"]
        if data.shape != self.data.shape or data.dtype != self.data.dtype:
            raise ValueError(f"bank state has shape {list(data.shape)} {data.dtype}, expected "
                             f"{list(self.data.shape)} {self.data.dtype}")
        self.data.copy_(data)

    def __repr__(self) -> str:
        return f"ClientBank({self.num_clients} clients x {self.layout.numel} {self.layout.dtype})"

