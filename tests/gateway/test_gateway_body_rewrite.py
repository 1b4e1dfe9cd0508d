"""A body the parser accepts never becomes a 500 when the gateway rewrites it (adds
stream_options.include_usage, writes the effective priority in)."""

from __future__ import annotations

import json
from typing import Any

C = "/v1/completions"


def test_bodies_the_gateway_rewrites_never_get_a_500(kit: Any) -> None:
    m = kit.MODEL

    async def body() -> None:
        async with kit.cluster(1) as c:
            stub = c.stubs[0]
            # a lone surrogate escape, and stream_options to complete: was a 500
            raw = b'{"model":"M","prompt":"hi \\ud800","stream":true,"stream_options":{}}'
            raw = raw.replace(b"M", m.encode())
            status, _, out = await c.post(C, raw)
            assert status == 200, out[:300]
            assert out.endswith(b"data: [DONE]\n\n")
            sent = stub.seen[-1].body
            assert sent["prompt"] == "hi \ud800"
            assert sent["stream_options"] == {"include_usage": True}
            # the body's priority differs from the header's: the body is rewritten
            raw = b'{"model":"M","prompt":"x","priority":2,"user":"\\udc00"}'
            raw = raw.replace(b"M", m.encode())
            status, _, out = await c.post(C, raw, {"X-Kvgate-Priority": "1"})
            assert status == 200, out[:300]
            assert stub.seen[-1].body["priority"] == 1
            assert stub.seen[-1].body["user"] == "\udc00"
            attempts = stub.attempts

            # numbers that read as infinite: a 400 naming the field, edit or not
            for raw, headers, param in [
                (b'{"model":"%s","prompt":"x","stream":true,"stream_options":{},"foo":1e400}',
                 {}, "foo"),
                (b'{"model":"%s","prompt":"x","priority":2,"bar":1e999}',
                 {"X-Kvgate-Priority": "1"}, "bar"),
                (b'{"model":"%s","prompt":"x","logit_bias":{"1":-1e400}}', {}, "logit_bias.1"),
            ]:
                status, hdrs, out = await c.post(C, raw % m.encode(), headers)
                assert status == 400, out[:300]
                err = json.loads(out)["error"]
                assert err["type"] == "invalid_request_error" and err["param"] == param, err
                assert hdrs["Content-Type"].startswith("application/json")
            # nested too deeply to be written back: a 400 too
            deep = b"[" * 3000 + b"]" * 3000
            raw = (b'{"model":"%s","prompt":"x","stream":true,"stream_options":{},"x":'
                   % m.encode()) + deep + b"}"
            status, _, out = await c.post(C, raw)
            assert status == 400, out[:300]
            assert json.loads(out)["error"]["type"] == "invalid_request_error"

            assert stub.attempts == attempts  # none of those reached the node
            responses = c.gw.gateway.metrics.responses
            assert not any(code >= 500 for (_, code) in responses), responses
            ctl = c.gw.controller
            assert ctl.num_requests() == 0 and ctl.admission.inuse_total == 0

    kit.run(body())
