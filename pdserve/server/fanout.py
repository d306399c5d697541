"""Parallel sampling (`n` > 1) and batched prompts: requests of one prompt and one choice each,
merged into one OpenAI response.

Who calls it: the completion routes of a colocated engine (`server/api.py`) and of the router
(`router/app.py`), each with its own single-request path as the children's handler, so a PD cluster
answers `n` and a prompt list exactly as one engine does (vLLM v1 also splits such a request into
child requests).

* Children: for prompt p (of P; `/v1/completions` takes a list of prompts, e.g. lm-eval's batches)
  and choice j (of n), child p·n + j is the client's body with that one prompt, `n` = 1 and, when
  seeded, `seed` + j (vLLM's rule: choice j of a seeded request equals a request with that seed;
  every prompt of a batch gets the same seeds, as vLLM gives each its own copy of the params); all are
  started at once. (Like vLLM v1, a prompt's n children do not share its prefill within a step; a
  later step's child finds it in the prefix cache.)
* Not streamed: choice i is child i's only choice, with index i; id, created and model are child 0's;
  usage counts each prompt once (its first choice's `prompt_tokens` and `prompt_tokens_details`,
  summed over prompts) and the completion tokens of every choice (OpenAI's count).
* Streamed: each child's chunks in its own order, interleaved across children as they come, with
  index i and the id and `created` of the stream's first chunk; one usage chunk at the end (when
  asked) and one `[DONE]`.
* Validation first: the colocated route's children each validate their request, then wait until
  all have (`StartGate`), so a bad prompt in a list refuses the request before any child reaches the
  engine. (The router's children are validated by their engines, each on its own: one refused there
  cancels the others, which aborts those already started.)
* Native (`/generate`, SGLang's shape): not streamed, the children's answers as a list, in order;
  streamed, each child's chunks with `"index": i` added, interleaved as they come.
* Failure: a child refused before its response started (its status is not 200, or its handler raised)
  fails the request with that answer, and the other children are cancelled. A child that fails
  mid-stream has its error event passed on; the stream then ends and the other children are closed,
  which aborts them on their engines.

* `StreamThen`: a streamed answer that calls `then()` however it ends (a single request's, which
  lets go of its reserved id; a merged one's, which lets its children's go), also when its body never
  starts.

Length (~470 lines): this docstring and the merge rules (usage, ids, stream interleaving, failure)
that the non-streamed, streamed and native forms share.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import contextvars
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
from starlette.responses import Response, StreamingResponse

from pdserve.sampling_params import MAX_N, child_seed
from pdserve.server.protocol import MAX_REQUEST_ID_CHARS, JSONResponse, error_body

MAX_CHILDREN = 1024  # prompts x choices per request: lm-eval's largest batches, with room to spare


class StreamThen(StreamingResponse):
    """A streamed response that calls `then()` (idempotent) once it has ended, however it ended: also
    when its body never started -- its client left before the headers went out, or a merged request
    (`merged`) closed it unread -- where the body's own `finally` never runs."""

    def __init__(self, content: AsyncIterator, then, **kwargs) -> None:
        super().__init__(_IterThen(content, then), **kwargs)
        self._then = then

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._then()


class _IterThen:
    """`body`, iterated; `then()` once it ends, fails or is closed (`aclose`), started or not."""

    def __init__(self, body: AsyncIterator, then) -> None:
        self._body, self._then = body, then

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            return await self._body.__anext__()
        except BaseException:
            self._then()
            raise

    async def aclose(self) -> None:
        try:
            await self._body.aclose()
        finally:
            self._then()


def num_choices(n) -> int:
    """The request's `n` (absent or null: 1); ValueError for anything but an integer in [1, MAX_N]."""
    if n is None:
        return 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise ValueError(f"n must be an integer in [1, {MAX_N}], got {n!r}")
    return n


