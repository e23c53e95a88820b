"""The faces: what clients and browsers talk to.

  http.py            the OpenAI-compatible HTTP API (hypercorn + starlette)
  responses.py       completions, chat and streaming responses
  auth.py            API keys
  openai_schema.py   pure request parsing and OpenAI error objects
  face.py            pure: what a face may use of a peer (FacePeer)
  metrics.py         Prometheus metrics
  web/               the peer's page

May import: the node (only through FacePeer), request/ and everything below it.
"""
