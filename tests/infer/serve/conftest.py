"""One tiny server for all the server tests (its engine's two programs compile once per package
run; engines of the same configuration share them)."""

import openai
import pytest

from tests.infer.serve import tiny


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
    """Overrides tests/conftest.py's fixture of that name, which clears JAX's caches after every
    module: the server below outlives the modules, and a cleared cache made its engine compile
    both programs again on its first step in the next module (indistinguishable, for a count of
    compilations, from a real recompilation). The serve tests compile few programs; the next
    module outside this package clears them."""
    yield


@pytest.fixture(scope="package")
def server():
    with tiny.serving() as running:
        yield running


@pytest.fixture(scope="package")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
