"""The Flower app of pfl: ``server_app`` and ``client_app`` (``pyproject.toml``'s
``[tool.flwr.app.components]``), run by ``flwr run .``.

What runs comes from the run config (``[tool.flwr.app.config]``, overridden by ``flwr run .
--run-config FILE``, the file ``pfl flower`` writes):

* ``pfl-config``  a RunConfig as JSON (empty: the defaults, FedAvg on digits);
* ``pfl-out``     the run directory for ``config.json``, ``metrics.jsonl`` and ``summary.json``
                  (empty: ``runs/flower-<algorithm>-<scenario>-<dataset>-seed<S>``);
* ``pfl-timeout-s`` how long the server waits for a round's replies (a node that does not
                  reply in time is a failure of that round);
* ``pfl-faults``  failure drills for tests (``flower.client.Faults``), empty normally.
"""
from __future__ import annotations

import contextlib

from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

from . import require_flwr

require_flwr()

from flwr.app import ArrayRecord, Context  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402

from ..config import RunConfig  # noqa: E402
from .client import config_from_key, make_client_app  # noqa: E402
from .strategy import PflStrategy  # noqa: E402


def run_server(config: RunConfig, grid: Grid, *, timeout: float = 3600.0, out: Optional[Path] = None,
               on_round: Optional[Callable[[dict], None]] = None) -> PflStrategy:
    """Run ``config``'s rounds over ``grid`` with :class:`PflStrategy` on a federation of the
    server's own; write the run directory ``out`` when given.  Returns the strategy (its
    ``history`` and ``fed.comm``)."""
    from ..atomic_io import atomic_write_json
    from ..engine.rundir import RunDirectory
    from ..runner import build, summarize

    with contextlib.ExitStack() as stack:
        rundir = None
        if out is not None:
            # As `pfl run`: checked before anything loads and locked for the whole run; a directory
            # that is not ours, or that already holds a run, is refused (Flower has no --overwrite).
            rundir = stack.enter_context(RunDirectory(out).claimed())
            if rundir.identity() is not None:
                raise ValueError(f"pfl-out {out} already holds a run; give `pfl flower` another --out, or remove it")
        fed, algorithm, partition = build(replace(config, executor="sequential", workers=None))
        if rundir is not None:
            rundir.begin()
            atomic_write_json(rundir.config, config.as_dict())

        def each_round(line: dict) -> None:
            if rundir is not None:
                rundir.append_metrics(line)
            if on_round is not None:
                on_round(line)

        strategy = PflStrategy(fed, algorithm, on_round=each_round)
        strategy.start(grid, ArrayRecord(), num_rounds=config.rounds, timeout=timeout)
        if rundir is not None:
            atomic_write_json(rundir.summary, summarize(config, strategy.history, fed, 0.0, partition.info))
        return strategy


def make_server_app(config: Optional[RunConfig] = None, *, timeout: Optional[float] = None,
                    on_round: Optional[Callable[[dict], None]] = None,
                    on_done: Optional[Callable[[PflStrategy], None]] = None) -> ServerApp:
    """A Flower ``ServerApp`` running ``config`` (None: from the run config, module docstring);
    ``on_round`` gets each round's metrics line, ``on_done`` the finished strategy."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        run_config = config
        if run_config is None:
            run_config = config_from_key(str(context.run_config.get("pfl-config", "")) or "{}")
        out = str(context.run_config.get("pfl-out", "")) if config is None else ""
        if config is None and not out:
            from ..runner import default_run_name

            out = str(Path("runs") / f"flower-{default_run_name(run_config)}")
        wait = timeout if timeout is not None else float(context.run_config.get("pfl-timeout-s", 3600.0))
        strategy = run_server(run_config, grid, timeout=wait, out=Path(out) if out else None, on_round=on_round)
        if on_done is not None:
            on_done(strategy)

    return app


server_app = make_server_app()
client_app = make_client_app()
