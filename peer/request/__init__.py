"""The path of one request: from a client's prompt to streamed tokens, here or elsewhere.

  generation.py      pure: the one generation interface the faces call
  admission.py       pure: bounded admission and its errors
  pipeline.py        admit, rank -> probe -> rerank, then one run per request
  run.py             one request's run: race, deliver, verify, fall back; outcomes recorded
  race.py            one race of attempts for the first token (hedging, stalls)
  forward.py         the sending side of the inference protocol
  inference.py       the serving side of the inference protocol
  serving.py         composes them for a peer: the GenerationService it exposes
  request_log.py     pure: the last requests that ended, for the page and /v1/requests

May import: routing/, swarm/, net/, engine/, config and root utilities, protocols/.
"""
