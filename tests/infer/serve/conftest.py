"""One tiny server for all the server tests (its engine's two programs compile once per process;
engines of the same configuration share them)."""

import openai
import pytest

from tests.infer.serve import tiny


@pytest.fixture(scope="session")
def server():
    with tiny.serving() as running:
        yield running


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