class StartGate:
    """The colocated route's children of one request start together: each child's task holds a
    ticket (`CHILD_GATE`); the route calls `validated()` once the child's request is checked, which
    waits until every ticket has passed or left. A child refused instead raises, and `merged` cancels
    the waiting others, none of whose requests has reached the engine (so a raising child must not
    leave: that could open the gate first). A child that returns without passing leaves, so its
    siblings are never held by it."""

    def __init__(self, num_children: int) -> None:
        self.num_waiting = num_children
        self.all_passed = asyncio.Event()

    def ticket(self) -> _Ticket:
        return _Ticket(self)

    def _count_down(self) -> None:
        self.num_waiting -= 1
        if self.num_waiting == 0:
            self.all_passed.set()


class _Ticket:
    def __init__(self, gate: StartGate) -> None:
        self.gate, self.counted = gate, False

    def leave(self) -> None:
        if not self.counted:
            self.counted = True
            self.gate._count_down()

    async def passed(self) -> None:
        self.leave()
        await self.gate.all_passed.wait()


# The ticket of the child this task runs (set by the route in the child's own task; None outside one).
CHILD_GATE: contextvars.ContextVar[_Ticket | None] = contextvars.ContextVar("child_gate", default=None)


async def validated() -> None:
    """Called by a route once its request is validated: inside a child, wait for its siblings."""
    ticket = CHILD_GATE.get()
    if ticket is not None:
        await ticket.passed()


def gated(handlers: list[Callable[[], Awaitable[Response | dict]]]) -> list[Awaitable[Response]]:
    """The colocated routes' children: each handler (one child's single-request route) run in its own
    task behind one `StartGate`, its dict answer made a JSONResponse, ready for `merged`."""
    gate = StartGate(len(handlers))

    async def child(handler) -> Response:
        ticket = gate.ticket()
        CHILD_GATE.set(ticket)  # (in this child's own task: merged runs each as one)
        out = await handler()
        ticket.leave()  # (answered without validating: must not hold its siblings; one that raised
        # must not open the gate either: `merged` cancels the waiting siblings instead)
        return out if isinstance(out, Response) else JSONResponse(out)

    return [child(h) for h in handlers]


def batch_of(prompt) -> list | None:
    """A completion's prompt list (several strings, or several lists of token ids) -> its prompts;
    None for one prompt (a string, one list of token ids, a list of one prompt, or a shape the route's
    own validation refuses). ValueError for a list whose prompts are not all of one kind (the
    number of prompts is bounded by `num_children`)."""
    if not isinstance(prompt, list) or len(prompt) < 2 or not isinstance(prompt[0], str | list):
        return None
    kind = type(prompt[0])
    if not all(type(p) is kind for p in prompt):
        raise ValueError("every prompt of a list must be a string, or every one a list of token ids")
    # (the router splits raw JSON: [["a"], ["b"]] became children of one-string lists, each a prompt
    # an engine accepts, where the engine and vLLM refuse the list)
    if kind is list and not all(type(t) is int for p in prompt for t in p):
        raise ValueError("a list of prompts as token ids must hold lists of integers only")
    return prompt


def num_children(num_prompts: int, n: int) -> int:
    """Prompts x choices; ValueError past MAX_CHILDREN (each child is a request on the engines).
    (A colocated request's children tokenize on the default thread pool: a large list queues ahead of
    other clients' prompts there for a moment, as that many separate requests would.)"""
    if num_prompts * n > MAX_CHILDREN:
        what = f"{num_prompts} prompts" if n == 1 else f"{num_prompts} prompts x n={n}"
        raise ValueError(f"{what}: more than {MAX_CHILDREN} choices per request")
    return num_prompts * n


MAX_CHILD_SUFFIX_CHARS = 5  # "_1023"


def base_request_id(client_request_id, fresh: str) -> str:
    """The id a split request's children extend (`<id>_<i>`): the client's request_id, else
    `fresh`. ValueError for a client's that is empty, not a string, or leaves no room for the suffix
    (the children's ids must pass the engines' length check, as the client's did)."""
    if client_request_id is None:
        return fresh
    limit = MAX_REQUEST_ID_CHARS - MAX_CHILD_SUFFIX_CHARS
    if not isinstance(client_request_id, str) or not 1 <= len(client_request_id) <= limit:
        raise ValueError(f"request_id of a request split into choices must be a string of 1 to {limit} chars")
    return client_request_id


