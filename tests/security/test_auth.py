"""Only known API keys are served: `revisit gateway`'s default (keys mode), through the real openai client against a
real gateway in front of real SGLang CPU workers. Before keys mode, any bearer string (or none, or a placeholder
such as "EMPTY") was a tenant."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from gateway.config import GatewayConfig, key_digest
from settings.secret import DataPlaneSecret
from tests.conftest import MODEL_ID, run_gateway
from tests.images_lib import png_data_url, small

REVISIT = str(Path(sys.executable).parent / "revisit")
ALICE = "sk-alice-" + "a" * 24
BOB = "sk-bob-" + "b" * 24
MALLORY = "sk-mallory-" + "m" * 24


@pytest.fixture(scope="module")
def keyed(workers, model_path, tmp_path_factory):
    """A gateway configured as `revisit gateway` is, from the environment, with a key file: alice's key listed in
    plain text, bob's by its digest, in namespaces of their own."""
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"# tenants\nteam-a {ALICE}\n\nteam-b sha256:{key_digest(BOB)}\n")
    config = GatewayConfig.from_env({"REVISIT_MODEL": MODEL_ID, "REVISIT_WORKERS": ",".join(w.url for w in workers),
                                     "REVISIT_MODEL_DIR": str(model_path), "REVISIT_API_KEYS_FILE": str(keys),
                                     "REVISIT_REUSE": "0", "REVISIT_STORE_SECRET_FILE": secret_file(keys.parent)})
    server = run_gateway(config)
    try:
        yield server
    finally:
        server.stop()


def ask(url: str, key: str | None, image: str) -> openai.types.chat.ChatCompletion:
    # The openai client insists on a key; "" sends none.
    with openai.OpenAI(base_url=url + "/v1", api_key=key or "", max_retries=0, timeout=300) as client:
        return client.chat.completions.create(model=MODEL_ID, max_tokens=2, temperature=0, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                         {"type": "text", "text": "What is it?"}]}])


@pytest.mark.parametrize("key", [None, "EMPTY", "my-key", MALLORY, ALICE + "x", key_digest(BOB)])
def test_a_key_not_listed_is_refused_with_openais_401(keyed, key):
    with pytest.raises(openai.AuthenticationError) as refused:
        ask(keyed.url, key, png_data_url(small("coffee.png")))
    error = refused.value.body
    assert refused.value.status_code == 401
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"  # as OpenAI answers
    assert (key or "<none>") not in error["message"]


def test_listed_keys_are_served_each_in_its_namespace(keyed):
    image = png_data_url(small("coffee.png"))
    answers = [ask(keyed.url, key, image) for key in (ALICE, BOB)]
    assert all(a.choices[0].message.content is not None for a in answers)
    keys = [httpx.post(keyed.url + "/v1/chat/completions", timeout=300, headers={"Authorization": f"Bearer {key}"},
                       json={"model": MODEL_ID, "max_tokens": 1, "messages": [{"role": "user", "content": [
                           {"type": "image_url", "image_url": {"url": image}}]}]}).headers["x-revisit-image-keys"]
            for key in (ALICE, BOB)]
    assert keys[0] != keys[1]  # the same image, two namespaces: two keys, nothing shared


def test_every_api_route_needs_a_key_but_health_does_not(keyed):
    for method, path in (("GET", "/v1/models"), ("GET", f"/v1/models/{MODEL_ID}"), ("POST", "/v1/completions"),
                         ("POST", "/v1/chat/completions")):
        response = httpx.request(method, keyed.url + path, json={"model": MODEL_ID, "prompt": "hi"}, timeout=30)
        assert response.status_code == 401, path
    assert httpx.get(keyed.url + "/v1/models", headers={"Authorization": f"Bearer {BOB}"}).status_code == 200
    assert httpx.get(keyed.url + "/health").status_code == 200  # load balancers probe without a key


