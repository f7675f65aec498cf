"""The ``flashckpt`` command: ``agent``, ``ls``, ``verify``, ``clean``, ``plan``, ``run``,
``status``, ``goodput``, ``export``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from typing import Any

from flashckpt import envnames, names

__all__ = ["build_parser", "main"]


def _monitor_flags() -> dict[str, Any]:
    """The agent's monitoring flags (names and help; MonitorConfig's fields carry none)."""
    from flashckpt.cliargs import Flag

    return {
        "enabled": Flag(("--no-monitor",), help="do not read the trainers' step rings at all"),
        "poll_s": Flag(("--monitor-poll",)),
        "metrics_port": Flag(
            ("--metrics-port",), help="Prometheus port (0: off)", to_field=lambda p: p or None
        ),
        "metrics_addr": Flag(
            ("--metrics-host", "--metrics-addr"),
            help="Prometheus bind address (127.0.0.1: this machine only; 0.0.0.0: every interface)",
        ),
        "events_dir": Flag(("--events-dir",), help="events.jsonl dir (default: --run-dir)"),
        "events_interval_s": Flag(("--events-interval",)),
        "window": Flag(("--monitor-window",)),
        "hang_factor": Flag(("--hang-factor",), help="hang after N x p50 step"),
        "hang_floor_s": Flag(("--hang-floor",), help="least seconds for a hang"),
        "hang_kill": Flag(
            ("--hang-kill",),
            help="kill hung workers after the stack dump (auto: under an elastic launcher)",
        ),
        "hang_dump_wait_s": Flag(("--hang-dump-wait",)),
        "straggler_factor": Flag(("--straggler-factor",)),
        "straggler_window": Flag(("--straggler-window",)),
        "straggler_min_steps": Flag(("--straggler-min-steps",)),
        "straggler_min_ms": Flag(("--straggler-min-ms",)),
        "straggler_metric": Flag(("--straggler-metric",)),
        "report_png": Flag(("--report-png",)),
    }


def _agent_args(p: argparse.ArgumentParser) -> None:
    """The ``agent`` flags: every AgentConfig and MonitorConfig field (defaults and help from
    the dataclasses), and the process's own (detach, pid and log files, lock wait)."""
    from flashckpt.agent.daemon import AgentConfig
    from flashckpt.cliargs import add_dataclass_args
    from flashckpt.monitor.step_monitor import MonitorConfig

    add_dataclass_args(p, AgentConfig)
    p.add_argument(
        "--lock-wait",
        type=float,
        default=0.0,
        help="seconds to wait for a previous agent of this job and node to exit",
    )
    p.add_argument("--detach", action="store_true", help="run in the background")
    p.add_argument("--pid-file", default=None, help="write the agent's pid to this file")
    p.add_argument(
        "--log-file",
        default=None,
        help="the agent's log file (default: <run-dir>/<job>.<node>.log with --detach, else "
        "stderr)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    m = p.add_argument_group("monitoring")
    add_dataclass_args(m, MonitorConfig, flags=_monitor_flags())


def agent_config(args: argparse.Namespace) -> Any:
    """The AgentConfig of parsed ``agent`` flags."""
    from flashckpt.agent.daemon import AgentConfig
    from flashckpt.cliargs import config_kwargs
    from flashckpt.monitor.step_monitor import MonitorConfig

    monitor = MonitorConfig(**config_kwargs(MonitorConfig, args, flags=_monitor_flags()))
    return AgentConfig(**config_kwargs(AgentConfig, args), monitor=monitor)


def _agent_pid(path: str) -> int | None:
    """The pid of the node agent answering on socket ``path``, or None if none answers."""
    from flashckpt.protocol.channel import AgentClient, AgentError
    from flashckpt.protocol.messages import Ping, PingReply

    try:
        client = AgentClient(path, timeout=0.1)
    except AgentError:
        return None
    try:
        reply = client.call(Ping(), timeout=5)
    except AgentError:
        return None
    finally:
        client.close()
    return reply.pid if isinstance(reply, PingReply) else None


def _cmd_agent(args: argparse.Namespace) -> int:
    from flashckpt.agent.daemon import run_agent
    from flashckpt.errors import UnsafeLocalStateError
    from flashckpt.protocol.channel import AgentError, socket_path

    cfg = agent_config(args)
    if args.detach:
        cmd = [sys.executable, "-m", "flashckpt", *[a for a in sys.argv[1:] if a != "--detach"]]
        from flashckpt.format.shm import ensure_private_dir

        log_path = args.log_file or names.agent_log_path(cfg.run_dir, cfg.job, cfg.node)
        try:
            ensure_private_dir(cfg.run_dir, "agent run dir")  # the log must not go elsewhere
        except UnsafeLocalStateError as e:
            print(f"flashckpt agent: {e}", file=sys.stderr)
            return 1
        with open(log_path, "ab") as logf:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True
            )
        path = socket_path(cfg.run_dir, cfg.job, cfg.node)
        deadline = time.monotonic() + 30
        other: int | None = None  # the pid of another agent answering on the socket
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                why = (
                    f": another agent (pid {other}) already serves job {cfg.job!r} node "
                    f"{cfg.node!r} on {path}"
                    if other is not None
                    else ""
                )
                print(
                    f"agent exited with code {proc.returncode}{why}; see {log_path}",
                    file=sys.stderr,
                )
                return proc.returncode or 1
            # The socket may be another agent's (a second --detach of a running job): it
            # counts only when the agent answering is the one started here.
            answer = _agent_pid(path)
            if answer == proc.pid:
                break
            other = answer if answer is not None else other
            time.sleep(0.05)
        else:
            print(f"agent did not start listening on {path}; see {log_path}", file=sys.stderr)
            return 1
        if args.pid_file:
            with open(args.pid_file, "w") as f:
                f.write(f"{proc.pid}\n")
        print(f"flashckpt agent pid {proc.pid} listening on {path} (log {log_path})")
        return 0
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        filename=args.log_file,
    )
    if args.pid_file:
        with open(args.pid_file, "w") as f:
            f.write(f"{os.getpid()}\n")
    try:
        return run_agent(cfg, lock_wait=args.lock_wait)
    except (UnsafeLocalStateError, AgentError) as e:  # a clear message, not a traceback
        logging.getLogger("flashckpt.agent.daemon").error("%s", e)
        print(f"flashckpt agent: {e}", file=sys.stderr)
        return 1
    finally:
        if args.pid_file:
            try:
                with open(args.pid_file) as f:
                    if f.read().strip() == str(os.getpid()):
                        os.unlink(args.pid_file)
            except OSError:
                pass


