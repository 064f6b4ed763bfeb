"""The HTTP layer: the FastAPI app, the OpenAI request and response models, serving of
completions and chat (whole and streamed), and API keys."""
