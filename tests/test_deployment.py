"""The compose file describes the same server `make serve` runs."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_compose_service_serves_with_a_health_check() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    service = compose["services"]["swallow"]
    assert service["command"][0] == "serve"
    assert any(p.endswith(":8000") for p in service["ports"])
    assert "/health" in " ".join(service["healthcheck"]["test"])


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_compose_file_validates() -> None:
    result = subprocess.run(["docker-compose", "config", "-q"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
