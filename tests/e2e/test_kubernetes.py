"""deploy/kubernetes renders with ``kubectl kustomize`` (the base and each overlay) and every
object validates against the Kubernetes 1.32 schemas (kubernetes-validate, strict: no unknown
field); the pieces docs/kubernetes.md promises are there. It was never applied to a live
cluster here (docs/kubernetes.md says so)."""

from __future__ import annotations

import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml

from tests.support.procs import ROOT

KUBECTL = shutil.which("kubectl")
pytestmark = pytest.mark.skipif(KUBECTL is None, reason="needs kubectl (kubectl kustomize renders deploy/kubernetes)")
DEPLOY = ROOT / "deploy" / "kubernetes"
KUBERNETES = "1.32.0"


def render(path: str) -> dict[tuple[str, str], dict]:
    out = subprocess.run([KUBECTL, "kustomize", str(DEPLOY / path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


@pytest.mark.parametrize("path", [".", "overlays/redis-cluster", "overlays/external-redis"])
def test_every_object_validates(path):
    objects = render(path)
    assert objects
    for (kind, name), obj in objects.items():
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)  # raises naming the field
        assert kind == "Namespace" or obj["metadata"]["namespace"] == "kvlookup", (kind, name)


def container(obj: dict, name: str) -> dict:
    return next(c for c in obj["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def test_the_base_has_what_the_docs_promise():
    objects = render(".")
    valkey = objects[("StatefulSet", "kvlookup-redis")]
    assert container(valkey, "valkey")["args"][:3] == ["valkey-server", "--appendonly", "yes"]
    assert valkey["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    ctrl = objects[("Deployment", "kvlookup-controller")]
    assert ctrl["spec"]["replicas"] >= 2
    c = container(ctrl, "controller")
    assert c["readinessProbe"]["httpGet"]["path"] == c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert objects[("Service", "kvlookup-controller")]["spec"]["ports"][0]["port"] == 9000
    pod = objects[("Deployment", "vllm-example")]["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["vllm", "kvlookup-sidecar"]
    sidecar = container(objects[("Deployment", "vllm-example")], "kvlookup-sidecar")
    assert sidecar["args"][:1] == ["sidecar"] and "127.0.0.1:9001" in sidecar["args"]
    assert {e["name"]: e.get("value") for e in sidecar["env"]}["KVLOOKUP_ALLOWED_PEERS"] == "127.0.0.0/8"
    settings = next(o for (k, n), o in objects.items() if k == "ConfigMap" and n.startswith("kvlookup-settings"))
    assert settings["data"]["KVLOOKUP_REDIS_URL"] == "redis://kvlookup-redis:6379/0"
    policies = {n for k, n in objects if k == "NetworkPolicy"}
    assert policies == {"kvlookup-redis", "kvlookup-controller", "vllm-example-lmcache-worker"}


def test_the_redis_cluster_overlay():
    objects = render("overlays/redis-cluster")
    valkey = objects[("StatefulSet", "kvlookup-redis")]
    assert valkey["spec"]["replicas"] == 6
    assert "--cluster-enabled yes" in container(valkey, "valkey")["args"][0]
    assert objects[("Service", "kvlookup-redis")]["spec"]["clusterIP"] == "None"
    assert ("Job", "kvlookup-redis-init") in objects
    settings = next(o for (k, n), o in objects.items() if k == "ConfigMap" and n.startswith("kvlookup-settings"))
    assert settings["data"]["KVLOOKUP_REDIS_CLUSTER"] == "1"
    assert settings["data"]["KVLOOKUP_REDIS_URL"] == "redis://kvlookup-redis-0.kvlookup-redis:6379/0"


def test_the_external_redis_overlay_runs_no_valkey():
    objects = render("overlays/external-redis")
    assert not any(name == "kvlookup-redis" for _, name in objects)
