"""Prefill/decode disaggregation: the pieces both PD engine roles share.

    messages.py   typed, versioned, HMAC-authenticated control messages (msgspec/msgpack, never pickle)
    control.py    ControlChannel: ZMQ PULL + per-peer PUSH sockets on one I/O thread; non-blocking API
    bootstrap.py  the prefill's bootstrap HTTP address book (PUT/GET /route, /health) and its clients
    state.py      KVState, RoomTable (forward-only states, a deadline in every state), AbortTracker
    handoff.py    HandoffPool: fixed-layout slots carrying token 1, cached counts, logprobs and the room

Import the submodules directly; this package imports nothing so that pure-Python users (router,
simulator) never pull in zmq, uvicorn or numpy by accident.
"""
