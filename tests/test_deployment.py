"""The deployment files describe the stack `swallow stack` starts.

`docker-compose.yml` (and its GPU override) runs the same roles, in the same numbers and start
order, wired the same way; `deploy/kubernetes/` runs them across nodes, validated offline against
the Kubernetes API schemas. Every role's command line is parsed with the real `swallow` parser.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from swallow.cli import build_parser
from api.stack.plan import plan_stack

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_GPU = ROOT / "docker-compose.gpu.yml"
K8S = ROOT / "deploy" / "kubernetes"
# A recent version the installed kubernetes-validate ships schemas for (it picks the newest <= this).
KUBERNETES_VERSION = "1.32.0"

SERVICES = {"api", "encoder", "worker-0", "worker-1"}
START_ORDER = ("encoder", "worker", "api")  # plan_stack's order: each role needs the ones before it

_parser = build_parser()


def _parse(argv: list[str]):
    return _parser.parse_args(argv)


def _defaults(obj: object) -> object:
    """``obj`` with every `${VAR:-default}` at its default, as compose reads it with none of them set."""
    return yaml.safe_load(re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", yaml.safe_dump(obj)))


def _options(argv: list[str] | tuple[str, ...]) -> set[str]:
    return {a.split("=", 1)[0] for a in argv if a.startswith("--")}


def _health_port(args) -> int:
    """The port a role answers /health on: the API's HTTP port, the others' --health-port."""
    return args.port if args.command == "api" else args.health_port


# ---------------------------------------------------------------------------------------- compose


@pytest.fixture(scope="module")
def raw_services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


@pytest.fixture(scope="module")
def services(raw_services: dict) -> dict:
    return _defaults(raw_services)


@pytest.fixture(scope="module")
def top_volumes() -> dict:
    return _defaults(yaml.safe_load(COMPOSE.read_text())["volumes"])


@pytest.fixture(scope="module")
def gpu_services() -> dict:
    return _defaults(yaml.safe_load(COMPOSE_GPU.read_text())["services"])


def _role(service_name: str) -> str:
    return re.sub(r"-\d+$", "", service_name)


def _command(service: dict) -> list[str]:
    return [str(a) for a in service["command"]]


def _mounts(service: dict) -> dict[str, tuple[str, str]]:
    """target -> (source, mode) of a service's short-syntax volumes."""
    out = {}
    for spec in service.get("volumes", []):
        source, target, *mode = spec.split(":")
        out[target] = (source, mode[0] if mode else "rw")
    return out


def _check_url(service: dict) -> str:
    match = re.search(r"['\"](http://[^'\"]+)['\"]", service["healthcheck"]["test"][-1])
    assert match, service["healthcheck"]
    return match.group(1)


def _depends(services: dict, name: str) -> dict[str, str]:
    """Every service ``name`` waits for, directly or not, with the condition of the direct edge."""
    out: dict[str, str] = {}
    for dep, spec in (services[name].get("depends_on") or {}).items():
        out[dep] = spec["condition"] if isinstance(spec, dict) else "service_started"
        out.update({k: v for k, v in _depends(services, dep).items() if k not in out})
    return out


def test_compose_services_are_the_stack_roles(services: dict) -> None:
    assert set(services) == SERVICES
    for name, service in services.items():
        args = _parse(_command(service))  # the image's entrypoint is `swallow`
        assert args.command == _role(name), name
        assert args.host == "0.0.0.0", f"{name} must listen beyond its container"
        if args.command != "api":
            assert getattr(args, f"{args.command}_id") == name


@pytest.fixture(scope="module")
def plan():
    return plan_stack("/models/demo", workers=2, encoders=1, internal_ports=range(17100, 17106),
                      store_name="swallow-test-store")


