"""compose.yaml is a valid Compose file that deploys what the README says, checked without Docker: against the
Compose Specification's JSON schema (as check-jsonschema ships it), after the interpolation Compose does. Where a
Compose tool is installed, its own reading of the file must agree."""

from __future__ import annotations

import importlib.resources
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from store import StoreConfig

ROOT = Path(__file__).resolve().parent.parent
VARIABLE = re.compile(r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")
SCALE_OUT = "compose.scale-out.yaml"
# What a file needs set to be read at all (Compose refuses it otherwise): this host's address on the cluster.
REQUIRED = {SCALE_OUT: {"CLUSTER_ADDRESS": "10.0.0.5"}}


class MissingVariable(KeyError):
    """A ``${NAME:?message}`` whose variable is unset: Compose refuses the file with the message."""


def _variable(match: re.Match[str], env: dict[str, str]) -> str:
    if match[0] == "$$":
        return "$"
    value, op = env.get(match["name"]), match["op"]
    if op in ("?", ":?"):
        if value is None or (op == ":?" and value == ""):
            raise MissingVariable(match["arg"])
        return value
    if op == "-":
        return value if value is not None else match["arg"]
    return value or (match["arg"] if op == ":-" else "") or ""


def interpolated(value: Any, env: dict[str, str]) -> Any:
    """``$$``, ``${NAME}``, ``${NAME:-default}`` and ``${NAME:?message}`` replaced as Compose replaces them (only the
    forms the compose files use)."""
    if isinstance(value, str):
        return VARIABLE.sub(lambda m: _variable(m, env), value)
    if isinstance(value, list):
        return [interpolated(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolated(v, env) for k, v in value.items()}
    return value


def compose_file(env: dict[str, str] | None = None, name: str = "compose.yaml") -> dict:
    """The file as Compose reads it with ``env`` (over the variables the file requires)."""
    return interpolated(yaml.safe_load((ROOT / name).read_text()), {**REQUIRED.get(name, {}), **(env or {})})


def compose_schema() -> dict:
    vendored = importlib.resources.files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json")
    return json.loads(vendored.read_text())


def test_compose_file_follows_the_compose_specification():
    schema = compose_schema()
    jsonschema.validators.validator_for(schema)(schema).validate(compose_file())
    broken = compose_file()
    broken["services"]["gateway"]["ports"] = {"8000": 8000}  # a mapping where the spec wants a list
    assert not jsonschema.validators.validator_for(schema)(schema).is_valid(broken)


def test_compose_deploys_a_gateway_in_front_of_gpu_workers_sharing_one_store():
    config = compose_file()
    services = config["services"]
    assert {"gateway", "worker-0", "worker-1"} <= set(services)
    workers = services["gateway"]["environment"]["REVISIT_WORKERS"].split(",")
    assert workers == ["http://worker-0:30000", "http://worker-1:30000"]
    for name in ("worker-0", "worker-1"):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
        assert any("/var/lib/revisit/store" in str(v) for v in services[name]["volumes"])
    assert "kv-store" in config["volumes"]
    # Gateway and workers name the same store, with variables the store understands.
    stores = []
    for name in ("gateway", "worker-0", "worker-1"):
        env = {k: str(v) for k, v in services[name]["environment"].items() if k.startswith("REVISIT_STORE_")}
        stores.append(StoreConfig.from_env(env))
        assert services[name].get("ipc") == "host"
    assert stores[0] == stores[1] == stores[2] and str(stores[0].lmdb_path).startswith("/var/lib/revisit/store")
    # The gateway reads the served model folder (processor settings, layer count: position-independent reuse).
    assert services["gateway"]["environment"]["REVISIT_MODEL_DIR"] == "/models/served"
    named = compose_file({"MODEL_NAME": "qwen2.5-vl-7b", "GATEWAY_PORT": "9000"})["services"]
    assert named["gateway"]["environment"]["REVISIT_MODEL"] == "qwen2.5-vl-7b"
    assert named["gateway"]["ports"] == ["9000:8000"]


def test_the_monitoring_profile_scrapes_the_gateway_into_grafana_with_the_dashboard():
    services = compose_file()["services"]
    assert services["prometheus"]["profiles"] == services["grafana"]["profiles"] == ["monitoring"]
    assert "profiles" not in services["gateway"]  # a plain `docker compose up` starts no monitoring
    scrape = yaml.safe_load((ROOT / "dashboards" / "prometheus.yml").read_text())["scrape_configs"][0]
    assert scrape["metrics_path"] == "/metrics" and scrape["static_configs"][0]["targets"] == ["gateway:8000"]
    mounts = {volume.split(":")[0]: volume.split(":")[1] for volume in services["grafana"]["volumes"]}
    assert mounts["./dashboards/grafana/revisit.json"].startswith("/var/lib/grafana/dashboards")
    provider = yaml.safe_load((ROOT / "dashboards/grafana/provisioning/dashboards/revisit.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    source = yaml.safe_load((ROOT / "dashboards/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert source["datasources"][0]["url"] == "http://prometheus:9090"
    for path in mounts:
        assert (ROOT / path).exists(), path



def test_the_scale_out_example_follows_the_specification_and_names_one_shared_store_and_books():
    schema = compose_schema()
    env = {"SHARED_HOST": "10.0.0.5", "CLUSTER_ADDRESS": "10.0.0.11", "WORKERS": "http://10.0.0.11:30000"}
    config = compose_file(env, SCALE_OUT)
    jsonschema.validators.validator_for(schema)(schema).validate(config)
    services = config["services"]
    roles = {name: tuple(service["profiles"]) for name, service in services.items()}
    assert {n for n, r in roles.items() if r == ("shared",)} == {"mooncake-master", "valkey", "gateway-1",
                                                                   "gateway-2", "load-balancer"}
    assert {n for n, r in roles.items() if r == ("gpu-host",)} == {"mooncake-store", "worker-0", "worker-1"}
    stores = {}
    for name in ("gateway-1", "gateway-2", "worker-0", "worker-1"):
        environment = {k: str(v) for k, v in services[name]["environment"].items() if k.startswith("REVISIT_STORE_")}
        stores[name] = StoreConfig.from_env(environment)
    assert {s.tiers for s in stores.values()} == {("mooncake",)}
    assert {(s.name, s.mooncake_master, s.mooncake_metadata_url, s.mooncake_admin, s.outcomes_url)
            for s in stores.values()} == {("default", "10.0.0.5:50051", "http://10.0.0.5:8080/metadata",
                                           "http://10.0.0.5:9003", "redis://10.0.0.5:6379/0")}
    assert stores["worker-0"].mooncake_local_hostname == "10.0.0.11"
    # The master listens where the store names it; the storage node joins it there.
    master = " ".join(services["mooncake-master"]["command"])
    assert "--rpc_port=50051" in master and "--http_metadata_server_port=8080" in master
    assert "--metrics_port=9003" in master and "10.0.0.11:50051:50051" in services["mooncake-master"]["ports"]
    node = " ".join(services["mooncake-store"]["command"])
    assert "--master_server_address=10.0.0.5:50051" in node and "--host=10.0.0.11" in node
    # Both gateways share one set of books, on the Valkey service, and sit behind the load balancer.
    gateways = [services[f"gateway-{i}"]["environment"] for i in (1, 2)]
    assert gateways[0] == gateways[1] and gateways[0]["REVISIT_BOOKS_URL"] == "redis://10.0.0.5:6379/0"
    assert gateways[0]["REVISIT_WORKERS"] == "http://10.0.0.11:30000"
    nginx = (ROOT / "docker/gateways.nginx.conf").read_text()
    assert "server gateway-1:8000" in nginx and "server gateway-2:8000" in nginx
    assert services["load-balancer"]["volumes"][0].startswith("./docker/gateways.nginx.conf:")
    assert services["gateway-1"]["build"]["args"]["EXTRAS"] == "scale-out"


def test_an_installed_compose_tool_reads_the_file_the_same_way():
    """A second opinion where a Compose tool is installed (`make test` installs docker-compose); on a machine without
    one the schema test above is the check."""
    tool = (["docker", "compose"] if shutil.which("docker") and subprocess.run(
        ["docker", "compose", "version"], capture_output=True).returncode == 0
        else ["docker-compose"] if shutil.which("docker-compose") else None)
    if tool is None:
        pytest.skip("no Compose tool installed: nothing to compare with")
    for name, profiles in (("compose.yaml", ["monitoring"]), (SCALE_OUT, ["shared", "gpu-host"])):
        flags = [flag for profile in profiles for flag in ("--profile", profile)]
        result = subprocess.run([*tool, "-f", str(ROOT / name), *flags, "config"], capture_output=True, text=True,
                                cwd=ROOT, timeout=120, env={"PATH": "/usr/bin:/bin", **REQUIRED.get(name, {})})
        assert result.returncode == 0, result.stderr
        theirs, ours = yaml.safe_load(result.stdout)["services"], compose_file(name=name)["services"]
        assert set(theirs) == set(ours)
        for service_name, service in ours.items():
            assert {k: str(v) for k, v in theirs[service_name].get("environment", {}).items()} == {
                k: str(v) for k, v in service.get("environment", {}).items()}
            assert sorted(published(theirs[service_name])) == sorted(published(service)), service_name
        if name in REQUIRED:  # the tool refuses the file without what it requires, and says what to set
            refused = subprocess.run([*tool, "-f", str(ROOT / name), *flags, "config"], capture_output=True,
                                     text=True, cwd=ROOT, timeout=120, env={"PATH": "/usr/bin:/bin"})
            assert refused.returncode != 0 and "CLUSTER_ADDRESS" in refused.stdout + refused.stderr


@pytest.mark.parametrize("name", ["compose.yaml", "compose.scale-out.yaml"])
def test_the_gateways_serve_only_the_keys_of_a_secret_file(name):
    config = compose_file({"API_KEYS_FILE": "/etc/revisit/api-keys"}, name=name)
    assert config["secrets"]["api_keys"] == {"file": "/etc/revisit/api-keys"}
    gateways = {n: s for n, s in config["services"].items() if n.startswith("gateway")}
    assert gateways
    for service in gateways.values():
        assert "api_keys" in service["secrets"]
        assert service["environment"]["REVISIT_API_KEYS_FILE"] == "/run/secrets/api_keys"
        assert "REVISIT_AUTH" not in service["environment"]  # keys mode, `revisit gateway`'s default


@pytest.mark.parametrize("name", ["compose.yaml", "compose.scale-out.yaml"])
def test_the_gateways_and_workers_share_the_deployment_secret(name):
    config = compose_file({"SECRET_FILE": "/etc/revisit/secret"}, name=name)
    assert config["secrets"]["data_plane_secret"] == {"file": "/etc/revisit/secret"}
    parts = {n: s for n, s in config["services"].items() if n.startswith(("gateway", "worker"))}
    assert any(n.startswith("gateway") for n in parts) and any(n.startswith("worker") for n in parts)
    for part in parts.values():
        assert "data_plane_secret" in part["secrets"]
        assert part["environment"]["REVISIT_STORE_SECRET_FILE"] == "/run/secrets/data_plane_secret"


def published(service: dict) -> list[tuple[str, str, str]]:
    """(host address, host port, container port) of each port a service publishes, in either of Compose's forms
    ("ADDRESS:PORT:PORT", "PORT:PORT", or a mapping with host_ip, published and target); "" for no address."""
    found = []
    for port in service.get("ports", []):
        if isinstance(port, dict):
            found.append((str(port.get("host_ip", "")), str(port.get("published", "")), str(port["target"])))
            continue
        parts = str(port).partition("/")[0].rsplit(":", 2)
        address, host, container = ([""] * (3 - len(parts)) + parts)
        found.append((address.strip("[]"), host, container))
    return found


ALL_INTERFACES = ("", "0.0.0.0", "::")
PUBLIC = {"compose.yaml": {"gateway"}, SCALE_OUT: {"load-balancer"}}  # the one service each file publishes to all


@pytest.mark.parametrize("name", ["compose.yaml", SCALE_OUT])
def test_only_the_gateway_or_its_load_balancer_is_published_to_every_network(name):
    services = compose_file(name=name)["services"]
    for service_name, service in services.items():
        for address, _, container in published(service):
            if service_name in PUBLIC[name]:
                continue
            assert address not in ALL_INTERFACES, f"{service_name} publishes {container} to every network"
    assert all(published(services[s]) for s in PUBLIC[name])
    # The Mooncake master's admin port (it lists every key) and its RPC and metadata ports, and Valkey's, on the
    # cluster's address alone.
    if name == SCALE_OUT:
        assert {p for p in published(services["mooncake-master"])} == {
            ("10.0.0.5", port, port) for port in ("50051", "8080", "9003")}
        assert published(services["valkey"]) == [("10.0.0.5", "6379", "6379")]
        assert not any(published(services[s]) for s in ("gateway-1", "gateway-2"))  # behind the load balancer
    else:
        assert {published(services[s])[0][0] for s in ("prometheus", "grafana")} == {"127.0.0.1"}


def test_on_one_host_the_workers_share_an_internal_network_with_the_gateway_alone():
    config = compose_file()
    services = config["services"]
    assert config["networks"]["workers"]["internal"] is True
    workers = [n for n in services if n.startswith("worker")]
    for worker in workers:
        assert services[worker]["networks"] == ["workers"] and not published(services[worker])
    assert set(services["gateway"]["networks"]) == {"default", "workers"}
    assert {n for n, s in services.items() if "workers" in s.get("networks", [])} == {"gateway", *workers}


def test_across_hosts_what_shares_the_host_network_listens_on_the_cluster_address():
    """The GPU hosts' workers and storage nodes share the host's network (Mooncake's transfer engine takes
    connections from its peers): SGLang and the storage node listen on the host's cluster address, not on every
    interface; nothing on the shared host shares its network."""
    with pytest.raises(MissingVariable, match="CLUSTER_ADDRESS"):
        interpolated(yaml.safe_load((ROOT / SCALE_OUT).read_text()), {})
    services = compose_file({"SHARED_HOST": "10.0.0.5", "CLUSTER_ADDRESS": "10.0.0.11"}, SCALE_OUT)["services"]
    on_host = {n for n, s in services.items() if s.get("network_mode") == "host"}
    assert on_host == {"mooncake-store", "worker-0", "worker-1"}
    for worker in ("worker-0", "worker-1"):
        command = services[worker]["command"]
        assert command[command.index("--host") + 1] == "10.0.0.11"
        assert services[worker]["environment"]["REVISIT_STORE_MOONCAKE_LOCAL_HOSTNAME"] == "10.0.0.11"
    assert "--host=10.0.0.11" in services["mooncake-store"]["command"]
    assert not any("0.0.0.0" in str(services[n].get("command", "")) for n in on_host)


def test_valkey_requires_the_password_of_a_secret_and_every_client_reads_it():
    config = compose_file({"BOOKS_PASSWORD_FILE": "/etc/revisit/books-password"}, SCALE_OUT)
    assert config["secrets"]["books_password"] == {"file": "/etc/revisit/books-password"}
    valkey = config["services"]["valkey"]
    assert valkey["secrets"] == ["books_password"]
    start = valkey["command"]
    assert start[:2] == ["sh", "-c"] and "requirepass" in start[2]
    assert '"$(cat /run/secrets/books_password)"' in start[2]
    assert "--requirepass" not in start[2]  # the password goes into a config file, never on a command line
    assert "exec docker-entrypoint.sh valkey-server /tmp/auth.conf" in start[2]  # the image's own start, as valkey
    assert "/run/secrets/books_password" in valkey["healthcheck"]["test"][1]
    assert "PONG" in valkey["healthcheck"]["test"][1]  # an authenticated answer, not any answer
    clients = {n: s for n, s in config["services"].items() if n.startswith(("gateway", "worker"))}
    assert len(clients) == 4
    for client_name, client in clients.items():
        assert "books_password" in client["secrets"], client_name
        environment = client["environment"]
        assert environment["REVISIT_STORE_OUTCOMES_PASSWORD_FILE"] == "/run/secrets/books_password"
        store = StoreConfig.from_env({k: str(v) for k, v in environment.items() if k.startswith("REVISIT_STORE_")})
        assert store.outcomes_url and store.outcomes_password_file == Path("/run/secrets/books_password")
        if client_name.startswith("gateway"):
            assert environment["REVISIT_BOOKS_PASSWORD_FILE"] == "/run/secrets/books_password"
