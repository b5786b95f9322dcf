"""deploy/ against the real CLI and itself, without starting a container (none can start
on these machines: the container runtime is refused setrlimit).

Every YAML file parses; every ``kvatlas`` command of the Dockerfile, the compose file,
the Kubernetes manifests and the systemd units parses with that subcommand's own parser
and its ``--help`` runs; the ports that manifests publish, probe and name in URLs are
the ones the commands' flags listen on; the extras the image installs are pyproject's.
test_loopback.py starts the commands themselves.
"""

from __future__ import annotations

import json
import re
import subprocess
from typing import Any

import pytest

from deploy.manifests import (
    DOCKERFILE,
    DeployCommand,
    all_commands,
    compose,
    compose_commands,
    dockerfile_arg_defaults,
    dockerfile_exec,
    dockerfile_installs,
    extras,
    k8s_containers,
    k8s_docs,
    listening_ports,
    load_all,
    parse,
    pod_spec,
    systemd_commands,
    systemd_env,
    unit_sections,
    units,
    url_host,
    url_port,
    yaml_files,
)
from docs.doc_commands import KVATLAS_PARSERS
from kvatlas.launch.procs import python_module

COMMANDS = all_commands()
ROLES = ("coordinator", "server", "router")


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: p.name)
def test_every_yaml_parses(path: Any) -> None:
    assert load_all(path), f"{path} holds no document"


def test_every_role_is_deployed_everywhere() -> None:
    for source in ("compose", "k8s", "systemd"):
        roles = sorted({c.role for c in COMMANDS if c.source == source})
        assert roles == sorted(ROLES), f"{source} runs {roles}"


@pytest.mark.parametrize("cmd", COMMANDS, ids=str)
def test_command_parses_with_the_real_cli(cmd: DeployCommand) -> None:
    if cmd.words[1:] == ("--help",):
        return
    assert cmd.role in KVATLAS_PARSERS, f"{cmd}: `kvatlas {cmd.role}` is no command"
    parse(cmd)


