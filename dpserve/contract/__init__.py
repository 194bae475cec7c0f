"""What the router and the drivers must agree on, and nothing else.

- ``protocol``: message kinds, error codes, the request/answer structs and the framing
  (``[header, *payload]``, msgpack, never pickle);
- ``validation``: how a generation request's fields are checked, the same on both sides;
- ``model_info``: the model's description a replica reports, and the limits derived from it;
- ``realtime``, ``video``: the session and video-job messages;
- ``control_state``: the desired control state every replica converges to;
- ``cost``: a request's cost units (the router's estimate, the replica's calibration);
- ``layout``: rank layout, tp-sp-cfg-dp;
- ``ids``: ids that name the replica owning a session or a job.

Nothing here imports the worker, the router or the operator (tests/unit/test_imports.py).
"""
