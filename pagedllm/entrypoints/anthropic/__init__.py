"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) over
the chat pipeline: ``protocol`` (request bodies and their conversion to a chat request),
``serving_messages`` (the serving class), ``errors`` (Anthropic's error shape on these
routes), ``router`` (the routes). What is supported and refused: docs/api.md."""