def _cmd_ls(args: argparse.Namespace) -> int:
    from flashckpt.format.storage import CorruptCheckpointError, Storage

    st = Storage(args.url)
    # An object store has no directories: a prefix "exists" once a key is under it, so an empty
    # bucket prefix is missing too. A mistyped root must not read as "no steps yet" (exit 0).
    if not st.fs.exists(st.root):
        print(
            f"flashckpt ls: {args.url} does not exist (no checkpoint was ever written there); "
            "check the URL (the --storage of the job)",
            file=sys.stderr,
        )
        return 2
    steps = st.committed_steps()
    rows: list[dict[str, Any]] = []
    for s in steps:
        try:
            m = st.manifest(s)
        except FileNotFoundError:
            continue  # deleted (retention) since it was listed
        except CorruptCheckpointError as e:
            rows.append({"step": s, "error": str(e)})
            continue
        rows.append(
            {
                "step": s,
                "bytes": sum(f.size for f in m.files.values()),
                "files": len(m.files),
                "world_size": m.world_size,
                "created": m.created,
            }
        )
    bad = any("error" in r for r in rows)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 1 if bad else 0
    if not rows:
        print(f"no committed steps in {args.url}")
        return 0
    print(f"{'step':>10} {'size':>12} {'files':>6} {'world':>6}  created")
    for r in rows:
        if "error" in r:
            print(f"{r['step']:>10} CORRUPT: {r['error']} (`flashckpt verify` checks every file)")
            continue
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["created"]))
        print(
            f"{r['step']:>10} {_human(r['bytes']):>12} {r['files']:>6} {r['world_size']:>6}  "
            f"{created}"
        )
    return 1 if bad else 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from flashckpt.format.storage import Storage

    st = Storage(args.url)
    steps = [args.step] if args.step is not None else st.committed_steps()
    if not steps:
        print(f"no committed steps in {args.url}", file=sys.stderr)
        return 1
    bad = 0
    for s in steps:
        check = st.check_step(s)
        if check.status == "ok":
            print(f"step {s}: ok")
        elif check.status == "missing" and args.step is None:
            # Listed, then deleted by retention (or uncommitted for a rewrite) under the check:
            # not corrupt.
            print(f"step {s}: removed while verifying (retention deleted it)")
        elif check.status == "missing":
            bad += 1
            print(f"step {s}: not committed in {args.url}")
        else:
            bad += 1
            for p in check.problems:
                print(f"step {s}: CORRUPT: {p}")
    return 1 if bad else 0


