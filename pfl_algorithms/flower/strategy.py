"""``PflStrategy``: a Flower ``Strategy`` (Message API, flwr >= 1.42) that drives any registered
algorithm's server side through the engine's round steps (``engine.rounds.start_round`` and
``finish_round``, as ``run_round`` does natively); it only translates between them and Flower's
messages.

One Flower round (``Strategy.start``'s loop; Flower counts rounds from 1, pfl from 0)::

    configure_train     start_round -> one Message per training task: the round and client
                        (ConfigRecord) and the download's records (which carry its bits)
    aggregate_train     the replies -> TrainResults (uploads decoded from their records, each
                        reply checked against what the server knows: ``validate``) ->
                        finish_round; a reply with an error (the ClientApp raised), none within
                        the timeout or one that breaks validate's rules is a failure, a
                        non-finite client a skip: the others are aggregated, the run goes on
    configure_evaluate  on the run's evaluation rounds, every client's evaluation task
    aggregate_evaluate  per-client accuracy and loss (a failed or refused client's NaN) -> the
                        round's eval

The ``arrays`` Flower passes around stay empty: server state is the algorithm's, as natively.
Node i serves client i: the strategy asks every node its ``partition-id`` (a query message)
before the first round.
"""
from __future__ import annotations

import math
import time
from logging import INFO
from typing import Callable, Iterable, Optional

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from ..engine.client import EvalResult
from ..engine.rounds import evaluated_clients, evaluates_after, evaluation_summary, evaluation_tasks, start_round
from . import records, validate
from .client import CONFIG, QUERY_METRICS

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
            ``failed`` (client -> reason: the ClientApp raised, did not reply in time or sent
            a reply that ``validate`` refuses) and,
            on evaluation rounds, ``eval_failed``.
    """

    def __init__(self, fed, algorithm, *, discovery_timeout: float = 600.0,
                 on_round: Optional[Callable[[dict], None]] = None):
        self.fed, self.algorithm = fed, algorithm
        self.discovery_timeout = discovery_timeout
        self.on_round = on_round
        self.nodes: dict[int, int] = {}  # client -> node id
        self.history: list[dict] = []
        self._start = self._record = None  # the round's RoundStart and RoundRecord

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
                       group_id=str(server_round))

    # ------------------------------------------------------------------ training

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """``start_round``'s training tasks, one message per sampled client (module docstring)."""
        self.discover(grid)
        self._start = start_round(self.fed, self.algorithm, server_round - 1)
        return [self._message(task.client, {"round": task.round}, task.download, MessageType.TRAIN, server_round)
                for task in self._start.tasks]

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
        """The replies as training results, read against what the server knows
        (:mod:`.validate`: a reply that breaks its rules is its client's failure), and
        ``finish_round`` (its evaluation is Flower's)."""
        contents, failed = self._by_client(replies, self._start.clients)
        results, refused = validate.train_results(self.fed, contents, len(self._start.clients))
        self._record = validate.finish_round_checked(self.fed, self.algorithm, self._start, results,
                                                     {**failed, **refused})
        finite = [loss for loss in self._record.train_loss.values() if math.isfinite(loss)]
        return None, MetricRecord({"train-loss": sum(finite) / len(finite) if finite else float("nan"),
                                   "failed": len(self._record.failed), "skipped": len(self._record.skipped)})

    # ------------------------------------------------------------------ evaluation

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """On evaluation rounds, each evaluated client's evaluation task as a message (none otherwise)."""
        if not evaluates_after(self.fed, server_round - 1):
            return []
        return [self._message(task.client, {"round": task.round, "split": task.split,
                                            "params": task.evaluation.params},
                              task.evaluation.download, MessageType.EVALUATE, server_round)
                for task in evaluation_tasks(self.fed, self.algorithm)]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> Optional[MetricRecord]:
        """Close the round: its evaluation (if any) joins its record in :attr:`history`."""
        record, result, failed = self._record, None, {}
        if evaluates_after(self.fed, server_round - 1):
            evaluated = evaluated_clients(self.fed)
            contents, failed = self._by_client(replies, evaluated)
            results, refused = validate.eval_results(self.fed, contents)
            failed = dict(sorted({**failed, **refused}.items()))
            nan = float("nan")
            record.eval = evaluation_summary([results.get(c, EvalResult(c, nan, nan, 0))
                                              for c in evaluated])
            result = MetricRecord({"mean-accuracy": record.eval["mean_accuracy"]})
        line = {**record.as_dict(), "failed": record.failed}
        if failed:
            line["eval_failed"] = failed
        line["comm_gb"] = self.fed.comm.gigabits()
        self.history.append(line)
        if self.on_round is not None:
            self.on_round(line)
        return result
