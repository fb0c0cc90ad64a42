"""The HTTP plumbing both apps share: the REST server (:mod:`sparkv.server.app`) and the device
service's app (:mod:`sparkv.device.app`) answer the same mistake with the same status and the
wire's one JSON error shape (docs/rest-api.md, docs/device-service.md).

* :mod:`~sparkv.rest.handlers`: the exception handlers and the JSON-body policy (400
  ``malformed_json`` for a body that does not parse, 422 ``invalid_request`` for one that does not
  match the schema);
* :mod:`~sparkv.rest.middleware`: one canonical URL per resource, the request body's size limit
  and deadline;
* :mod:`~sparkv.rest.http_protocol`: uvicorn's HTTP/1.1 protocol answering unparsable requests in
  JSON, with a deadline for a request's headers;
* :mod:`~sparkv.rest.listen`: binding the port before anything is loaded, then running uvicorn;
* :mod:`~sparkv.rest.openapi`: the statuses this plumbing answers, declared on every operation.

Nothing here is imported by the edge: it needs the ``server`` extra (FastAPI, uvicorn).
"""
