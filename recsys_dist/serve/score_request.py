"""One ``POST /score``, from its bytes to its answer, within the server's limits
(``recsys_dist.serve.limits``).

:func:`score_request`: the body is read on the event loop, counted against the memory budget as
it arrives (``Content-Length`` first: a body that cannot fit is refused unread), within
``body_timeout`` seconds; then decoded, checked, counted again for its rows and scored in a
worker thread, so that a large body never stalls the other connections. Every refusal is an
answer with a JSON ``{"error": ...}`` that says which limit and what to do:

- 400: not JSON, nested too deeply, a number with more digits than Python reads, a lone
  surrogate escape, or rows the scorer refuses (naming the row and the column);
- 408: the body did not arrive within ``body_timeout``; 413: the body is over
  ``max_body_bytes``, or the request would take more memory than the whole budget;
- 503 with ``Retry-After``: the budget is held by the requests in flight;
- 500: an unexpected error (logged with its traceback, repeats rate-limited).

A client that goes away while sending its body is logged as one line (no traceback).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from recsys_dist.errors import BadRequest
from recsys_dist.serve.limits import (
    Hold,
    InFlight,
    Limits,
    Refused,
    body_cost,
    elements_cost,
    list_elements,
    rows_cost,
)
from recsys_dist.serve.request_rows import check_body

log = logging.getLogger("recsys_dist.serve")


class ClientGone(Exception):
    """The client closed its connection before its request was read."""


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n:,} bytes"


def _too_large(size: int | str, limits: Limits) -> Refused:
    return Refused(
        413,
        f"the body ({size}) is over this server's limit of {_mib(limits.max_body_bytes)} per request (set from "
        "its memory, serve --memory-mb); send fewer rows per request",
    )


async def _chunks(request: Request):
    """The body's chunks as they arrive. Raises ClientDisconnect when the client goes away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        yield message.get("body", b"")
        if not message.get("more_body", False):
            return


DISCARD_IDLE = 1.0  # seconds without a byte of a refused body: the client sends none, answered now


async def _discard(chunks, most: int, deadline: float | None) -> bool:
    """Read and drop the rest of a refused body, at most ``most`` bytes, until ``deadline``
    (event loop time) or ``DISCARD_IDLE`` seconds without a byte: whether it all came. Then the
    refusal reaches the client and the connection serves its next request; closed with the body
    unread, the client's next send meets a reset and the answer is lost."""
    n = 0
    try:
        async with asyncio.timeout_at(deadline):
            while True:
                async with asyncio.timeout(DISCARD_IDLE):
                    chunk = await anext(chunks, None)
                if chunk is None:
                    return True
                n += len(chunk)
                if n > most:
                    return False
    except (TimeoutError, ClientDisconnect):
        return False


