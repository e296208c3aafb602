"""The deployment files, offline: every Kubernetes manifest against the Kubernetes schemas (the ones
kubernetes-validate bundles; the LeaderWorkerSet against its CRD's schema, vendored in tests/schemas),
the Compose file against the Compose specification (the compose-spec package's parser), and what r1sup
relies on in them checked against the config they carry and the image's settings."""

from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from conftest import ROOT
from r1sup import config as cfg
from r1sup.config import tomllib  # tomli on Python 3.10

DEPLOY = ROOT / "deploy"
KUBE = DEPLOY / "kubernetes"
DOCKERFILE = DEPLOY / "container" / "Dockerfile"
COMPOSE = DEPLOY / "compose" / "docker-compose.yml"
LWS_SCHEMA = ROOT / "tests" / "schemas" / "leaderworkerset-v1.json"
# the oldest Kubernetes the manifests support (fsGroupChangePolicy, startupProbe...) and the newest
# whose schemas the package bundles
KUBE_VERSIONS = ("1.30.0", "latest")


def manifests() -> list[tuple[Path, int, dict[str, Any]]]:
    out = []
    for path in sorted(KUBE.rglob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for n, doc in enumerate(yaml.safe_load_all(path.read_text(encoding="utf-8"))):
            if doc is not None:
                out.append((path, n, doc))
    return out


def by_kind(kind: str, where: Path | None = None) -> list[dict[str, Any]]:
    """The manifests of ``kind`` in the directory ``where`` (None: anywhere)."""
    return [d for p, _, d in manifests() if d["kind"] == kind and where in (None, p.parent)]


def strict(schema: Any) -> Any:
    """The CRD schema as a validator that refuses unknown fields (the API server would prune them
    silently: a typo would be lost without a word) and knows int-or-string."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if out.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    open_ended = "additionalProperties" in out or out.get("x-kubernetes-preserve-unknown-fields")
    if out.get("type") == "object" and "properties" in out and not open_ended:
        out["additionalProperties"] = False
    return out


def validate_lws(doc: dict[str, Any]) -> None:
    vendored = json.loads(LWS_SCHEMA.read_text(encoding="utf-8"))
    schema = strict(vendored["openAPIV3Schema"])
    # metadata is an ObjectMeta, which the CRD leaves open
    schema["properties"]["metadata"] = {"type": "object"}
    assert (
        doc["apiVersion"] == f"{vendored['group']}/{vendored['version']}" and doc["kind"] == vendored["kind"]
    )
    jsonschema.Draft7Validator(schema).validate(doc)
    # the pod templates inside are full PodTemplateSpecs: check them with Kubernetes' own schema too
    import kubernetes_validate

    lwt = doc["spec"]["leaderWorkerTemplate"]
    for template in (lwt.get("leaderTemplate"), lwt["workerTemplate"]):
        if template is not None:
            wrapped = {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": "t"},
                "template": template,
            }
            kubernetes_validate.validate(wrapped, "1.30.0", strict=True)


def _id(item: tuple[Path, int, dict[str, Any]]) -> str:
    path, _, doc = item
    return f"{path.relative_to(KUBE)}:{doc['kind']}/{doc['metadata']['name']}"


@pytest.mark.parametrize(("path", "n", "doc"), manifests(), ids=[_id(m) for m in manifests()])
def test_every_manifest_validates_against_the_kubernetes_schemas(path: Path, n: int, doc: dict[str, Any]):
    import kubernetes_validate

    if doc["kind"] == "LeaderWorkerSet":
        validate_lws(doc)
        return
    latest = kubernetes_validate.latest_version()
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(doc, latest if version == "latest" else version, strict=True)


def test_strict_validation_catches_what_the_api_server_would_drop():
    import kubernetes_validate

    (sts,) = by_kind("StatefulSet")
    typo = copy.deepcopy(sts)
    typo["spec"]["template"]["spec"]["terminationGracePeriod"] = 180
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, "1.30.0", strict=True)
    (lws,) = by_kind("LeaderWorkerSet")
    bad = copy.deepcopy(lws)
    bad["spec"]["leaderWorkerTemplate"]["sizes"] = 2
    with pytest.raises(jsonschema.ValidationError):
        validate_lws(bad)
    bad = copy.deepcopy(lws)
    bad["spec"]["leaderWorkerTemplate"]["size"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        validate_lws(bad)


def test_each_kustomization_lists_its_manifests():
    for kustomization in KUBE.rglob("kustomization.yaml"):
        data = yaml.safe_load(kustomization.read_text(encoding="utf-8"))
        listed = set(data["resources"])
        here = {p.name for p in kustomization.parent.glob("*.yaml")} - {"kustomization.yaml"}
        assert listed == here - {"secret.example.yaml"}, kustomization  # the key is never committed


# --- what r1sup relies on ----------------------------------------------------------------------------


def image_env() -> dict[str, str]:
    """The ENV of deploy/container/Dockerfile, build arguments at their defaults."""
    text = DOCKERFILE.read_text(encoding="utf-8").replace("\\\n", " ")
    args = {m.group(1): m.group(2) for m in re.finditer(r"^ARG (\w+)=(\S*)", text, re.M)}
    env: dict[str, str] = {}
    for line in re.findall(r"^ENV (.+)$", text, re.M):
        for item in shlex.split(line):
            name, _, value = item.partition("=")
            env[name] = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), ""), value)
    return env


def container_env(container: dict[str, Any]) -> dict[str, str]:
    """The container's variables; a secret's value stands in as a placeholder."""
    return {e["name"]: e.get("value", "<from a secret>") for e in container.get("env", [])}


def r1sup_config(configmap: dict[str, Any], env: dict[str, str]) -> cfg.Config:
    return cfg.build(tomllib.loads(configmap["data"]["r1sup.toml"]), env=env)


def served(where: Path) -> tuple[dict[str, Any], dict[str, Any], cfg.Config]:
    """(pod spec, r1sup's container, its effective config) of the workload in ``where``."""
    (configmap,) = by_kind("ConfigMap", where)
    workloads = by_kind("StatefulSet", where) + by_kind("LeaderWorkerSet", where)
    (workload,) = workloads
    if workload["kind"] == "StatefulSet":
        pod = workload["spec"]["template"]["spec"]
    else:
        pod = workload["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]
    container = pod["containers"][0]  # r1sup's (the leader's in a LeaderWorkerSet)
    env = {**image_env(), **container_env(container)}
    return pod, container, r1sup_config(configmap, env)


@pytest.mark.parametrize("where", [KUBE, KUBE / "multinode"], ids=["statefulset", "leaderworkerset"])
def test_the_config_each_workload_carries_is_valid_with_the_images_settings(where: Path):
    _, container, config = served(where)
    assert config.server.host == "0.0.0.0"  # reachable from the Service: allowed only with the key
    assert "VLLM_API_KEY" in container_env(container)
    assert config.daemon.metrics_port == 8090 and config.daemon.metrics_host == "0.0.0.0"
    assert config.state.dir.startswith("/var/lib/r1sup/")


@pytest.mark.parametrize("where", [KUBE, KUBE / "multinode"], ids=["statefulset", "leaderworkerset"])
def test_probes_grace_period_gpu_and_volumes(where: Path):
    pod, container, config = served(where)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": config.server.port, "r1sup": config.daemon.metrics_port}
    probes = {k: container[k]["httpGet"] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert probes["startupProbe"] == {"path": "/readyz", "port": "r1sup"}
    assert probes["readinessProbe"] == {"path": "/readyz", "port": "r1sup"}
    assert probes["livenessProbe"] == {"path": "/livez", "port": "r1sup"}
    # the startup budget: a wait for another replica's tune, then every launch the ladder may make
    startup = container["startupProbe"]
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    wait = config.state.profile_wait_s if ("R1SUP_STATE_PROFILE_STORE" in container_env(container)) else 0
    assert budget >= wait + config.ladder.max_attempts * config.server.startup_timeout_s, budget
    # SIGTERM: r1sup stops vLLM (grace, then the wait for memory and port, and a drain) before SIGKILL;
    # on SIGTERM the drain of the requests in flight lasts at most server.stop_timeout_s
    drain = min(config.daemon.drain_timeout_s, config.server.stop_timeout_s)
    needed = config.server.stop_timeout_s + config.server.memory_release_timeout_s + drain
    assert pod["terminationGracePeriodSeconds"] > needed
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= config.start.tensor_parallel_size
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts["/var/lib/r1sup"] == "state" and mounts["/etc/r1sup"] == "config"
    assert container_env(container)["R1SUP_CONFIG"] == "/etc/r1sup/r1sup.toml"
    assert pod["enableServiceLinks"] is False  # no <SERVICE>_PORT variables that could read as R1SUP_*
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_the_statefulset_keeps_its_state_on_a_claim_and_shares_the_fleets_store():
    (sts,) = by_kind("StatefulSet")
    claims = {c["metadata"]["name"]: c["spec"]["accessModes"] for c in sts["spec"]["volumeClaimTemplates"]}
    assert claims["state"] == ["ReadWriteOnce"]
    (pvc,) = by_kind("PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    pod = sts["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["profiles"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    (container,) = pod["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert container_env(container)["R1SUP_STATE_PROFILE_STORE"] == mounts["profiles"]
    (secret,) = [d for p, _, d in manifests() if p.name == "secret.example.yaml"]
    refs = [e["valueFrom"]["secretKeyRef"] for e in container["env"] if e["name"] == "VLLM_API_KEY"]
    assert refs == [{"name": secret["metadata"]["name"], "key": "api-key"}]
    assert "api-key" in secret["stringData"]


@pytest.mark.parametrize("where", [KUBE, KUBE / "multinode"], ids=["statefulset", "leaderworkerset"])
def test_services_select_the_pods_and_name_their_ports(where: Path):
    pod, container, _ = served(where)
    workload = (by_kind("StatefulSet", where) + by_kind("LeaderWorkerSet", where))[0]
    if workload["kind"] == "StatefulSet":
        labels = workload["spec"]["template"]["metadata"]["labels"]
    else:
        # LeaderWorkerSet adds leaderworkerset.sigs.k8s.io/name to every pod it creates
        leader = workload["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]["labels"]
        labels = {**leader, "leaderworkerset.sigs.k8s.io/name": workload["metadata"]["name"]}
    port_names = {p["name"] for p in container["ports"]}
    for service in by_kind("Service", where):
        selector = service["spec"]["selector"]
        assert selector.items() <= labels.items(), (selector, labels)
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names


def test_the_multinode_leader_runs_r1sup_after_the_ray_cluster_is_complete():
    (lws,) = by_kind("LeaderWorkerSet")
    lwt = lws["spec"]["leaderWorkerTemplate"]
    leader = lwt["leaderTemplate"]["spec"]["containers"][0]
    worker = lwt["workerTemplate"]["spec"]["containers"][0]
    assert leader["command"][:2] == ["tini", "--"] and worker["command"][:2] == ["tini", "--"]
    assert "multi-node-serving.sh leader" in leader["args"][0] and leader["args"][0].rstrip().endswith("run")
    assert "&& exec r1sup" in leader["args"][0]
    assert "multi-node-serving.sh worker" in worker["args"][0] and "LWS_LEADER_ADDRESS" in worker["args"][0]
    _, _, config = served(KUBE / "multinode")
    pp = config.server.extra_args[config.server.extra_args.index("--pipeline-parallel-size") + 1]
    assert int(pp) == lwt["size"]  # one pipeline stage per node of the group
    assert config.ladder.first_launch == "as_configured" and not config.ladder.allow_tensor_parallel


def test_every_r1sup_variable_in_the_deployment_files_is_a_setting():
    names: set[str] = set(image_env())
    for _, _, doc in manifests():
        names |= set(re.findall(r"\b(R1SUP_[A-Z0-9_]+)", json.dumps(doc)))
    names |= set(re.findall(r"\b(R1SUP_[A-Z0-9_]+)", COMPOSE.read_text(encoding="utf-8")))
    names = {n for n in names if n.startswith("R1SUP_") and not n.startswith("R1SUP_PIP_")}
    settings = cfg.env_overrides({n: "x" for n in names})
    known = {dotted for dotted, _, _ in cfg.declarations()}
    assert set(settings) <= known, set(settings) - known
    assert names - {f"R1SUP_{d.replace('.', '_').upper()}" for d in settings} == {"R1SUP_CONFIG"}


# --- the image --------------------------------------------------------------------------------------


def test_the_dockerfile_pins_the_vllm_image_and_runs_r1sup_under_tini_as_a_user():
    text = DOCKERFILE.read_text(encoding="utf-8")
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.M)
    assert base and re.fullmatch(r"docker\.io/vllm/vllm-openai:v\d+\.\d+\.\d+", base.group(1)), base
    assert re.search(r'^ENTRYPOINT \["tini", "--", "r1sup", "--log-format", "json", "run"\]$', text, re.M)
    user = re.findall(r"^USER (\S+)$", text, re.M)
    assert user[-1] != "root" and user[-1].split(":")[0] not in ("0", "root")
    assert 'VOLUME ["/var/lib/r1sup"]' in text
    assert image_env()["R1SUP_STATE_DIR"].startswith("/var/lib/r1sup/")
    assert "/readyz" in re.search(r"^HEALTHCHECK .*$\n.*$", text, re.M).group(0)  # type: ignore[union-attr]


# --- Compose ----------------------------------------------------------------------------------------


def compose() -> dict[str, Any]:
    return dict(yaml.safe_load(COMPOSE.read_text(encoding="utf-8")))


def test_the_compose_file_follows_the_compose_specification():
    from compose_spec import PyCompose

    parsed = PyCompose.from_yaml(COMPOSE.read_text(encoding="utf-8"))
    assert parsed.service_names() == ["r1sup"]
    broken = COMPOSE.read_text(encoding="utf-8").replace("stop_grace_period:", "stop_grace:")
    with pytest.raises(ValueError):
        PyCompose.from_yaml(broken)


def seconds(duration: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([hms])", duration))


def test_the_compose_service_what_r1sup_relies_on():
    service = compose()["services"]["r1sup"]
    assert service["build"]["dockerfile"] == "deploy/container/Dockerfile"
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    check = " ".join(service["healthcheck"]["test"])
    assert "127.0.0.1:8090/readyz" in check
    assert seconds(service["healthcheck"]["start_period"]) >= 1800  # a model load and a tune
    mounts = {v.split(":")[1]: v.split(":")[0] for v in service["volumes"]}
    assert mounts["/var/lib/r1sup"] == "state" and "state" in compose()["volumes"]
    (secret,) = service["secrets"]
    assert service["environment"]["R1SUP_SERVER_API_KEY_FILE"] == f"/run/secrets/{secret}"
    assert compose()["secrets"][secret]["file"] == "./secrets/api-key"
    config_file = DEPLOY / "compose" / mounts["/etc/r1sup/r1sup.toml"]
    env = {**image_env(), **service["environment"]}
    config = cfg.build(tomllib.loads(config_file.read_text(encoding="utf-8")), env=env)
    assert config.server.host == "0.0.0.0" and config.server.api_key_file == f"/run/secrets/{secret}"
    needed = config.server.stop_timeout_s + config.server.memory_release_timeout_s
    assert seconds(service["stop_grace_period"]) > needed + 30
    assert service["ports"][1].startswith("127.0.0.1:8090:")  # r1sup's endpoint stays on the host
