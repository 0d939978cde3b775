"""The service's errors: one class per HTTP status the API answers with.

Each is a :class:`~kvstream.errors.KVStreamError`; the server turns one into a JSON body
``{"error": message, "type": class name}`` with its :attr:`ServiceError.status`, and
:class:`~kvstream.serve.client.Client` raises the same class from such a response, so a
caller catches the same errors in-process and over HTTP (the shape of httpx's error tree)::

    ServiceError
    ├── BadRequestError         400  the body is not JSON
    ├── UnauthorizedError       401  missing or wrong bearer token
    ├── NotFoundError           404  unknown route, model or worker
    ├── MethodNotAllowedError   405
    ├── ConflictError           409  a duplicate registration, a block-size or hash mismatch
    ├── PayloadTooLargeError    413  a body or token list over the configured limit
    ├── InvalidRequestError     422  JSON of the wrong shape (Dynamo's status for it)
    └── UnavailableError        503  not ready yet, or the service is unreachable (client)
"""

from __future__ import annotations

from typing import ClassVar

from kvstream.errors import KVStreamError

__all__ = [
    "BadRequestError",
    "ConflictError",
    "InvalidRequestError",
    "MethodNotAllowedError",
    "NotFoundError",
    "PayloadTooLargeError",
    "ServiceError",
    "UnauthorizedError",
    "UnavailableError",
    "error_for_status",
]


class ServiceError(KVStreamError):
    """An API error; ``status`` is its HTTP status code."""

    status: ClassVar[int] = 500


class BadRequestError(ServiceError):
    """The request body is not valid JSON."""

    status = 400


class UnauthorizedError(ServiceError):
    """The service requires a bearer token and the request had none or a wrong one."""

    status = 401


class NotFoundError(ServiceError):
    """Unknown route, model (no worker registered for it) or worker."""

    status = 404


class MethodNotAllowedError(ServiceError):
    """The route exists but not for this HTTP method."""

    status = 405


class ConflictError(ServiceError):
    """The request contradicts the service's state: a duplicate registration, a block size
    other than the model's, a hash configuration the workers do not use."""

    status = 409


class PayloadTooLargeError(ServiceError):
    """The body, or its token or hash list, is over the configured limit."""

    status = 413


class InvalidRequestError(ServiceError):
    """The body is JSON but not of the expected shape (a missing field, a token id that is
    not a u32, an unsigned hash where Dynamo takes signed i64)."""

    status = 422


class UnavailableError(ServiceError):
    """The service is not ready, or (client side) could not be reached."""

    status = 503


_BY_STATUS: dict[int, type[ServiceError]] = {
    cls.status: cls
    for cls in (
        BadRequestError,
        UnauthorizedError,
        NotFoundError,
        MethodNotAllowedError,
        ConflictError,
        PayloadTooLargeError,
        InvalidRequestError,
        UnavailableError,
    )
}
_BY_NAME: dict[str, type[ServiceError]] = {cls.__name__: cls for cls in _BY_STATUS.values()}


def error_for_status(status: int, type_name: str | None = None) -> type[ServiceError]:
    """The error class for a response: by the ``type`` the body names, else by status."""
    if type_name is not None and type_name in _BY_NAME:
        return _BY_NAME[type_name]
    return _BY_STATUS.get(status, ServiceError)
