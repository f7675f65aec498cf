"""Turns on etcd's user/password auth for the jobs (the component's Job runs it, in the
trainer image): a ``root`` user (etcd requires one), and the jobs' user with a role of its own
name that may read and write only the keys under the jobs' prefix; then ``auth enable``.

A rerun (the Job's pod restarted, the kit applied again) changes nothing once the jobs' user
logs in; an etcd left half set up (a user made, auth still off) is reported with the etcdctl
commands that finish or undo it, never guessed at. Every option also reads the
``FLASHCKPT_ETCD_*`` environment of ``flashckpt run`` for the TLS files.

    python etcd_auth_setup.py --endpoint flashckpt-etcd:2379 --user flashckpt-trainer \\
        --password-file /secrets/password --root-password-file /secrets/root-password
"""

from __future__ import annotations

import argparse
import sys
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--endpoint", required=True, help="etcd HOST:PORT (https with TLS files)")
    p.add_argument("--user", required=True, help="the jobs' etcd user")
    p.add_argument("--password-file", required=True, help="file with the jobs' user's password")
    p.add_argument("--root-password-file", required=True, help="file with root's password")
    p.add_argument("--key-prefix", default="/flashckpt", help="the jobs' key prefix")
    p.add_argument("--ca", default=None, help="etcd's CA ($FLASHCKPT_ETCD_CA)")
    p.add_argument("--cert", default=None, help="client certificate ($FLASHCKPT_ETCD_CERT)")
    p.add_argument("--key", default=None, help="its key ($FLASHCKPT_ETCD_KEY)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per etcd request")
    args = p.parse_args(argv)
    password = _read(args.password_file, "jobs' user's password")
    root_password = _read(args.root_password_file, "root password")
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
