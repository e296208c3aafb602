"""The deployment files, offline: the Helm chart rendered (with Helm's own Go library, through the
helm-python-sdk package) with its default values and with each example values file, every object
against the Kubernetes schemas (the ones kubernetes-validate bundles; the LeaderWorkerSet against its
CRD's schema, vendored in tests/schemas), the Compose file against the Compose specification (the
compose-spec package's parser), and what r1sup relies on in them checked against the config they
carry and the image's settings."""

from __future__ import annotations

import copy
import functools
import json
import re
import shlex
import types
import typing
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from conftest import ROOT, planning_without_a_driver
from r1sup.core import config as cfg
from r1sup.core.config import tomllib  # tomli on Python 3.10

DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "r1sup"
DOCKERFILE = DEPLOY / "container" / "Dockerfile"
COMPOSE = DEPLOY / "compose" / "docker-compose.yml"
LWS_SCHEMA = ROOT / "tests" / "schemas" / "leaderworkerset-v1.json"
PODMONITOR_SCHEMA = ROOT / "tests" / "schemas" / "podmonitor-v1.json"
SERVICEMONITOR_SCHEMA = ROOT / "tests" / "schemas" / "servicemonitor-v1.json"
SCALEDOBJECT_SCHEMA = ROOT / "tests" / "schemas" / "scaledobject-v1alpha1.json"
VALUES_SCHEMA = CHART / "values.schema.json"
VLLM_SCRAPE = ROOT / "tests" / "fixtures" / "metrics" / "vllm-cpu-0.32-busy.txt"
# the service-level capacity (the slo work): asserted once r1sup registers it
SLO_CAPACITY = "r1sup_capacity_slo_requests"
# the oldest Kubernetes the chart supports (its kubeVersion: preStop's sleep action, fsGroupChangePolicy,
# startupProbe...) and the newest whose schemas the package bundles
KUBE_VERSIONS = ("1.30.0", "latest")
RELEASE = "r1"
# LeaderWorkerSet's variables in a group's pods (its webhook sets them; the workers add LWS_WORKER_INDEX)
LWS_ENV = {"LWS_LEADER_ADDRESS": "r1-0.r1.serving", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "0"}
# the default values, every example values file, and the multi-node example on Ray (its default backend
# is vLLM's own multi-node mode, mp)
RAY = "+ray"
# the autoscalers (off by default): KEDA with a ServiceMonitor on the default values, the plain HPA on the
# multi-node example (it scales the LeaderWorkerSet's groups)
KEDA = "+keda"
HPA = "+hpa"
OVERLAYS: dict[str, dict[str, Any]] = {
    RAY: {"multinode": {"backend": "ray"}},
    KEDA: {
        "autoscaling": {
            "enabled": True,
            "keda": {"serverAddress": "http://prometheus-operated.monitoring.svc:9090"},
        },
        "metrics": {"serviceMonitor": {"enabled": True}},
    },
    HPA: {"autoscaling": {"enabled": True, "kind": "hpa", "maxReplicas": 2}},
}
VALUE_SETS = (
    ["default"]
    + sorted(p.stem for p in (CHART / "examples").glob("*.yaml"))
    + [f"multinode-deepseek-r1{RAY}", f"default{KEDA}", f"multinode-deepseek-r1{HPA}"]
)


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out


def _json_type(hint: Any) -> dict[str, Any]:
    """The JSON schema of a setting's Python type (``X | None`` included: null is allowed anyway)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if args and typing.get_origin(hint) in (typing.Union, types.UnionType):
        (hint,) = args
    origin = typing.get_origin(hint) or hint
    if origin is list:
        return {"type": "array", "items": _json_type(typing.get_args(hint)[0])}
    if origin is dict:
        return {"type": "object", "additionalProperties": _json_type(typing.get_args(hint)[1])}
    return {"type": {str: "string", bool: "boolean", int: "integer", float: "number"}[origin]}


def config_schema() -> dict[str, Any]:
    """The ``config`` part of values.schema.json as r1sup's declarations make it: every section and key of
    r1sup.toml (no other), each with its type, choices and bounds; null removes a default."""
    sections: dict[str, Any] = {}
    for dotted, f, hint in cfg.declarations():
        section, key = dotted.split(".", 1)
        body = sections.setdefault(
            section, {"type": ["object", "null"], "additionalProperties": False, "properties": {}}
        )
        one = _json_type(hint)
        checks = {"choices": "enum", "minimum": "minimum", "maximum": "maximum"}
        checks["exclusive_minimum"] = "exclusiveMinimum"
        for name, word in checks.items():
            if name in f.metadata:
                one[word] = list(f.metadata[name]) if name == "choices" else f.metadata[name]
        body["properties"][key] = {"anyOf": [one, {"type": "null"}]}
    for old, new in cfg.RENAMED_SECTIONS.items():  # read under its old name for one release
        sections[old] = {
            "description": f"the old name of {new}, read for this release (r1sup warns)",
            **sections[new],
        }
    return {"type": "object", "additionalProperties": False, "properties": sections}


def example_values(name: str) -> dict[str, Any] | None:
    base, plus, overlay = name.partition("+")
    if base == "default":
        values: dict[str, Any] = {}
    else:
        values = dict(yaml.safe_load((CHART / "examples" / f"{base}.yaml").read_text(encoding="utf-8")))
    if plus:
        values = merged(values, OVERLAYS[plus + overlay])
    return values or None


def render(values: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The chart's objects as `helm template` renders them with ``values`` over the defaults."""
    import helm_python as helm

    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(values, name=RELEASE, namespace="serving", is_install=True)
    docs = []
    for path in sorted(files):
        if not path.endswith(".yaml"):
            continue
        docs.extend(doc for doc in yaml.safe_load_all(files[path]) if doc is not None)
    return docs


@functools.cache
def _rendered(name: str) -> str:
    return json.dumps(render(example_values(name)))


def rendered(name: str) -> list[dict[str, Any]]:
    """The objects of a value set (a fresh copy: tests may change them)."""
    return list(json.loads(_rendered(name)))


def by_kind(kind: str, name: str = "default") -> list[dict[str, Any]]:
    return [d for d in rendered(name) if d["kind"] == kind]


