"""The published OpenAPI schema against the server, the other way round from
test_server_robustness's fuzzing (which finds 5xx and answers the schema does not
describe): bodies schemathesis generates as valid must be accepted (a 404 for an id
that names nothing aside), on the tiny random-weight Gemma 3 model. Derandomized, a few
examples per operation.

What JSON Schema cannot say is left out: token counts (a prompt past the context, a rewind
past the session's tokens), names unique across `tools` or a named `tool_choice` among
them, `min_tokens` against `max_tokens`, constraints that do not compile (a regex, a
grammar, JSON text that is no schema)."""

from __future__ import annotations

import re

import httpx
import pytest
from server.conftest import engine_args, run_server

from loom.tokenizer.packaged_templates import GEMMA3_TEMPLATE, packaged_template_file

schemathesis = pytest.importorskip("schemathesis")

# Refusals no schema can state (see the module docstring).
BEYOND_THE_SCHEMA = re.compile(
    r"context limit|can rewind|the function '[^']*' twice|which is not in tools|"
    r"must not exceed max_tokens|invalid (structured_outputs|response_format|tools|text) ")


@pytest.fixture(scope="module")
def server(tiny_models):
    args = engine_args(tiny_models, num_kv_blocks=1024, max_model_len=512)
    with run_server(args, chat_template=str(packaged_template_file(GEMMA3_TEMPLATE)),
                    max_tokens_cap=2) as srv:
        yield srv


def test_schema_valid_bodies_are_accepted(server):
    from hypothesis import HealthCheck, given, settings

    base = server.base_url
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    refused: list[str] = []
    accepted = 0
    with httpx.Client(base_url=base, timeout=60) as http:
        for op in [result.ok() for result in schema.get_all_operations()]:
            if op.method.upper() != "POST" or "{response_id}" in op.path:
                continue
            path_parameters = None
            if "{session_id}" in op.path:
                r = http.post("/v1/sessions", json={"prompt": "Once upon a time"})
                path_parameters = {"session_id": r.json()["id"]}

            @settings(max_examples=25, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(schemathesis.GenerationMode.POSITIVE,
                                       path_parameters=path_parameters))
            def run(case):
                nonlocal accepted
                response = case.call(base_url=base, timeout=60)
                if response.status_code == 200:
                    accepted += 1
                    if case.operation.path == "/v1/sessions":
                        http.delete(f"/v1/sessions/{response.json()['id']}")
                elif response.status_code in (404, 409):  # an id that names nothing
                    pass
                elif not BEYOND_THE_SCHEMA.search(response.text):
                    refused.append(f"{case.operation.label} {case.body!r:.300}: "
                                   f"{response.status_code} {response.text[:300]}")

            run()
            for sid in list(server.app.state.loom.session_owners):
                http.delete(f"/v1/sessions/{sid}")
        for rid in server.app.state.responses.store.ids():
            http.delete(f"/v1/responses/{rid}")
    assert not refused, "\n".join(refused)
    assert accepted > 50, accepted
