"""Errors the router answers with, all in OpenAI's error shape.

Exception tree::

    RouterError                 base; carries an HTTP status, a type and a code
    ├── BadRequestError         400 invalid_request_error: malformed JSON, wrong types,
    │                           missing fields, token IDs out of range, empty prompt
    ├── UnauthorizedError       401 authentication_error: missing or wrong API key
    ├── ForbiddenError          403 permission_error: endpoint disabled by configuration
    ├── NotFoundError           404 not_found_error: unknown route or worker
    ├── PayloadTooLargeError    413 invalid_request_error: body over --max-body-bytes
    ├── UnprocessableError      422 invalid_request_error: a well-formed admin request
    │                           with a bad value (a worker URL that does not parse)
    ├── OverloadedError         429 rate_limit_error: admission queue full (Retry-After)
    ├── UpstreamError           502 upstream_error: the request broke the connection to
    │                           two workers (a query of death), or is quarantined
    ├── UnavailableError        503 service_unavailable: no healthy worker could serve
    └── GatewayTimeoutError     504 timeout_error: the request outlived --request-timeout-secs

Body: ``{"error": {"message": ..., "type": ..., "code": ..., "param": null}}``.
"""

from __future__ import annotations

import orjson
from starlette.responses import Response


class RouterError(Exception):
    status = 500
    type = "internal_error"
    code = "internal_error"

    def __init__(
        self, message: str, *, code: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.headers = headers or {}

    def response(self) -> Response:
        return error_response(self.status, self.message, self.type, self.code, self.headers)


class BadRequestError(RouterError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class UnauthorizedError(RouterError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class ForbiddenError(RouterError):
    status = 403
    type = "permission_error"
    code = "forbidden"


class NotFoundError(RouterError):
    status = 404
    type = "not_found_error"
    code = "not_found"


class PayloadTooLargeError(RouterError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class UnprocessableError(RouterError):
    status = 422
    type = "invalid_request_error"
    code = "invalid_value"


class UpstreamError(RouterError):
    status = 502
    type = "upstream_error"
    code = "request_failed_on_workers"


class OverloadedError(RouterError):
    status = 429
    type = "rate_limit_error"
    code = "router_overloaded"


class UnavailableError(RouterError):
    status = 503
    type = "service_unavailable"
    code = "no_healthy_worker"


def error_body(message: str, type_: str, code: str) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "code": code, "param": None}})


def error_response(
    status: int, message: str, type_: str, code: str, headers: dict[str, str] | None = None
) -> Response:
    return Response(
        error_body(message, type_, code),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


class GatewayTimeoutError(RouterError):
    status = 504
    type = "timeout_error"
    code = "request_timeout"
