"""service.api.responses.ModelResponseRoute (issue 14): a sync route's response model is validated and
serialised on the route's own thread, with FastAPI's bytes, and OpenAPI does not change. Each check
compares against FastAPI's own APIRoute serving the same endpoint."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fastapi import APIRouter, FastAPI, Response
from fastapi.exceptions import ResponseValidationError
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import Engine

import service.api.routes as route_modules
from service.api.app import create_app
from service.api.responses import ModelResponseRoute
from service.api.routes import cluster, exports, faults, health, jobs, logs, plans, tenants, tokens
from service.settings import Settings
from tests.api.conftest import bearer
from tests.api.test_request_path import SPEC

ROUTE_MODULES = (cluster, exports, faults, health, jobs, logs, plans, tenants, tokens)
_ROUTE_PARAMS = [name for name in inspect.signature(APIRoute.__init__).parameters
                 if name not in ("self", "path", "endpoint", "dependency_overrides_provider")]


def plain_copy(router: APIRouter) -> APIRouter:
    """The router's routes as FastAPI's own APIRoute, serving the endpoints as written."""
    plain = APIRouter()
    for route in router.routes:
        assert isinstance(route, APIRoute)
        plain.add_api_route(route.path, inspect.unwrap(route.endpoint), route_class_override=APIRoute,
                            **{name: getattr(route, name) for name in _ROUTE_PARAMS})
    return plain


@contextmanager
def thread_hops(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    import anyio.to_thread

    hops: list[str] = []
    run_sync = anyio.to_thread.run_sync

    async def counting(func: Any, *args: Any, **kwargs: Any) -> Any:
        hops.append(getattr(func, "__qualname__", repr(func)))
        return await run_sync(func, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(anyio.to_thread, "run_sync", counting)
        yield hops


def serialise_hops(hops: list[str]) -> list[str]:
    return [h for h in hops if "serialize" in h or "validate" in h]


# ---- the route class against FastAPI's, on endpoints of every kind ---------------------------------
class Item(BaseModel):
    model_config = ConfigDict(validate_by_name=True)  # an ORM-like row has `item_id`, JSON `itemId`

    item_id: int = Field(alias="itemId")
    name: str
    note: str | None = None
    tags: list[str] = []


@dataclasses.dataclass
class ItemRow:  # an ORM-like object: validated from its attributes
    item_id: int
    name: str
    note: str | None = None
    tags: list[str] = dataclasses.field(default_factory=list)


def _endpoints(router: APIRouter) -> None:
    @router.post("/created", response_model=Item, status_code=201, response_model_exclude_none=True)
    def created() -> Item:
        return Item(itemId=1, name="a")

    @router.get("/from-dict", response_model=list[Item], response_model_include={0: {"name"}})
    def from_dict() -> Any:
        return [{"itemId": "2", "name": "b", "note": "n"}, {"itemId": 3, "name": "c"}]

    @router.get("/from-row", response_model=Item, response_model_by_alias=False)
    def from_row() -> Any:
        return ItemRow(item_id=4, name="d", tags=["x"])

    @router.get("/annotated")
    def annotated() -> Item:
        return Item(itemId=5, name="e")

    @router.get("/response", response_model=Item)
    def response() -> Response:
        return Response(b'{"raw":true}', media_type="application/json", headers={"X-Raw": "1"})

    @router.get("/header", response_model=Item)
    def header(response: Response) -> Item:
        response.headers["X-Set"] = "1"
        response.status_code = 203
        return Item(itemId=6, name="f")

    @router.get("/invalid", response_model=Item)
    def invalid() -> Any:
        return {"name": "no id"}

    @router.get("/async", response_model=Item)
    async def asynchronous() -> Any:
        return {"itemId": 7, "name": "g"}


def _app(route_class: type[APIRoute]) -> FastAPI:
    app = FastAPI()
    router = APIRouter(prefix="/v1", route_class=route_class)
    _endpoints(router)
    app.include_router(router)
    return app


def test_the_route_class_sends_fastapis_response_without_a_serialisation_hop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ours, theirs = TestClient(_app(ModelResponseRoute)), TestClient(_app(APIRoute))
    assert ours.app.openapi() == theirs.app.openapi()  # type: ignore[attr-defined]
    for method, path in [("POST", "/v1/created"), ("GET", "/v1/from-dict"), ("GET", "/v1/from-row"),
                         ("GET", "/v1/annotated"), ("GET", "/v1/response"), ("GET", "/v1/header"),
                         ("GET", "/v1/async")]:
        expected = theirs.request(method, path)
        with thread_hops(monkeypatch) as hops:
            got = ours.request(method, path)
        assert (got.status_code, got.content) == (expected.status_code, expected.content), path
        assert got.headers.items() == expected.headers.items(), path
        if path != "/v1/header":  # a `Response` parameter: FastAPI serialises the value (and its headers)
            assert serialise_hops(hops) == [], (path, hops)
    assert ours.post("/v1/created").json() == {"itemId": 1, "name": "a", "tags": []}
    assert ours.get("/v1/header").headers["X-Set"] == "1"
    for client in (ours, theirs):
        with pytest.raises(ResponseValidationError, match="itemId"):
            client.get("/v1/invalid")


# ---- the app's routes ------------------------------------------------------------------------------
def test_every_router_uses_the_route_class() -> None:
    files = {p.stem for p in Path(route_modules.__file__).parent.glob("*.py")} - {"__init__"}
    assert {m.__name__.rsplit(".", 1)[1] for m in ROUTE_MODULES} == files  # a new router joins the list
    for module in ROUTE_MODULES:
        assert module.router.route_class is ModelResponseRoute, module.__name__
        assert all(isinstance(r, ModelResponseRoute) for r in module.router.routes), module.__name__


@pytest.fixture
def plain_app(settings: Settings, db_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> FastAPI:
    """The same app with FastAPI's own APIRoute on every router."""
    for module in ROUTE_MODULES:
        monkeypatch.setattr(module, "router", plain_copy(module.router))
    return create_app(settings, engine=db_engine)


def test_openapi_is_unchanged(app: FastAPI, plain_app: FastAPI) -> None:
    assert app.openapi() == plain_app.openapi()


def test_the_apps_sync_routes_serialise_on_their_thread_with_fastapis_bytes(
    client: TestClient, plain_app: FastAPI, tokens: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    user, admin = bearer(tokens["a"]), bearer(tokens["admin"])
    job = client.post("/v1/jobs", json=SPEC, headers=user).json()
    requests = [("GET", "/v1/jobs", user), ("GET", f"/v1/jobs/{job['id']}", user),
                ("GET", f"/v1/jobs/{job['id']}/events", user), ("GET", "/v1/cluster", user),
                ("GET", "/v1/tokens", admin), ("GET", "/v1/tenants", admin), ("GET", "/readyz", {}),
                ("POST", f"/v1/jobs/{job['id']}/cancel", user)]
    with TestClient(plain_app) as plain:
        for method, path, auth in requests:  # warm: each token's use recorded, the job cancelled
            client.request(method, path, headers=auth)
        for method, path, auth in requests:
            with thread_hops(monkeypatch) as theirs:
                expected = plain.request(method, path, headers=auth)
            with thread_hops(monkeypatch) as ours:
                got = client.request(method, path, headers=auth)
            assert expected.status_code == 200, (path, expected.text)
            assert (got.status_code, got.content) == (expected.status_code, expected.content), path
            assert got.headers.items() == expected.headers.items(), path
            assert serialise_hops(theirs), (path, theirs)  # FastAPI's own hop: the count is live
            assert serialise_hops(ours) == [], (path, ours)
