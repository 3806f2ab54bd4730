import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from stack import Backend, Stack  # noqa: E402

BACKEND_TOKEN = "integration-test-token"


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "backend(token=..., redis_timeout=..., mock_args=[...]): options for the `backend` fixture (stack.Backend)",
    )


@pytest.fixture
def stack(tmp_path):
    """Processes started through this fixture are stopped by PID after the test."""
    s = Stack(tmp_path / "stack")
    try:
        yield s
    finally:
        s.stop_all()


@pytest.fixture(scope="module")
def module_stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("stack"))
    try:
        yield s
    finally:
        s.stop_all()


@pytest.fixture(scope="module")
def cluster(module_stack):
    """A three-node Redis Cluster for one test module, and a client of it."""
    ports = module_stack.redis_cluster(3)
    client = redis.RedisCluster(host="127.0.0.1", port=ports[0])
    yield client
    client.close()


@pytest.fixture
def backend(stack, request):
    """Redis, the companion and the mock upstream on free loopback ports, for one test
    (stopped with `stack`); `backend.envoy(backend.filter_config(limits))` starts an Envoy.
    A suite sets options with a marker: `pytestmark = pytest.mark.backend(redis_timeout="40ms")`."""
    marker = request.node.get_closest_marker("backend")
    options = {"token": BACKEND_TOKEN, **(marker.kwargs if marker else {})}
    return Backend(stack, **options)


@pytest.fixture
def provider_env(backend):
    """An Envoy per filter config on the test's backend: `provider_env.start(limits, **options)`
    returns its port; `provider_env.redis` is a client of the backend's Redis."""
    def start(limits, **options):
        return backend.envoy(backend.filter_config(limits, **options))[0]

    return SimpleNamespace(redis=redis.Redis(port=backend.redis_port), start=start, backend=backend)


@pytest.fixture(scope="session")
def tiktoken_encodings():
    """OpenAI's own tokenizer (the `tiktoken` package), the outside reference for prompt
    counts: {"o200k_base": Encoding, "cl100k_base": Encoding}. Its vocabularies are read
    from the files tiktoken-rs ships (checked against tiktoken's own hashes), as
    tests/cases/make_token_counts.py does: nothing is downloaded."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "cases"))
    from make_token_counts import encodings

    return encodings()


def openai_chat_prompt_tokens(encoding, messages) -> int:
    """A chat request's prompt as OpenAI bills it (OpenAI's cookbook formula, the one
    docs/tokens.md cites): 3 tokens per message, each string field's tokens, 1 more per `name`,
    and 3 to prime the reply."""
    total = 3
    for message in messages:
        total += 3
        for field, value in message.items():
            total += len(encoding.encode_ordinary(value))
            total += 1 if field == "name" else 0
    return total