def test_compose_topology_matches_swallow_stack(services: dict, plan) -> None:
    parsed = {name: _parse(_command(s)) for name, s in services.items()}
    assert Counter(r.role for r in plan.roles) == Counter(_role(n) for n in services)

    # Every option the plan gives a role, the compose service gives it too.
    for role in plan.roles:
        name = next(n for n in services if _role(n) == role.role)
        missing = _options(role.argv) - _options(_command(services[name]))
        assert not missing, f"{name} lacks {missing} that `swallow stack` passes"

    # The API's worker and encoder lists are exactly the other services' message sockets.
    api_plan = _parse(list(plan.of_role("api")[0].argv))
    for role, option in (("worker", "workers"), ("encoder", "encoders")):
        assert getattr(api_plan, option).split(",") == [r.address for r in plan.of_role(role)]
        expected = {f"tcp://{n}:{a.port}" for n, a in parsed.items() if a.command == role}
        listed = getattr(parsed["api"], option).split(",")
        assert len(listed) == len(set(listed)) and set(listed) == expected, (option, listed)

    # Encoders and workers share one embedding store, as in the plan.
    plan_stores = {_parse(list(r.argv)).embedding_cache_name for r in plan.roles if r.role != "api"}
    assert plan_stores == {plan.store_name}
    stores = {a.embedding_cache_name for a in parsed.values() if a.command != "api"}
    assert len(stores) == 1 and None not in stores, stores

    # Every role the plan health-checks is health-checked on the same path, on its own health port.
    for role in plan.roles:
        url = urlsplit(role.health_url)
        assert url.port == _health_port(_parse(list(role.argv)))
        for name in (n for n in services if _role(n) == role.role):
            check = urlsplit(_check_url(services[name]))
            assert (check.hostname, check.path) == ("127.0.0.1", url.path), name
            assert check.port == _health_port(parsed[name]), name

    # The plan's start order, enforced by health: each role waits until the earlier roles are healthy.
    assert [r.role for r in plan.roles] == sorted((r.role for r in plan.roles), key=START_ORDER.index)
    for name in services:
        earlier = {n for n in services if START_ORDER.index(_role(n)) < START_ORDER.index(_role(name))}
        deps = _depends(services, name)
        assert set(deps) == earlier, (name, deps)
        direct = services[name].get("depends_on") or {}
        assert all(spec["condition"] == "service_healthy" for spec in direct.values()), name


def test_compose_encoder_and_workers_share_memory(services: dict, top_volumes: dict) -> None:
    """The store is a segment in /dev/shm: the encoder and the workers mount one tmpfs there."""
    shm = {name: _mounts(s).get("/dev/shm") for name, s in services.items() if _role(name) != "api"}
    sources = {mount[0] for mount in shm.values() if mount}
    assert None not in shm.values() and len(sources) == 1, shm
    (volume,) = sources
    opts = top_volumes[volume]["driver_opts"]
    assert opts["type"] == "tmpfs" and opts["device"] == "tmpfs"
    size = re.search(r"size=(\d+)([kmg]?)", opts["o"])
    size_mib = int(size.group(1)) * {"": 2**-20, "k": 2**-10, "m": 1, "g": 1024}[size.group(2)]
    cache_mib = _parse(_command(services["encoder"])).embedding_cache_mib
    assert size_mib >= cache_mib + 64, "the tmpfs must hold the store, with room to spare"
    assert all(mode == "rw" for _, mode in shm.values())


def test_compose_mounts_the_model_read_only_where_each_role_reads_it(services: dict, raw_services: dict) -> None:
    for name, service in services.items():
        model = _parse(_command(service)).model
        assert _mounts(service).get(model) == ("./models/demo", "ro"), (name, service["volumes"])
        assert f"${{SWALLOW_MODEL_DIR:-./models/demo}}:{model.replace('demo', '${SWALLOW_MODEL_NAME:-demo}')}:ro" \
            in raw_services[name]["volumes"], "host directory and name configurable"


def test_compose_api_shares_its_upload_spool_with_the_encoder(services: dict, top_volumes: dict) -> None:
    api = _parse(_command(services["api"]))
    assert api.shared_spool and api.spool_dir
    source = _mounts(services["api"])[api.spool_dir][0]
    assert source in top_volumes, "the spool should be a named volume"
    assert _mounts(services["encoder"]).get(api.spool_dir, (None,))[0] == source, "encoders read it at the same path"


def test_compose_publishes_the_api_port_and_passes_the_api_key(services: dict, raw_services: dict) -> None:
    assert raw_services["api"]["ports"] == ["${SWALLOW_PORT:-8000}:8000"]
    assert int(services["api"]["ports"][0].split(":")[1]) == _parse(_command(services["api"])).port
    assert raw_services["api"]["environment"]["SWALLOW_API_KEY"] == "${SWALLOW_API_KEY:-}"
    for name, service in services.items():
        assert service["restart"] in ("always", "unless-stopped"), name
        assert (service["build"], service["image"]) == (".", "swallow:latest"), name
        if name != "api":
            assert "ports" not in service, f"{name} is internal"


