"""``PflStrategy``: a Flower ``Strategy`` (Message API, flwr 1.22) that drives any registered
algorithm's server side, as ``engine.rounds.run_round`` does natively.

One Flower round (``Strategy.start``'s loop; Flower counts rounds from 1, pfl from 0)::

    configure_train     sample_clients(round), configure -> one Message per sampled node:
                        the round and client (ConfigRecord) and the download's records; the
                        ledger counts each download as decoded from its records
    aggregate_train     the replies -> Uploads (clients in ascending order, as natively), each
                        upload counted from its records; a reply with an error (the ClientApp
                        raised) or none within the timeout is a failure, a non-finite client a
                        skip: the others are aggregated and the run goes on
    configure_evaluate  on the run's evaluation rounds, every client's evaluation download
    aggregate_evaluate  per-client accuracy and loss (a failed client's NaN), the round's record

The ``arrays`` Flower passes around stay empty: server state is the algorithm's, as natively.
Node i serves client i: the strategy asks every node its ``partition-id`` (a query message)
before the first round.
"""
from __future__ import annotations

import math
import time
from logging import INFO
from typing import Callable, Iterable, Optional

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from ..engine.rounds import RoundRecord, _downloads, _evaluation
from ..engine.uploads import Uploads
from . import records
from .client import CONFIG, EVAL_METRICS, QUERY_METRICS, TRAIN_METRICS

NO_REPLY = "no reply within the round's timeout"


def _last_line(text) -> str:
    """The last line of an error reason (Ray's carry the whole remote traceback), at most 300
    characters."""
    lines = [line.strip() for line in str(text or "").splitlines() if line.strip()]
    return (lines[-1] if lines else "")[-300:]


