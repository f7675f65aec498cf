"""``flashckpt run``: an elastic launcher on etcd v3, with standby machines and flash checkpoints.

One launcher runs per machine::

    flashckpt run --nnodes 2:2 --nproc-per-node 8 --rdzv-endpoint etcd1:2379 --rdzv-id job7 \\
        --storage s3://bucket/job7 train.py --lr 3e-4

It is torchrun's elastic agent (``LocalElasticAgent``, same flags where they exist) with:

- our etcd v3 rendezvous backend (:mod:`elastic.rendezvous`);
- the flashckpt node agent running beside the workers for the life of the launcher, and
  ``FLASHCKPT_JOB``/``FLASHCKPT_NODE``/``FLASHCKPT_RUN_DIR``/``FLASHCKPT_SHM_DIR`` in the
  workers' environment, so ``flashckpt.checkpointing()`` in the worker finds it
  (``FLASHCKPT_STORAGE`` carries ``--storage`` for the script's own use);
- standby machines: start more launchers than ``MAX`` with the same ``--rdzv-id``; they wait in
  the rendezvous and take the place of a machine that dies;
- liveness by etcd leases plus a probe of the peers when workers fail
  (:mod:`elastic.membership`): a dead machine is dropped from torch's rendezvous state as soon as
  it is known dead, instead of after torch's heartbeat timeout (15 s by default);
- a fast recovery path: peers are probed when workers fail, torch's rendezvous wakes on etcd
  watches instead of polling (:mod:`elastic.rdzv_watch`), the node agent and its snapshots stay
  across rounds (:mod:`elastic.node_agent`), so survivors reload from memory, and workers are
  forked from a process that has already imported torch (:mod:`elastic.prewarm`,
  ``--no-prewarm`` to turn off);
- workers that die with their launcher (``PR_SET_PDEATHSIG``, :mod:`elastic.worker_entry`), and
  a worker that fails with an exception exits at once instead of tearing torch down;
- ``--standalone``: a private etcd for single-machine runs (the default when ``--nnodes`` is 1
  and no ``--rdzv-endpoint`` is given);
- ``--health-check``: a short compute + all-reduce probe before each round's workers start;
  a machine that fails it is recorded in etcd and never admitted to this job again.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import uuid
from collections.abc import Sequence

from elastic.launch_config import (
    EventLog,
    LauncherConfig,
    LaunchError,
    default_node_id,
    default_shutdown_timeout,
)

__all__ = ["LauncherConfig", "launch", "main", "parse_args"]

logger = logging.getLogger("flashckpt.launcher")


def _parse_nnodes(text: str) -> tuple[int, int]:
    parts = text.split(":")
    try:
        if len(parts) == 1:
            return int(parts[0]), int(parts[0])
        if len(parts) == 2:
            return int(parts[0]), int(parts[1])
    except ValueError:
        pass
    raise ValueError(f"--nnodes {text!r}: use N or MIN:MAX (e.g. 2:2, or 1:4 to scale)")


def _parse_nproc(text: str) -> int:
    if text == "cpu":
        return os.cpu_count() or 1
    if text in ("gpu", "auto"):
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
        if text == "gpu":
            raise ValueError("--nproc-per-node gpu: no CUDA device is visible on this machine")
        return os.cpu_count() or 1
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"--nproc-per-node {text!r}: use a number, 'gpu', 'cpu' or 'auto'"
        ) from None


def _parse_rdzv_conf(text: str) -> dict[str, str]:
    conf: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--rdzv-conf item {item!r}: use key=value[,key=value...]")
        conf[key.strip()] = value.strip()
    return conf


def _build_parser() -> argparse.ArgumentParser:
    from flashckpt.protocol import default_run_dir

    p = argparse.ArgumentParser(
        prog="flashckpt run",
        description="Launch an elastic training job (torchrun-compatible flags) with etcd v3 "
        "rendezvous, standby machines and flash checkpointing.",
    )
    add = p.add_argument
    add("--nnodes", default="1", help="N or MIN:MAX machines (default 1)")
    add(
        "--nproc-per-node",
        "--nproc_per_node",
        default="1",
        help="workers per machine: a number, 'gpu', 'cpu' or 'auto' (default 1)",
    )
    add(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        default=None,
        help="etcd client URL(s) host:port[,host:port] shared by all machines",
    )
    add(
        "--rdzv-id",
        "--rdzv_id",
        default=None,
        help="job id, the same on every machine (names the flashckpt job too)",
    )
    add(
        "--rdzv-conf",
        "--rdzv_conf",
        default="",
        help="rendezvous options key=value,...: join_timeout, last_call_timeout, "
        "keep_alive_interval, keep_alive_max_attempt, read_timeout, key_prefix, ...",
    )
    add(
        "--rdzv-backend",
        "--rdzv_backend",
        default="flashckpt-etcd",
        help="only 'flashckpt-etcd' (etcd v3) is supported",
    )
    add(
        "--standalone",
        action="store_true",
        help="single machine: start a private etcd (default when --nnodes is 1 and no "
        "--rdzv-endpoint is given)",
    )
    add(
        "--max-restarts",
        "--max_restarts",
        type=int,
        default=3,
        help="worker-group restarts after failures before giving up (default 3)",
    )
    add(
        "--shutdown-timeout",
        "--shutdown_timeout",
        type=float,
        default=None,
        help="seconds after SIGTERM/SIGINT before workers are killed and the launcher has "
        "stopped (default $TORCH_ELASTIC_SHUTDOWN_TIMEOUT or 30, as torchrun)",
    )
    add(
        "--monitor-interval",
        "--monitor_interval",
        type=float,
        default=0.1,
        help="seconds between checks of the workers (default 0.1)",
    )
    add(
        "--local-addr",
        "--local_addr",
        default=None,
        help="this machine's address as the others reach it (default: its FQDN)",
    )
    add(
        "--node-id",
        default=None,
        help="this machine's id in the job (default: host name); simulated machines on one "
        "host need distinct ids",
    )
    add("--storage", default=None, help="checkpoint root URL for the node agent (fsspec)")
    add("--shm-dir", default="/dev/shm", help="where the node agent keeps snapshots")
    add(
        "--run-dir", default=default_run_dir(), help="directory of the node agent's socket and logs"
    )
    add("--keep", type=int, default=3, help="committed steps kept in storage (default 3)")
    add(
        "--metrics-port",
        type=int,
        default=None,
        help="serve the node agent's Prometheus metrics on this port (default: off)",
    )
    add(
        "--lease-ttl",
        type=float,
        default=5.0,
        help="seconds after which a machine that stopped renewing its etcd lease is declared "
        "dead (default 5)",
    )
    add(
        "--no-probe",
        dest="probe",
        action="store_false",
        help="do not probe peers when workers fail; rely on lease expiry alone",
    )
    add(
        "--no-prewarm",
        dest="prewarm",
        action="store_false",
        help="start every worker as a fresh interpreter instead of forking it from a process "
        "that has already imported torch (needed for NUMA memory binding)",
    )
    add(
        "--health-check",
        action="store_true",
        help="before each round, run a compute + all-reduce probe; a machine that fails is "
        "recorded in etcd and not admitted again to this job",
    )
    add(
        "--log-dir",
        "--log_dir",
        default=None,
        help="base directory of the worker logs (a sub-directory per job id is created)",
    )
    add(
        "-r",
        "--redirects",
        default="0",
        help="redirect std streams of workers to log files in the log directory: 0-3 for all "
        "(1 stdout, 2 stderr, 3 both) or 0:1,1:2 per local rank (as torchrun)",
    )
    add(
        "-t",
        "--tee",
        default="0",
        help="like --redirects, but also show the streams on the console (as torchrun)",
    )
    add(
        "--local-ranks-filter",
        "--local_ranks_filter",
        default="",
        help="only show these local ranks' output on the console, e.g. 0 or 0,1 (as torchrun)",
    )
    add(
        "--start-method",
        "--start_method",
        default="spawn",
        choices=["spawn", "fork", "forkserver"],
        help="multiprocessing start method (as torchrun: scripts always run as new processes)",
    )
    add(
        "--no-python",
        "--no_python",
        action="store_true",
        help="run the entry point directly (a binary or a shell script), not with python",
    )
    add(
        "--node-rank",
        "--node_rank",
        type=int,
        default=0,
        help="accepted for torchrun compatibility; as with torchrun's dynamic backends it is "
        "ignored: the etcd rendezvous assigns the machines' ranks",
    )
    add(
        "--master-addr",
        "--master_addr",
        default=None,
        help="accepted for torchrun compatibility; only torchrun's static rendezvous uses it",
    )
    add(
        "--master-port",
        "--master_port",
        type=int,
        default=None,
        help="accepted for torchrun compatibility; only torchrun's static rendezvous uses it "
        "(worker rank 0 gets a free port every round)",
    )
    add(
        "--event-log",
        default=None,
        help="append lifecycle events (JSON lines with wall-clock times) to this file",
    )
    add(
        "--swap-stragglers",
        action="store_true",
        help="leave the job for a waiting standby when this machine stays the slowest by "
        "--straggler-factor (checked every 2 s, 5 checks in a row)",
    )
    add(
        "--straggler-factor",
        type=float,
        default=1.5,
        help="a machine slower than this many times the others' median is a straggler (1.5)",
    )
    add(
        "-m",
        "--module",
        action="store_true",
        help="run the entry point as a Python module (python -m)",
    )
    add("-v", "--verbose", action="store_true", help="debug logging")
    add("training_script", help="the training script (or module, with -m)")
    add("training_script_args", nargs=argparse.REMAINDER)
    return p  # fmt: skip


def parse_args(argv: Sequence[str]) -> tuple[LauncherConfig, bool]:
    """Parses ``flashckpt run`` arguments.

    Returns:
        The launcher configuration, and whether ``--verbose`` was given.

    Raises:
        SystemExit: On invalid arguments, with a message that names the flag and the fix.
    """
    parser = _build_parser()
    args = parser.parse_args(list(argv))
    try:
        if args.rdzv_backend not in ("flashckpt-etcd", "etcd-v3"):
            raise ValueError(
                f"--rdzv-backend {args.rdzv_backend!r}: flashckpt run supports 'flashckpt-etcd' "
                "(etcd v3) only; use torchrun for torch's own backends"
            )
        min_nodes, max_nodes = _parse_nnodes(args.nnodes)
        standalone = args.standalone or (args.rdzv_endpoint is None and max_nodes == 1)
        rdzv_id = args.rdzv_id or ("s" + uuid.uuid4().hex[:12] if standalone else "none")
        _warn_static_only(args)
        ranks_filter: frozenset[int] | None = None
        if args.local_ranks_filter:
            try:
                ranks_filter = frozenset(int(r) for r in args.local_ranks_filter.split(","))
            except ValueError:
                raise ValueError(
                    f"--local-ranks-filter {args.local_ranks_filter!r}: use a comma-separated "
                    "list of local ranks, e.g. 0,1"
                ) from None
        config = LauncherConfig(
            entrypoint=args.training_script,
            entrypoint_args=list(args.training_script_args),
            module=args.module,
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            nproc_per_node=_parse_nproc(args.nproc_per_node),
            rdzv_endpoint=args.rdzv_endpoint,
            rdzv_id=rdzv_id,
            rdzv_conf=_parse_rdzv_conf(args.rdzv_conf),
            standalone=standalone,
            max_restarts=args.max_restarts,
            shutdown_timeout=(
                args.shutdown_timeout
                if args.shutdown_timeout is not None
                else default_shutdown_timeout()
            ),
            monitor_interval=args.monitor_interval,
            local_addr=args.local_addr,
            node_id=args.node_id or default_node_id(),
            storage=args.storage,
            shm_dir=args.shm_dir,
            run_dir=args.run_dir,
            keep=args.keep,
            metrics_port=args.metrics_port,
            lease_ttl=args.lease_ttl,
            probe=args.probe,
            health_check=args.health_check,
            prewarm=args.prewarm,
            log_dir=args.log_dir,
            redirects=args.redirects,
            tee=args.tee,
            local_ranks_filter=ranks_filter,
            no_python=args.no_python,
            start_method=args.start_method,
            event_log=args.event_log,
            swap_stragglers=args.swap_stragglers,
            straggler_factor=args.straggler_factor,
        )
    except ValueError as exc:
        parser.error(str(exc))
    return config, args.verbose


def _warn_static_only(args: argparse.Namespace) -> None:
    # torchrun's own behaviour for non-static rendezvous backends: accepted, unused, said so.
    unused = []
    if args.node_rank != 0:
        unused.append(f"--node-rank {args.node_rank}")
    if args.master_addr is not None:
        unused.append(f"--master-addr {args.master_addr}")
    if args.master_port is not None:
        unused.append(f"--master-port {args.master_port}")
    if unused:
        logger.warning(
            "%s: only torchrun's static rendezvous uses these; with the etcd rendezvous the "
            "machines' ranks are assigned each round and worker rank 0 hosts the store on a "
            "free port (MASTER_ADDR/MASTER_PORT in the workers' environment)",
            ", ".join(unused),
        )


def main(argv: list[str]) -> int:
    """``flashckpt run`` entry point (called by ``flashckpt.cli``).

    Args:
        argv: The arguments after ``run``.

    Returns:
        The exit code: 0 when the job finished (or this standby was not needed), 1 when the
        workers failed beyond ``--max-restarts``, 2 on a configuration or etcd error, 128+N
        when stopped by signal N.
    """
    config, verbose = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format=f"[flashckpt run {config.node_id}] %(asctime)s %(levelname)s %(message)s",
    )
    try:
        return launch(config)
    except LaunchError as exc:
        print(f"flashckpt run: error: {exc}", file=sys.stderr)
        return 2


def launch(config: LauncherConfig) -> int:
    """Runs one machine of an elastic job until the job ends; see the module docstring.

    Returns:
        The exit code (see :func:`main`).

    Raises:
        elastic.launch_config.LaunchError: If etcd is unreachable, the node id is taken, the node
            was marked unhealthy, or the node agent does not start.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException

    # Not at the top: the session imports torch, which parsing the flags (and --help) does not
    # need. No cycle: the session imports the configuration from elastic.launch_config.
    from elastic.session import LaunchSession

    events = EventLog(config.event_log, config.node_id)
    try:
        with LaunchSession(config, events) as session:
            return session.run()
    except SignalException as exc:
        # Stopped while setting up (connecting to etcd, registering, starting the agent): the
        # session released what it had; a signal is an exit code, not a traceback.
        logger.warning("stopping on %s", exc.sigval.name)
        events("signal", signal=exc.sigval.name)
        return 128 + int(exc.sigval)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
