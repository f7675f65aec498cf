"""Helpers of the deploy/ tests: render the kustomize overlays, walk the pod templates of the
rendered objects, and parse the command lines the manifests and scripts run with the real
parsers of ``flashckpt agent``, ``flashckpt run`` and ``torchrun``.

A module of its own (not conftest) so test files can import it by a unique name."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUSTOMIZE = DEPLOY / "kubernetes"
OVERLAYS = ("byo-etcd", "jobset", "pytorchjob", "sidecar")
"""Every overlay under deploy/kubernetes/overlays (a test checks the list is complete)."""
DATA = Path(__file__).with_name("data")

K8S_VERSION = "1.33.0"
"""The Kubernetes version whose schemas the rendered objects are validated against."""


def kubectl_unavailable() -> str | None:
    """Why ``kubectl kustomize`` cannot render here, or None."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return "kubectl is not installed (1.21 or newer: it carries kustomize v4+)"
    done = subprocess.run([kubectl, "version", "--client"], capture_output=True, text=True)
    m = re.search(r"Kustomize Version: v(\d+)", done.stdout)
    if m is None or int(m.group(1)) < 4:
        return f"kubectl's kustomize is older than v4 (the overlays use `patches`): {done.stdout}"
    return None


@cache
def render(overlay: str) -> tuple[dict[str, Any], ...]:
    """The objects ``kubectl kustomize`` renders from the overlay (offline: no cluster)."""
    why = kubectl_unavailable()
    if why:
        pytest.skip(why)
    done = subprocess.run(
        ["kubectl", "kustomize", str(KUSTOMIZE / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"kubectl kustomize {overlay} failed:\n{done.stderr}"
    assert done.stderr.strip() == "", f"kubectl kustomize {overlay} warned:\n{done.stderr}"
    return tuple(d for d in yaml.safe_load_all(done.stdout) if d)


@dataclass
class Pod:
    """A pod template of a rendered object."""

    owner: dict[str, Any]
    """The object (DaemonSet, StatefulSet, JobSet, PyTorchJob)."""
    template: dict[str, Any]
    """The pod template: ``metadata`` and ``spec``."""

    @property
    def spec(self) -> dict[str, Any]:
        return self.template["spec"]

    @property
    def name(self) -> str:
        return f"{self.owner['kind']}/{self.owner['metadata']['name']}"

    def containers(self) -> list[dict[str, Any]]:
        """The init containers and containers."""
        return [*self.spec.get("initContainers", []), *self.spec["containers"]]

    def volume(self, name: str) -> dict[str, Any]:
        (vol,) = [v for v in self.spec.get("volumes", []) if v["name"] == name]
        return vol

    def volume_at(self, container: dict[str, Any], path: str) -> dict[str, Any]:
        """The volume the container mounts at ``path`` or at a directory above it."""
        best = None
        for m in container.get("volumeMounts", []):
            mp = m["mountPath"].rstrip("/")
            if (path == mp or path.startswith(mp + "/")) and (
                best is None or len(mp) > len(best["mountPath"])
            ):
                best = m
        assert best is not None, f"{self.name} {container['name']}: nothing mounted at {path}"
        vol = dict(self.volume(best["name"]))
        # Where below the volume's root the path lies.
        vol["subpath"] = path[len(best["mountPath"].rstrip("/")) :].lstrip("/")
        return vol


def pods(objects: tuple[dict[str, Any], ...]) -> Iterator[Pod]:
    """The pod templates of the workload objects."""
    for obj in objects:
        kind = obj["kind"]
        if kind in ("DaemonSet", "StatefulSet", "Deployment", "Job"):
            yield Pod(obj, obj["spec"]["template"])
        elif kind == "JobSet":
            for rj in obj["spec"]["replicatedJobs"]:
                yield Pod(obj, rj["template"]["spec"]["template"])
        elif kind == "PyTorchJob":
            for spec in obj["spec"]["pytorchReplicaSpecs"].values():
                yield Pod(obj, spec["template"])


def expand(args: list[str], env: dict[str, str] | None = None) -> list[str]:
    """Kubernetes' ``$(VAR)`` expansion of a container's command line, with placeholder values
    for the variables (``env`` overrides them)."""
    values = env or {}

    def value(m: re.Match[str]) -> str:
        return values.get(m.group(1), f"v-{m.group(1)}")

    return [re.sub(r"\$\((\w+)\)", value, a) for a in args]


def argv(container: dict[str, Any]) -> list[str]:
    return expand([*container.get("command", []), *container.get("args", [])])


def parse_agent(args: list[str]) -> argparse.Namespace:
    """``flashckpt agent ARGS`` parsed by the CLI's own parser (unknown flags fail)."""
    from flashckpt.cli import build_parser

    return _parse(build_parser(), ["agent", *args])


def parse_status(args: list[str]) -> argparse.Namespace:
    from flashckpt.cli import build_parser

    return _parse(build_parser(), ["status", *args])


def parse_run(args: list[str]) -> argparse.Namespace:
    """``flashckpt run ARGS`` parsed by the launcher's own parser."""
    from flashckpt.elastic.launch.launcher import _build_parser

    return _parse(_build_parser(), args)


def parse_torchrun(args: list[str]) -> argparse.Namespace:
    """``torchrun ARGS`` parsed by torch's own parser (the installed torch's flags)."""
    from torch.distributed.run import get_args_parser

    return _parse(get_args_parser(), args)


def _parse(parser: argparse.ArgumentParser, args: list[str]) -> argparse.Namespace:
    def fail(message: str) -> None:  # argparse's own exits the process
        raise AssertionError(f"{parser.prog} {' '.join(args)}: {message}")

    # No abbreviations: a manifest must spell each flag in full (argparse would take a prefix).
    todo = [parser]
    while todo:
        p = todo.pop()
        p.error = fail  # type: ignore[method-assign]
        p.allow_abbrev = False
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += action.choices.values()
    return parser.parse_args(args)


def crd_schema(kind: str, version: str) -> dict[str, Any]:
    """The vendored openAPIV3Schema of a CRD (``tests/deploy/data/*.json``, from the upstream
    release named in its ``source``)."""
    for path in DATA.glob("*.json"):
        doc = json.loads(path.read_text())
        if doc["kind"] == kind:
            return doc["versions"][version]  # type: ignore[no-any-return]
    raise AssertionError(f"no vendored CRD schema for {kind}")


def strict(schema: Any) -> Any:
    """The schema with unknown fields refused wherever the API server would prune them (an
    object schema with ``properties``, without ``additionalProperties`` or
    ``x-kubernetes-preserve-unknown-fields``): a misspelt field fails, as with
    ``kubectl apply --validate=strict``."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


QUANTITY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9}


def quantity(text: str | int) -> int:
    """A Kubernetes memory quantity in bytes (``16Gi``, ``512Mi``, ``1000``)."""
    s = str(text)
    for suffix, mult in QUANTITY.items():
        if s.endswith(suffix):
            return int(float(s[: -len(suffix)]) * mult)
    return int(s)