def _cmd_clean(args: argparse.Namespace) -> int:
    from flashckpt.agent.daemon import abandoned_segments

    if args.older_than < 0:
        print("flashckpt clean: --older-than must be >= 0 seconds", file=sys.stderr)
        return 2
    try:
        os.listdir(args.shm_dir)
    except OSError as e:
        print(f"flashckpt clean: cannot read {args.shm_dir}: {e}", file=sys.stderr)
        return 1
    verb = "would remove" if args.dry_run else "removed"
    total = ngroups = ndirs = nkept = 0
    # The slots of a standalone agent lie in --shm-dir itself; those of the agents of
    # `flashckpt run` in a directory per job, node and generation inside it, whatever the job id.
    dirs = [args.shm_dir, *_generation_dirs(args.shm_dir, args.job)]
    for d in dirs:
        groups = abandoned_segments(d, args.older_than)
        if args.job:
            groups = [g for g in groups if g.key[0] == args.job]
        for g in groups:
            job, node = g.key
            where = "" if d == args.shm_dir else f" in {d}"
            if g.only_copy is not None and not args.force:
                # The only copy of a step (issue 41: clean deleted it without a word).
                again = (
                    "Run the job's command again (it resumes from these)"
                    if g.only_copy.endswith("(the job has no storage)")
                    else "Fix the storage and run the job's command again (it resumes from "
                    "these and writes the step)"
                )
                print(
                    f"kept job {job} node {node}{where}: {len(g.paths)} files, "
                    f"{_human(g.nbytes)}: the only copy of {g.only_copy}. {again}, or pass "
                    "--force to delete them and lose that step"
                )
                nkept += 1
                groups = [x for x in groups if x is not g]
                continue
            if not args.dry_run:
                g.remove()
            total += g.nbytes
            ngroups += 1
            lost = f"; the only copy of {g.only_copy}, deleted (--force)" if g.only_copy else ""
            print(
                f"{verb} job {job} node {node}{where}: {len(g.paths)} files, "
                f"{_human(g.nbytes)} ({g.reason}{lost})"
            )
            for p in g.paths:
                print(f"  {p}")
        if d == args.shm_dir:
            continue
        try:
            left = {os.path.join(d, n) for n in os.listdir(d)}
            idle = time.time() - os.lstat(d).st_mtime
        except OSError:
            continue
        if args.dry_run:
            left -= {p for g in groups for p in g.paths}
        # An empty directory is left by a launcher killed after its agent removed its segments;
        # a live launcher's is empty only for the instant before its agent starts, so an empty
        # one must also have been unchanged for a while.
        emptied = not left and (groups or idle >= max(args.older_than, _EMPTY_DIR_AGE_S))
        if emptied and (args.dry_run or _rmdir(d)):
            ndirs += 1
            print(f"{verb} directory {d}")
    if not ngroups and not ndirs and not nkept:
        print(f"nothing to clean in {args.shm_dir} (segments of live agents are never removed)")
    elif ngroups:
        print(f"{verb} {_human(total)} in {ngroups} segment groups")
    return 1 if nkept else 0


