"""``flashckpt run``: an elastic launcher on etcd v3, with standby machines and flash checkpoints.

One launcher runs per machine::

    flashckpt run --nnodes 2:2 --nproc-per-node 8 --rdzv-endpoint etcd1:2379 --rdzv-id job7 \\
        --storage s3://bucket/job7 train.py --lr 3e-4

It is torchrun's elastic agent (``LocalElasticAgent``, same flags where they exist) with:

- our etcd v3 rendezvous backend (:mod:`flashckpt.elastic.rendezvous.backend`);
- the flashckpt node agent running beside the workers for the life of the launcher, and
  ``FLASHCKPT_JOB``/``FLASHCKPT_NODE``/``FLASHCKPT_RUN_DIR``/``FLASHCKPT_SHM_DIR`` in the
  workers' environment, so ``flashckpt.checkpointing()`` in the worker finds it
  (``FLASHCKPT_STORAGE`` carries ``--storage`` for the script's own use);
- standby machines: start more launchers than ``MAX`` with the same ``--rdzv-id``; they wait in
  the rendezvous and take the place of a machine that dies;
- liveness by etcd leases plus a probe of the peers when workers fail
  (:mod:`flashckpt.elastic.membership.nodes`): a dead machine leaves the rendezvous as soon as
  it is known dead (its rendezvous lease is revoked), instead of after a heartbeat timeout;
- a fast recovery path: peers are probed when workers fail, the rendezvous learns everything
  from etcd watches (:mod:`flashckpt.elastic.rendezvous.handler`), the node agent and its
  snapshots stay across rounds (:mod:`flashckpt.elastic.launch.agent_runner`), so survivors reload
  from memory, and workers are forked from a process that has already imported torch
  (:mod:`flashckpt.elastic.launch.prewarm`, ``--no-prewarm`` to turn off);
- workers that die with their launcher (``PR_SET_PDEATHSIG``,
  :mod:`flashckpt.elastic.launch.worker_entry`), and a worker that fails with an exception exits at
  once instead of tearing torch down;
- ``--standalone``: a private etcd for single-machine runs (the default when ``--nnodes`` is 1
  and no ``--rdzv-endpoint`` is given);
- ``--health-check``: a short compute + all-reduce probe before each round's workers start;
  a machine that fails it is recorded in etcd and never admitted to this job again;
- fencing of a machine cut off from the job (a network partition,
  :mod:`flashckpt.elastic.membership.nodes`): when its lease renewals fail for ``--lease-ttl`` minus
  a fifth and no other machine answers either, its node agent commits nothing more and its workers
  stop before the lease can lapse; the others go on with a standby; once etcd answers again it
  registers afresh and waits as a standby (or leaves: exit 0 if the job finished meanwhile, 1 after
  the rendezvous' join timeout). Not with ``--standalone`` (nobody else could take its place).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from flashckpt import cliargs
from flashckpt.elastic.launch.config import (
    JOB_ID_HELP,
    EventLog,
    LauncherConfig,
    LaunchError,
    derive_job_id,
    parse_nnodes,
)

__all__ = ["LauncherConfig", "launch", "main", "parse_args"]

logger = logging.getLogger("flashckpt.launcher")


def _build_parser() -> argparse.ArgumentParser:
    """The ``flashckpt run`` flags: one per LauncherConfig field (names, help and defaults from
    the dataclass, see :mod:`flashckpt.elastic.launch.config`), and those computed from several
    flags or
    accepted only for torchrun compatibility, declared here."""
    # allow_abbrev=False: argparse matches a prefix of a flag anywhere in argv, the training
    # script's own arguments included ("train.py --log x" was "ambiguous option: --log could
    # match --log-dir, --log_dir"); the launcher's flags are spelled out in full.
    p = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="flashckpt run",
        description="Launch an elastic training job (torchrun-compatible flags) with etcd v3 "
        "rendezvous, standby machines and flash checkpointing.",
    )
    add = p.add_argument
    add("--nnodes", default="1", help="N or MIN:MAX machines (default 1)")
    add(
        "--rdzv-id",
        "--rdzv_id",
        default=None,
        help=JOB_ID_HELP,
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
    cliargs.add_dataclass_args(p, LauncherConfig)
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
    add("-v", "--verbose", action="store_true", help="debug logging")
    add("training_script", help="the training script (or module, with -m)")
    add("training_script_args", nargs=argparse.REMAINDER, help="the training script's arguments")
    return p


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
        min_nodes, max_nodes = parse_nnodes(args.nnodes)
        standalone = args.standalone or (args.rdzv_endpoint is None and max_nodes == 1)
        rdzv_id, id_origin = args.rdzv_id or "none", None
        if not args.rdzv_id:
            derived = derive_job_id(
                storage=args.storage,
                entrypoint=args.training_script,
                entrypoint_args=list(args.training_script_args),
                module=args.module,
                standalone=standalone,
            )
            if derived is not None:
                rdzv_id, id_origin = derived
        _warn_static_only(args)
        config = LauncherConfig(
            entrypoint=args.training_script,
            entrypoint_args=list(args.training_script_args),
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            rdzv_id=rdzv_id,
            rdzv_id_origin=id_origin,
            standalone=standalone,
            **cliargs.config_kwargs(LauncherConfig, args),
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
        workers failed beyond ``--max-restarts`` or with an error no restart can mend (not
        restarted), or the node agent could not write the newest snapshot to storage (it keeps
        it in memory for the same command run again), 2 on a configuration, storage or etcd
        error, a job that already ended (run again with ``--rerun-finished``) or that already
        runs on this machine, 128+N when stopped by signal N.
    """
    config, verbose = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format=f"[flashckpt run {config.node_id}] %(asctime)s %(levelname)s %(message)s",
    )
    if config.rdzv_id_origin is not None:
        logger.info(
            "job id: %s (derived from %s; pass --rdzv-id to choose one)",
            config.rdzv_id,
            config.rdzv_id_origin,
        )
    from flashckpt.elastic.launch.restore_report import say, silence

    try:
        return launch(config)
    except LaunchError as exc:
        say(f"flashckpt run: error: {exc}", sys.stderr)
        return 2
    finally:
        # A stdout that became a closed pipe (``| tee`` gone after a Ctrl-C) must not turn the
        # exit code into the interpreter's 120 when it flushes at exit.
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            silence(sys.stdout)


def launch(config: LauncherConfig) -> int:
    """Runs one machine of an elastic job until the job ends; see the module docstring.

    Returns:
        The exit code (see :func:`main`).

    Raises:
        flashckpt.elastic.launch.config.LaunchError: If etcd is unreachable, the node id is taken,
        the node
            was marked unhealthy, or the node agent does not start.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException

    # Not at the top: the session imports torch, which parsing the flags (and --help) does not
    # need. No cycle: the session imports the configuration from flashckpt.elastic.launch.config.
    from flashckpt.elastic.launch.session import LaunchSession

    events = EventLog(config.event_log, config.node_id)
    try:
        with LaunchSession(config, events) as session:
            code = session.run()
        if code == 0:  # the job finished (or went on without this machine): the last one out
            from flashckpt.elastic.launch.jobcleanup import (
                remove_after_launch,  # removes its leftover keys
            )

            remove_after_launch(config)
        return session.exit_code(code)
    except SignalException as exc:
        # Stopped while setting up (connecting to etcd, registering, starting the agent): the
        # session released what it had; a signal is an exit code, not a traceback.
        logger.warning("stopping on %s", exc.sigval.name)
        events("signal", signal=exc.sigval.name)
        return 128 + int(exc.sigval)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
