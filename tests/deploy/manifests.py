"""The ``kvatlas`` commands of deploy/: the Dockerfile, the compose file, the Kubernetes
manifests and the systemd units, read as their runtimes would read them.

Each command comes out as the words a shell would pass (``kvatlas <role> --flag ...``),
with the runtime's variables put in: Kubernetes' ``$(VAR)`` from the container's
``env`` (a ConfigMap's value, a field of the pod), systemd's ``${VAR}`` from
deploy/systemd/kvatlas.env and ``%H`` (the host's name). ``parse`` runs them through
the real CLI's parser (tests/docs' helper, so a flag is a whole flag of that
subcommand), and ``on_loopback`` rewrites one to run on 127.0.0.1 in a scratch folder.

Must not: start processes (the tests do).
"""

from __future__ import annotations

import argparse
import re
import shlex
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from docs.doc_commands import ROOT, check_kvatlas, kvatlas_parser

DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE = DEPLOY / "compose.yaml"
K8S = DEPLOY / "k8s"
SYSTEMD = DEPLOY / "systemd"
KVATLAS_IMAGES = ("kvatlas", "kvatlas:")
"""A compose image or a Kubernetes container image that is deploy/Dockerfile's."""
POD_FIELDS = {"spec.nodeName": "node-1", "status.podIP": "10.1.2.3"}
"""Stand-ins for the pod fields the manifests read through the downward API."""
HOSTNAME = "node-1"
"""systemd's ``%H``."""


@dataclass(frozen=True)
class DeployCommand:
    source: str  # "compose", "k8s", "systemd", "dockerfile"
    name: str  # the service, container or unit
    words: tuple[str, ...]  # "kvatlas", the role, its arguments

    @property
    def role(self) -> str:
        return self.words[1]

    def __str__(self) -> str:
        return f"{self.source}:{self.name}"


def yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def load_all(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def extras() -> set[str]:
    """The optional-dependency names of pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return set(project["optional-dependencies"])


# ---- Dockerfile


def dockerfile_lines() -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    return [
        ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")
    ]


def dockerfile_exec(instruction: str) -> list[str]:
    """An exec-form instruction's list (``ENTRYPOINT ["kvatlas"]``)."""
    found = [ln for ln in dockerfile_lines() if ln.split(None, 1)[0] == instruction]
    assert len(found) == 1, f"one {instruction} in the Dockerfile, found {found}"
    value = yaml.safe_load(found[0].split(None, 1)[1])
    assert isinstance(value, list), f"{instruction} in exec form: {found[0]}"
    return [str(v) for v in value]


def dockerfile_arg_defaults(name: str) -> list[str]:
    """The defaults of every ``ARG name=...`` (one per stage that declares it)."""
    pat = re.compile(rf"^ARG {name}=(.*)$")
    return [m.group(1).strip('"') for ln in dockerfile_lines() if (m := pat.match(ln))]


def dockerfile_installs() -> list[str]:
    """The requirement of each ``pip install`` / ``pip wheel`` of the project."""
    reqs = []
    for ln in dockerfile_lines():
        if re.search(r"\bpip (install|wheel)\b", ln):
            reqs += [w for w in shlex.split(ln) if re.match(r"^(kvatlas|\.)\[", w)]
    return reqs


# ---- compose


def compose() -> dict[str, Any]:
    (doc,) = load_all(COMPOSE)
    assert isinstance(doc, dict)
    return doc


def is_kvatlas_service(service: Mapping[str, Any]) -> bool:
    image = str(service.get("image", ""))
    return image == "kvatlas" or image.startswith("kvatlas:")


def compose_commands() -> Iterator[DeployCommand]:
    for name, service in compose()["services"].items():
        if is_kvatlas_service(service):
            yield DeployCommand("compose", name, ("kvatlas", *map(str, service["command"])))


# ---- Kubernetes


def k8s_docs() -> list[dict[str, Any]]:
    return [d for p in sorted(K8S.glob("*.yaml")) for d in load_all(p)]


def k8s_config_maps() -> dict[str, dict[str, str]]:
    return {
        d["metadata"]["name"]: d.get("data", {}) for d in k8s_docs() if d["kind"] == "ConfigMap"
    }


def pod_spec(doc: Mapping[str, Any]) -> dict[str, Any] | None:
    if doc["kind"] in ("Deployment", "DaemonSet", "StatefulSet"):
        spec: dict[str, Any] = doc["spec"]["template"]["spec"]
        return spec
    return None


def container_env(container: Mapping[str, Any]) -> dict[str, str]:
    """What ``$(NAME)`` stands for in this container's args."""
    maps = k8s_config_maps()
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = str(var["value"])
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            env[var["name"]] = POD_FIELDS[source["fieldRef"]["fieldPath"]]
        else:
            ref = source["configMapKeyRef"]
            env[var["name"]] = maps[ref["name"]][ref["key"]]
    return env


def k8s_containers() -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, container) for every container of every workload."""
    for doc in k8s_docs():
        spec = pod_spec(doc)
        if spec is not None:
            for c in spec["containers"]:
                yield doc, c


_K8S_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _expand(arg: str, env: Mapping[str, str], where: str) -> str:
    """Kubernetes' ``$(NAME)`` in an argument, from the container's env."""
    unset = [v for v in _K8S_VAR.findall(arg) if v not in env]
    assert not unset, f"{where}: $({unset[0]}) is not in the container's env"
    return _K8S_VAR.sub(lambda m: env[m.group(1)], arg)


def k8s_commands() -> Iterator[DeployCommand]:
    for doc, c in k8s_containers():
        if c["image"] != "kvatlas":
            continue
        env = container_env(c)
        args = [_expand(str(a), env, doc["metadata"]["name"]) for a in c["args"]]
        yield DeployCommand("k8s", f"{doc['metadata']['name']}/{c['name']}", ("kvatlas", *args))


# ---- systemd


def unit_sections(path: Path) -> dict[str, dict[str, list[str]]]:
    """A unit file's sections: key -> its values in order (continuations joined)."""
    text = re.sub(r"\\\n", " ", path.read_text())
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def systemd_env() -> dict[str, str]:
    env = {}
    for line in (SYSTEMD / "kvatlas.env").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    return env