def test_compose_health_checks_need_no_curl(services: dict) -> None:
    for name, service in services.items():
        check = service["healthcheck"]
        assert check["test"][:2] == ["CMD", "python"] and "urllib" in check["test"][-1], name
        assert {"interval", "timeout", "retries", "start_period"} <= check.keys(), name


def test_gpu_override_puts_encoder_and_workers_on_cuda(services: dict, gpu_services: dict) -> None:
    assert set(gpu_services) == SERVICES - {"api"}
    worker_gpus = []
    for name, override in gpu_services.items():
        command = _command(override)
        assert _parse(command).device == "cuda", name
        i = command.index("--device")
        assert command[:i] + command[i + 2:] == _command(services[name]), f"{name}: only --device may differ"
        (device,) = override["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"], name
        assert len(device["device_ids"]) == 1, name
        if _role(name) == "worker":
            worker_gpus += device["device_ids"]
    assert len(worker_gpus) == len(set(worker_gpus)) == 2, "one GPU per worker"


def test_dockerfile_runs_swallow_and_exposes_the_roles_ports(services: dict) -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["swallow"]' in dockerfile
    exposed = {int(p) for line in re.findall(r"^EXPOSE (.+)$", dockerfile, re.M) for p in line.split()}
    for service in services.values():
        args = _parse(_command(service))
        assert {args.port, _health_port(args)} <= exposed
    # The image installs the package, so the demo page must be package data.
    import tomllib

    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "static/*" in package_data["demo"] and (ROOT / "demo" / "static" / "index.html").exists()


needs_compose = pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")


def _compose(*args: str, files: tuple[Path, ...] = (COMPOSE,), **env: str) -> subprocess.CompletedProcess:
    flags = [a for f in files for a in ("-f", str(f))]
    result = subprocess.run(["docker-compose", *flags, "config", *args], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, **env}, timeout=60)
    assert result.returncode == 0, result.stderr
    return result


@needs_compose
@pytest.mark.parametrize("files", [(COMPOSE,), (COMPOSE, COMPOSE_GPU)], ids=["cpu", "gpu"])
def test_compose_files_validate(files: tuple[Path, ...]) -> None:
    _compose("-q", files=files)


@needs_compose
def test_compose_variables_reach_every_service() -> None:
    env = {"SWALLOW_MODEL_DIR": "/srv/ckpt", "SWALLOW_MODEL_NAME": "mimo", "SWALLOW_PORT": "9001",
           "SWALLOW_API_KEY": "k3y"}
    config = yaml.safe_load(_compose(**env).stdout)["services"]
    for service in config.values():
        assert _parse(service["command"]).model == "/models/mimo"
        assert "/srv/ckpt:/models/mimo:ro" in service["volumes"]
    api = config["api"]
    assert [(int(p["published"]), int(p["target"])) for p in api["ports"]] == [(9001, 8000)]
    assert api["environment"]["SWALLOW_API_KEY"] == "k3y"