@pytest.mark.parametrize("role", ["", *sorted({c.role for c in COMMANDS if c.role != "--help"})])
def test_help_runs(role: str) -> None:
    """The image's default command, and ``--help`` of every role deploy/ runs."""
    argv = [role, "--help"] if role else ["--help"]
    done = subprocess.run(
        python_module("kvatlas.cli.main", *argv), capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout


def test_a_wrong_flag_is_found() -> None:
    bad = DeployCommand("test", "bad", ("kvatlas", "server", "--l1-sise-gb", "1"))
    with pytest.raises(AssertionError, match="l1-sise-gb"):
        parse(bad)
    abbreviated = DeployCommand("test", "abbr", ("kvatlas", "server", "--l1-size", "1"))
    with pytest.raises(AssertionError):
        parse(abbreviated)


# ---- the image


def test_the_image_runs_kvatlas_as_a_user() -> None:
    assert dockerfile_exec("ENTRYPOINT") == ["kvatlas"]
    text = DOCKERFILE.read_text()
    froms = re.findall(r"^FROM (\S+)", text, re.M)
    assert all(f == "${PYTHON_IMAGE}" for f in froms), froms
    assert dockerfile_arg_defaults("PYTHON_IMAGE") == ["python:3.11-slim"]
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0"), users


def test_the_image_installs_real_extras() -> None:
    installs = dockerfile_installs()
    assert installs, "no pip install of kvatlas in the Dockerfile"
    defaults = dockerfile_arg_defaults("EXTRAS")
    assert defaults and len(set(defaults)) == 1, f"ARG EXTRAS defaults differ: {defaults}"
    build_args = compose()["x-kvatlas"]["build"]["args"]["EXTRAS"]
    for chosen in (defaults[0], build_args):
        names = set(chosen.split(","))
        assert names <= extras(), f"extras pyproject does not have: {names - extras()}"
        assert set(ROLES) <= names
    for req in installs:
        inside = req.split("[", 1)[1].rstrip("]")
        assert inside == "${EXTRAS}" or set(inside.split(",")) <= extras(), req


def test_the_image_exposes_the_deployed_ports() -> None:
    text = DOCKERFILE.read_text()
    exposed = {int(p) for ln in re.findall(r"^EXPOSE (.+)$", text, re.M) for p in ln.split()}
    used = set().union(*(listening_ports(c) for c in compose_commands()))
    used |= set().union(*(listening_ports(c) for c in systemd_commands()))
    assert exposed <= used, f"exposed ports no command listens on: {exposed - used}"


# ---- compose


def _compose_port(service: dict[str, Any], container_port: int) -> bool:
    return any(str(p).rsplit(":", 1)[-1] == str(container_port) for p in service.get("ports", []))


def _healthcheck_port(service: dict[str, Any]) -> int | None:
    test = " ".join(service.get("healthcheck", {}).get("test", []))
    m = re.search(r"http://127\.0\.0\.1:(\d+)/", test)
    return int(m.group(1)) if m else None


def test_compose_ports_agree_with_the_flags() -> None:
    services = compose()["services"]
    by_name = {c.name: c for c in compose_commands()}
    for name, cmd in by_name.items():
        a = parse(cmd)
        service = services[name]
        http = a.http_port if cmd.role == "server" else a.port
        assert _healthcheck_port(service) == http, f"{name}'s healthcheck is not on {http}"
        assert _compose_port(service, http), f"{name} does not publish {http}"
        assert a.host == "0.0.0.0", f"{name} binds {a.host}: other containers cannot reach it"
        for url in getattr(a, "coordinator_url", None) or []:
            target = by_name[url_host(url)]
            assert target.role == "coordinator" and url_port(url) == parse(target).port, url


def test_compose_vllm_reaches_the_server_through_lmcache() -> None:
    services = compose()["services"]
    (server,) = [c for c in compose_commands() if c.role == "server"]
    a = parse(server)
    vllm = services["vllm"]
    assert vllm["network_mode"] == f"service:{server.name}"
    assert vllm["ipc"] == f"service:{server.name}" and services[server.name]["ipc"] == "shareable"
    config = json.loads(vllm["command"][vllm["command"].index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "LMCacheMPConnector"
    assert config["kv_connector_extra_config"]["lmcache.mp.port"] == a.port
    (engine_url,) = a.engine_url
    assert url_host(engine_url) == server.name
    vllm_port = next(int(w.split("=")[1]) for w in vllm["command"] if w.startswith("--port="))
    assert url_port(engine_url) == vllm_port and _compose_port(services[server.name], vllm_port)
    shm_gb = float(services[server.name]["shm_size"].rstrip("gb"))
    assert shm_gb > a.l1_size_gb, "/dev/shm must hold the L1 region and the engine's own"


# ---- Kubernetes


def _container_ports(container: dict[str, Any]) -> dict[str, int]:
    return {p.get("name", str(p["containerPort"])): p["containerPort"] for p in container["ports"]}


def test_k8s_container_ports_agree_with_the_flags() -> None:
    for cmd in (c for c in COMMANDS if c.source == "k8s"):
        workload, name = cmd.name.split("/")
        (container,) = [c for d, c in k8s_containers() if d["metadata"]["name"] == workload
                        and c["name"] == name]  # fmt: skip
        declared = set(_container_ports(container).values())
        assert listening_ports(cmd) <= declared, (
            f"{cmd}: undeclared {listening_ports(cmd) - declared}"
        )
        for probe in ("readinessProbe", "livenessProbe"):
            port = container.get(probe, {}).get("httpGet", {}).get("port")
            if port is not None:
                assert port in _container_ports(container), f"{cmd}: {probe} on {port}"
        assert parse(cmd).host == "0.0.0.0", f"{cmd} binds loopback: the Service cannot reach it"


def test_k8s_services_target_declared_ports_and_urls_name_services() -> None:
    docs = k8s_docs()
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    workloads = [d for d in docs if pod_spec(d) is not None]
    for svc in services.values():
        selector = svc["spec"]["selector"]
        (workload,) = [w for w in workloads if selector.items() <= w["spec"]["template"]
                       ["metadata"]["labels"].items()]  # fmt: skip
        ports: dict[str, int] = {}
        for c in pod_spec(workload)["containers"]:  # type: ignore[index]
            ports |= _container_ports(c)
        for p in svc["spec"]["ports"]:
            assert ports[p["targetPort"]] == p["port"], f"{svc['metadata']['name']}: {p}"
    for cmd in (c for c in COMMANDS if c.source == "k8s"):
        for url in getattr(parse(cmd), "coordinator_url", None) or []:
            svc = services[url_host(url)]
            assert url_port(url) in {p["port"] for p in svc["spec"]["ports"]}, f"{cmd}: {url}"


def test_k8s_server_pod_shares_shm_with_its_engine() -> None:
    (ds,) = [d for d in k8s_docs() if d["kind"] == "DaemonSet"]
    spec = pod_spec(ds)
    assert spec is not None
    volumes = {v["name"]: v for v in spec["volumes"]}
    (server_cmd,) = [c for c in COMMANDS if c.source == "k8s" and c.role == "server"]
    a = parse(server_cmd)
    shm_volumes = set()
    for c in spec["containers"]:
        for m in c.get("volumeMounts", []):
            if m["mountPath"] == "/dev/shm":
                shm_volumes.add(m["name"])
    (shm,) = shm_volumes
    assert volumes[shm]["emptyDir"]["medium"] == "Memory"
    assert _gib(volumes[shm]["emptyDir"]["sizeLimit"]) > a.l1_size_gb
    for flag, path in (("state_dir", a.state_dir), ("l2_path", a.l2_path)):
        mounted = [m["name"] for c in spec["containers"] for m in c.get("volumeMounts", [])
                   if m["mountPath"] == path]  # fmt: skip
        assert mounted and "hostPath" in volumes[mounted[0]], f"--{flag} is not on a hostPath"
    assert "$(NODE_NAME)" in " ".join(
        next(c for c in spec["containers"] if c["image"] == "kvatlas")["args"]
    ), "the instance id must outlive the pod: the node's name"
    vllm = next(c for c in spec["containers"] if c["image"] != "kvatlas")
    config = json.loads(vllm["args"][vllm["args"].index("--kv-transfer-config") + 1])
    assert config["kv_connector_extra_config"]["lmcache.mp.port"] == a.port
    (engine_url,) = a.engine_url
    assert url_port(engine_url) in set(_container_ports(vllm).values())


def _gib(quantity: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Gi|Mi)", quantity)
    assert m, quantity
    return float(m.group(1)) / (1024 if m.group(2) == "Mi" else 1)


# ---- systemd


def test_systemd_units_restart_and_keep_the_cache() -> None:
    for unit in units():
        service = unit_sections(unit)["Service"]
        assert service["Restart"] in (["on-failure"], ["always"]), unit.name
        assert service["User"] != ["root"], unit.name
    server = unit_sections(next(u for u in units() if "server" in u.name))["Service"]
    assert server.get("RemoveIPC") == ["no"]
    assert "PrivateDevices" not in server or server["PrivateDevices"] == ["no"]
    assert not [k for k in server if k.startswith(("ExecStartPre", "ExecStopPost"))]
    (cmd,) = [c for c in systemd_commands() if c.role == "server"]
    a = parse(cmd)
    assert a.instance_id and a.state_dir, "a fixed instance id and state dir keep the cache"


def test_systemd_coordinator_urls_name_the_coordinators_port() -> None:
    (coord,) = [c for c in systemd_commands() if c.role == "coordinator"]
    port = parse(coord).port
    assert url_port(systemd_env()["COORDINATOR_URL"]) == port
    for cmd in systemd_commands():
        for url in getattr(parse(cmd), "coordinator_url", None) or []:
            assert url_port(url) == port, f"{cmd}: {url}"