def units() -> list[Path]:
    return sorted(SYSTEMD.glob("*.service"))


def systemd_commands() -> Iterator[DeployCommand]:
    env = systemd_env()
    for unit in units():
        (exec_start,) = unit_sections(unit)["Service"]["ExecStart"]
        words = shlex.split(exec_start.replace("%H", HOSTNAME))
        words = [re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], w) for w in words]
        assert Path(words[0]).name == "kvatlas", f"{unit.name} runs {words[0]}"
        yield DeployCommand("systemd", unit.stem, ("kvatlas", *words[1:]))


def all_commands() -> list[DeployCommand]:
    entry = dockerfile_exec("ENTRYPOINT")
    docker = DeployCommand("dockerfile", "CMD", (*entry, *dockerfile_exec("CMD")))
    return [docker, *compose_commands(), *k8s_commands(), *systemd_commands()]


# ---- parsing


def parse(cmd: DeployCommand) -> argparse.Namespace:
    """The command's arguments as its real parser reads them (AssertionError naming
    the command when one does not parse: an unknown flag, a missing value)."""
    check_kvatlas(cmd.words)
    parser, args = kvatlas_parser(cmd.words)
    parser.allow_abbrev = False
    return parser.parse_args(args)


def url_port(url: str) -> int:
    """The port of ``http://host:port`` or ``host:port``."""
    port = urlsplit(url if "://" in url else f"tcp://{url}").port
    assert port is not None, f"no port in {url}"
    return port


def url_host(url: str) -> str:
    host = urlsplit(url if "://" in url else f"tcp://{url}").hostname
    assert host, f"no host in {url}"
    return host


def listening_ports(cmd: DeployCommand) -> set[int]:
    """Every port the command listens on, from its parsed flags."""
    a = parse(cmd)
    if cmd.role in ("coordinator", "router"):
        return {a.port}
    assert cmd.role == "server", cmd
    ports = {a.port, a.http_port}
    if a.p2p_advertise_url:
        ports.add(url_port(a.p2p_listen_url or a.p2p_advertise_url))
        if a.p2p_data_port:
            ports.add(a.p2p_data_port)
    return ports


# ---- loopback


PORT_FLAGS = ("--port", "--http-port", "--p2p-data-port")
URL_FLAGS = ("--coordinator-url", "--p2p-advertise-url", "--p2p-listen-url", "--engine-url")
PATH_FLAGS = ("--state-dir", "--l2-path", "--snapshot-path")
SMALL_L1_GB, SMALL_L2_GB = "0.0625", "0.25"
SMALL = {"--l1-size-gb": SMALL_L1_GB, "--l2-size-gb": SMALL_L2_GB, "--no-l1-prefault": None}


def split_flags(args: tuple[str, ...]) -> list[tuple[str, str | None]]:
    """``--flag value`` and ``--flag=value`` pairs, in order (a flag alone: None);
    only for the flags of deploy/, whose values never start with ``--``."""
    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(args):
        word = args[i]
        if "=" in word:
            flag, _, value = word.partition("=")
            out.append((flag, value))
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            out.append((word, args[i + 1]))
            i += 1
        else:
            out.append((word, None))
        i += 1
    return out


def on_loopback(
    cmd: DeployCommand, ports: Mapping[int, int], scratch: Path, replace: Mapping[str, str]
) -> list[str]:
    """The command's arguments to run it here: every address 127.0.0.1, each port mapped
    through ``ports`` (the same deployed port, the same local one, so that a URL still
    names the process it named), paths under ``scratch``, L1 and L2 small; ``replace``
    sets flags outright (a token file, a broker)."""
    out: list[str] = [cmd.role]
    for flag, deployed in split_flags(cmd.words[2:]):
        if flag in SMALL:
            continue
        value = deployed
        if flag in replace:
            value = replace[flag]
        elif flag == "--host" or flag == "--coordinator-advertise-ip":
            value = "127.0.0.1"
        elif flag in PORT_FLAGS and value is not None:
            value = str(ports[int(value)])
        elif flag in URL_FLAGS and value is not None:
            port = ports[url_port(value)]
            value = f"http://127.0.0.1:{port}" if "://" in value else f"127.0.0.1:{port}"
        elif flag in PATH_FLAGS and value is not None:
            value = str(scratch / cmd.name.replace("/", "-") / Path(value).name)
        out += [flag] if value is None else [flag, value]
    if cmd.role == "server":
        out += ["--l1-size-gb", SMALL_L1_GB, "--no-l1-prefault"]
        if any(flag == "--l2-size-gb" for flag, _ in split_flags(cmd.words[2:])):
            out += ["--l2-size-gb", SMALL_L2_GB]
    return out