def child_updates(n: int, prompts: list | None, base: str, seed) -> list[dict]:
    """The fields each child of a split request takes over its parent's: child i = p·n + j is
    prompt p's choice j (of `prompts`, when a list), `n` = 1, seed per `child_seed`, and
    `request_id` `<base>_<i>`, so that one id names them all. (Both splits use it: the engine's
    route over its parsed body, the router's over the client's JSON.)"""
    out = []
    for prompt in prompts if prompts is not None else [None]:
        for j in range(n):
            update = {"n": 1, "seed": child_seed(seed, j), "request_id": f"{base}_{len(out)}"}
            out.append(update if prompts is None else update | {"prompt": prompt})
    return out


def child_bodies(body: dict, n: int, prompts: list | None = None, base_id: str = "") -> list[dict]:
    """The router's children: the client's JSON body under each of `child_updates`, with the base
    id `base_request_id` gives (the client's request_id, else `base_id`). ValueError from it."""
    base = base_request_id(body.get("request_id"), base_id)
    return [{**body, **update} for update in child_updates(n, prompts, base, body.get("seed"))]


class BadSplit(ValueError):
    """A request that cannot be split as asked; `param` names the field at fault (a 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def generate_children(body: dict, fresh_id: str) -> tuple[int, list[dict]] | None:
    """`/generate` (SGLang's) split: a batch of prompts (`text` a list of strings, `input_ids` a list
    of id lists) and/or `sampling_params.n` > 1 -> (n, the children's bodies), child p·n + j being
    prompt p's sample j: the body with that one prompt, its sampling params (one dict for all or one
    per prompt) less `n`, seed + j when seeded, and `rid` the client's list's i-th, else `<rid>_<i>`
    (`fresh_id` when none is given: one id names them all for /abort_request). None: one prompt, one
    sample (the caller's single path, whose validation refuses a malformed body). BadSplit for a
    split that cannot be made. (Both splits use it: the colocated route's over its parsed body, the
    router's over the client's JSON, which it has not checked: shapes are checked here.)"""
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        return None
    key, given = ("text", text) if text is not None else ("input_ids", input_ids)
    batch = given if isinstance(given, list) and given and isinstance(given[0], str | list) else None
    params, rid = body.get("sampling_params", {}), body.get("rid")
    if isinstance(params, list):
        if batch is None or len(params) != len(batch):
            raise BadSplit("a list of sampling_params needs one per prompt of a batch", "sampling_params")
        per_prompt = params
    else:
        per_prompt = [params] * len(batch or [None])
    if not all(isinstance(p, dict) for p in per_prompt):
        if batch is None and not isinstance(rid, list):
            return None
        raise BadSplit("sampling_params must be an object, or a list of one per prompt", "sampling_params")
    try:
        ns = [num_choices(p.get("n")) for p in per_prompt]
    except ValueError as e:
        raise BadSplit(str(e), "n") from None
    if any(x != ns[0] for x in ns):
        raise BadSplit("every prompt's n must be the same", "n")
    n = ns[0]
    if batch is None and n == 1 and not isinstance(rid, list):
        return None
    try:
        count = num_children(len(per_prompt), n)
    except ValueError as e:
        raise BadSplit(str(e), "n" if n > 1 else key) from None
    if isinstance(rid, list):
        if len(rid) != count or len(set(map(str, rid))) != len(rid):
            raise BadSplit(f"a rid list needs {count} distinct ids (prompts x n)", "rid")
        if not all(isinstance(r, str) and 1 <= len(r) <= MAX_REQUEST_ID_CHARS for r in rid):
            raise BadSplit(f"each rid must have 1 to {MAX_REQUEST_ID_CHARS} characters", "rid")
        rids = rid
    else:  # (one id names them all: /abort_request takes it)
        try:
            base = base_request_id(rid or None, fresh_id)
        except ValueError as e:
            raise BadSplit(str(e).replace("request_id", "rid"), "rid") from None
        rids = [f"{base}_{i}" for i in range(count)]
    children = []
    for i in range(count):
        p, j = divmod(i, n)
        sp = {k: v for k, v in per_prompt[p].items() if k != "n"}
        if "seed" in sp:
            sp["seed"] = child_seed(sp["seed"], j)
        children.append({**body, key: batch[p] if batch else given, "sampling_params": sp, "rid": rids[i]})
    return n, children


def parent_id(child_id, i: int = 0):
    """The merged answer's id from child i's: `cmpl-<base>_<i>` -> `cmpl-<base>` (the id
    /abort_request takes for all the children); anything else as it is."""
    suffix = f"_{i}"
    return child_id[: -len(suffix)] if isinstance(child_id, str) and child_id.endswith(suffix) else child_id


async def merged(
    children: list[Awaitable[Response]],
    stream: bool,
    include_usage: bool,
    n: int | None = None,
    native: bool = False,
) -> Response:
    """Run the children's handlers (each returns a Response or raises) and merge their answers;
    children p·n .. p·n + n - 1 are one prompt's choices (`n` None: all are one prompt's).
    `native`: `/generate` answers (a list; chunks with their index), not OpenAI's."""
    n = n or len(children)
    tasks = [asyncio.ensure_future(c) for c in children]

    def answered() -> list:
        return [t.result() for t in tasks if t.done() and not t.cancelled() and t.exception() is None]

    try:
        pending = set(tasks)
        while pending:  # until all answered, or one failed (raised, or answered other than 200)
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if any(t.exception() is not None or t.result().status_code != 200 for t in done):
                break
    except asyncio.CancelledError:
        with anyio.CancelScope(shield=True):
            await _stop(tasks, answered())
        raise
    failed = next((t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None), None)
    if failed is not None:
        await _stop(tasks, answered())
        raise failed.exception()  # e.g. the engine's APIError: answered as for one request
    # A refusal ends the request at once: the others are cancelled (their engines abort them), not
    # left to generate answers nobody reads (a router's child answers its refusal, it does not raise).
    ok = answered()
    bad = next((r for r in ok if r.status_code != 200), None)
    if bad is not None:
        await _stop(tasks, [r for r in ok if r is not bad])
        return bad
    responses = [t.result() for t in tasks]
    if stream:
        events = _merged_events(responses, include_usage, n, native)

        def let_go() -> None:  # (the merged body may never start: each child lets go of its id then too)
            for r in responses:
                if isinstance(r, StreamThen):
                    r._then()

        return StreamThen(events, let_go, media_type="text/event-stream")
    bodies = await asyncio.gather(*(_read(r) for r in responses))
    try:
        parts = [json.loads(b) for b in bodies]
        return JSONResponse(parts if native else merge_bodies(parts, n))
    except (ValueError, KeyError, IndexError, TypeError):
        # A child's body is not a completion (e.g. the router relayed a decode's in-band error): pass
        # on the first such body as it was.
        for b in bodies:
            with contextlib.suppress(ValueError):
                obj = json.loads(b)
                if isinstance(obj, dict) and isinstance(obj.get("choices"), list) and obj["choices"]:
                    continue
            return Response(b, 502, media_type="application/json")
        raise


