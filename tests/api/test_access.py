"""--api-key and --cors-origin: bearer auth on /v1 and /metrics, CORS preflights and headers."""

import aiohttp
import openai
import pytest
from aiohttp import web
from scripted_backend import ScriptedBackend

from meshnode.api.auth import ApiAccess
from meshnode.api.openai_api import start_api_server
from meshnode.app.api_options import api_access
from meshnode.app.cli import build_parser
from meshnode.commandline.config import ConfigError, parse_args_with_config

KEY = "sk-mesh-test-0123456789"
ORIGIN = "https://console.example"


def metrics_route(app: web.Application) -> None:
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text="meshnode_up 1\n")

    app.router.add_get("/metrics", metrics)
    app.router.add_get("/meshnode/mesh", metrics)


@pytest.fixture
async def serve():
    runners = []

    async def start(access: ApiAccess, backend=None) -> str:
        runner, port = await start_api_server(
            backend or ScriptedBackend(), "127.0.0.1", 0, extra_routes=metrics_route, access=access
        )
        runners.append(runner)
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


async def request(method: str, url: str, **kwargs) -> tuple[int, dict, dict[str, str]]:
    async with aiohttp.ClientSession() as session, session.request(method, url, **kwargs) as response:
        body = await response.json(content_type=None) if response.content_length != 0 else {}
        return response.status, body, dict(response.headers)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/metrics"),
        ("GET", "/meshnode/mesh"),
    ],
)
@pytest.mark.parametrize("authorization", [None, "Bearer wrong-key", f"Basic {KEY}", KEY])
async def test_every_v1_route_metrics_and_node_views_need_the_key(serve, method, path, authorization):
    base = await serve(ApiAccess(api_key=KEY))
    headers = {"Authorization": authorization} if authorization else {}
    status, body, response_headers = await request(method, base + path, json={"prompt": "x"}, headers=headers)
    assert status == 401
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == "invalid_api_key"
    assert KEY not in body["error"]["message"]
    assert response_headers["WWW-Authenticate"] == "Bearer"


async def test_the_right_key_is_let_through_and_probes_stay_open(serve):
    base = await serve(ApiAccess(api_key=KEY))
    auth = {"Authorization": f"Bearer {KEY}"}
    assert (await request("GET", f"{base}/v1/models", headers=auth))[0] == 200
    status, body, _ = await request(
        "POST", f"{base}/v1/completions", headers=auth, json={"prompt": "x", "max_tokens": 2}
    )
    assert status == 200 and body["choices"][0]["text"] == "He"
    async with aiohttp.ClientSession() as session, session.get(f"{base}/metrics", headers=auth) as r:
        assert r.status == 200 and "meshnode_up" in await r.text()
    # Orchestrators probe without credentials.
    assert (await request("GET", f"{base}/livez"))[0] == 200
    assert (await request("GET", f"{base}/health"))[0] == 200


async def test_without_a_key_configured_nothing_is_asked(serve):
    base = await serve(ApiAccess())
    assert (await request("GET", f"{base}/v1/models"))[0] == 200


async def test_the_official_client_gets_an_authentication_error(serve):
    base = await serve(ApiAccess(api_key=KEY))
    wrong = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="sk-wrong", max_retries=0)
    right = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
    try:
        with pytest.raises(openai.AuthenticationError) as refused:
            await wrong.completions.create(model="tiny", prompt="x", max_tokens=2)
        assert refused.value.status_code == 401
        assert refused.value.code == "invalid_api_key"
        completion = await right.completions.create(model="tiny", prompt="x", max_tokens=2)
        assert completion.choices[0].text == "He"
    finally:
        await wrong.close()
        await right.close()


