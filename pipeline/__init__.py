"""The one request pipeline between a request line and the engine (``engine_adapter``): used by
the worker's drain and by ``boxcar run``, so a line gets the same engine input or the same error
on both paths. Imports the engine and the OpenAI format only: ``boxcar run`` loads no service
code."""
