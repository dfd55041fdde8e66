"""The compose file describes the same server `make serve` runs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from api.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def raw_service() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["swallow"]


@pytest.fixture(scope="module")
def service(raw_service: dict) -> dict:
    """The service with every `${VAR:-default}` at its default, as compose would with none of them set."""
    return yaml.safe_load(re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", yaml.safe_dump(raw_service)))


def _option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_compose_service_serves_with_a_health_check(service: dict) -> None:
    assert service["command"][0] == "serve"
    assert any(p.endswith(":8000") for p in service["ports"])
    assert "/health" in " ".join(service["healthcheck"]["test"])


def test_compose_command_is_a_valid_serve_command_line(service: dict) -> None:
    command = [str(a) for a in service["command"]]
    args = build_parser().parse_args(command)  # the image's entrypoint is `swallow`
    assert args.command == "serve"
    assert (args.host, args.port) == ("0.0.0.0", 8000)
    assert args.model.startswith("/models/") and args.spool_dir


def test_compose_mounts_the_model_read_only_where_serve_reads_it(service: dict, raw_service: dict) -> None:
    command = [str(a) for a in service["command"]]
    model_mounts = [v for v in service["volumes"] if v.split(":")[1] == _option(command, "--model")]
    assert model_mounts == ["./models/demo:/models/demo:ro"], service["volumes"]
    assert any(v.startswith("${SWALLOW_MODEL_DIR:-") for v in raw_service["volumes"]), "host directory configurable"
    spool = _option(command, "--spool-dir")
    assert any(v.split(":")[1] == spool for v in service["volumes"]), "the upload spool should be a volume"


def test_compose_publishes_the_port_and_passes_the_api_key(service: dict, raw_service: dict) -> None:
    assert raw_service["ports"] == ["${SWALLOW_PORT:-8000}:8000"]
    assert raw_service["environment"]["SWALLOW_API_KEY"] == "${SWALLOW_API_KEY:-}"
    assert service["restart"] in ("always", "unless-stopped")


def test_compose_health_check_needs_no_curl(service: dict) -> None:
    check = service["healthcheck"]
    test = check["test"]
    assert test[:2] == ["CMD", "python"]
    assert "urllib" in test[-1] and "http://127.0.0.1:8000/health" in test[-1]
    assert {"interval", "timeout", "retries"} <= check.keys()


def test_dockerfile_runs_swallow_with_the_demo_page() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["swallow"]' in dockerfile
    assert "EXPOSE 8000" in dockerfile
    # The image installs the package, so the demo page must be package data.
    import tomllib

    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "static/*" in package_data["api"] and (ROOT / "api" / "static" / "index.html").exists()


def _compose_config(**env: str) -> dict:
    result = subprocess.run(["docker-compose", "config"], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, **env})
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_compose_file_validates() -> None:
    result = subprocess.run(["docker-compose", "config", "-q"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_compose_variables_reach_the_service() -> None:
    service = _compose_config(SWALLOW_MODEL_DIR="/srv/ckpt", SWALLOW_MODEL_NAME="mimo", SWALLOW_PORT="9001",
                              SWALLOW_API_KEY="k3y")["services"]["swallow"]
    assert _option(service["command"], "--model") == "/models/mimo"
    assert "/srv/ckpt:/models/mimo:ro" in service["volumes"]
    assert {"published": 9001, "target": 8000} in [{k: int(v) for k, v in p.items() if k in ("published", "target")}
                                                   for p in service["ports"]]
    assert service["environment"]["SWALLOW_API_KEY"] == "k3y"