class PflStrategy(Strategy):
    """The server side of ``algorithm`` (attached to the server's federation ``fed``) over
    Flower nodes.

    Attributes:
        history: one dict per finished round, as a native run's ``metrics.jsonl`` line, plus
            ``failed`` (client -> reason: the ClientApp raised or did not reply in time) and,
            on evaluation rounds, ``eval_failed``.
    """

    def __init__(self, fed, algorithm, *, discovery_timeout: float = 600.0,
                 on_round: Optional[Callable[[dict], None]] = None):
        self.fed, self.algorithm = fed, algorithm
        self.discovery_timeout = discovery_timeout
        self.on_round = on_round
        self.nodes: dict[int, int] = {}  # client -> node id
        self.history: list[dict] = []
        self._round: dict = {}

    def summary(self) -> None:
        """Log what runs (Flower calls this at the start)."""
        log(INFO, "\t├──> pfl algorithm %s on %d clients", self.algorithm.name, self.fed.num_clients)

    # ------------------------------------------------------------------ nodes

    def discover(self, grid: Grid) -> None:
        """Map every client to its node: wait until the federation's clients have nodes, then
        ask each node its ``partition-id``.

        Raises:
            RuntimeError: within ``discovery_timeout`` some client has no node, or two nodes
                claim one client.
        """
        if self.nodes:
            return
        deadline = time.time() + self.discovery_timeout
        nodes = list(grid.get_node_ids())
        while len(nodes) < self.fed.num_clients and time.time() < deadline:
            time.sleep(0.5)
            nodes = list(grid.get_node_ids())
        queries = [Message(RecordDict(), dst_node_id=node, message_type=MessageType.QUERY) for node in nodes]
        replies = grid.send_and_receive(queries, timeout=max(deadline - time.time(), 1.0))
        for reply in replies:
            if reply.has_error():
                continue
            client = int(reply.content[QUERY_METRICS]["partition-id"])
            if client in self.nodes:
                raise RuntimeError(f"nodes {self.nodes[client]} and {reply.metadata.src_node_id} both serve client "
                                   f"{client}: give each SuperNode its own partition-id")
            self.nodes[client] = reply.metadata.src_node_id
        missing = sorted(set(range(self.fed.num_clients)) - set(self.nodes))
        if missing:
            raise RuntimeError(f"no node serves clients {missing}: start one SuperNode per client, each with "
                               f"--node-config 'partition-id=<i> num-partitions={self.fed.num_clients}'")

    def _message(self, client: int, config: dict, download, message_type: str, server_round: int):
        content = RecordDict({CONFIG: ConfigRecord({"client": client, **config})})
        if download is not None:
            for name, record in records.encode(download, "down").items():
                content[name] = record
        return Message(content, dst_node_id=self.nodes[client], message_type=message_type,
                       group_id=str(server_round)), content

    # ------------------------------------------------------------------ training

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """One training message per sampled client (module docstring)."""
        self.discover(grid)
        fed, round_ = self.fed, server_round - 1
        clients = fed.sample_clients(round_).tolist()
        self._round = {"start": time.perf_counter(), "clients": clients, "up": fed.comm.total("up"),
                       "down": fed.comm.total("down")}
        downloads = _downloads(self.algorithm.configure(round_, torch.tensor(clients)), clients)
        messages = []
        for client in clients:
            message, content = self._message(client, {"round": round_}, downloads[client], MessageType.TRAIN,
                                             server_round)
            sent = records.decode(content, "down", fed.device)
            if sent is not None:  # counted as it travels: from its records
                fed.comm.record("down", client, sent, fed.cohort_of(client).name)
            messages.append(message)
        return messages

    def _by_client(self, replies: Iterable[Message], clients: list[int]) -> tuple[dict, dict]:
        """(content by client, failure reason by client) of a round's replies."""
        client_of = {node: client for client, node in self.nodes.items()}
        contents, failed = {}, {}
        for reply in replies:
            client = client_of.get(reply.metadata.src_node_id)
            if client is None or client not in clients:
                continue
            if reply.has_error():
                failed[client] = f"error {reply.error.code}: {_last_line(reply.error.reason)}"
            else:
                contents[client] = reply.content
        for client in clients:
            if client not in contents and client not in failed:
                failed[client] = NO_REPLY
        return contents, failed

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[Optional[ArrayRecord], Optional[MetricRecord]]:
        """Aggregate the uploads of the clients that replied with a finite update."""
        fed, round_, clients = self.fed, server_round - 1, self._round["clients"]
        contents, failed = self._by_client(replies, clients)
        losses, skipped, senders, uploads = {}, [], [], []
        for client in clients:
            if client not in contents:
                continue
            content = contents[client]
            train = content[TRAIN_METRICS]
            losses[client] = float(train["loss"])
            if not train["finite"]:
                skipped.append(client)
            elif records.has_message(content, "up"):
                upload = records.decode(content, "up", fed.device)
                fed.comm.record("up", client, upload, fed.cohort_of(client).name)
                senders.append(client)
                uploads.append(upload)
        self.algorithm.aggregate(round_, Uploads(senders, uploads, sorted([*skipped, *failed])))
        fed.round = round_ + 1
        record = RoundRecord(round=round_, clients=clients, train_loss=losses, skipped=skipped,
                             bits_up=fed.comm.total("up") - self._round["up"],
                             bits_down=fed.comm.total("down") - self._round["down"],
                             wall_s=time.perf_counter() - self._round["start"],
                             algorithm=dict(self.algorithm.round_metrics(round_)))
        self._round.update(record=record, failed=failed)
        finite = [loss for loss in losses.values() if math.isfinite(loss)]
        return None, MetricRecord({"train-loss": sum(finite) / len(finite) if finite else float("nan"),
                                   "failed": len(failed), "skipped": len(skipped)})

    # ------------------------------------------------------------------ evaluation

    def _evaluates(self, round_: int) -> bool:
        settings = self.fed.settings
        return (round_ + 1) % settings.eval_every == 0 or round_ + 1 == settings.rounds

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """On evaluation rounds, every client's evaluation message (none otherwise)."""
        if not self._evaluates(server_round - 1):
            return []
        messages = []
        for client in range(self.fed.num_clients):
            evaluation = _evaluation(self.algorithm.evaluation(client))
            messages.append(self._message(client, {"round": self.fed.round, "split": "test",
                                                   "params": evaluation.params},
                                          evaluation.download, MessageType.EVALUATE, server_round)[0])
        return messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> Optional[MetricRecord]:
        """Close the round: its evaluation (if any) joins its record in :attr:`history`."""
        record: RoundRecord = self._round["record"]
        line = record.as_dict()
        result = None
        if self._evaluates(server_round - 1):
            clients = list(range(self.fed.num_clients))
            contents, failed = self._by_client(replies, clients)
            nan = float("nan")
            acc = {c: float(contents[c][EVAL_METRICS]["accuracy"]) if c in contents else nan for c in clients}
            loss = {c: float(contents[c][EVAL_METRICS]["loss"]) if c in contents else nan for c in clients}
            valid = [a for a in acc.values() if a == a]
            line["eval"] = {"split": "test", "accuracy": acc, "loss": loss,
                            "mean_accuracy": sum(valid) / len(valid) if valid else nan}
            if failed:
                line["eval_failed"] = failed
            result = MetricRecord({"mean-accuracy": line["eval"]["mean_accuracy"]})
        line["failed"] = self._round["failed"]
        line["comm_gb"] = self.fed.comm.gigabits()
        self.history.append(line)
        if self.on_round is not None:
            self.on_round(line)
        return result
