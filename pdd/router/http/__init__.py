"""The router's HTTP surface: OpenAI request bodies and their validation, the routes, SSE and
response bodies, API keys, the one error handler, the body-size limit, the request deadline
and the SIGTERM drain gate. Start at ``routes``."""
