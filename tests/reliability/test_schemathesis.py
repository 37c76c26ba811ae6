"""schemathesis over the OpenAPI schema of the real server: no 5xx, every response matches it.

Driven directly (one hypothesis run per operation) rather than through schemathesis' pytest
plugin, which does not load under this pytest version.
"""

from __future__ import annotations

import pytest
import schemathesis
from schemathesis.checks import (content_type_conformance, not_a_server_error, response_headers_conformance,
                                 response_schema_conformance, status_code_conformance)
from hypothesis import HealthCheck, given, settings

from helpers.live import live_server
from server.http.app import create_app
from server.settings import Settings


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance]


@pytest.fixture(scope="module")
def url():
    with live_server(create_app(Settings(max_batch_size=4, max_delay_ms=1))) as u:
        yield u


def test_api_conforms(url):
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    failures: dict[str, str] = {}
    operations = 0
    for result in schema.get_all_operations():
        op = result.ok()
        operations += 1

        @given(case=op.as_strategy())
        @settings(max_examples=25, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case):
            # Not "positive_data_acceptance": a schema-valid string is not necessarily a valid image.
            case.call_and_validate(checks=CHECKS)

        try:
            run()
        except Exception as e:  # noqa: BLE001 - collect every operation's failure, then report all
            failures[op.label] = str(e)[:2000]
    assert operations >= 12
    assert not failures, "\n\n".join(f"{k}:\n{v}" for k, v in failures.items())