_GENERATION_DIR_RE = re.compile(r"^flashckpt\.([A-Za-z0-9_-]{1,64})\.([A-Za-z0-9_-]{1,64})\.g\d+$")
"""The name of :func:`flashckpt.names.generation_shm_dir`: job, node."""

_EMPTY_DIR_AGE_S = 60.0
"""How long an empty generation directory must be unchanged before ``clean`` removes it."""


def _generation_dirs(shm_dir: str, job: str | None) -> list[str]:
    """The per-generation segment directories of ``flashckpt run``'s agents in ``shm_dir`` that
    belong to this user (``flashckpt.<job>.<node>.g<N>``), of every job or of ``job``."""
    out = []
    try:
        entries = sorted(os.listdir(shm_dir))
    except OSError:
        return []
    for name in entries:
        m = _GENERATION_DIR_RE.match(name)
        if not m or (job is not None and m.group(1) != job):
            continue
        path = os.path.join(shm_dir, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():  # never through a link
            out.append(path)
    return out


def _rmdir(path: str) -> bool:
    try:
        os.rmdir(path)  # only ever an empty one
    except OSError:
        return False
    return True


def _cmd_status(args: argparse.Namespace) -> int:
    if args.etcd:
        return _cmd_status_etcd(args)
    from flashckpt.monitor.statusview import collect_status, format_status
    from flashckpt.protocol.channel import default_run_dir

    run_dir = args.run_dir or envnames.run_dir() or default_run_dir()
    wait = 0.8 if args.timeout is None else args.timeout
    agents = collect_status(run_dir, args.job, wait, show_dead=args.all)
    if args.json:
        print(json.dumps(agents, indent=1, default=str))
    else:
        print(format_status(agents))
    return 0 if any("error" not in a for a in agents) else 1


def _cmd_status_etcd(args: argparse.Namespace) -> int:
    """The whole job from the per-machine summaries its launchers publish to etcd."""
    from datetime import timedelta

    from flashckpt.elastic.etcd.client import EtcdClient, EtcdError, EtcdSecurity
    from flashckpt.elastic.membership.jobview import format_job_view, read_job_view
    from flashckpt.elastic.rendezvous.backend import job_prefix

    job = args.job or envnames.job()
    if not job:
        print(
            "flashckpt status: --etcd needs --job <id> (the --rdzv-id of `flashckpt run`)",
            file=sys.stderr,
        )
        return 2
    try:
        security = EtcdSecurity.from_options(
            ca_file=args.etcd_ca,
            cert_file=args.etcd_cert,
            key_file=args.etcd_key,
            user=args.etcd_user,
            password_file=args.etcd_password_file,
            key_prefix=args.key_prefix,
        )
        etcd = args.etcd
        if security is not None and security.tls and "://" not in etcd:
            etcd = ",".join(f"https://{e.strip()}" for e in etcd.split(",") if e.strip())
        wait = 5.0 if args.timeout is None else args.timeout
        client = EtcdClient(etcd, timeout=timedelta(seconds=wait), security=security)
        view = read_job_view(client, job_prefix(job, args.key_prefix))
    except ValueError as e:
        print(f"flashckpt status: {e}", file=sys.stderr)
        return 2
    except EtcdError as e:
        print(
            f"flashckpt status: cannot read job {job!r} from etcd at {args.etcd}: {e}; check "
            "--etcd (the launchers' --rdzv-endpoint)",
            file=sys.stderr,
        )
        return 1
    if args.json:
        print(json.dumps(view, indent=1, default=str))
    else:
        print(format_job_view(view, job))
    return 0 if view["machines"] else 1


def _cmd_export(args: argparse.Namespace) -> int:
    from flashckpt.format.storage import CorruptCheckpointError
    from flashckpt.offline.export import export_dcp, export_safetensors

    try:
        if args.format == "dcp":
            step, keys = export_dcp(args.url, args.step, args.to, strip_prefix=args.strip_prefix)
            print(f"step {step}: wrote a torch.distributed.checkpoint of {keys} to {args.to}")
        else:
            step, n = export_safetensors(
                args.url, args.step, args.to, strip_prefix=args.strip_prefix
            )
            print(f"step {step}: wrote {n} tensors of the full model to {args.to}")
    except (FileNotFoundError, FileExistsError, CorruptCheckpointError, ValueError) as e:
        print(f"flashckpt export: {e}", file=sys.stderr)
        return 1
    return 0


def _cmd_plan(argv: list[str]) -> int:
    from flashckpt import planning as planner

    return planner.main(argv)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("agent", "run"):
        # SIGPIPE stays ignored: a trainer that dies while the agent writes to its socket must
        # give the agent an EPIPE error, not kill it (with the snapshots it keeps); the launcher
        # must not die with its job because its output was cut.
        return _main(argv)
    # Every other command lists or reports: it ends quietly when its output is cut
    # (`flashckpt plan ... | head -1`), as Unix tools do, instead of a BrokenPipeError.
    if threading.current_thread() is not threading.main_thread():
        return _main(argv)
    previous = signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGPIPE, previous)