@needs_compose
def test_compose_gpu_override_merges_into_the_stack() -> None:
    config = yaml.safe_load(_compose(files=(COMPOSE, COMPOSE_GPU), SWALLOW_WORKER_1_GPU="3").stdout)["services"]
    assert "deploy" not in config["api"] and _parse(config["api"]["command"]).command == "api"
    for name in SERVICES - {"api"}:
        assert _parse(config[name]["command"]).device == "cuda", name
        assert config[name]["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
        assert "healthcheck" in config[name] and "/dev/shm" in " ".join(config[name]["volumes"]), name
    assert config["worker-1"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["3"]


# ------------------------------------------------------------------------------------- kubernetes


@pytest.fixture(scope="module")
def kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


@pytest.fixture(scope="module")
def manifests() -> dict[str, list[dict]]:
    """file name -> its resources, for every manifest but the kustomization."""
    return {p.name: [d for d in yaml.safe_load_all(p.read_text()) if d]
            for p in sorted(K8S.glob("*.yaml")) if p.name != "kustomization.yaml"}


@pytest.fixture(scope="module")
def resources(manifests: dict) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for docs in manifests.values() for d in docs}


_FIELDS = {"status.podIP": "10.1.2.3", "metadata.name": "swallow-worker-0", "metadata.namespace": "swallow",
           "spec.nodeName": "node-a"}


def _expand(container: dict, resources: dict) -> list[str]:
    """The container's args as the kubelet passes them: $(VAR) from its env (config maps, downward API)."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "configMapKeyRef" in var["valueFrom"]:
            ref = var["valueFrom"]["configMapKeyRef"]
            env[var["name"]] = resources[("ConfigMap", ref["name"])]["data"][ref["key"]]
        elif "fieldRef" in var["valueFrom"]:
            env[var["name"]] = _FIELDS[var["valueFrom"]["fieldRef"]["fieldPath"]]
    args = []
    for arg in container["args"]:
        unknown = set(re.findall(r"\$\((\w+)\)", arg)) - env.keys()
        assert not unknown, f"{container['name']}: {arg} names {unknown}, which its env does not define"
        args.append(re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg))
    return args


@pytest.fixture(scope="module")
def roles(resources: dict) -> dict[str, dict]:
    """role -> {workload, pod spec, container, args (parsed)} for the three role workloads."""
    out = {}
    for (kind, _), doc in resources.items():
        if kind not in ("Deployment", "StatefulSet", "DaemonSet"):
            continue
        pod = doc["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        args = _parse(_expand(container, resources))
        assert args.command not in out, f"two workloads run {args.command}"
        out[args.command] = {"workload": doc, "pod": pod, "container": container, "args": args}
    assert set(out) == {"api", "encoder", "worker"}
    return out


def _selects(service: dict, workload: dict) -> bool:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return service["spec"]["selector"].items() <= labels.items()


def _service_for(resources: dict, workload: dict) -> dict:
    (service,) = [d for (kind, _), d in resources.items() if kind == "Service" and _selects(d, workload)]
    return service


def _dns_target(address: str, namespace: str) -> tuple[str, int]:
    """dns://NAME:PORT -> (service name, port); NAME may be short or the in-cluster FQDN."""
    url = urlsplit(address)
    assert url.scheme == "dns", address
    name, *rest = url.hostname.split(".")
    assert rest in ([], [namespace], [namespace, "svc", "cluster", "local"]), address
    return name, url.port


def test_kustomization_lists_every_manifest(kustomization: dict, manifests: dict) -> None:
    assert set(kustomization["resources"]) == set(manifests)
    namespace = kustomization["namespace"]
    assert ("Namespace", namespace) in {(d["kind"], d["metadata"]["name"]) for ds in manifests.values() for d in ds}
    for docs in manifests.values():
        for d in docs:
            if d["kind"] != "Namespace":
                assert d["metadata"].get("namespace") == namespace, d["metadata"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kustomization_builds(resources: dict) -> None:
    result = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    built = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(result.stdout) if d}
    assert built == set(resources)


def test_manifests_validate_against_the_kubernetes_schemas(manifests: dict) -> None:
    import kubernetes_validate

    for name, docs in manifests.items():
        for doc in docs:
            try:
                version = kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            except Exception as exc:  # ValidationError, SchemaNotFoundError: neither has a useful str()
                pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']}: {getattr(exc, 'message', exc)}",
                            pytrace=False)
            assert version == KUBERNETES_VERSION.rsplit(".", 1)[0]
    # The validator does reject what the API server would.
    broken = copy.deepcopy(next(d for docs in manifests.values() for d in docs if d["kind"] == "StatefulSet"))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_k8s_role_commands_parse_and_listen_on_the_pod_ip(roles: dict) -> None:
    for role, r in roles.items():
        assert r["args"].host == "0.0.0.0", role
        if role != "api":
            declared = {p["containerPort"] for p in r["container"]["ports"]}
            assert {r["args"].port, r["args"].health_port} <= declared, role


def test_k8s_router_finds_workers_through_a_headless_service(roles: dict, resources: dict) -> None:
    worker, api = roles["worker"], roles["api"]["args"]
    assert worker["workload"]["kind"] == "StatefulSet"
    service = _service_for(resources, worker["workload"])
    assert service["spec"]["clusterIP"] == "None"
    assert worker["workload"]["spec"]["serviceName"] == service["metadata"]["name"]
    name, port = _dns_target(api.workers, service["metadata"]["namespace"])
    assert (name, port) == (service["metadata"]["name"], worker["args"].port), api.workers
    assert port in {p["port"] for p in service["spec"]["ports"]}
    assert worker["args"].worker_id == "swallow-worker-0", "each worker is named after its pod"


