"""Turns on etcd's user/password auth for the jobs (the component's Job runs it, in the
trainer image): a ``root`` user (etcd requires one), and the jobs' user with a role of its own
name that may read and write only the keys under the jobs' prefix; then ``auth enable``.

A rerun (the Job's pod restarted, the kit applied again) changes nothing once the jobs' user
logs in; an etcd left half set up (a user made, auth still off) is reported with the etcdctl
commands that finish or undo it, never guessed at. The TLS files also come from the
``FLASHCKPT_ETCD_*`` environment of ``flashckpt run``.

With ``--wait``, it changes nothing (no root password): it returns once auth is on and the
jobs' user reads its prefix, trying again every ``--retry-every`` seconds (the trainers' init
container: a trainer that logged in before auth was on would hold no token).

    python etcd_auth_setup.py --endpoint flashckpt-etcd:2379 --user flashckpt-trainer \\
        --password-file /secrets/password --root-password-file /secrets/root-password
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from datetime import timedelta

from flashckpt.elastic.etcd.client import EtcdAuthError, EtcdClient, EtcdError, EtcdSecurity
from flashckpt.elastic.etcd.server import enable_auth


def _read(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            secret = f.readline().rstrip("\r\n")
    except OSError as exc:
        raise SystemExit(f"etcd auth setup: cannot read the {what} ({path}): {exc}") from None
    if not secret:
        raise SystemExit(f"etcd auth setup: the {what} in {path} is empty")
    return secret


def _not_ready(anonymous: EtcdClient, user: EtcdClient, prefix: str) -> str | None:
    """Why the jobs' user cannot work yet (None: auth is on and it reads ``prefix``)."""
    try:
        try:
            anonymous.get(prefix + "auth-setup")
            return "auth is not enabled yet (the Job flashckpt-etcd-auth turns it on)"
        except EtcdAuthError:
            pass
        user.get(prefix + "auth-setup")
        return None
    except EtcdError as exc:
        return str(exc)
    finally:
        anonymous.close()
        user.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--endpoint", required=True, help="etcd HOST:PORT (https with TLS files)")
    p.add_argument("--user", required=True, help="the jobs' etcd user")
    p.add_argument("--password-file", required=True, help="file with the jobs' user's password")
    p.add_argument("--root-password-file", help="file with root's password (not with --wait)")
    p.add_argument("--wait", action="store_true", help="only wait until auth is on and works")
    p.add_argument("--retry-every", type=float, default=5.0, help="seconds between --wait tries")
    p.add_argument("--key-prefix", default="/flashckpt", help="the jobs' key prefix")
    p.add_argument("--ca", default=None, help="etcd's CA ($FLASHCKPT_ETCD_CA)")
    p.add_argument("--cert", default=None, help="client certificate ($FLASHCKPT_ETCD_CERT)")
    p.add_argument("--key", default=None, help="its key ($FLASHCKPT_ETCD_KEY)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per etcd request")
    args = p.parse_args(argv)
    password = _read(args.password_file, "jobs' user's password")
    if args.wait == bool(args.root_password_file):
        p.error("pass --root-password-file to set auth up, or --wait to wait for it")
    root_password = "" if args.wait else _read(args.root_password_file, "root password")
    if args.user == "root":
        p.error("--user root: give the jobs a user of their own (root may do anything)")
    tls = EtcdSecurity.from_options(ca_file=args.ca, cert_file=args.cert, key_file=args.key)
    tls = replace(tls, user=None, password=None) if tls is not None else None
    endpoint = args.endpoint
    if tls is not None and tls.tls and "://" not in endpoint:
        endpoint = f"https://{endpoint}"
    prefix = args.key_prefix.rstrip("/") + "/"
    timeout = timedelta(seconds=args.timeout)

    def client(user: str | None, pw: str | None) -> EtcdClient:
        if tls is not None:
            security: EtcdSecurity | None = replace(tls, user=user, password=pw)
        else:
            security = EtcdSecurity(user=user, password=pw) if user else None
        return EtcdClient(endpoint, timeout=timeout, security=security)

    if args.wait:
        while True:
            why = _not_ready(client(None, None), client(args.user, password), prefix)
            if why is None:
                print(f"etcd at {endpoint}: auth is on; user {args.user!r} reads {prefix}")
                return 0
            print(f"waiting for etcd's auth at {endpoint}: {why}", flush=True)
            time.sleep(args.retry_every)
    anonymous = client(None, None)
    try:
        anonymous.get(prefix + "auth-setup")  # refused once auth is on
        auth_on = False
    except EtcdAuthError:
        auth_on = True
    except EtcdError as exc:
        print(f"etcd auth setup: cannot reach etcd at {endpoint}: {exc}", file=sys.stderr)
        return 1  # the Job retries: etcd may still be starting
    try:
        if not auth_on:
            try:
                enable_auth(
                    anonymous, root_password=root_password, user=args.user, password=password,
                    prefix=prefix,
                )  # fmt: skip
            except EtcdError as exc:
                print(
                    f"etcd auth setup: etcd at {endpoint} refused a step ({exc}); it may be "
                    "half set up by an earlier run: finish it by hand (etcdctl user add / role "
                    f"add {args.user} / role grant-permission {args.user} --prefix readwrite "
                    f"{prefix} / user grant-role / auth enable) or undo it (etcdctl user delete, "
                    "role delete) and run this again",
                    file=sys.stderr,
                )
                return 1
    finally:
        anonymous.close()
    # Whether it was on already or turned on just now: the jobs' user must log in and use its
    # prefix, and nobody without a password may.
    user = client(args.user, password)
    try:
        user.put(prefix + "auth-setup", b"ok")
        user.delete(prefix + "auth-setup")
    except EtcdAuthError as exc:
        print(
            f"etcd auth setup: auth is on, but user {args.user!r} cannot use {prefix}: {exc}; "
            "check the password Secret, or grant its role readwrite on the prefix",
            file=sys.stderr,
        )
        return 1
    finally:
        user.close()
    print(
        f"etcd at {endpoint}: auth {'was already' if auth_on else 'is now'} enabled; user "
        f"{args.user!r} reads and writes {prefix} only"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
