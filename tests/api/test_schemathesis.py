"""Property-based conformance: schemathesis generates requests (valid and invalid) from the OpenAPI
document; no response may be a server error or disagree with the document."""

from __future__ import annotations

from pathlib import Path

import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from sqlalchemy.orm import Session

from service.api.app import create_app
from service.auth import create_token
from service.settings import Settings
from service.store import migrate
from service.store.db import make_engine

MAX_EXAMPLES = 30
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> tuple[FastAPI, str]:
    home: Path = tmp_path_factory.mktemp("schemathesis")
    # The fuzz sends thousands of requests with one token: a rate limit sized for people would answer
    # most of them 429 (documented, but it would hide the handlers from the fuzz).
    settings = Settings(home=home, rate_limit_per_s=100_000, rate_limit_burst=100_000)
    engine = make_engine(settings.db_url)
    migrate.upgrade(engine)  # the schema comes from the migrations, as in production
    with Session(engine) as s:
        token = create_token(s, tenant="fuzz", admin=True)
        s.commit()
    return create_app(settings, engine=engine), token


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "invalid"])
def test_no_server_errors_and_responses_match_the_document(
    api: tuple[FastAPI, str], mode: GenerationMode
) -> None:
    app, token = api
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    headers = {"Authorization": f"Bearer {token}"}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8

    tested = 0
    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode, headers=headers))
        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            database=None,
        )
        def check(case: schemathesis.Case) -> None:
            case.call_and_validate(headers=headers, checks=CHECKS)

        try:
            check()
            tested += 1
        except Unsatisfiable:
            # An operation without parameters or body (e.g. /healthz) has no invalid request to make.
            assert mode == GenerationMode.NEGATIVE, operation.label
    assert tested >= (len(operations) if mode == GenerationMode.POSITIVE else 6)
