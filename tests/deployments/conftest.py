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