def strict(schema: Any) -> Any:
    """A CRD schema as a validator that refuses unknown fields (the API server would prune them
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


def validate_custom(doc: dict[str, Any], schema_file: Path) -> None:
    vendored = json.loads(schema_file.read_text(encoding="utf-8"))
    schema = strict(vendored["openAPIV3Schema"])
    # metadata is an ObjectMeta, which the CRD leaves open
    schema["properties"]["metadata"] = {"type": "object"}
    assert (
        doc["apiVersion"] == f"{vendored['group']}/{vendored['version']}" and doc["kind"] == vendored["kind"]
    )
    jsonschema.Draft7Validator(schema).validate(doc)


def validate_lws(doc: dict[str, Any]) -> None:
    validate_custom(doc, LWS_SCHEMA)
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


def all_objects() -> list[tuple[str, dict[str, Any]]]:
    return [(name, doc) for name in VALUE_SETS for doc in rendered(name)]


def _id(item: tuple[str, dict[str, Any]]) -> str:
    name, doc = item
    return f"{name}:{doc['kind']}/{doc['metadata']['name']}"


@pytest.mark.parametrize(("values", "doc"), all_objects(), ids=[_id(m) for m in all_objects()])
def test_every_rendered_object_validates_against_the_kubernetes_schemas(values: str, doc: dict[str, Any]):
    import kubernetes_validate

    if doc["kind"] == "LeaderWorkerSet":
        validate_lws(doc)
        return
    if doc["kind"] == "PodMonitor":
        validate_custom(doc, PODMONITOR_SCHEMA)
        return
    if doc["kind"] == "ServiceMonitor":
        validate_custom(doc, SERVICEMONITOR_SCHEMA)
        return
    if doc["kind"] == "ScaledObject":
        validate_custom(doc, SCALEDOBJECT_SCHEMA)
        return
    latest = kubernetes_validate.latest_version()
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(doc, latest if version == "latest" else version, strict=True)


def test_every_value_set_renders_what_it_is_for():
    kinds = {name: sorted({d["kind"] for d in rendered(name)}) for name in VALUE_SETS}
    assert "StatefulSet" in kinds["default"] and "LeaderWorkerSet" not in kinds["default"]
    for name in ("multinode-deepseek-r1", f"multinode-deepseek-r1{RAY}"):
        assert "LeaderWorkerSet" in kinds[name] and "StatefulSet" not in kinds[name]
    assert "PodMonitor" in kinds["shared-cache-monitoring"] and "Job" in kinds["shared-cache-monitoring"]
    assert {"ScaledObject", "ServiceMonitor"} <= set(kinds[f"default{KEDA}"])
    assert "HorizontalPodAutoscaler" in kinds[f"multinode-deepseek-r1{HPA}"]
    off = {"ScaledObject", "HorizontalPodAutoscaler", "ServiceMonitor"}  # off by default
    assert not off & set(kinds["default"])


def test_helm_lint_finds_nothing_above_information():
    import helm_python as helm

    for name in VALUE_SETS:
        report = helm.lint(str(CHART), example_values(name), strict=True, kube_version="v1.30.0")
        assert report["errors"] == [], report
        assert [m for m in report["messages"] if m["severity"] > 1] == [], report


def test_strict_validation_catches_what_the_api_server_would_drop():
    import kubernetes_validate

    (sts,) = by_kind("StatefulSet")
    typo = copy.deepcopy(sts)
    typo["spec"]["template"]["spec"]["terminationGracePeriod"] = 180
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, "1.30.0", strict=True)
    (lws,) = by_kind("LeaderWorkerSet", "multinode-deepseek-r1")
    bad = copy.deepcopy(lws)
    bad["spec"]["leaderWorkerTemplate"]["sizes"] = 2
    with pytest.raises(jsonschema.ValidationError):
        validate_lws(bad)
    bad = copy.deepcopy(lws)
    bad["spec"]["leaderWorkerTemplate"]["size"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        validate_lws(bad)
    (monitor,) = by_kind("PodMonitor", "shared-cache-monitoring")
    bad = copy.deepcopy(monitor)
    bad["spec"]["podMetricsEndpoints"][0]["paths"] = "/metrics"
    with pytest.raises(jsonschema.ValidationError):
        validate_custom(bad, PODMONITOR_SCHEMA)


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


def pod_of(workload: dict[str, Any]) -> dict[str, Any]:
    """The pod spec that runs r1sup (the leader's in a LeaderWorkerSet)."""
    if workload["kind"] == "StatefulSet":
        return dict(workload["spec"]["template"]["spec"])
    return dict(workload["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"])


def pod_specs(values: str) -> list[dict[str, Any]]:
    """Every pod spec the value set renders (a LeaderWorkerSet's leader and worker)."""
    out = []
    for doc in rendered(values):
        if doc["kind"] in ("StatefulSet", "Job"):
            out.append(doc["spec"]["template"]["spec"])
        elif doc["kind"] == "LeaderWorkerSet":
            lwt = doc["spec"]["leaderWorkerTemplate"]
            out += [lwt["leaderTemplate"]["spec"], lwt["workerTemplate"]["spec"]]
    return out


def served(values: str) -> tuple[dict[str, Any], dict[str, Any], cfg.Config]:
    """(pod spec, r1sup's container, its effective config) of the value set's workload."""
    (configmap,) = [d for d in by_kind("ConfigMap", values) if d["metadata"]["name"] == RELEASE]
    (workload,) = by_kind("StatefulSet", values) + by_kind("LeaderWorkerSet", values)
    pod = pod_of(workload)
    container = pod["containers"][0]
    env = {**image_env(), **container_env(container), **started_env(container, LWS_ENV)}
    return pod, container, cfg.build(tomllib.loads(configmap["data"]["r1sup.toml"]), env=env)


@pytest.mark.parametrize("values", VALUE_SETS)
def test_the_config_each_value_set_carries_is_valid_with_the_images_settings(values: str):
    _, container, config = served(values)
    assert config.server.host == "0.0.0.0"  # reachable from the Service: allowed only with the key
    assert "VLLM_API_KEY" in container_env(container)
    assert config.daemon.metrics_port == 8090 and config.daemon.metrics_host == "0.0.0.0"
    assert config.state.dir.startswith("/var/lib/r1sup/")


def test_the_config_table_is_written_as_the_toml_r1sup_reads():
    """Whole numbers stay integers (YAML numbers reach Helm's templates as floats), fractions stay
    fractions, strings are quoted with their escapes, lists stay lists, and a key set to null is left
    out; a table nested in a section is refused with the key's name."""
    values = {
        "config": {
            "model": {"name": 'org/m "q" \\ é', "served_name": "m"},
            "server": {"extra_args": ["--max-num-seqs", "8"], "stop_timeout_s": 12.5},
            "start": {"max_model_len": 4096, "gpu_memory_utilization": 0.9, "quantization": None},
            "search": {"allow_weight_quantization": False},
        }
    }
    (configmap,) = [d for d in render(values) if d["kind"] == "ConfigMap"]
    table = tomllib.loads(configmap["data"]["r1sup.toml"])
    assert table["model"]["name"] == 'org/m "q" \\ é'
    assert table["server"]["extra_args"] == ["--max-num-seqs", "8"]
    assert table["server"]["stop_timeout_s"] == 12.5 and table["server"]["port"] == 8000
    assert table["start"]["max_model_len"] == 4096 and isinstance(table["start"]["max_model_len"], int)
    assert table["start"]["gpu_memory_utilization"] == 0.9 and "quantization" not in table["start"]
    assert table["search"]["allow_weight_quantization"] is False
    import helm_python as helm

    # a table where the chart writes values (server.env, a table of r1sup's, passes the values' schema)
    with pytest.raises(helm.HelmError, match="not a TOML value"):
        render({"config": {"server": {"env": {"A": "1"}}}})
    # a key that is no setting is refused before that, by the values' schema
    with pytest.raises(helm.HelmValuesError, match="'nested' not allowed"):
        render({"config": {"start": {"nested": {"a": 1}}}})


@pytest.mark.parametrize("values", VALUE_SETS)
def test_probes_grace_period_gpu_and_volumes(values: str):
    pod, container, config = served(values)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    expected = {"http": config.server.port, "r1sup": config.daemon.metrics_port}
    if config.multinode.nnodes > 1 and config.multinode.backend == "mp":
        expected["rendezvous"] = config.multinode.master_port  # the workers' way in
    assert ports == expected
    probes = {k: container[k]["httpGet"] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert probes["startupProbe"] == {"path": "/readyz", "port": "r1sup"}
    assert probes["readinessProbe"] == {"path": "/readyz", "port": "r1sup"}
    assert probes["livenessProbe"] == {"path": "/livez", "port": "r1sup"}
    # the startup budget: a wait for another replica's tune (for a group: for its Ray cluster), then
    # every launch the search may make
    startup = container["startupProbe"]
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    env = container_env(container)
    wait = config.state.profile_wait_s if "R1SUP_STATE_PROFILE_STORE" in env else 0
    ray = re.search(r"--ray_init_timeout=(\d+)", " ".join(container.get("args", [])))
    wait += int(ray.group(1)) if ray else 0
    assert budget >= wait + config.search.max_attempts * config.server.startup_timeout_s, budget
    # SIGTERM comes after the preStop pause; then r1sup drains (at most server.stop_timeout_s), stops
    # vLLM (grace) and waits for the memory and the port, all before Kubernetes' SIGKILL
    pause = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pause >= 5  # kube-proxy and the ingress take the pod out of rotation in that time
    drain = min(config.daemon.drain_timeout_s, config.server.stop_timeout_s)
    needed = pause + config.server.stop_timeout_s + config.server.memory_release_timeout_s + drain
    assert pod["terminationGracePeriodSeconds"] > needed
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= config.start.tensor_parallel_size
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts["/var/lib/r1sup"] == "state" and mounts["/etc/r1sup"] == "config"
    assert env["R1SUP_CONFIG"] == "/etc/r1sup/r1sup.toml"
    assert pod["enableServiceLinks"] is False  # no <SERVICE>_PORT variables that could read as R1SUP_*
    # the verdict of an exit reaches `kubectl describe pod` (r1sup writes it there)
    assert container["terminationMessagePath"] == "/dev/termination-log"


def test_the_derived_budgets_follow_the_config_and_r1sups_defaults():
    """The chart derives the grace period and the startup budget from the config: with the keys left
    out, from r1sup's own defaults (the config's declarations), not from figures of its own."""
    values = {
        "config": {
            "server": {"startup_timeout_s": None, "stop_timeout_s": None, "memory_release_timeout_s": None},
            "search": {"max_attempts": None},
            "state": None,
        }
    }
    docs = render(values)
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
    (configmap,) = [d for d in docs if d["kind"] == "ConfigMap"]
    pod = pod_of(sts)
    env = {**image_env(), **container_env(pod["containers"][0])}
    config = cfg.build(tomllib.loads(configmap["data"]["r1sup.toml"]), env=env)
    assert "startup_timeout_s" not in configmap["data"]["r1sup.toml"]
    startup = pod["containers"][0]["startupProbe"]
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    needed = config.state.profile_wait_s + config.search.max_attempts * config.server.startup_timeout_s
    assert needed <= budget < needed + startup["periodSeconds"]
    drain = min(config.daemon.drain_timeout_s, config.server.stop_timeout_s)
    pause = pod["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
    whole_stop = pause + config.server.stop_timeout_s + config.server.memory_release_timeout_s + drain
    assert whole_stop < pod["terminationGracePeriodSeconds"] <= whole_stop + 60


def test_values_that_name_the_search_section_ladder_render_the_same_config_and_budget():
    """Values written before the rename (config.ladder) keep working for this release: r1sup.toml gets
    them under [ladder], which r1sup reads as [search] with a warning, over the chart's [search]
    defaults (a key they set to null stays removed), and the startup budget counts their max_attempts."""

    def made(values: dict[str, Any]) -> tuple[dict[str, Any], cfg.Config, int]:
        docs = render(values)
        (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
        (configmap,) = [d for d in docs if d["kind"] == "ConfigMap"]
        table = tomllib.loads(configmap["data"]["r1sup.toml"])
        container = pod_of(sts)["containers"][0]
        config = cfg.build(table, env={**image_env(), **container_env(container)})
        startup = container["startupProbe"]
        return table, config, startup["periodSeconds"] * startup["failureThreshold"]

    mine = {"max_attempts": 2, "allow_weight_quantization": None}
    old_table, old, old_budget = made({"config": {"ladder": mine}})
    new_table, new, new_budget = made({"config": {"search": mine}})
    assert "search" not in old_table and old_table["ladder"] == {"min_max_model_len": 8192, "max_attempts": 2}
    assert "ladder" not in new_table and new_table["search"] == old_table["ladder"]
    assert old == new and old.search.max_attempts == 2 and not old.search.allow_weight_quantization
    assert [(r.old, r.new) for r in old.renamed] == [("[ladder]", "[search]")] and not new.renamed
    _, default, default_budget = made({})
    assert old_budget == new_budget < default_budget and default.search.max_attempts == 4
    import helm_python as helm

    with helm.Chart.load(str(CHART)) as chart:  # the install's notes say it too
        notes = [
            chart.render({"config": {section: mine}}, name=RELEASE, namespace="serving", is_install=True)[
                "r1sup/templates/NOTES.txt"
            ]
            for section in ("ladder", "search")
        ]
    assert "config.ladder is now config.search" in notes[0] and "ladder" not in notes[1]


def test_the_statefulset_keeps_its_state_on_a_claim_and_shares_the_fleets_store():
    (sts,) = by_kind("StatefulSet")
    claims = {c["metadata"]["name"]: c["spec"]["accessModes"] for c in sts["spec"]["volumeClaimTemplates"]}
    assert claims == {"state": ["ReadWriteOnce"], "models": ["ReadWriteOnce"]}
    (pvc,) = by_kind("PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"  # outlives the release
    pod = sts["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["profiles"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    (container,) = pod["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert container_env(container)["R1SUP_STATE_PROFILE_STORE"] == mounts["profiles"]
    refs = [e["valueFrom"]["secretKeyRef"] for e in container["env"] if e["name"] == "VLLM_API_KEY"]
    assert refs == [{"name": "r1sup-api-key", "key": "api-key"}]
    assert not by_kind("Secret")  # the key is never in the chart's values nor its objects


def test_a_shared_model_cache_is_one_claim_fetched_into_before_r1sup_starts():
    (sts,) = by_kind("StatefulSet", "shared-cache-monitoring")
    pod = sts["spec"]["template"]["spec"]
    assert [c["metadata"]["name"] for c in sts["spec"]["volumeClaimTemplates"]] == ["state"]
    claims = {d["metadata"]["name"]: d for d in by_kind("PersistentVolumeClaim", "shared-cache-monitoring")}
    models = {v["name"]: v for v in pod["volumes"]}["models"]["persistentVolumeClaim"]["claimName"]
    assert claims[models]["spec"]["accessModes"] == ["ReadWriteMany"]
    # the existing fleet store is used, not created
    assert {v["name"]: v for v in pod["volumes"]}["profiles"]["persistentVolumeClaim"]["claimName"] == (
        "r1sup-fleet-profiles"
    )
    assert "r1sup-fleet-profiles" not in claims
    (fetch,) = pod["initContainers"]
    (main,) = pod["containers"]
    assert fetch["image"] == main["image"] and "@sha256:" in main["image"]
    fetch_mounts = {m["name"]: m["mountPath"] for m in fetch["volumeMounts"]}
    main_mounts = {m["name"]: m["mountPath"] for m in main["volumeMounts"]}
    assert fetch_mounts["models"] == main_mounts["models"] == "/var/cache/r1sup"  # HF_HOME's volume
    assert image_env()["HF_HOME"].startswith(main_mounts["models"] + "/")
    env = container_env(fetch)
    _, _, config = served("shared-cache-monitoring")
    assert env["MODEL_ID"] == config.model.name and "HF_TOKEN" in env
    assert "*.safetensors" in json.loads(env["MODEL_ALLOW_PATTERNS"])
    assert container_env(main)["HF_HUB_OFFLINE"] == "1"


def test_the_model_fetch_runs_python_that_compiles_and_is_skipped_for_a_local_model():
    (sts,) = by_kind("StatefulSet")
    (fetch,) = sts["spec"]["template"]["spec"]["initContainers"]
    assert fetch["command"][1] == "-c"
    compile(fetch["command"][2], "fetch-model", "exec")
    docs = render({"config": {"model": {"name": "/srv/models/r1-14b"}}})
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
    pod = sts["spec"]["template"]["spec"]
    assert "initContainers" not in pod and "HF_HUB_OFFLINE" not in container_env(pod["containers"][0])


@pytest.mark.parametrize("values", VALUE_SETS)
def test_services_select_the_pods_and_keep_r1sups_port_off_the_clients_service(values: str):
    pod, container, config = served(values)
    (workload,) = by_kind("StatefulSet", values) + by_kind("LeaderWorkerSet", values)
    if workload["kind"] == "StatefulSet":
        labels = workload["spec"]["template"]["metadata"]["labels"]
    else:
        # LeaderWorkerSet adds leaderworkerset.sigs.k8s.io/name to every pod it creates
        leader = workload["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]["labels"]
        labels = {**leader, "leaderworkerset.sigs.k8s.io/name": workload["metadata"]["name"]}
    port_names = {p["name"] for p in container["ports"]}
    services = {s["metadata"]["name"]: s for s in by_kind("Service", values)}
    for service in services.values():
        selector = service["spec"]["selector"]
        assert selector.items() <= labels.items(), (selector, labels)
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names
    clients = services[RELEASE]
    assert [p["targetPort"] for p in clients["spec"]["ports"]] == ["http"]
    pods = services[f"{RELEASE}-pods"]
    assert pods["spec"]["clusterIP"] == "None" and pods["spec"]["publishNotReadyAddresses"] is True
    assert {p["targetPort"] for p in pods["spec"]["ports"]} == {"http", "r1sup"}
    if workload["kind"] == "StatefulSet":
        assert workload["spec"]["serviceName"] == pods["metadata"]["name"]
    (pdb,) = by_kind("PodDisruptionBudget", values)
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["maxUnavailable"] == 1


@pytest.mark.parametrize("values", VALUE_SETS)
def test_both_metrics_endpoints_are_scraped(values: str):
    """r1sup's endpoint by the pods' annotations, vLLM's /metrics (the API port) by the headless
    Service's; with the Prometheus operator, one PodMonitor for both."""
    _, container, config = served(values)
    (workload,) = by_kind("StatefulSet", values) + by_kind("LeaderWorkerSet", values)
    if workload["kind"] == "StatefulSet":
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
    else:
        annotations = workload["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == config.daemon.metrics_port
    (pods,) = [s for s in by_kind("Service", values) if s["metadata"]["name"].endswith("-pods")]
    assert int(pods["metadata"]["annotations"]["prometheus.io/port"]) == config.server.port
    for monitor in by_kind("PodMonitor", values):
        endpoints = {(e["port"], e["path"]) for e in monitor["spec"]["podMetricsEndpoints"]}
        assert endpoints == {("r1sup", "/metrics"), ("http", "/metrics")}
        assert monitor["spec"]["selector"]["matchLabels"].items() <= workload["metadata"]["labels"].items()


@pytest.mark.parametrize("values", VALUE_SETS)
def test_every_pod_runs_restricted(values: str):
    """Pod Security "restricted": non-root, seccomp RuntimeDefault, no privilege escalation, every
    capability dropped (a LeaderWorkerSet's workers too)."""
    specs = pod_specs(values)
    assert specs
    for pod in specs:
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in pod["containers"] + pod.get("initContainers", []):
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False
            assert context["capabilities"]["drop"] == ["ALL"] and "add" not in context["capabilities"]


def test_the_upgrade_gate_tunes_the_new_image_then_gates_against_the_fleets_store():
    docs = rendered("shared-cache-monitoring")
    (job,) = [d for d in docs if d["kind"] == "Job"]
    gate_config = next(
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == f"{RELEASE}-gate"
    )
    release_config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == RELEASE)
    # a pre-upgrade hook: it runs with the new values (image, config) before anything is rolled, and its
    # config is its own (the release's ConfigMap still holds the old one then)
    for doc in (job, gate_config):
        assert doc["metadata"]["annotations"]["helm.sh/hook"] == "pre-upgrade"
    assert int(gate_config["metadata"]["annotations"]["helm.sh/hook-weight"]) < int(
        job["metadata"]["annotations"]["helm.sh/hook-weight"]
    )
    assert gate_config["data"] == release_config["data"]
    pod = job["spec"]["template"]["spec"]
    assert job["spec"]["backoffLimit"] == 0 and pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    (sts,) = by_kind("StatefulSet", "shared-cache-monitoring")
    assert container["image"] == pod_of(sts)["containers"][0]["image"]
    script = container["args"][0]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    tune, _, gate = script.partition("&&")
    assert "r1sup --log-format json tune --config /etc/r1sup/r1sup.toml" in tune
    assert f"exec r1sup profile gate --config /etc/r1sup/r1sup.toml --store {mounts['profiles']}" in gate
    env = container_env(container)
    # tune neither reads nor publishes the store: only the gate publishes, and only a profile that holds
    assert "R1SUP_STATE_PROFILE_STORE" not in env
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["state"] == {"name": "state", "emptyDir": {}}
    assert volumes["config"]["configMap"]["name"] == gate_config["metadata"]["name"]
    assert volumes["profiles"]["persistentVolumeClaim"]["claimName"] == "r1sup-fleet-profiles"
    assert env["R1SUP_SERVER_HOST"] == "127.0.0.1" and "VLLM_API_KEY" not in env
    config = cfg.build(tomllib.loads(gate_config["data"]["r1sup.toml"]), env={**image_env(), **env})
    assert (
        job["spec"]["activeDeadlineSeconds"] >= config.search.max_attempts * config.server.startup_timeout_s
    )
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    import helm_python as helm

    with pytest.raises(helm.HelmError, match="upgradeGate needs profileStore.enabled"):
        render({"upgradeGate": {"enabled": True}, "profileStore": {"enabled": False}})


def started_env(container: dict[str, Any], lws: dict[str, str]) -> dict[str, str]:
    """The ``R1SUP_*`` assignments the container's shell makes before it execs r1sup, with
    LeaderWorkerSet's variables (``lws``) as its webhook sets them in each pod."""
    script = " ".join(container.get("args", []))
    out = {}
    for name, value in re.findall(r'\b(R1SUP_\w+)=("[^"]*"|\S+)', script):
        out[name] = re.sub(r"\$\{(\w+)\}", lambda m: lws[m.group(1)], value.strip('"'))
    return out


def group(values: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(the LeaderWorkerSet's leaderWorkerTemplate, the leader's container, the worker's)."""
    (lws,) = by_kind("LeaderWorkerSet", values)
    lwt = lws["spec"]["leaderWorkerTemplate"]
    return lwt, lwt["leaderTemplate"]["spec"]["containers"][0], lwt["workerTemplate"]["spec"]["containers"][0]


def node_config(values: str, container: dict[str, Any], rank: int) -> cfg.Config:
    """r1sup's config in one pod of the group: the ConfigMap's file, the image's variables, the
    container's, and what its shell sets from LeaderWorkerSet's (node ``rank``)."""
    (configmap,) = [d for d in by_kind("ConfigMap", values) if d["metadata"]["name"] == RELEASE]
    lws = {**LWS_ENV, "LWS_WORKER_INDEX": str(rank)}
    env = {**image_env(), **container_env(container), **started_env(container, lws)}
    if "VLLM_API_KEY" in env:
        env["VLLM_API_KEY"] = "k"
    return cfg.build(tomllib.loads(configmap["data"]["r1sup.toml"]), env=env)


def test_the_multinode_default_is_vllms_own_mode_a_leader_node_0_and_headless_workers():
    """multinode.backend mp: the leader's r1sup launches vLLM as node 0 at its own address; each worker
    runs `r1sup worker`, which launches vLLM headless as its LWS_WORKER_INDEX with the leader's flags
    (read from the leader's /status on its r1sup port). The command lines are r1sup's own, built from
    the config each pod reads."""
    from r1sup.adapters.launcher import build_spec
    from r1sup.core.flags import EngineFlags
    from r1sup.supervision.worker import check_worker_config, leader_status_url, worker_spec

    lwt, leader, worker = group("multinode-deepseek-r1")
    assert example_values("multinode-deepseek-r1")["multinode"]["backend"] == "mp"  # type: ignore[index]
    assert leader["command"][:2] == ["tini", "--"] and worker["command"][:2] == ["tini", "--"]
    assert leader["args"][0].rstrip().endswith("exec r1sup --log-format json run")
    assert worker["args"][0].rstrip().endswith("exec r1sup --log-format json worker")
    assert "ray" not in json.dumps([leader["args"], worker["args"]]).lower()
    # the leader: node 0 of size nodes, at the address LeaderWorkerSet gives it, on its rendezvous port
    config = node_config("multinode-deepseek-r1", leader, 0)
    flags = EngineFlags.from_start(config.start)
    argv = list(build_spec(config, flags).argv)
    placed = argv[
        argv.index("--distributed-executor-backend") : argv.index("--distributed-executor-backend") + 10
    ]
    ports = {p["name"]: p["containerPort"] for p in leader["ports"]}
    assert placed == [
        "--distributed-executor-backend", "mp", "--nnodes", str(lwt["size"]), "--node-rank", "0",
        "--master-addr", LWS_ENV["LWS_LEADER_ADDRESS"], "--master-port", str(ports["rendezvous"]),
    ]  # fmt: skip
    assert "--headless" not in argv
    pp = argv[argv.index("--pipeline-parallel-size") + 1]
    assert int(pp) == lwt["size"]  # one pipeline stage per node of the group
    # a worker: the same config, its rank, headless, the leader's flags, the leader's /status
    for rank in range(1, lwt["size"]):
        wconfig = node_config("multinode-deepseek-r1", worker, rank)
        check_worker_config(wconfig)
        wargv = list(worker_spec(wconfig, flags).argv)
        assert wargv[wargv.index("--node-rank") + 1] == str(rank) and "--headless" in wargv
        assert wargv[wargv.index("--master-addr") + 1] == LWS_ENV["LWS_LEADER_ADDRESS"]
        assert wargv[wargv.index("--master-port") + 1] == str(ports["rendezvous"])
        assert flags.to_argv() == [a for a in wargv if a in flags.to_argv()]
        assert wargv[wargv.index("--pipeline-parallel-size") + 1] == pp
        assert leader_status_url(wconfig) == f"http://{LWS_ENV['LWS_LEADER_ADDRESS']}:{ports['r1sup']}/status"
        assert wconfig.server.host == "127.0.0.1" and "VLLM_API_KEY" not in container_env(worker)
    # the worker's probes ask its r1sup: alive while its loop turns, ready while it runs the leader's launch
    wports = {p["name"]: p["containerPort"] for p in worker["ports"]}
    assert wports == {"r1sup": wconfig.daemon.metrics_port}
    assert worker["startupProbe"]["httpGet"] == {"path": "/livez", "port": "r1sup"}
    assert worker["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "r1sup"}
    assert worker["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "r1sup"}
    # its grace period covers r1sup's stop of vLLM and the wait for its memory
    wpod = lwt["workerTemplate"]["spec"]
    assert (
        wpod["terminationGracePeriodSeconds"]
        > wconfig.server.stop_timeout_s + wconfig.server.memory_release_timeout_s
    )
    mounts = {m["name"]: m["mountPath"] for m in worker["volumeMounts"]}
    assert mounts["config"] == "/etc/r1sup" and mounts["state"] == image_env()["HOME"]
    assert {v["name"]: v for v in wpod["volumes"]}["config"]["configMap"]["name"] == RELEASE
    # no Ray: every container of the group runs on a read-only root file system, as on one box
    for container in (leader, worker):
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # the leader's start-up budget has no Ray wait in it
    assert "--ray_init_timeout" not in leader["args"][0]
    assert container_env(worker)["NCCL_DEBUG"] == container_env(leader)["NCCL_DEBUG"] == "WARN"
    assert config.search.first_launch == "as_configured" and not config.search.allow_tensor_parallel


def test_the_multinode_leader_on_ray_runs_r1sup_after_the_ray_cluster_is_complete():
    from r1sup.adapters.launcher import build_spec
    from r1sup.core.flags import EngineFlags

    values = f"multinode-deepseek-r1{RAY}"
    lwt, leader, worker = group(values)
    assert leader["command"][:2] == ["tini", "--"] and worker["command"][:2] == ["tini", "--"]
    assert "multi-node-serving.sh leader" in leader["args"][0] and leader["args"][0].rstrip().endswith("run")
    assert "&& exec r1sup" in leader["args"][0]
    assert "multi-node-serving.sh worker" in worker["args"][0] and "LWS_LEADER_ADDRESS" in worker["args"][0]
    # both sides wait for each other as long as the values say, not vLLM's script's 300 s
    timeouts = {re.search(r"--ray_init_timeout=(\d+)", c["args"][0]).group(1) for c in (leader, worker)}  # type: ignore[union-attr]
    assert timeouts == {"1800"}
    # the worker is probed: its Ray node must reach the group's head
    for probe in ("startupProbe", "livenessProbe"):
        assert "ray health-check" in " ".join(worker[probe]["exec"]["command"])
    start = worker["startupProbe"]
    assert start["periodSeconds"] * start["failureThreshold"] >= 1800
    assert container_env(worker)["NCCL_DEBUG"] == container_env(leader)["NCCL_DEBUG"] == "WARN"
    # r1sup names the executor itself (and refuses it in extra_args); no placement flags with Ray
    config = node_config(values, leader, 0)
    assert config.multinode.backend == "ray" and config.multinode.nnodes == lwt["size"]
    argv = list(build_spec(config, EngineFlags.from_start(config.start)).argv)
    assert argv[argv.index("--distributed-executor-backend") + 1] == "ray"
    assert not {"--nnodes", "--node-rank", "--master-addr", "--headless"} & set(argv)
    assert int(argv[argv.index("--pipeline-parallel-size") + 1]) == lwt["size"]
    assert "rendezvous" not in {p["name"] for p in leader["ports"]}


def test_a_multinode_backend_other_than_mp_or_ray_fails_the_render():
    import helm_python as helm

    values = example_values("multinode-deepseek-r1") or {}
    values["multinode"]["backend"] = "nccl"
    with pytest.raises(helm.HelmError, match='multinode.backend: must be mp or ray; got "nccl"'):
        render(values)


def test_the_network_values_reach_both_pods_of_a_group():
    values = example_values("multinode-deepseek-r1") or {}
    values["multinode"]["network"] = {
        "env": {"NCCL_IB_HCA": "mlx5"},
        "resources": {"rdma/rdma_shared_device_a": "1"},
        "capabilities": ["IPC_LOCK"],
        "podAnnotations": {"k8s.v1.cni.cncf.io/networks": "rdma-net"},
    }
    (lws,) = [d for d in render(values) if d["kind"] == "LeaderWorkerSet"]
    validate_lws(lws)
    lwt = lws["spec"]["leaderWorkerTemplate"]
    for template in (lwt["leaderTemplate"], lwt["workerTemplate"]):
        container = template["spec"]["containers"][0]
        assert container_env(container)["NCCL_IB_HCA"] == "mlx5"
        assert container["resources"]["limits"]["rdma/rdma_shared_device_a"] == "1"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
        assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        assert template["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"] == "rdma-net"


def test_every_r1sup_variable_in_the_deployment_files_is_a_setting():
    names: set[str] = set(image_env())
    for _, doc in all_objects():
        names |= set(re.findall(r"\b(R1SUP_[A-Z0-9_]+)", json.dumps(doc)))
    names |= set(re.findall(r"\b(R1SUP_[A-Z0-9_]+)", COMPOSE.read_text(encoding="utf-8")))
    names = {n for n in names if n.startswith("R1SUP_") and not n.startswith("R1SUP_PIP_")}
    settings = cfg.env_settings({n: "x" for n in names})
    known = {dotted for dotted, _, _ in cfg.declarations()}
    assert set(settings) <= known, set(settings) - known
    assert names - {f"R1SUP_{d.replace('.', '_').upper()}" for d in settings} == {"R1SUP_CONFIG"}


# --- the image --------------------------------------------------------------------------------------


def test_the_dockerfile_pins_the_vllm_image_and_runs_r1sup_under_tini_as_a_user():
    text = DOCKERFILE.read_text(encoding="utf-8")
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.M)
    # pinned by digest: the tag's content cannot change under a rebuild
    assert base and re.fullmatch(
        r"docker\.io/vllm/vllm-openai:v\d+\.\d+\.\d+@sha256:[0-9a-f]{64}", base.group(1)
    ), base
    assert re.search(r'^ENTRYPOINT \["tini", "--", "r1sup", "--log-format", "json", "run"\]$', text, re.M)
    user = re.findall(r"^USER (\S+)$", text, re.M)
    assert user[-1] != "root" and user[-1].split(":")[0] not in ("0", "root")
    assert 'VOLUME ["/var/lib/r1sup"]' in text
    assert image_env()["R1SUP_STATE_DIR"].startswith("/var/lib/r1sup/")
    # healthy while the supervisor's loop turns, loading included; ready is another question (/readyz)
    check = re.search(r"^HEALTHCHECK .*$\n.*$", text, re.M)
    assert check and "/livez" in check.group(0) and "/readyz" not in check.group(0)


def test_the_charts_default_image_is_the_dockerfiles_vllm_release_which_the_memory_model_covers():
    """One vLLM release in the image: the Dockerfile's pinned base, the chart's default tag, and a
    release inside the range r1sup's memory model was checked against."""
    from r1sup.core.vllmversion import SUPPORTED, Version

    text = DOCKERFILE.read_text(encoding="utf-8")
    base = re.search(r"^ARG BASE_IMAGE=docker\.io/vllm/vllm-openai:(v[\d.]+)@sha256:", text, re.M)
    assert base, "the base image is not pinned by digest"
    values = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    assert values["image"]["tag"].endswith(f"-vllm-{base.group(1)}"), values["image"]["tag"]
    low, high = SUPPORTED
    assert low <= Version.parse(base.group(1)) <= high


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


# --- the values' schema ------------------------------------------------------------------------------


def test_the_values_schema_knows_every_setting_of_r1sup_and_no_other():
    """The schema's config part is r1sup's declarations: a setting added to r1sup must be added here."""
    schema = json.loads(VALUES_SCHEMA.read_text(encoding="utf-8"))
    assert schema["properties"]["config"] == config_schema()
    assert schema["additionalProperties"] is False


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"replica": 3}, "'replica' not allowed"),
        ({"gpu": {"cuont": 2}}, "at '/gpu': additional properties 'cuont' not allowed"),
        ({"config": {"start": {"max_model_length": 8192}}}, "'max_model_length' not allowed"),
        ({"config": {"servr": {"port": 8000}}}, "at '/config': additional properties 'servr' not allowed"),
        ({"config": {"start": {"kv_cache_dtype": "fp4"}}}, "at '/config/start/kv_cache_dtype'"),
        ({"autoscaling": {"targetLoad": 0}}, "at '/autoscaling/targetLoad'"),
    ],
)
def test_a_misspelled_or_invalid_key_fails_at_install(values: dict[str, Any], where: str):
    import helm_python as helm

    with pytest.raises(helm.HelmValuesError, match=re.escape(where)):
        render(values)
    report = helm.lint(str(CHART), values, strict=True, kube_version="v1.30.0")
    assert any(where in e for e in report["errors"]), report


def test_tensor_parallel_beyond_the_gpus_a_pod_requests_fails_at_install():
    import helm_python as helm

    with pytest.raises(helm.HelmValuesError, match="/config/start/tensor_parallel_size"):
        render({"config": {"start": {"tensor_parallel_size": 2}}})  # gpu.count 1
    with pytest.raises(helm.HelmValuesError, match="/config/start/tensor_parallel_size"):
        render({"gpu": {"count": 4}, "config": {"start": {"tensor_parallel_size": 8}}})
    for count in (2, 8):
        docs = render({"gpu": {"count": count}, "config": {"start": {"tensor_parallel_size": count}}})
        (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
        assert pod_of(sts)["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == str(count)
    # more GPUs than the schema can compare (gpu.count's bound) is refused too, not let through
    with pytest.raises(helm.HelmValuesError, match="/gpu/count"):
        render({"gpu": {"count": 17}})


# --- the default config plans as given on the cards its comments name --------------------------------


def cards_the_values_name() -> list[str]:
    """The catalog's GPUs that values.yaml's comments name (e.g. "L4, A10, RTX 4090 class")."""
    from r1sup.core import catalog

    comments = " ".join(
        line.split("#", 1)[1]
        for line in (CHART / "values.yaml").read_text(encoding="utf-8").splitlines()
        if "#" in line
    )
    return [
        name for name in catalog.gpu_names() if re.search(rf"(?<![\w-]){re.escape(name)}(?![\w])", comments)
    ]


@pytest.fixture
def no_driver(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Planning only: no NVIDIA driver, an empty HF cache, no R1SUP_* settings from the caller."""
    planning_without_a_driver(monkeypatch, tmp_path)
    monkeypatch.setenv("R1SUP_STATE_DIR", str(tmp_path / "state"))


def test_the_values_name_the_cards_the_default_config_is_for():
    assert {"L4", "A10", "RTX 4090"} <= set(cards_the_values_name())


@pytest.mark.parametrize("card", cards_the_values_name())
def test_the_default_config_plans_as_given_on_every_card_its_comments_name(
    card: str, no_driver: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    """`r1sup plan --config <the chart's r1sup.toml> --gpu CARD` says FITS as given (exit 0)."""
    from r1sup.cli.app import main

    (configmap,) = [d for d in by_kind("ConfigMap") if d["metadata"]["name"] == RELEASE]
    path = tmp_path / "r1sup.toml"
    path.write_text(configmap["data"]["r1sup.toml"], encoding="utf-8")
    code = main(["plan", "--config", str(path), "--gpu", card, "--json"])
    verdict = json.loads(capsys.readouterr().out)["verdict"]
    assert code == 0, verdict
    assert verdict["status"] == "fits"


# --- the profile store without ReadWriteMany; the upgrade gate's timeout and model cache ---------------


def test_the_http_store_needs_no_claim():
    url = "https://profiles.example.com/r1sup"
    docs = render({"profileStore": {"url": url}})
    assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim"]  # no ReadWriteMany class needed
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
    (configmap,) = [d for d in docs if d["kind"] == "ConfigMap"]
    pod = pod_of(sts)
    (container,) = pod["containers"]
    assert "profiles" not in {v["name"] for v in pod["volumes"]}
    assert "profiles" not in {m["name"] for m in container["volumeMounts"]}
    env = {**image_env(), **container_env(container)}
    env["VLLM_API_KEY"] = "k"
    config = cfg.build(tomllib.loads(configmap["data"]["r1sup.toml"]), env=env)
    assert config.state.profile_store == url
    import helm_python as helm

    with pytest.raises(helm.HelmValuesError, match="/profileStore/url"):
        render({"profileStore": {"url": "nfs://server/profiles"}})
    with pytest.raises(helm.HelmError, match="the HTTP store is read-only"):
        render({"profileStore": {"url": url}, "upgradeGate": {"enabled": True}, "models": {"shared": True}})


def test_the_gate_asks_for_the_helm_timeout_it_needs_and_reads_the_shared_model_cache():
    import helm_python as helm

    values = example_values("shared-cache-monitoring")
    docs = rendered("shared-cache-monitoring")
    (job,) = [d for d in docs if d["kind"] == "Job"]
    deadline = job["spec"]["activeDeadlineSeconds"]
    timeout = job["metadata"]["annotations"]["r1sup.io/helm-timeout"]
    assert timeout.endswith("s") and int(timeout[:-1]) > deadline > 5 * 60  # Helm's default: 5 minutes
    with helm.Chart.load(str(CHART)) as chart:
        notes = chart.render(values, name=RELEASE, namespace="serving", is_install=False)
    assert f"--timeout {timeout}" in notes["r1sup/templates/NOTES.txt"]
    # the model: the release's shared claim, not an emptyDir filled at each upgrade
    pod = job["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    (sts,) = by_kind("StatefulSet", "shared-cache-monitoring")
    served_models = {v["name"]: v for v in pod_of(sts)["volumes"]}["models"]
    assert volumes["models"]["persistentVolumeClaim"] == served_models["persistentVolumeClaim"]
    with pytest.raises(helm.HelmError, match="upgradeGate needs models.shared"):
        render({"upgradeGate": {"enabled": True}})


# --- the ServiceMonitor and the autoscalers ----------------------------------------------------------


def test_the_service_monitor_scrapes_both_endpoints_through_the_pods_service_only():
    services = {s["metadata"]["name"]: s for s in by_kind("Service", f"default{KEDA}")}
    (monitor,) = by_kind("ServiceMonitor", f"default{KEDA}")
    selector = monitor["spec"]["selector"]["matchLabels"]
    chosen = [n for n, s in services.items() if selector.items() <= s["metadata"]["labels"].items()]
    assert chosen == [f"{RELEASE}-pods"]  # every pod, ready or not; not the clients' Service
    ports = {p["name"] for p in services[f"{RELEASE}-pods"]["spec"]["ports"]}
    endpoints = {(e["port"], e["path"]) for e in monitor["spec"]["endpoints"]}
    assert endpoints == {("r1sup", "/metrics"), ("http", "/metrics")} and {p for p, _ in endpoints} <= ports
    bad = copy.deepcopy(monitor)
    bad["spec"]["endpoints"][0]["intervall"] = "30s"
    with pytest.raises(jsonschema.ValidationError):
        validate_custom(bad, SERVICEMONITOR_SCHEMA)


def autoscaler_queries(values: str) -> list[str]:
    """The PromQL of the value set's autoscaler: the ScaledObject's trigger, or the prometheus-adapter
    rule the HPA carries."""
    out = [t["metadata"]["query"] for d in by_kind("ScaledObject", values) for t in d["spec"]["triggers"]]
    for hpa in by_kind("HorizontalPodAutoscaler", values):
        rule = yaml.safe_load(hpa["metadata"]["annotations"]["r1sup.io/prometheus-adapter-rule"])
        out += [rule["seriesQuery"], rule["metricsQuery"]]
    return out


def selected_series(expr: str) -> set[str]:
    return set(re.findall(r"([A-Za-z_:][A-Za-z0-9_:]*)\{", expr))


def vllm_metric_names() -> set[str]:
    """The series the installed vLLM's Prometheus logger declares (vllm/v1/metrics/loggers.py), read from
    its source file: importing it imports torch and vLLM, a minute of a loaded core."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations, "vLLM is not installed"
    source = (Path(spec.submodule_search_locations[0]) / "v1" / "metrics" / "loggers.py").read_text(
        encoding="utf-8"
    )
    return set(re.findall(r'name="(vllm:[a-z_:]+)"', source))


@pytest.mark.parametrize("values", [f"default{KEDA}", f"multinode-deepseek-r1{HPA}"])
def test_every_series_the_autoscaler_queries_is_one_r1sup_and_vllm_export(values: str):
    from r1sup.adapters.metrics import Metrics

    queries = autoscaler_queries(values)
    assert queries
    wanted = set().union(*(selected_series(q) for q in queries))
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting", "r1sup_capacity_requests"} <= wanted
    for query in queries:
        assert query.count("(") == query.count(")") and query.count("{") == query.count("}")
    vllm_wanted = {s for s in wanted if s.startswith("vllm:")}
    assert vllm_wanted <= vllm_metric_names()
    recorded = VLLM_SCRAPE.read_text(encoding="utf-8")  # a real vllm-cpu 0.32 engine's /metrics
    for name in vllm_wanted:
        assert re.search(rf"^{re.escape(name)}\{{", recorded, re.M), name
    registered = {family.name for family in Metrics().registry.collect()}
    r1sup_wanted = {s for s in wanted if s.startswith("r1sup_")}
    assert r1sup_wanted <= {"r1sup_capacity_requests", SLO_CAPACITY}
    # the service-level figure comes from the slo work; until r1sup registers it the query falls back
    for name in r1sup_wanted:
        if name != SLO_CAPACITY or SLO_CAPACITY in registered:
            assert name in registered, name
        else:
            assert "or max by (namespace, pod) (r1sup_capacity_requests" in " ".join(queries)


def test_the_autoscaler_scales_the_workload_on_the_proven_capacity():
    (so,) = by_kind("ScaledObject", f"default{KEDA}")
    (sts,) = by_kind("StatefulSet", f"default{KEDA}")
    ref = so["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == (
        "apps/v1",
        "StatefulSet",
        sts["metadata"]["name"],
    )
    assert "replicas" not in sts["spec"]  # the autoscaler owns it: an upgrade does not reset it
    assert "replicas" in by_kind("StatefulSet")[0]["spec"]
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    # the figure per replica is read at query time (a ratio to the proven capacity): the target is the
    # fraction of it, 1 by default; no request count typed into the values
    assert trigger["metadata"]["threshold"] == "1"
    query = trigger["metadata"]["query"]
    assert f'namespace="serving",pod=~"{RELEASE}-[0-9]+"' in query
    assert "/ on (namespace, pod)" in query
    (lws,) = by_kind("LeaderWorkerSet", f"multinode-deepseek-r1{HPA}")
    (hpa,) = by_kind("HorizontalPodAutoscaler", f"multinode-deepseek-r1{HPA}")
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("LeaderWorkerSet", lws["metadata"]["name"])
    (metric,) = hpa["spec"]["metrics"]
    rule = yaml.safe_load(hpa["metadata"]["annotations"]["r1sup.io/prometheus-adapter-rule"])
    assert metric["pods"]["metric"]["name"] == rule["name"]["as"]
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    assert "<<.LabelMatchers>>" in rule["metricsQuery"]
    import helm_python as helm

    with pytest.raises(helm.HelmError, match="autoscaling.keda.serverAddress: required"):
        render({"autoscaling": {"enabled": True}})
    with pytest.raises(helm.HelmError, match="minReplicas"):
        render({"autoscaling": {"enabled": True, "kind": "hpa", "minReplicas": 5, "maxReplicas": 2}})
    without_waiting = render(merged(OVERLAYS[KEDA], {"autoscaling": {"countWaiting": False}}))
    (so,) = [d for d in without_waiting if d["kind"] == "ScaledObject"]
    assert "vllm:num_requests_waiting" not in so["spec"]["triggers"][0]["metadata"]["query"]