async def test_a_preflight_from_an_allowed_origin_is_answered_before_auth(serve):
    base = await serve(ApiAccess(api_key=KEY, cors_origins=(ORIGIN,)))
    preflight = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    status, _, headers = await request("OPTIONS", f"{base}/v1/chat/completions", headers=preflight)
    assert status == 204
    assert headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert "Authorization" in headers["Access-Control-Allow-Headers"]
    assert headers["Vary"] == "Origin"

    status, body, headers = await request(
        "OPTIONS", f"{base}/v1/chat/completions", headers=preflight | {"Origin": "https://evil.example"}
    )
    assert status == 403 and body["error"]["type"] == "invalid_request_error"
    assert "Access-Control-Allow-Origin" not in headers


@pytest.mark.parametrize("stream", [False, True])
async def test_answers_to_an_allowed_origin_carry_cors_headers(serve, stream):
    base = await serve(ApiAccess(api_key=KEY, cors_origins=(ORIGIN,)))
    body = {"prompt": "x", "max_tokens": 2, "stream": stream}
    auth = {"Authorization": f"Bearer {KEY}"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{base}/v1/completions", json=body, headers=auth | {"Origin": ORIGIN}) as r,
    ):
        assert r.status == 200
        assert r.headers["Access-Control-Allow-Origin"] == ORIGIN
    # A refusal reaches the page too, so it can tell the user why.
    status, _, headers = await request("GET", f"{base}/v1/models", headers={"Origin": ORIGIN})
    assert status == 401 and headers["Access-Control-Allow-Origin"] == ORIGIN
    status, _, headers = await request(
        "GET", f"{base}/v1/models", headers=auth | {"Origin": "https://evil.example"}
    )
    assert status == 200 and "Access-Control-Allow-Origin" not in headers


async def test_any_origin(serve):
    base = await serve(ApiAccess(cors_origins=("*",)))
    _, _, headers = await request("GET", f"{base}/v1/models", headers={"Origin": "https://a.example"})
    assert headers["Access-Control-Allow-Origin"] == "*"


def test_the_key_never_shows_in_a_repr():
    access = ApiAccess(api_key=KEY, cors_origins=(ORIGIN,))
    assert KEY not in repr(access) and KEY not in str(access)
    assert "set" in repr(access)


@pytest.mark.parametrize("command", ["serve", "start"])
def test_api_key_and_origins_from_the_command_line_environment_and_file(tmp_path, command):
    parser = build_parser()
    required = ["--model", "m.gguf"] if command == "serve" else []
    args = parse_args_with_config(
        parser,
        [command, *required, "--api-key", KEY, "--cors-origin", ORIGIN, "--cors-origin", "*"],
        environ={},
    )
    assert api_access(args) == ApiAccess(api_key=KEY, cors_origins=(ORIGIN, "*"))

    args = parse_args_with_config(
        parser, [command, *required], environ={"MESHNODE_API_KEY": KEY, "MESHNODE_CORS_ORIGIN": ORIGIN}
    )
    assert api_access(args) == ApiAccess(api_key=KEY, cors_origins=(ORIGIN,))

    config = tmp_path / "meshnode.toml"
    config.write_text(f'api-key = "{KEY}"\ncors-origin = ["{ORIGIN}"]\n')
    args = parse_args_with_config(parser, [command, *required, "--config", str(config)], environ={})
    assert api_access(args) == ApiAccess(api_key=KEY, cors_origins=(ORIGIN,))


def test_generate_takes_the_key_from_the_environment():
    args = parse_args_with_config(
        build_parser(), ["generate", "--prompt", "x"], environ={"MESHNODE_API_KEY": KEY}
    )
    assert args.api_key == KEY


@pytest.mark.parametrize(
    ("option", "value"), [("--api-key", "two words"), ("--cors-origin", "console.example")]
)
def test_malformed_access_options_are_refused(option, value):
    with pytest.raises(ConfigError, match="MESHNODE_"):
        parse_args_with_config(
            build_parser(),
            ["serve", "--model", "m.gguf"],
            environ={f"MESHNODE_{option[2:].upper().replace('-', '_')}": value},
        )
