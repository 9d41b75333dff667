"""The OpenAPI document is valid, describes exactly the router's calls, and is served."""

from openapi_spec_validator import validate

from api_support import api  # noqa: F401  (fixture)
from queues import exceptions
from queues.api.handlers import router
from queues.api.openapi import DOCUMENT, ERROR_CODES

HTTP_METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}


def test_the_document_is_valid_openapi():
    validate(DOCUMENT)


def test_the_document_describes_every_route_and_nothing_else():
    routed = {(route.method.lower(), route.pattern) for route in router.routes}
    described = {
        (method, path)
        for path, operations in DOCUMENT["paths"].items()
        for method in operations
        if method in HTTP_METHODS
    }

    assert described == routed


def test_each_path_parameter_of_a_route_is_described():
    for route in router.routes:
        path = DOCUMENT["paths"][route.pattern]
        operation = path[route.method.lower()]
        declared = path.get("parameters", []) + operation.get("parameters", [])
        params = {p["name"] for p in declared if p["in"] == "path"}
        expected = {segment[1:-1] for segment in route.pattern.split("/") if segment.startswith("{")}
        assert params == expected, route.pattern


def test_the_document_lists_every_error_code_the_api_can_answer():
    codes = {
        error.code
        for error in vars(exceptions).values()
        if isinstance(error, type) and issubclass(error, exceptions.TaskhosterError)
    }

    assert set(ERROR_CODES) == codes


async def test_the_document_is_served_without_a_token(api):
    answer = await api.get("/api/schema")

    assert answer.status_code == 200
    assert answer.json() == DOCUMENT
