"""One exception hierarchy for kvgate.

::

    KvgateError
    ├── ConfigError            bad configuration, found at startup (never a silent fallback)
    ├── ClientRequestError     the caller's fault (400): malformed body, prompt too long
    │   └── AuthError          bad or missing API key (401)
    ├── UpstreamError          a node misbehaved or could not be reached (502/503)
    │   ├── UpstreamTimeout
    │   └── UpstreamProtocolError
    └── InvariantViolation     our bug: a state the core promised could not happen

Backpressure (queue, reject) is never an exception: it is a decision value.
Each error carries an ``http_status`` hint for the gateway's edge.
"""


class KvgateError(Exception):
    http_status = 500
    error_type = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ConfigError(KvgateError):
    http_status = 500
    error_type = "server_error"


class ClientRequestError(KvgateError):
    http_status = 400
    error_type = "invalid_request_error"


class AuthError(ClientRequestError):
    http_status = 401
    error_type = "authentication_error"


class UpstreamError(KvgateError):
    http_status = 502
    error_type = "server_error"


class UpstreamTimeout(UpstreamError):
    http_status = 504


class UpstreamProtocolError(UpstreamError):
    pass


class InvariantViolation(KvgateError):
    pass
