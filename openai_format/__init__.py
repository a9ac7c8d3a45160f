"""The OpenAI Batch format, engine-free and database-free (pydantic only), shared by
``boxcar run`` and the service:

- ``types``: the request bodies of /v1/chat/completions and /v1/completions, their value ranges;
- ``responses_request`` (with ``responses_parts``): the /v1/responses body and its mapping onto
  the chat request it runs as; ``response_object``: the ``Response`` a finished line returns;
- ``parse``: one input line -> ``BatchLine`` or ``LineError`` (the line error codes);
- ``sampling``: a request body -> the engine's ``SamplingParams`` keyword arguments;
- ``engine_fields``: a validated body -> the typed JSON a line's row keeps for the drain loop;
- ``responses``: engine-free results -> completion objects, output and error lines.
"""
