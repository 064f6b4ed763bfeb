"""A real local Ray instance for the engine tests (no mocked Ray)."""

import asyncio

import pytest
import ray


@pytest.fixture(scope="session")
def ray_local():
    if ray.is_initialized():
        ray.shutdown()
    # Logical CPUs: the workers reserve resources; the machine's 2 cores are shared.
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="session")
def serve_http(ray_local):
    """Ray Serve's HTTP proxy on a free loopback port; yields the base URL."""
    import socket

    from ray import serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
