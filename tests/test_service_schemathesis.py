"""Property-based API check: schemathesis reads the service's own /openapi.json (fetched with the
bearer token) and throws generated bodies, valid and invalid, at /v1/completions and
/v1/chat/completions on a twin. No 5xx ever; where the schema declares a response, the answer
conforms to it (status code, content type, body)."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the `test` extra")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance, negative_data_rejection, not_a_server_error, response_schema_conformance,
    status_code_conformance)

from service_helpers import running_service  # noqa: E402

pytestmark = pytest.mark.slow

TOKEN = "schema-s3"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# positive_data_acceptance is left out on purpose: the schema cannot say everything the service
# checks (max_tokens against the configured limit, an empty prompt, best_of other than 1), so
# some schema-valid bodies are rightly 400s.
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]


@pytest.fixture(scope="module")
def svc(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    with running_service(tiny_checkpoint, tmp_path_factory.mktemp("schemathesis"), token=TOKEN,
                         max_output_tokens=8, default_max_tokens=4) as s:
        yield s


@pytest.fixture(scope="module")
def api_schema(svc):  # noqa: ANN201 - schemathesis' schema type
    return schemathesis.openapi.from_url(f"{svc.url}/openapi.json", headers=AUTH)


schema = schemathesis.pytest.from_fixture("api_schema").include(path_regex=r"^/v1/(chat/)?completions$")


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_generated_requests_never_5xx_and_conform(case, svc) -> None:  # noqa: ANN001
    case.call_and_validate(base_url=svc.url, headers=AUTH, checks=CHECKS)
