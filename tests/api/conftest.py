"""Fixtures shared by the API tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from demo.render import write_media
from demo.tasks import make_eval_set
from tests.api.live import DEMO, LiveServer, live_server


@pytest.fixture(scope="session")
def demo_server() -> Iterator[LiveServer]:
    """`swallow serve` of the demo model with its default options, shared by the
    files of the "demo-server" group (tests/conftest.py): their tests assert
    nothing about what another file's requests left in its caches or counters."""
    with live_server(DEMO) as running:
        yield running


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, list[Path]]]:
    """One sample of the demo world per media kind: (question, files)."""
    out: dict[str, tuple[str, list[Path]]] = {}
    directory = tmp_path_factory.mktemp("media")
    for i, sample in enumerate(make_eval_set(seed=4242, per_task=1)):
        kind = sample.media[0] if sample.media else "text"
        if kind not in out:
            out[kind] = (sample.question, write_media(sample, directory, f"s{i}"))
    return out
