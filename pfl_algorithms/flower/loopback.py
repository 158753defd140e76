"""A Flower ``Grid`` whose nodes are ClientApp calls in this process: node i holds client i's
Context (``partition-id`` i) and answers each message at once, in order.  No Ray, no network:
a fast, deterministic way to run :class:`~pfl_algorithms.flower.strategy.PflStrategy` and the
ClientApp through the same Message API (tests, debugging).  A ClientApp that raises gives an
error reply, as the simulation and deployment runtimes do.

Like those runtimes, a LoopbackGrid sets the process's Flower task identity (run 0, the
SuperLink's node), which flwr >= 1.42 reads to fill in every new ``Message``'s metadata."""
from __future__ import annotations

import uuid
from typing import Iterable, Optional

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

# Flower's code for an exception raised in a ClientApp (flwr.common.constant.ErrorCode).
CLIENT_APP_RAISED_EXCEPTION = 300


class LoopbackGrid(Grid):
    """``num_nodes`` nodes (ids 1..num_nodes) running ``client_app``; ``down``: node ids that
    never reply (as a killed SuperNode)."""

    def __init__(self, client_app, num_nodes: int, *, down: Iterable[int] = ()):
        self.client_app = client_app
        self.contexts = {node: Context(run_id=0, node_id=node, state=RecordDict(), run_config={},
                                       node_config={"partition-id": node - 1, "num-partitions": num_nodes})
                         for node in range(1, num_nodes + 1)}
        self.down = set(down)
        # What Flower's runtimes set before a ServerApp runs (run_simulation: task 1 on the
        # SuperLink's node); Message(...) raises without it.
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 0, SUPERLINK_NODE_ID
        self._replies: dict[str, Message] = {}

    def set_run(self, run_id: int) -> None:
        """Runs are not tracked."""

    @property
    def run(self):
        raise NotImplementedError("a LoopbackGrid has no run")

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None) -> Message:
        """A message to ``dst_node_id``."""
        return Message(content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id, ttl=ttl)

    def get_node_ids(self) -> Iterable[int]:
        """Every node, including those that are down (they are still registered)."""
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Deliver each message to its node now; the ids of the messages pushed."""
        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = message_id = uuid.uuid4().hex
            ids.append(message_id)
            node = message.metadata.dst_node_id
            if node in self.down:
                continue
            try:
                reply = self.client_app(message, self.contexts[node])
            except Exception as error:  # a ClientApp's failure is the round's, not the server's
                reply = Message(Error(CLIENT_APP_RAISED_EXCEPTION, f"{type(error).__name__}: {error}"),
                                reply_to=message)
            reply.metadata.__dict__["_src_node_id"] = node
            self._replies[message_id] = reply
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """The replies received for ``message_ids``."""
        return [self._replies.pop(i) for i in list(message_ids) if i in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: Optional[float] = None) -> Iterable[Message]:
        """Push, then pull every reply there is (a node that is down gives none)."""
        return self.pull_messages(self.push_messages(messages))