def test_a_refused_request_is_refused_before_its_body_is_read(keyed):
    # A caller without a key cannot make the gateway take in 60 MB: the 401 comes first.
    with httpx.Client(timeout=30) as client:
        response = client.post(keyed.url + "/v1/chat/completions", content=b"x" * (60 << 20),
                               headers={"Authorization": f"Bearer {MALLORY}", "Content-Type": "application/json"})
    assert response.status_code == 401


def secret_file(folder: Path) -> str:
    path = folder / "secret"
    if not path.exists():
        DataPlaneSecret.create(path)
    return str(path)


def environment(**settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REVISIT_")}
    return {**env, "REVISIT_MODEL": "m", "REVISIT_WORKERS": "http://127.0.0.1:9", "REVISIT_REUSE": "0", **settings}


def test_keys_mode_without_the_deployment_secret_does_not_start(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"team-a {ALICE}\n")
    result = subprocess.run([REVISIT, "gateway"], capture_output=True, text=True, timeout=60,
                            env=environment(REVISIT_API_KEYS_FILE=str(keys)))
    assert result.returncode == 2 and "REVISIT_STORE_SECRET_FILE" in result.stderr
    (tmp_path / "short").write_text("ab" * 8)
    result = subprocess.run([REVISIT, "gateway"], capture_output=True, text=True, timeout=60,
                            env=environment(REVISIT_API_KEYS_FILE=str(keys),
                                            REVISIT_STORE_SECRET_FILE=str(tmp_path / "short")))
    assert result.returncode == 2 and "at least 32" in result.stderr and "ab" * 8 not in result.stderr


def test_revisit_keys_secret_makes_a_private_secret_and_never_overwrites_one(tmp_path):
    path = tmp_path / "secret"
    subprocess.run([REVISIT, "keys", "secret", str(path)], check=True, timeout=60, capture_output=True)
    made = path.read_bytes()
    assert DataPlaneSecret.read(path).configured and (path.stat().st_mode & 0o777) == 0o600
    again = subprocess.run([REVISIT, "keys", "secret", str(path)], timeout=60, capture_output=True, text=True)
    assert again.returncode == 2 and "exists" in again.stderr and path.read_bytes() == made


def test_revisit_gateway_without_keys_does_not_start_and_says_what_to_do():
    result = subprocess.run([REVISIT, "gateway"], capture_output=True, text=True, timeout=60, env=environment())
    assert result.returncode == 2
    assert "REVISIT_API_KEYS_FILE" in result.stderr and "REVISIT_AUTH=open" in result.stderr


@pytest.mark.parametrize("line,message", [("team short-key", "at least 16"), ("team", "expected"),
                                           ("team sha256:abc", "64 hex"), ("bad/name " + ALICE, "namespace")])
def test_a_bad_key_file_does_not_start_and_names_the_line_not_the_key(tmp_path, line, message):
    keys = tmp_path / "keys"
    keys.write_text(f"# ok\nteam-a {BOB}\n{line}\n")
    result = subprocess.run([REVISIT, "gateway"], capture_output=True, text=True, timeout=60,
                            env=environment(REVISIT_API_KEYS_FILE=str(keys)))
    assert result.returncode == 2 and message in result.stderr and "line 3" in result.stderr
    assert BOB not in result.stderr and ALICE not in result.stderr


def test_a_new_key_from_the_command_is_served(tmp_path, workers, model_path):
    keys = tmp_path / "keys"
    made = subprocess.run([REVISIT, "keys", "new", "team-c", "--append", str(keys)], capture_output=True, text=True,
                          timeout=60, check=True)
    key = made.stdout.strip()
    assert key.startswith("sk-revisit-") and key not in keys.read_text()  # the file holds its digest only
    assert (keys.stat().st_mode & 0o777) == 0o600
    config = GatewayConfig.from_env(environment(REVISIT_MODEL=MODEL_ID, REVISIT_API_KEYS_FILE=str(keys),
                                                REVISIT_STORE_SECRET_FILE=secret_file(tmp_path),
                                                REVISIT_WORKERS=",".join(w.url for w in workers),
                                                REVISIT_MODEL_DIR=str(model_path)))
    server = run_gateway(config)
    try:
        assert httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer x" + key}).status_code == 401
    finally:
        server.stop()