def test_k8s_encoders_are_per_node_and_found_through_a_headless_service(roles: dict, resources: dict) -> None:
    encoder, worker, api = roles["encoder"], roles["worker"], roles["api"]["args"]
    assert encoder["workload"]["kind"] == "DaemonSet", "one encoder (and embedding store) per node"
    service = _service_for(resources, encoder["workload"])
    namespace = service["metadata"]["namespace"]
    assert service["spec"]["clusterIP"] == "None"
    assert _dns_target(api.encoders, namespace) == (service["metadata"]["name"], encoder["args"].port)
    # The embedding ring: every encoder, reached on its health port (/internal/embeddings); an
    # encoder's own node name is its pod IP, which is what the ring's DNS lookup yields.
    for r in (encoder, worker):
        assert _dns_target(r["args"].embedding_peers, namespace) == (service["metadata"]["name"],
                                                                      encoder["args"].health_port)
    assert encoder["args"].embedding_node == _FIELDS["status.podIP"]


def test_k8s_encoder_shares_its_node_memory_with_the_workers(roles: dict) -> None:
    encoder, worker = roles["encoder"], roles["worker"]
    assert encoder["pod"].get("hostIPC") is True and worker["pod"].get("hostIPC") is True
    stores = {encoder["args"].embedding_cache_name, worker["args"].embedding_cache_name}
    assert len(stores) == 1 and None not in stores, stores
    assert _FIELDS["metadata.namespace"] in stores.pop(), "one store per namespace on a shared node"
    assert "embedding-cache-name" not in " ".join(roles["api"]["container"]["args"])


def test_k8s_every_role_has_probes_on_its_health_port(roles: dict) -> None:
    for role, r in roles.items():
        container, health = r["container"], _health_port(r["args"])
        named = {p.get("name"): p["containerPort"] for p in container["ports"]}
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container.get(kind)
            assert probe, f"{role} has no {kind}"
            action = probe.get("httpGet") or probe.get("tcpSocket")
            assert named.get(action["port"], action["port"]) == health, (role, kind)
            if kind == "readinessProbe" or role != "api":
                assert probe.get("httpGet", {}).get("path") == "/health", (role, kind)
            elif kind == "livenessProbe":  # the API lives on without workers: /health would restart it
                assert probe.get("httpGet", {}).get("path") == "/livez", (role, kind)
        # Slow model loads are the startup probe's business: minutes, not seconds.
        startup = container["startupProbe"]
        if role != "api":
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, role
        assert "requests" in container["resources"], role


def test_k8s_workers_get_a_gpu_each(roles: dict) -> None:
    worker = roles["worker"]
    assert worker["args"].device == "cuda"
    resources = worker["container"]["resources"]
    assert int(resources["limits"]["nvidia.com/gpu"]) == 1
    assert int(resources["requests"].get("nvidia.com/gpu", 1)) == 1
    for role in ("api", "encoder"):
        assert "nvidia.com/gpu" not in roles[role]["container"]["resources"].get("limits", {}), role


def test_k8s_model_is_one_read_only_volume_where_every_role_reads_it(roles: dict, resources: dict) -> None:
    models = set()
    for role, r in roles.items():
        volumes = {v["name"]: v for v in r["pod"]["volumes"]}
        (mount,) = [m for m in r["container"]["volumeMounts"]
                    if r["args"].model.startswith(m["mountPath"].rstrip("/") + "/")]
        assert mount.get("readOnly") is True, role
        claim = volumes[mount["name"]]["persistentVolumeClaim"]["claimName"]
        assert ("PersistentVolumeClaim", claim) in resources, role
        models.add(r["args"].model)
    assert len(models) == 1, models


def test_k8s_api_service_and_key(roles: dict, resources: dict) -> None:
    api = roles["api"]
    assert api["workload"]["kind"] == "Deployment"
    service = _service_for(resources, api["workload"])
    assert service["spec"].get("clusterIP") != "None" and service["spec"].get("type", "ClusterIP") in (
        "ClusterIP", "LoadBalancer", "NodePort")
    named = {p.get("name"): p["containerPort"] for p in api["container"]["ports"]}
    (port,) = service["spec"]["ports"]
    assert named.get(port["targetPort"], port["targetPort"]) == api["args"].port
    assert not api["args"].shared_spool, "the API's spool is its own pod's; encoders get the bytes"
    (key,) = [e for e in api["container"]["env"] if e["name"] == "SWALLOW_API_KEY"]
    assert key["valueFrom"]["secretKeyRef"]["optional"] is True