async def read_body(request: Request, limits: Limits, hold: Hold) -> bytearray:
    """The request's body, held against the memory budget as it arrives; a body refused is
    read on and dropped (up to ``max_body_bytes`` more, until ``DISCARD_IDLE`` seconds pass
    without a byte), so that the refusal reaches the client. A request sent with ``Expect:
    100-continue`` refused from its headers is answered at once, without ``100 Continue``, and
    its connection closed.

    Raises:
        Refused: 413 over ``max_body_bytes`` or the whole budget, 503 over what is left of it,
            408 past ``body_timeout``.
        ClientGone: the client went away (logged as one line).
    """
    declared = request.headers.get("content-length", "")
    expect = request.headers.get("expect", "").lower() == "100-continue"
    size = int(declared) if declared.isdigit() else None
    body, chunks, refused = bytearray(), _chunks(request), None
    try:
        async with asyncio.timeout(limits.body_timeout) as timeout:
            try:
                if size is not None and size > limits.max_body_bytes:
                    raise _too_large(f"{size:,} bytes", limits)
                held = body_cost(size or 0)
                if held:
                    hold.add(held, f"a body of {_mib(size)}")
                async for chunk in chunks:
                    body += chunk
                    if len(body) > limits.max_body_bytes:
                        raise _too_large(f"over {len(body):,} bytes, still arriving", limits)
                    if body_cost(len(body)) > held:  # a body without Content-Length: held as it grows
                        hold.add(body_cost(len(body)) - held, f"a body of {_mib(len(body))} so far")
                        held = body_cost(len(body))
            except Refused as r:
                refused = r
    except TimeoutError:
        raise Refused(
            408,
            f"the body did not arrive within {limits.body_timeout:g} s ({len(body):,} bytes of "
            f"{declared or 'an unknown length'} came; serve --body-timeout)",
            close=True,
        ) from None
    except ClientDisconnect:
        client = request.client
        log.warning(
            "recsys-dist serve: client %s went away while sending its body (%s of %s bytes came)",
            f"{client.host}:{client.port}" if client else "?",
            f"{len(body):,}",
            declared or "?",
        )
        raise ClientGone from None
    if refused is None:
        return body
    if expect and not body:  # refused from its headers: no 100 Continue, nothing read, closed
        refused.close = True
        raise refused
    del body
    refused.close = not await _discard(chunks, limits.max_body_bytes, timeout.when())
    raise refused


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def decode_body(raw: bytes | bytearray):
    """A request body decoded as JSON.

    Raises:
        BadRequest: not JSON (or not UTF-8), nested too deeply, a number past Python's digit
            limit, a lone surrogate escape; the message says which.
    """
    try:
        body = json.loads(raw)
        # A lone surrogate escape (\ud800) decodes, but is no text a reader can take; only a body
        # holding a surrogate escape at all pays for the check (a second pass over every string).
        if _SURROGATE_ESCAPE.search(raw):
            json.dumps(body, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        raise BadRequest(
            f"the body nests lists or objects more than ~{sys.getrecursionlimit()} deep; a request is "
            '{"rows": [row, ...]}, a row an object of column -> value (a list value holds plain values) or a text line'
        ) from None
    except UnicodeEncodeError:  # a ValueError too: first
        raise BadRequest("the body holds a \\u escape of a lone surrogate (e.g. \\ud800), which is not text") from None
    except (ValueError, UnicodeDecodeError) as err:
        if "integer string conversion" in str(err):  # Python's limit on the digits of an int
            raise BadRequest(
                f"a number in the body has more than {sys.get_int_max_str_digits()} digits, over the size limit of a "
                "number; send such a value as a string"
            ) from None
        raise BadRequest(f'the body is not JSON ({err}); send {{"rows": [row, ...]}}') from None
    return body


def _features(served) -> int:
    prep = served.loaded.preprocessing
    return len(prep.record["dense"]) + len(prep.record["sparse"]) if prep is not None else 40


def _decode_and_score(served, raw: bytearray, hold: Hold) -> JSONResponse:
    """In a worker thread: decode, check, hold the rows' memory, score (``served.scorer``), and
    write the answer's JSON."""
    rows = check_body(decode_body(raw))
    elements = list_elements(rows)  # a list's ids are no feature each: counted apart (5M in one row)
    what = f"{len(rows):,} rows" + (f" holding {elements:,} list elements" if elements else "")
    hold.add(rows_cost(len(rows), _features(served)) + elements_cost(elements), f"{what} of a {_mib(len(raw))} body")
    out = served.scorer(rows)
    return JSONResponse({**out, "version": served.version, "model": served.loaded.source})


def _error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


async def score_request(request: Request, served, limits: Limits, gate: InFlight) -> Response:
    """The answer to one ``POST /score`` scored by ``served`` (see the module doc)."""
    hold = gate.hold()
    try:
        raw = await read_body(request, limits, hold)
        return await run_in_threadpool(_decode_and_score, served, raw, hold)
    except Refused as r:
        return _error(r.status, r.message, r.headers())
    except BadRequest as err:
        return _error(400, str(err))
    except ClientGone:
        return Response(status_code=400)  # nobody reads it
    except Exception as err:  # noqa: BLE001 - a bug must answer 500, logged, not kill the connection silently
        log.error("recsys-dist serve: POST /score failed: %s: %s", type(err).__name__, err, exc_info=True)
        return _error(500, f"internal error ({type(err).__name__}: {str(err)[:200]}); the server logged it")
    finally:
        hold.release()