def merge_bodies(parts: list[dict], n: int | None = None) -> dict:
    """Non-streamed children's responses -> one response with their choices, index i each; parts
    p·n .. p·n + n - 1 are prompt p's choices (`n` None: one prompt), whose prompt is counted once."""
    out = dict(parts[0])
    out["id"] = parent_id(out.get("id"))
    out["choices"] = []
    for i, p in enumerate(parts):
        (choice,) = p["choices"]
        out["choices"].append({**choice, "index": i})
    if "usage" in out:
        firsts = [p["usage"] for p in parts[:: n or len(parts)]]  # (each prompt's first choice)
        prompt = sum(u["prompt_tokens"] for u in firsts)
        completion = sum(p["usage"]["completion_tokens"] for p in parts)
        out["usage"] = {
            **parts[0]["usage"],
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        details = [u.get("prompt_tokens_details") for u in firsts]
        if len(firsts) > 1:  # (summed over prompts; vLLM reports its last prompt's alone)
            if all(isinstance(d, dict) for d in details):
                out["usage"]["prompt_tokens_details"] = {
                    key: sum(d.get(key) or 0 for d in details) for key in details[0]
                }
            else:  # (some engine wrote none: no total would be true)
                out["usage"].pop("prompt_tokens_details", None)
    return out


async def _merged_events(
    responses: list[Response], include_usage: bool, n: int, native: bool = False
) -> AsyncIterator[str]:
    q: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, resp: Response) -> None:
        buf = ""
        utf8 = codecs.getincrementaldecoder("utf-8")()  # a chunk may end inside a character
        try:
            async for chunk in resp.body_iterator:
                buf += utf8.decode(chunk) if isinstance(chunk, bytes) else chunk
                buf = buf.replace("\r\n", "\n")
                while "\n\n" in buf:
                    event, buf = buf.split("\n\n", 1)
                    q.put_nowait((i, event))
        except Exception as e:  # noqa: BLE001 - reported in-band, as a single stream's failure is
            q.put_nowait((i, e))
        q.put_nowait((i, end))

    pumps = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(responses)]
    usages: list[dict | None] = [None] * len(responses)
    stream_id, created = None, None
    num_open = len(responses)
    try:
        while num_open:
            i, item = await q.get()
            if item is end:
                num_open -= 1
                continue
            if isinstance(item, Exception):
                yield _sse(error_body(f"choice {i} failed: {item!r}", 502, "BadGateway"))
                break
            if not item.startswith("data: ") or item == "data: [DONE]":
                continue
            if native and item.startswith('data: {"output_ids"'):  # (a native chunk: its index spliced
                # in, not re-encoded: each chunk repeats the whole output so far; native_stream.py)
                yield f'data: {{"index": {i}, {item[7:]}\n\n'
                continue
            obj = json.loads(item[6:])
            if "error" in obj:  # in-band failure of one child: the request fails
                yield _sse(obj)
                break
            if not obj.get("choices") and obj.get("usage"):
                usages[i] = obj
                continue
            if stream_id is None:
                stream_id, created = parent_id(obj.get("id"), i), obj.get("created")
            obj["id"] = stream_id
            if created is not None:
                obj["created"] = created
            for c in obj.get("choices", ()):
                c["index"] = i
            yield _sse(obj)
        else:
            if include_usage and all(u is not None for u in usages):
                last = merge_bodies([{**u, "choices": [{}]} for u in usages], n)
                last |= {"id": stream_id or last.get("id"), "choices": []}
                yield _sse(last if created is None else last | {"created": created})
        yield "data: [DONE]\n\n"
    finally:
        # Shielded: Starlette cancels a stream whose client left again at every await, which would
        # cut the children's cleanup (a router child's decode leg) short.
        with anyio.CancelScope(shield=True):
            await _stop(pumps, responses)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _read(resp: Response) -> bytes:
    if isinstance(resp, StreamingResponse):
        parts = []
        async for chunk in resp.body_iterator:
            parts.append(chunk.encode() if isinstance(chunk, str) else chunk)
        return b"".join(parts)
    return resp.body


async def _stop(tasks: list[asyncio.Future], responses: list[Response]) -> None:
    """Cancel `tasks` (and wait for them: a cancelled stream runs its cleanup, which aborts its
    request), then close the streamed bodies of `responses` nobody will read."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for r in responses:
        aclose = getattr(getattr(r, "body_iterator", None), "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()
