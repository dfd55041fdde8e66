"""The bad-input corpus (tests/api/bad_inputs.py) against one live server.

Invariant 5: every bad input gets its exact 4xx with a readable JSON error and no
traceback, within the client timeout, and the server goes on serving: /health
answers and a greedy completion gives the same tokens after the corpus as before.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest

from api.models import write_random_multimodal
from llm_core.model.presets import tiny
from tests.api.bad_inputs import Case, build_corpus
from tests.api.live import LiveServer, live_server

MAX_UPLOAD_MB = 4  # small, so oversized cases are cheap
CLIENT_TIMEOUT_S = 30.0
TRACEBACK_MARKERS = ("Traceback", 'File "', '.py", line')
PROBE_EVERY = 25
PROBE = {"prompt": list(range(5, 25)), "max_tokens": 8, "temperature": 0, "ignore_eos": True}
# One TLS context for every case's client: httpx loads the CA bundle for each new
# client otherwise (60 ms, most of a case's time), though the server is plain HTTP.
_TLS = ssl.create_default_context()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    checkpoint = write_random_multimodal(tmp_path_factory.mktemp("corpus") / "tiny-mm", tiny(), seed=0)
    with live_server(checkpoint, "--max-upload-mb", str(MAX_UPLOAD_MB)) as live:
        yield live


@dataclass(frozen=True)
class Outcome:
    case: Case
    problem: str | None  # None: the case passed
    seconds: float


def run_case(url: str, case: Case) -> Outcome:
    started = time.monotonic()
    try:
        # A connection of its own: a case the server closes on cannot fail the next one.
        with httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT_S, verify=_TLS) as client:
            response = case.send(client)
    except httpx.HTTPError as exc:
        return Outcome(case, f"no answer: {type(exc).__name__}: {exc}", time.monotonic() - started)
    seconds = time.monotonic() - started
    return Outcome(case, _problem(case, response, seconds), seconds)


def _problem(case: Case, response: httpx.Response, seconds: float) -> str | None:
    text = response.text
    got = f"{response.status_code} {text[:300]!r}"
    if response.status_code >= 500:
        return f"a server error (expected {case.status}): {got}"
    if response.status_code != case.status:
        return f"expected {case.status}, got {got}"
    if any(marker in text for marker in TRACEBACK_MARKERS):
        return f"traceback text in the answer: {got}"
    if seconds > CLIENT_TIMEOUT_S:
        return f"took {seconds:.1f} s"
    if 400 <= response.status_code < 500:
        return _error_body_problem(response)
    return None


def _error_body_problem(response: httpx.Response) -> str | None:
    try:
        error = response.json()["error"]
        message = error["message"]
    except (ValueError, KeyError, TypeError):
        return f"the {response.status_code} is not a JSON error: {response.text[:300]!r}"
    if not isinstance(message, str) or not message.strip():
        return f"the {response.status_code} has no readable message: {error!r}"
    if error.get("code") != response.status_code or not error.get("type"):
        return f"the error lacks its type or code: {error!r}"
    return None


def _probe_tokens(client: httpx.Client) -> list[int] | str:
    """The probe's greedy tokens, or what went wrong."""
    try:
        answer = client.post("/v1/completions", json=PROBE)
    except httpx.HTTPError as exc:
        return f"no answer: {exc}"
    if answer.status_code != 200:
        return f"{answer.status_code} {answer.text[:300]!r}"
    return answer.json()["choices"][0]["token_ids"]


def _server_problems(server: LiveServer, tokens_before: list[int] | str) -> list[str]:
    """What is wrong with the server after the corpus: it must answer as it did before."""
    problems: list[str] = []
    with httpx.Client(base_url=server.url, timeout=CLIENT_TIMEOUT_S) as client:
        health = client.get("/health")
        if health.status_code != 200:
            problems.append(f"/health answered {health.status_code} {health.text[:300]!r}")
        tokens_after = _probe_tokens(client)
    if tokens_after != tokens_before:
        problems.append(f"the greedy probe now gives {tokens_after}; before the corpus it gave {tokens_before}")
    tracebacks = server.log().count("Traceback")
    if tracebacks:
        problems.append(f"the server logged {tracebacks} tracebacks:\n{server.log()[-4000:]}")
    return problems


def _unhealthy(client: httpx.Client, case_number: int, tokens_before: list[int]) -> str | None:
    """Why the server is not well right after a case, or None. /health after every case;
    the greedy probe (a real generation) after every PROBE_EVERY-th."""
    try:
        health = client.get("/health")
    except httpx.HTTPError as exc:
        return f"/health did not answer: {exc}"
    if health.status_code != 200:
        return f"/health answered {health.status_code}"
    if case_number % PROBE_EVERY == 0 and (tokens := _probe_tokens(client)) != tokens_before:
        return f"the greedy probe gave {tokens}, before the corpus {tokens_before}"
    return None


def test_bad_input_corpus(server: LiveServer, suite_report: Callable[[str], None]) -> None:
    cases = build_corpus(MAX_UPLOAD_MB << 20)
    with httpx.Client(base_url=server.url, timeout=CLIENT_TIMEOUT_S) as client:
        tokens_before = _probe_tokens(client)
        assert isinstance(tokens_before, list), f"the probe failed before the corpus: {tokens_before}"
        outcomes = []
        for number, case in enumerate(cases, 1):
            outcome = run_case(server.url, case)
            if outcome.problem is None and (sick := _unhealthy(client, number, tokens_before)):
                outcome = Outcome(case, f"the server was not well after it: {sick}", outcome.seconds)
            outcomes.append(outcome)
    failures = [f"{o.case.name}: {o.problem}" for o in outcomes if o.problem is not None]
    slowest = sorted(outcomes, key=lambda o: o.seconds)[-3:]
    suite_report(f"bad-input corpus: {len(cases)} cases, {len(cases) - len(failures)} passed; slowest: "
                 + ", ".join(f"{o.case.name} {o.seconds:.2f} s" for o in reversed(slowest)))
    problems = failures + _server_problems(server, tokens_before)
    assert not problems, f"{len(failures)} of {len(cases)} cases failed:\n" + "\n".join(problems)