def _main(argv: list[str]) -> int:
    if argv and argv[0] == "plan":
        return _cmd_plan(argv[1:])
    if argv and argv[0] == "goodput":
        from flashckpt.monitor import goodput

        return goodput.main(argv[1:])
    if argv and argv[0] == "run":
        from flashckpt.elastic.launch import launcher

        return launcher.main(argv[1:])
    # The agent's flags come from its configuration dataclasses, whose modules import most of
    # the agent: only a command line that may name the agent builds them (`flashckpt status`
    # answers in a fraction of a second instead of importing the daemon).
    parser = build_parser(agent_flags=not argv or argv[0] not in _LIGHT_VERBS)
    args = parser.parse_args(argv)
    if args.cmd == "agent":
        return _cmd_agent(args)
    if args.cmd == "ls":
        return _cmd_ls(args)
    if args.cmd == "verify":
        return _cmd_verify(args)
    if args.cmd == "clean":
        return _cmd_clean(args)
    if args.cmd == "status":
        return _cmd_status(args)
    if args.cmd == "export":
        return _cmd_export(args)
    parser.error(f"unknown command {args.cmd}")
    return 2


def _url(text: str) -> str:
    from flashckpt.cliargs import storage_url

    try:
        return storage_url(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _version() -> str:
    """The installed package's version (its metadata), as pip reports it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flashckpt")
    except PackageNotFoundError:
        return "(not installed: no package metadata; install with pip install .)"


_LIGHT_VERBS = frozenset({"ls", "verify", "clean", "status", "export"})
"""The verbs whose command line never needs the agent's flags."""


class _VersionAction(argparse.Action):
    """``--version``: reads the package metadata only when asked (importlib.metadata costs a
    tenth of a second at every start)."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(f"flashckpt {_version()}")
        parser.exit()


def build_parser(*, agent_flags: bool = True) -> argparse.ArgumentParser:
    """The parser of every verb but ``plan``, ``goodput`` and ``run`` (they parse their own).

    Args:
        agent_flags: add the ``agent`` verb's flags (False: the verb is listed without them, for
            a command line of another verb; building them imports the agent's modules).
    """
    parser = argparse.ArgumentParser(
        prog="flashckpt",
        description="Flash checkpointing for PyTorch training: the node agent, the elastic "
        "launcher and the tools that read a run's checkpoints and events.",
        epilog="`flashckpt VERB --help` describes a verb.",
    )
    parser.add_argument("--version", action=_VersionAction, help="print the version")
    # One line per verb in `flashckpt --help` (each help fits the 80-column default); the longer
    # description is the verb's own --help.
    sub = parser.add_subparsers(dest="cmd", required=True, title="verbs", metavar="VERB")
    p = sub.add_parser("agent", help="run the node agent (a daemon per machine)")
    if agent_flags:
        _agent_args(p)
    p = sub.add_parser("ls", help="list committed steps with sizes")
    p.add_argument("url", type=_url, help="checkpoint root URL")
    p.add_argument("--json", action="store_true", help="print the steps as a JSON list")
    p = sub.add_parser("verify", help="check the integrity of committed steps")
    p.add_argument("url", type=_url, help="checkpoint root URL")
    p.add_argument(
        "--step", type=int, default=None, help="check only this step (default: every committed)"
    )
    p = sub.add_parser(
        "clean",
        help="remove the shared-memory segments of dead agents",
        description="Remove the shared-memory segments of dead node agents (snapshots nobody "
        "resumes).",
    )
    p.add_argument("--shm-dir", default="/dev/shm", help="the slots' tmpfs (/dev/shm)")
    p.add_argument("--job", default=None, help="only this job's segments")
    p.add_argument(
        "--older-than",
        type=float,
        default=0.0,
        help="only segments unchanged for this many seconds (0: every dead agent's)",
    )
    p.add_argument("--dry-run", action="store_true", help="list what would go, remove nothing")
    p.add_argument(
        "--force",
        action="store_true",
        help="also remove snapshots that are the only copy of a step storage lacks",
    )
    sub.add_parser("plan", help="plan training time, GPU memory and checkpoint interval")
    sub.add_parser("run", help="launch an elastic job (torchrun-compatible flags)")
    p = sub.add_parser("status", help="the live job: ranks, steps, step times, alerts")
    p.add_argument(
        "--run-dir", default=None, help=f"agents' run dir (default: ${envnames.RUN_DIR})"
    )
    p.add_argument("--job", default=None, help="only this job (required with --etcd)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--etcd",
        "--rdzv-endpoint",
        dest="etcd",
        default=None,
        help="HOST:PORT of the job's etcd: show every machine of the job (from the summaries "
        "`flashckpt run` publishes) instead of the agents under --run-dir",
    )
    p.add_argument("--key-prefix", default="/flashckpt", help="etcd key prefix (/flashckpt)")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds to wait for the agents (0.8) or for etcd with --etcd (5)",
    )
    p.add_argument(
        "--all",
        action="store_true",
        help="also list the sockets of dead node agents (hidden: no live job has them)",
    )
    for name, help_text in (
        ("--etcd-ca", f"CA certificate that signed etcd's certificate (${envnames.ETCD_CA})"),
        ("--etcd-cert", f"etcd client certificate (${envnames.ETCD_CERT})"),
        ("--etcd-key", f"key of --etcd-cert (${envnames.ETCD_KEY})"),
        (
            "--etcd-user",
            f"etcd user; password in ${envnames.ETCD_PASSWORD} (${envnames.ETCD_USER})",
        ),
        (
            "--etcd-password-file",
            f"file with the etcd user's password (${envnames.ETCD_PASSWORD_FILE})",
        ),
    ):
        p.add_argument(name, default=None, help=help_text)
    sub.add_parser("goodput", help="wall-time breakdown of a run from its events files")
    p = sub.add_parser(
        "export",
        help="write a step as one safetensors file or a DCP dir",
        description="Write a step as one consolidated safetensors file, or as a DCP directory.",
    )
    p.add_argument("url", type=_url, help="checkpoint root URL")
    p.add_argument("--step", type=int, default=None, help="step (default: newest committed)")
    p.add_argument("--to", required=True, help="output file (safetensors) or directory (dcp)")
    p.add_argument(
        "--format",
        choices=("safetensors", "dcp"),
        default="safetensors",
        help="one consolidated safetensors file, or a DCP directory (default safetensors)",
    )
    p.add_argument("--strip-prefix", default=None, help="drop this key prefix (e.g. 'module.')")
    return parser
